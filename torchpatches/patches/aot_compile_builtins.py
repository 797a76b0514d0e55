"""aot_compile_builtins: an AOT-compiled function that reads a builtin loads again without ``f_globals`` (torch 2.11).

What goes wrong upstream
    ``torch.compile(fn, fullgraph=True).aot_compile(...)`` records the globals the compiled bytecode needs
    (``GraphCaptureOutput.get_runtime_env``). torch 2.11 keeps only the module globals the graph's inputs come
    from, not the builtins the bytecode reads (``len``, ``type``, Dynamo's ``__builtins_dict__`` entries), so
    the saved function fails to load on its own: ``torch.compiler.load_compiled_function(file)`` raises
    ``RuntimeError: Missing required external references: ['__builtins_dict___0']``. transformers' code
    (``type(...)`` checks) reaches it. Fixed upstream by pytorch/pytorch#177558 (in 2.12); vLLM carries the
    same change in ``vllm/env_override.py`` for torch 2.10 - 2.11.

What the patch changes
    ``get_runtime_env`` calls the original, then adds each external reference the bytecode makes that is
    neither an import nor a used global: a ``__builtins_dict__`` entry of the frame's globals (only its
    picklable members, as upstream) or a builtin by name. That is upstream's loop, after the call. Dynamo and
    Inductor compile the same graphs; only what the saved package carries changes (no Inductor cache key).

Versions
    torch 2.11.0 (fingerprint ``c1de648d130a6253``); 2.12.1, 2.13.0 and 2.15.0 carry the fix and another source
    (skipped by fingerprint).

When to delete
    When the supported torch floor is 2.12.
"""
from .._core.declare import Patch, Target

_BODY = "torchpatches.patches._bodies.aot_compile_builtins"
#: fingerprint(torch._dynamo.convert_frame.GraphCaptureOutput.get_runtime_env) of torch 2.11.0.
FINGERPRINT_TORCH_2_11_0 = "c1de648d130a6253"


PATCH = Patch("aot_compile_builtins", targets=Target(
    "torch._dynamo.convert_frame:GraphCaptureOutput.get_runtime_env", f"{_BODY}:make_replacement",
    {FINGERPRINT_TORCH_2_11_0}),
    summary="torch 2.11: an aot_compile'd function that reads a builtin loads without f_globals (pytorch#177558)",
    requires={"torch": ">=2.11"})
