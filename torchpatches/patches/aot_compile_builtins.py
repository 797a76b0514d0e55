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
from __future__ import annotations

import builtins
import pickle
from typing import Any, Callable, Dict

from .._core.declare import Patch, Target

__all__ = ["PATCH", "make_replacement", "FINGERPRINT_TORCH_2_11_0"]

#: fingerprint(torch._dynamo.convert_frame.GraphCaptureOutput.get_runtime_env) of torch 2.11.0.
FINGERPRINT_TORCH_2_11_0 = "c1de648d130a6253"


def _picklable(members: Dict[str, Any]) -> Dict[str, Any]:
    """The entries of a builtins dict that pickle (upstream's ``_safe_builtins_dict``)."""
    kept = {}
    for name, value in members.items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - anything pickle refuses is left out, as upstream does
            continue
        kept[name] = value
    return kept


def make_replacement(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def get_runtime_env(self: Any) -> Any:
        """torchpatches: the builtins the bytecode reads join ``used_globals`` (pytorch#177558)."""
        env = original(self)
        for ref in env.external_refs:
            if ref in env.used_globals:
                continue
            if ref.startswith("__builtins_dict__") and ref in self.f_globals:
                env.used_globals[ref] = _picklable(self.f_globals[ref])
            elif hasattr(builtins, ref):
                env.used_globals[ref] = getattr(builtins, ref)
        return env

    return get_runtime_env


PATCH = Patch(
    name="aot_compile_builtins",
    summary="torch 2.11: an aot_compile'd function that reads a builtin loads without f_globals (pytorch#177558)",
    targets=(
        Target("torch._dynamo.convert_frame:GraphCaptureOutput.get_runtime_env", make_replacement=make_replacement,
               fingerprints=frozenset({FINGERPRINT_TORCH_2_11_0})),
    ),
    requires={"torch": ">=2.11"},
)
