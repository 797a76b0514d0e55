"""The ``rope`` patch: diffusers' apply_rotary_emb through the RoPE op for FLUX's call form.

Equivalence on tiny FLUX.1 / FLUX.2 transformers (eager and compiled with fullgraph=True,
Inductor kernel counts before/after), revert by identity of every alias, and delegation of
every other call form to the original.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from torchpatches._core import gates as _gates  # noqa: E402
import harness as testing  # noqa: E402
from torchpatches.patches import rope as rope_patch  # noqa: E402
from torchpatches.patches._bodies import rope as rope_body  # noqa: E402

from diffusers.models import embeddings  # noqa: E402

#: The alias modules this diffusers has (FLUX.2 arrived in 0.36, FLUX.3 in 0.42).
ALIAS_MODULE_NAMES = [
    name for name in (alias.split(":")[0] for alias in rope_patch.ALIASES) if importlib.util.find_spec(name) is not None
]
ALIAS_MODULES = [importlib.import_module(name) for name in ALIAS_MODULE_NAMES]
TARGET = "diffusers.models.embeddings:apply_rotary_emb"

# bf16/fp16 outputs may differ by one unit in the last place (fp32 rounding order); fp32 by ~1 ulp.
TOLERANCE = {
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.bfloat16: dict(rtol=2**-7, atol=2**-7),
    torch.float16: dict(rtol=2**-10, atol=2**-10),
}


def original_function() -> Callable[..., torch.Tensor]:
    with torchpatches.disabled("rope"):
        return embeddings.apply_rotary_emb


@pytest.fixture
def patched() -> Iterator[Callable[..., torch.Tensor]]:
    """The patch applied (alone) for the test; every patch's state before the test is restored after it."""
    with torchpatches.only("rope"):
        assert torchpatches.status()["rope"].state.value == "applied", str(torchpatches.status()["rope"])
        yield embeddings.apply_rotary_emb


