"""Two ranks of diffusers' context parallelism on the CPU (gloo), for test_fused_context_parallel (not a test module).

:func:`run_ranks` forks two ranks of the calling process (torch and diffusers are imported once, in the
parent: a spawned rank would pay both imports again), each runs every :data:`CASES` entry and writes what
it saw to ``<folder>/rank<r>.json``. Per case, on each rank: a tiny model (harness ``<model>-fused``) gets
``enable_parallelism(config=ContextParallelConfig(...))`` and runs twice under context parallelism, with
every fused pattern reverted and with them applied and the PyTorch tier forced (the fused path on CPU),
and once without context parallelism (a sanity reference).

What diffusers 0.42.1 needs to run this on a CPU-only host, and what this file supplies (nothing else):

- ``ModelMixin._resolve_parallel_config`` computes ``rank % torch.accelerator.device_count()``, a
  ``ZeroDivisionError`` on a host without an accelerator (the device it computes is unused by context
  parallelism): :func:`_one_device` reports one device while ``enable_parallelism`` runs.
- Ring attention needs a backend that returns the log-sum-exp. The ``native`` backend (the one that runs
  on CPU) raises ``ValueError: Native attention does not support return_lse=True``; ``_native_flash``
  calls ``aten::_scaled_dot_product_flash_attention``, which has no CPU kernel (``NotImplementedError``).
  :func:`_cpu_flash_kernel` registers one for this process (torch's
  ``_scaled_dot_product_flash_attention_for_cpu``, which returns the log-sum-exp), so the ring cases run
  diffusers' own ring code over the ``_native_flash`` backend. The ``ring-native`` case records the
  ``native`` backend's error.
- Wan's 1-D timestep does not fit its ``cp_plan`` entry (2 dims expected). diffusers' context-parallel hook then
  calls ``logger.warning_once``, which diffusers does not define (``transformers`` adds it to ``logging.Logger``
  on import; without it the hook raises ``AttributeError``): :func:`_warning_once` adds it where it is missing.
- Uneven shards (``ulysses_anything`` / ``ring_anything``) end in ``dist.all_gather`` of differently sized
  tensors, which gloo refuses (``ProcessGroupGloo::allgather: invalid tensor size``); those cases pass a
  ``cp_plan`` without the output gather (diffusers' own argument) and compare each rank's shard.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

#: name -> (ContextParallelConfig arguments, attention backend or None, tiny_inputs options, shards gathered)
CASES: Dict[str, Tuple[Dict[str, Any], Any, Dict[str, Any], bool]] = {
    "ulysses": (dict(ulysses_degree=2), None, {}, True),
    "ring": (dict(ring_degree=2), "_native_flash", {}, True),
    # 9 image + 7 text tokens: rank 0 gets 5 + 4, rank 1 gets 4 + 3.
    "ulysses-uneven": (dict(ulysses_degree=2, ulysses_anything=True), None, dict(side=3, text_tokens=7), False),
    "ring-uneven": (dict(ring_degree=2, ring_anything=True), "_native_flash", dict(side=3, text_tokens=7), False),
}
MODELS = ("flux1", "flux2", "wan", "qwenimage")
#: The cases a model does not run, and why.
NOT_RUN = {
    **{("wan", case): "wan's tiny inputs have no text-token option: evenly split cases only"
       for case in ("ulysses-uneven", "ring-uneven")},
    # QwenImage's processor always builds a joint attention mask from the text mask: the CPU ring backend
    # (_native_flash, the one that returns the log-sum-exp there) raises for any attn_mask, and diffusers'
    # TemplatedRingAnythingAttention refuses one.
    ("qwenimage", "ring"): "qwenimage passes an attention mask, which the CPU ring backend (_native_flash) refuses",
    ("qwenimage", "ring-uneven"): "qwenimage passes an attention mask, which diffusers' ring_anything refuses",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Patches applied in the patched run (and reverted in the unpatched one) besides the fused patterns.
EXTRA = ("rope", "cp_all_to_all", "cp_ring_attention", "cp_ulysses_anything")
#: The fused ops whose calls are counted (their ``_impl``: the body every tier and dispatch reaches).
OPS = ("modulate", "qk_norm_rope", "rms_norm_rope", "swiglu", "slices", "lse_merge")
#: Seconds a collective may wait for the other rank before it raises (a failing rank must not hang the test).
COLLECTIVE_TIMEOUT = 60


@contextlib.contextmanager
def _one_device() -> Iterator[None]:
    """diffusers 0.42.1 divides the rank by the accelerator count; on a CPU-only host that is 0."""
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: max(real(), 1)
    try:
        yield
    finally:
        torch.accelerator.device_count = real


@contextlib.contextmanager
def _warning_once() -> Iterator[None]:
    """``logging.Logger.warning_once`` (each message once), as ``transformers`` adds it, while it is missing."""
    import functools
    import logging

    if hasattr(logging.Logger, "warning_once"):
        yield
        return

    @functools.lru_cache(None)
    def warning_once(self: logging.Logger, *args: Any, **kwargs: Any) -> None:
        self.warning(*args, **kwargs)

    logging.Logger.warning_once = warning_once  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del logging.Logger.warning_once


def _cpu_flash_kernel() -> torch.library.Library:
    """CPU kernels for ``aten::_scaled_dot_product_flash_attention`` and its backward (diffusers' ``_native_flash``
    backend, the ring's log-sum-exp), through torch's CPU flash attention. Kept alive by the returned library."""
    lib = torch.library.Library("aten", "IMPL")

    def flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, scale=scale)
        empty = torch.empty(0, dtype=torch.int64)
        return out, lse, empty, empty, query.shape[2], key.shape[2], empty, empty, query.new_empty(0)

    def flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                       is_causal, philox_seed, philox_offset, *, scale=None):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, scale=scale)

    lib.impl("_scaled_dot_product_flash_attention", flash, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", flash_backward, "CPU")
    return lib


def _count_op_calls(counts: Dict[str, Any]) -> None:
    """Count each fused op body's calls and the token counts (dim 1) of its first tensor."""
    import importlib

    for name in OPS:
        module = importlib.import_module(f"torchpatches.ops._{name}")
        real = module._impl

        def counting(*args: Any, _real: Callable[..., Any] = real, _name: str = name, **kwargs: Any) -> Any:
            counts[_name] += 1
            if isinstance(args[0], torch.Tensor) and args[0].dim() >= 2:
                counts["tokens"].add(int(args[0].shape[1]))
            return _real(*args, **kwargs)

        module._impl = counting


def _count_functional_collectives(counts: Dict[str, Any]) -> None:
    """Count ``funcol.all_to_all_single`` calls (diffusers' Ulysses exchange when ``cp_all_to_all`` is reverted, its
    uneven-shard exchanges always) and ``funcol.all_gather_tensor`` calls (the ring's key/value gather when
    ``cp_ring_attention`` is reverted, and the output gather of diffusers' hooks)."""
    import torch.distributed._functional_collectives as funcol

    for name, key in (("all_to_all_single", "functional_all_to_all"), ("all_gather_tensor", "functional_all_gather")):
        real = getattr(funcol, name)

        def counting(*args: Any, _real: Callable[..., Any] = real, _key: str = key, **kwargs: Any) -> Any:
            counts[_key] += 1
            return _real(*args, **kwargs)

        setattr(funcol, name, counting)


def _count_size_gathers(counts: Dict[str, Any]) -> None:
    """Count the exchanges of the ranks' sequence lengths: diffusers' ``gather_size_by_comm`` as its attention code
    calls it (the uneven shards' paths) and the patches' ``ints_of_every_rank`` (``cp_ulysses_anything`` and the
    uneven ring of ``cp_ring_attention``, one per attention call)."""
    from diffusers.models import attention_dispatch

    from torchpatches.patches._bodies import cp_ring_attention, cp_ulysses_anything

    for owner, name in ((attention_dispatch, "gather_size_by_comm"), (cp_ulysses_anything, "ints_of_every_rank"),
                        (cp_ring_attention, "ints_of_every_rank")):
        real = getattr(owner, name)

        def counting(*args: Any, _real: Callable[..., Any] = real, **kwargs: Any) -> Any:
            counts["size_gathers"] += 1
            return _real(*args, **kwargs)

        setattr(owner, name, counting)


def _case(name: str, which: str, dtype: torch.dtype, counts: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ContextParallelOutput

    import torchpatches
    from _fused_models import FUSED
    from harness import build_model, tiny_inputs
    from torchpatches.ops import force_tier

    config_args, backend, options, gathered = CASES[name]
    config = f"{which}-fused"
    model = build_model(config, dtype=dtype)
    inputs = tiny_inputs(config, dtype=dtype, **options)
    inputs.pop("return_dict")
    # Every case names its backend: set_attention_backend also sets diffusers' process-wide active backend, which
    # a model without its own (QwenImage's processor) would otherwise inherit from the case before.
    model.set_attention_backend(backend or "native")
    with torch.no_grad(), torchpatches.disabled(*FUSED, *EXTRA):
        single = model(**inputs, return_dict=False)[0]
    # gloo cannot gather uneven shards: their plan leaves out the output gather
    plan = None if gathered else {key: entry for key, entry in model._cp_plan.items()
                                  if not isinstance(entry, ContextParallelOutput)}
    with _one_device():
        model.enable_parallelism(config=ContextParallelConfig(**config_args), cp_plan=plan)
    processors = [m.processor for m in model.modules() if hasattr(m, "processor")]
    with torch.no_grad():
        counts.clear()
        with torchpatches.disabled(*FUSED, *EXTRA):
            vanilla = model(**inputs, return_dict=False)[0]
        functional_vanilla = [counts["functional_all_to_all"], counts["functional_all_gather"],
                              counts["size_gathers"]]
        counts.clear()
        counts["tokens"] = set()
        with force_tier("torch"):
            fused = model(**inputs, return_dict=False)[0]
    if not gathered:  # this rank's part of the sequence
        single = single.tensor_split(2, dim=1)[dist.get_rank()]
    return dict(
        equal=bool(torch.equal(fused, vanilla)),
        shape=list(fused.shape),
        vs_single=float((vanilla.float() - single.float()).abs().max()) if vanilla.shape == single.shape else None,
        counts={op: counts[op] for op in OPS},
        functional_all_to_all=[functional_vanilla[0], counts["functional_all_to_all"]],  # unpatched, patched
        functional_all_gather=[functional_vanilla[1], counts["functional_all_gather"]],
        size_gathers=[functional_vanilla[2], counts["size_gathers"]],
        tokens=sorted(counts["tokens"]),
        processors_parallel=sum(getattr(p, "_parallel_config", None) is not None for p in processors),
        processors=len(processors),
    )


def _grad_case(mode: str, counts: Dict[str, Any]) -> Dict[str, Any]:
    """A training step under context parallelism on tiny FLUX.1 (fp32): the output and the input's gradient with every
    patch reverted and applied, and the functional collectives each made. The fused patterns step aside (grad).
    Ulysses: diffusers' ``autograd.Function`` exchanges in its forward and backward with grad off, where
    ``cp_all_to_all`` takes c10d's collective. Ring: ``cp_ring_attention``'s forward gathers through c10d, merges with
    ``lse_merge`` and leaves on ``ctx`` what diffusers' own backward (gathering through the functional collective)
    reads."""
    import torchpatches
    from _fused_models import FUSED
    from diffusers import ContextParallelConfig
    from harness import build_model, tiny_inputs

    config_args, backend, _, _ = CASES[mode]
    model = build_model("flux1-fused")
    inputs = tiny_inputs("flux1-fused")
    inputs.pop("return_dict")
    if backend is not None:
        model.set_attention_backend(backend)
    with _one_device():
        model.enable_parallelism(config=ContextParallelConfig(**config_args))
    runs = []
    for patched in (False, True):
        hidden = inputs["hidden_states"].detach().clone().requires_grad_(True)
        counts.clear()
        counts["tokens"] = set()
        with contextlib.ExitStack() as stack:
            if not patched:
                stack.enter_context(torchpatches.disabled(*FUSED, *EXTRA))
            out = model(**{**inputs, "hidden_states": hidden}, return_dict=False)[0]
            out.square().sum().backward()
        runs.append((out.detach(), hidden.grad, [counts["functional_all_to_all"], counts["functional_all_gather"]],
                     counts["lse_merge"]))
    (out0, grad0, calls0, merges0), (out1, grad1, calls1, merges1) = runs
    return dict(equal=bool(torch.equal(out0, out1)), grad_equal=bool(torch.equal(grad0, grad1)),
                grad_nonzero=bool(grad0.abs().sum() > 0), functional=[calls0, calls1], merges=[merges0, merges1])


def _native_ring_error() -> str:
    """What diffusers' ``native`` backend (the one that runs on CPU) says to ring attention."""
    from diffusers import ContextParallelConfig

    from harness import build_model, tiny_inputs

    model = build_model("flux1-fused")
    inputs = tiny_inputs("flux1-fused")
    with _one_device():
        model.enable_parallelism(config=ContextParallelConfig(ring_degree=2))
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as e:  # noqa: BLE001 (the error is the result)
        return f"{type(e).__name__}: {e}"
    return "no error"


def _rank(rank: int, store: str, folder: str, repo_tests: str) -> None:
    """One rank: every case, results (or the first error) to ``folder/rank<rank>.json``."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # forked: OpenMP's pool did not survive the fork; 2 ranks share the cores anyway
    sys.path.insert(0, repo_tests)
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    results: Dict[str, Any] = {}
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
    try:
        import torchpatches
        from _fused_models import FUSED

        torchpatches.apply([*FUSED, *EXTRA])
        counts: Dict[str, Any] = collections.Counter()
        _count_op_calls(counts)
        _count_functional_collectives(counts)
        _count_size_gathers(counts)
        results["ring-native"] = _native_ring_error()
        kernel = _cpu_flash_kernel()
        for mode in ("ulysses", "ring"):
            results[f"{mode}-grad"] = _grad_case(mode, counts)
        with _warning_once():
            for name in CASES:
                for which in (m for m in MODELS if (m, name) not in NOT_RUN):
                    for dtype_name, dtype in DTYPES.items():
                        results[f"{name}/{which}/{dtype_name}"] = _case(name, which, dtype, counts)
        del kernel
    except BaseException:  # noqa: BLE001 (reported to the parent; the other rank's collectives time out)
        results["error"] = traceback.format_exc()
    finally:
        Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _import_once() -> None:
    """What both ranks import, imported in the parent before the fork (else each rank pays it, on shared cores)."""
    import importlib

    for name in ("torch.distributed.device_mesh", "diffusers.models.transformers.transformer_flux",
                 "diffusers.models.transformers.transformer_flux2", "diffusers.models.transformers.transformer_wan",
                 "diffusers.models.transformers.transformer_qwenimage",
                 "diffusers.hooks.context_parallel",
                 "torchpatches._harness", *(f"torchpatches.ops._{op}" for op in OPS)):
        importlib.import_module(name)


def run_ranks(folder: Path, timeout: float = 240.0) -> List[Dict[str, Any]]:
    """Fork two ranks, wait for both (at most ``timeout`` s, then end them), return their results."""
    import torch.multiprocessing as mp

    _import_once()
    tests = str(Path(__file__).resolve().parent)
    context = mp.start_processes(_rank, args=(str(folder / "store"), str(folder), tests), nprocs=2,
                                 join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the two ranks did not finish in {timeout:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(2)]
