"""The fused patterns under diffusers' context parallelism: two CPU ranks (gloo), tiny FLUX.1 / FLUX.2 / Wan /
QwenImage.

``model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))`` and ``ring_degree=2``, even and uneven
shards (``ulysses_anything`` / ``ring_anything``; not Wan; QwenImage Ulysses only: ``NOT_RUN`` says why), fp32 and
bf16, the PyTorch tier forced so the fused glue runs on CPU: on each rank the output equals, bit for bit, the same
model's with every fused pattern (and ``rope``, ``cp_all_to_all``, ``cp_ring_attention``) reverted. The fused block /
norm / activation patterns and the processors' q/k stretch ran on that rank's shard of the sequence, the processors
passing diffusers' attention call what diffusers' processors pass (their ``_parallel_config``; Wan's cross-attention
none; QwenImage's joint text mask, split with the text, two of its tokens masked); Ulysses' all-to-alls went through
c10d (``cp_all_to_all``), also in the backward of a training step, and so did ring attention's key/value gathers
(``cp_ring_attention``, even and uneven shards), whose forward leaves diffusers' own ring backward what it reads
(output and input gradient of a training step bit-identical, in both modes); uneven Ulysses exchanged the ranks'
lengths once per attention call (``cp_ulysses_anything``). What diffusers 0.42.1 lacks on a CPU-only host, and what the ranks
supply, is in ``_context_parallel.py``.

One fork of two ranks serves every case (about 6 s on 2 shared cores, the imports included). The result does not
depend on torch's release, so one session of the matrix runs it (marker ``once``: tests-2.13.0).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

pytest.importorskip("diffusers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from _context_parallel import CASES, DTYPES, MODELS, NOT_RUN, run_ranks  # noqa: E402

pytestmark = [
    pytest.mark.once,
    # Asking a CUDA build for its devices (diffusers does, in each rank) fails in a forked child once the parent
    # has asked ("Cannot re-initialize CUDA in forked subprocess"), and with a GPU diffusers builds its mesh there.
    pytest.mark.skipif(torch.version.cuda is not None or torch.version.hip is not None,
                       reason="forked CPU ranks need a CPU-only torch build (tests-2.13.0 installs one)"),
]

#: Fused op calls per forward under context parallelism, the same as without it: tiny FLUX (1 double + 2 single
#: blocks), Wan (2 blocks, each a self- and a cross-attention) and QwenImage (2 double-stream blocks). The attention
#: processors run the fused q/k stretch on the rank's shard and hand diffusers' attention call what diffusers'
#: processor does (FLUX: its ``_parallel_config``; Wan: that in self-attention, none in cross-attention); FLUX.2's
#: single-block processor also writes its SwiGLU into to_out's buffer.
EXPECTED = {
    "flux1": {"modulate": 11, "qk_norm_rope": 3, "rms_norm_rope": 0, "swiglu": 0, "slices": 4},
    "flux2": {"modulate": 11, "qk_norm_rope": 3, "rms_norm_rope": 0, "swiglu": 4, "slices": 2},
    "wan": {"modulate": 8, "qk_norm_rope": 0, "rms_norm_rope": 4, "swiglu": 0, "slices": 0},
    "qwenimage": {"modulate": 13, "qk_norm_rope": 2, "rms_norm_rope": 0, "swiglu": 0, "slices": 0},
}
#: Attention calls per forward that context parallelism splits (Wan's cross-attention is not split).
PARALLEL_ATTENTION = {"flux1": 3, "flux2": 3, "wan": 2, "qwenimage": 2}


def op_calls(case: str, which: str) -> Dict[str, int]:
    """The fused ops' calls per forward: the model's patterns (``EXPECTED``) and, under ring attention (even or
    uneven shards), one log-sum-exp merge per split attention call (``cp_ring_attention``; two ranks, so one merge
    each)."""
    return dict(EXPECTED[which], lse_merge=PARALLEL_ATTENTION[which] if case.startswith("ring") else 0)


def functional_all_to_all(case: str, which: str) -> List[int]:
    """``funcol.all_to_all_single`` calls per forward, (unpatched, patched): Ulysses exchanges q, k, v and the output
    (4 per split attention call), which ``cp_all_to_all`` sends through c10d, and ``cp_ulysses_anything`` the
    uneven shards' (``ulysses_anything``, split sizes); ring attention gathers."""
    calls = 4 * PARALLEL_ATTENTION[which]
    return {"ulysses": [calls, 0], "ulysses-uneven": [calls, 0]}.get(case, [0, 0])