@pytest.fixture
def op_calls(monkeypatch: pytest.MonkeyPatch) -> List[Tuple[int, ...]]:
    """Records the shape of every call that reached the op."""
    calls: List[Tuple[int, ...]] = []
    real = rope_body._rotate

    def counting(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
        calls.append(tuple(x.shape))
        return real(x, cos, sin, sequence_dim)

    monkeypatch.setattr(rope_body, "_rotate", counting)
    return calls


def flux_freqs(tokens: int, head_dim: int, axes: Tuple[int, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin exactly as FluxPosEmbed makes them: fp32 [S, D], each value repeated for a pair."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    ids = torch.randint(0, 32, (tokens, 3)).float()
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=list(axes))(ids)
    assert cos.shape == (tokens, head_dim) and cos.dtype == torch.float32
    return cos, sin


# ---- declaration and bookkeeping ------------------------------------------------------------


def test_importing_the_patch_module_imports_no_diffusers() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        import torchpatches.patches.rope as p
        assert p.PATCH.name == "rope"
        heavy = [m for m in ("diffusers", "triton", "flashinfer") if m in sys.modules]
        assert not heavy, heavy
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fingerprint_is_verified_for_the_installed_diffusers() -> None:
    target = rope_patch.PATCH.targets[0]
    assert target.path == TARGET
    assert target.fingerprints == frozenset(rope_patch.SOURCES.values())
    if diffusers.__version__ not in rope_patch.SOURCES:
        pytest.skip(f"diffusers {diffusers.__version__} not measured: {_gates.fingerprint(original_function())}")
    assert _gates.fingerprint(original_function()) == rope_patch.SOURCES[diffusers.__version__]


def test_apply_rebinds_every_alias_and_revert_restores_identity(patched: Callable[..., torch.Tensor]) -> None:
    original = original_function()
    patched = embeddings.apply_rotary_emb  # disabled() re-applied the patch: a fresh replacement
    assert patched is not original and patched.__torchpatches_target__ == "diffusers.models.embeddings:apply_rotary_emb"
    assert torchpatches.status()["rope"].state.value == "applied"
    for module in ALIAS_MODULES:
        assert module.apply_rotary_emb is patched, module.__name__

    torchpatches.revert("rope")
    assert torchpatches.status()["rope"].state.value == "disabled"
    assert embeddings.apply_rotary_emb is original
    for module in ALIAS_MODULES:
        assert module.apply_rotary_emb is original, module.__name__

    torchpatches.apply("rope")
    assert embeddings.apply_rotary_emb is not original
    with torchpatches.disabled("rope"):
        assert embeddings.apply_rotary_emb is original
        assert all(module.apply_rotary_emb is original for module in ALIAS_MODULES)
    assert embeddings.apply_rotary_emb is not original
    assert all(module.apply_rotary_emb is embeddings.apply_rotary_emb for module in ALIAS_MODULES)


# ---- the function itself ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_flux_form_goes_through_the_op_and_matches(
    patched: Callable[..., torch.Tensor], op_calls: List[Tuple[int, ...]], dtype: torch.dtype, sequence_dim: int
) -> None:
    original = original_function()
    torch.manual_seed(sequence_dim)
    tokens, heads, head_dim = 37, 3, 32
    shape = (2, tokens, heads, head_dim) if sequence_dim == 1 else (2, heads, tokens, head_dim)
    x = torch.randn(shape, dtype=dtype)
    x_before = x.clone()
    freqs = flux_freqs(tokens, head_dim, (8, 12, 12))

    got = patched(x, freqs, sequence_dim=sequence_dim)
    want = original(x, freqs, sequence_dim=sequence_dim)

    assert op_calls == [shape]
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    assert torch.equal(x, x_before), "the original is out of place; so must the replacement be"
    assert got.data_ptr() != x.data_ptr()
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def _non_flux_calls() -> Dict[str, Callable[[Callable[..., torch.Tensor]], torch.Tensor]]:
    """Call forms FLUX never makes; each must reach the original, unchanged."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 32)  # [B, H, S, D]
    cos, sin = flux_freqs(16, 32, (8, 12, 12))
    complex_freqs = torch.polar(torch.ones(16, 16), torch.randn(16, 16))
    x_grad = x.clone().requires_grad_(True)
    return {
        "use_real_false_complex": lambda f: f(x.transpose(1, 2), complex_freqs, use_real=False),
        "unbind_dim_-2": lambda f: f(x, (cos, sin), use_real_unbind_dim=-2),
        "broadcast_cos_row": lambda f: f(x, (cos[:1], sin[:1])),
        "bf16_freqs": lambda f: f(x, (cos.bfloat16(), sin.bfloat16())),
        "x_3d": lambda f: f(x[0], (cos, sin)),
        "needs_grad": lambda f: f(x_grad, (cos, sin)),
        "freqs_three_tensors": lambda f: f(x, (cos, sin, sin)),
        "sequence_dim_3": lambda f: f(x, (cos, sin), sequence_dim=3),
        "unbind_dim_0": lambda f: f(x, (cos, sin), use_real_unbind_dim=0),
    }


def _outcome(call: Callable[[Callable[..., torch.Tensor]], torch.Tensor], f: Callable[..., torch.Tensor]) -> Any:
    """The result, or the exception type and message when the original refuses the call."""
    try:
        return call(f)
    except Exception as error:  # noqa: BLE001 - the replacement must fail exactly like the original
        return (type(error), str(error))


@pytest.mark.parametrize("form", sorted(_non_flux_calls()))
def test_other_call_forms_go_to_the_original(
    patched: Callable[..., torch.Tensor], op_calls: List[Tuple[int, ...]], form: str
) -> None:
    original = original_function()
    call = _non_flux_calls()[form]
    got, want = _outcome(call, patched), _outcome(call, original)
    assert op_calls == []
    if isinstance(want, tuple):
        assert got == want
    else:
        assert got.dtype == want.dtype
        assert torch.equal(got, want)


def test_a_call_the_op_refuses_goes_to_the_original(
    patched: Callable[..., torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
        raise ValueError("refused")

    monkeypatch.setattr(rope_body, "_rotate", refuse)
    x = torch.randn(1, 7, 2, 16, dtype=torch.bfloat16)
    freqs = flux_freqs(7, 16, (4, 6, 6))
    assert torch.equal(patched(x, freqs, sequence_dim=1), original_function()(x, freqs, sequence_dim=1))


# a fresh process: the registry's late imports and revert, the same on every torch release
@pytest.mark.once
def test_environment_disable_and_modules_imported_after_the_patch() -> None:
    """TORCHPATCHES_DISABLE=rope leaves diffusers untouched; FLUX modules imported after an apply
    get the replacement; revert restores every one of them by identity. In a fresh process, so
    that the FLUX.2 / FLUX.3 modules really are imported late."""
    code = textwrap.dedent(
        f"""
        import importlib, sys, torchpatches
        import diffusers.models.embeddings as embeddings
        original = embeddings.apply_rotary_emb
        assert torchpatches.status()["rope"].state.value == "disabled", torchpatches.status()["rope"]
        assert original.__module__ == "diffusers.models.embeddings"

        torchpatches.apply("rope")  # an explicit apply still works
        patched = embeddings.apply_rotary_emb
        assert patched.__torchpatches_target__ == "diffusers.models.embeddings:apply_rotary_emb"
        late = {ALIAS_MODULE_NAMES!r}
        assert not any(name in sys.modules for name in late), "must be imported late for this test"
        late = [importlib.import_module(name) for name in late]
        assert all(module.apply_rotary_emb is patched for module in late)

        torchpatches.revert("rope")
        assert embeddings.apply_rotary_emb is original
        assert all(module.apply_rotary_emb is original for module in late)
        """
    )
    env = dict(os.environ, TORCHPATCHES_DISABLE="rope")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_replacement_keeps_the_original_name_and_doc(patched: Callable[..., torch.Tensor]) -> None:
    original = original_function()
    assert patched.__name__ == original.__name__ and patched.__doc__ == original.__doc__
    assert not hasattr(patched, "__wrapped__")  # the registry fingerprints what is bound, not what it wraps


# ---- tiny FLUX models ------------------------------------------------------------------------


def tiny_model(name: str, dtype: torch.dtype) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    return testing.build_model(name, dtype=dtype), testing.tiny_inputs(name, dtype=dtype)


MODELS = ("flux1", "flux2")


def run_model(model: torch.nn.Module, inputs: Dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_tiny_flux_eager_matches_and_uses_the_op(
    patched: Callable[..., torch.Tensor], op_calls: List[Tuple[int, ...]], name: str, dtype: torch.dtype
) -> None:
    model, inputs = tiny_model(name, dtype)
    after = run_model(model, inputs)
    blocks = 2  # one double-stream block (joint q/k) + one single-stream block
    assert len(op_calls) == 2 * blocks, op_calls  # q and k of each block
    with torchpatches.disabled("rope"):
        before = run_model(model, inputs)
    assert torch.isfinite(before).all()
    # one ulp of RoPE output, carried through a block or two of bf16 matmuls
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-2, atol=4e-2)
    torch.testing.assert_close(after, before, **tolerance)


# ---- compiled (Inductor on the CPU) -------------------------------------------------------------

def compile_and_count(model: torch.nn.Module, inputs: Dict[str, Any]) -> Tuple[torch.Tensor, int, str]:
    """A fresh fullgraph compile (no FX graph cache); returns output, fused kernel count, generated code.

    Kernels are counted in the generated code (distinct ``cpp_fused_*`` / ``triton_*`` kernel
    definitions): ``metrics.generated_kernel_count`` counts kernel objects, not fused kernels, on CPU,
    and ``metrics.num_bytes_accessed`` stays 0 for CPU kernels, so bytes are not asserted here.
    """
    report = testing.inductor_report(model, **inputs)
    return report.output[0], report.kernels, report.code


@pytest.mark.slow
def test_tiny_flux_compiled_fullgraph_same_kernels_and_outputs(
    patched: Callable[..., torch.Tensor],
    op_calls: List[Tuple[int, ...]],
    record_property: Callable[[str, Any], None],
) -> None:
    model, inputs = tiny_model("flux1", torch.float32)
    eager = run_model(model, inputs)
    op_calls.clear()  # the eager run above went through the op; count only what tracing does

    with torchpatches.disabled("rope"):
        vanilla, vanilla_kernels, _ = compile_and_count(model, inputs)
    with_patch, patch_kernels, _ = compile_and_count(model, inputs)
    assert op_calls == [], "under torch.compile the patch must keep diffusers' math"
    # The alternative, with the Triton tier (on the CPU: an opaque custom op running Triton's
    # interpreter) so the graph has the same shape as on a GPU: RoPE as a call Inductor cannot fuse.
    pytest.importorskip("triton")
    from torchpatches.ops import _rope as rope_op

    # The alternative the patch decided against: the op stays in the graph while compiling.
    op_kept_under_compile = testing.replacing(rope_patch.PATCH, testing.rope_op_under_compile)
    with torchpatches.disabled("rope"), op_kept_under_compile, rope_op.force_tier("triton"):
        with_op, op_kernels, op_code = compile_and_count(model, inputs)
    torch._dynamo.reset()

    counts = dict(vanilla=vanilla_kernels, patched=patch_kernels, op_under_compile=op_kernels)
    record_property("inductor_fused_kernels", counts)
    print(f"\ninductor fused kernels, tiny FLUX.1, CPU, torch {torch.__version__}: {counts}")
    # Under compile the patch keeps diffusers' math, so Inductor sees the same graph: same kernels.
    assert patch_kernels == vanilla_kernels
    torch.testing.assert_close(with_patch, vanilla, rtol=0, atol=0)
    torch.testing.assert_close(vanilla, eager, rtol=1e-4, atol=1e-4)
    # The alternative also compiles with fullgraph=True (the op is a custom op with a fake kernel)
    # and stays within the op's tolerance; the op call is visible in the generated code.
    assert len(op_calls) == 4 and "torchpatches.rope_qk_triton" in op_code
    torch.testing.assert_close(with_op, vanilla, rtol=1e-4, atol=1e-4)