def size_gathers(case: str, which: str) -> List[int]:
    """Exchanges of the ranks' sequence lengths per forward, (unpatched, patched): diffusers' uneven Ulysses asks for
    them once per exchange of q, k, v and the output (and once more for a mask: QwenImage's), ``cp_ulysses_anything``
    once per attention call; the uneven ring once per call, patched or not (patched: one read back to the host)."""
    calls = PARALLEL_ATTENTION[which]
    per_call = 5 if which == "qwenimage" else 4
    return {"ulysses-uneven": [per_call * calls, calls], "ring-uneven": [calls, calls]}.get(case, [0, 0])


def functional_all_gather(case: str, which: str) -> List[int]:
    """``funcol.all_gather_tensor`` calls per forward, (unpatched, patched): ring attention gathers keys and values
    once per split attention call, which ``cp_ring_attention`` sends through c10d (even and uneven shards);
    diffusers' output gather (1, even shards only) is left as it is."""
    calls = PARALLEL_ATTENTION[which]
    return {"ulysses": [1, 1], "ring": [calls + 1, 1], "ring-uneven": [calls, 0]}.get(case, [0, 0])


#: Functional collectives of a training step, [all-to-all, all-gather] unpatched and patched. Ulysses: 12 exchanges
#: forward and 12 backward, none functional with ``cp_all_to_all``. Ring: 3 gathers forward (c10d with
#: ``cp_ring_attention``), and diffusers' backward's 3 gathers and 6 permutes (all-to-alls), left as they are.
GRAD_FUNCTIONAL = {"ulysses": [[24, 1], [0, 1]], "ring": [[6, 7], [6, 4]]}
#: Tokens per rank that the fused ops saw. FLUX (image + text, and each stream alone): even 16 + 8 -> 8 + 4; uneven
#: 9 + 7 -> 5 + 4 / 4 + 3. Wan: 32 video tokens -> 16 (the cross-attention's text keys are not split). QwenImage:
#: 16 image + 8 text -> 8 + 4 (the op takes both streams; the 2 masked text tokens are rank 1's); uneven 9 + 7 ->
#: 5 + 4 / 4 + 3.
TOKENS = {("flux", True): [[4, 8, 12], [4, 8, 12]], ("flux", False): [[4, 5, 9], [3, 4, 7]],
          ("wan", True): [[16], [16]], ("qwenimage", True): [[4, 8], [4, 8]], ("qwenimage", False): [[4, 5], [3, 4]]}

@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    results = run_ranks(Path(tmp_path_factory.mktemp("context_parallel")))
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return results


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("which", MODELS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_glue_on_each_shard_equals_diffusers(ranks: List[Dict[str, Any]], case: str, which: str,
                                                   dtype: str) -> None:
    gathered = CASES[case][3]
    if (which, case) in NOT_RUN:
        pytest.skip(NOT_RUN[which, case])
    for rank, results in enumerate(ranks):
        got = results[f"{case}/{which}/{dtype}"]
        assert got["equal"], (rank, got)
        assert got["counts"] == op_calls(case, which), (rank, got)
        assert got["functional_all_to_all"] == functional_all_to_all(case, which), (rank, got)
        assert got["functional_all_gather"] == functional_all_gather(case, which), (rank, got)
        assert got["size_gathers"] == size_gathers(case, which), (rank, got)
        family = which if which in ("wan", "qwenimage") else "flux"
        assert got["tokens"] == TOKENS[family, gathered][rank], (rank, got)  # the patterns saw this rank's shard
        assert got["processors"] > 0 and got["processors_parallel"] == got["processors"], (rank, got)
        # Context parallelism itself computed the model (the shard, or all of it after the gather).
        tolerance = 1e-5 if dtype == "float32" else 3e-2
        assert got["vs_single"] is not None and got["vs_single"] <= tolerance, (rank, got)


def test_ring_attention_needs_a_log_sum_exp_on_cpu(ranks: List[Dict[str, Any]]) -> None:
    """Why the ring cases bring a CPU flash kernel: diffusers' CPU backend cannot do ring attention."""
    for results in ranks:
        assert results["ring-native"] == "ValueError: Native attention does not support return_lse=True"


@pytest.mark.parametrize("mode", sorted(GRAD_FUNCTIONAL))
def test_a_training_step_gives_the_same_gradient(ranks: List[Dict[str, Any]], mode: str) -> None:
    """Training through Ulysses or ring attention (tiny FLUX.1, fp32): with every patch applied, output and input
    gradient equal the unpatched ones bit for bit (the fused patterns step aside under autograd), and the forward's
    collectives left the functional path (``cp_all_to_all``, ``cp_ring_attention``)."""
    for rank, results in enumerate(ranks):
        got = results[f"{mode}-grad"]
        assert got == dict(equal=True, grad_equal=True, grad_nonzero=True, functional=GRAD_FUNCTIONAL[mode],
                           merges=[0, PARALLEL_ATTENTION["flux1"] if mode == "ring" else 0]), (rank, got)
