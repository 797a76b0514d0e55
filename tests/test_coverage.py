"""torchpatches.coverage and ``python -m torchpatches coverage``: what fused in a model and why not.

Tiny models of every fused family on the CPU with the PyTorch tier forced (the fused paths run as on a GPU); each
way a call is handed to diffusers' code is produced and must be named; the report's module names must be the
model's; the recorder must be gone after every call, whatever happened.
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager, Dict, Iterator, List

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402
from torchpatches.patches import _fused_common  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "patches"))
from _fused_models import DEVICE, MODELS, tiny  # noqa: E402

#: What a CPU run cannot fuse whatever the model: the GELU epilogue is cuBLASLt's (CUDA only).
CPU_ONLY_DECLINES = {"gelu_gemm"}
#: Calls a pattern hands back on every device: SD3's processor without q/k norms, Z-Image's unmodulated context
#: refiner blocks.
DECLINED_BY_DESIGN = {("sd3", "sd3_qk_norm"), ("zimage", "rms_sandwich_block")}


def _cover(model: torch.nn.Module, inputs: Dict[str, Any], tier: Any = "torch") -> Any:
    with force_tier(tier), torch.no_grad():
        return torchpatches.coverage(model, **inputs)


def _names(model: torch.nn.Module) -> set:
    names = {name for name, _ in model.named_modules()}
    return names | {f"{name}.processor" for name, module in model.named_modules() if hasattr(module, "processor")}


@pytest.mark.parametrize("family", MODELS)
def test_every_family_fuses_and_names_its_modules(family: str) -> None:
    model, inputs = tiny(family)
    report = _cover(model, inputs)
    assert _fused_common.observer is None
    assert any(row["fused"] for row in report.rows), report
    for row in report.rows:
        assert row["fused"] or row["pattern"] in CPU_ONLY_DECLINES or (family, row["pattern"]) in DECLINED_BY_DESIGN
        assert row["calls"] > 0 and row["modules"], row  # every patched object it ran on is named
        assert all(name in _names(model) for name in row["modules"] if not name.startswith("+")), row
    patterns = {row["pattern"] for row in report.rows}
    assert {row["class"] for row in report.rows}.isdisjoint(row["class"] for row in report.untargeted)
    assert not report.not_applied and patterns
    if DEVICE.type == "cpu":
        assert report.timing == {"skipped": "not timed: on cpu (timing needs CUDA)"}
    else:
        assert report.timing["rounds"] == 7 and report.timing["ratio"] > 0
    assert json.loads(json.dumps(report.to_json()))["schema"] == "torchpatches.coverage/1"
    assert str(report).startswith(f"torchpatches coverage: {type(model).__name__}")


@contextlib.contextmanager
def _global_hook() -> Iterator[None]:
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _grad(model: torch.nn.Module) -> Iterator[None]:
    """Training: the parameters want gradients (the tiny models are built frozen)."""
    model.requires_grad_(True)
    try:
        with torch.enable_grad():
            yield
    finally:
        model.requires_grad_(False)


#: (situation, its context around the call given the model, the reason's words, its tier, patterns that still fuse)
SITUATIONS = [
    ("autocast", lambda model: torch.autocast(DEVICE.type, dtype=torch.bfloat16), "autocast is on", "torch", ()),
    ("not CUDA", lambda model: contextlib.nullcontext(), "device cpu", None, ()),
    # the position embedder has no parameters and integer ids: its tables need no gradient
    ("grad", _grad, "a gradient is wanted", "torch", ("rope_tables",)),
    ("global hook", lambda model: _global_hook(), "module-global forward hooks", "torch", ()),
]


@pytest.mark.parametrize("situation, context, words, tier, still", SITUATIONS, ids=[s[0] for s in SITUATIONS])
def test_every_call_handed_back_says_why(situation: str, context: Callable[[torch.nn.Module], ContextManager],
                                         words: str, tier: Any, still: tuple) -> None:
    if situation == "not CUDA" and DEVICE.type != "cpu":
        pytest.skip("the models run on CUDA here")
    model, inputs = tiny("flux1")
    with force_tier(tier), context(model):
        report = torchpatches.coverage(model, **inputs)
    assert report.rows and report.fused_calls() == sum(report.fused_calls(name) for name in still), report
    assert all(words in reason for reason in report.reasons()), report.reasons()


def test_a_hooked_or_subclassed_submodule_is_named_and_the_rest_fuses() -> None:
    model, inputs = tiny("flux1")
    block = model.transformer_blocks[0]
    handle = block.norm1.norm.register_forward_hook(lambda module, args, out: None)

    class MyLayerNorm(torch.nn.LayerNorm):
        pass

    old = block.norm1_context.norm
    block.norm1_context.norm = MyLayerNorm(old.normalized_shape, eps=old.eps, elementwise_affine=False)
    try:
        report = _cover(model, inputs)
    finally:
        handle.remove()
    declined = {row["modules"][0]: row["reason"] for row in report.rows if not row["fused"] and
                row["pattern"] == "adaln"}
    assert declined == {
        "transformer_blocks.0.norm1": "a LayerNorm submodule has forward hooks",
        "transformer_blocks.0.norm1_context": "a submodule is MyLayerNorm, a subclass of LayerNorm",
    }, report
    assert report.fused_calls("adaln") == 3 and report.fused_calls("qk_norm_rope") == 3


def test_a_replaced_global_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusers.models.transformers import transformer_flux

    monkeypatch.setattr(transformer_flux, "apply_rotary_emb", lambda x, *args, **kwargs: x)
    report = _cover(*tiny("flux1"))
    assert report.reasons("qk_norm_rope") == ["a global the original reads was replaced: apply_rotary_emb"]
    assert report.fused_calls("adaln") > 0


def test_under_torch_compile_the_calls_are_diffusers_code() -> None:
    model, inputs = tiny("flux1")
    compiled = torch.compile(model, backend="eager")
    try:
        report = _cover(compiled, inputs)
    finally:
        torch._dynamo.reset()
    assert report.rows and report.fused_calls() == 0
    assert all(reason.startswith("compiling") for reason in report.reasons()), report.reasons()


def test_a_pattern_switched_off_is_listed_with_its_state() -> None:
    model, inputs = tiny("flux1")
    with torchpatches.disabled("adaln"):
        report = _cover(model, inputs)
    assert report.fused_calls("adaln") == 0 and report.declined_calls("adaln") == 0
    off = {(row["class"], row["pattern"], row["state"]) for row in report.not_applied}
    assert off == {("AdaLayerNormZero", "adaln", "disabled"), ("AdaLayerNormZeroSingle", "adaln", "disabled"),
                   ("AdaLayerNormContinuous", "adaln", "disabled")}
    untargeted = {row["class"] for row in report.untargeted}
    assert "TimestepEmbedding" in untargeted and "FluxTransformerBlock" not in untargeted
    assert "AdaLayerNormZero" not in untargeted  # targeted, by a pattern that is off: listed as not applied


def test_the_recorder_is_gone_after_a_failing_call_and_calls_do_not_nest() -> None:
    model, inputs = tiny("flux1")
    with pytest.raises(TypeError):
        torchpatches.coverage(model, **inputs, not_an_argument=1)
    assert _fused_common.observer is None
    with pytest.raises(TypeError, match="nn.Module"):
        torchpatches.coverage(lambda: None)

    class Nested(torch.nn.Module):
        def forward(self) -> Any:
            return torchpatches.coverage(model, **inputs)

    with pytest.raises(RuntimeError, match="does not nest"):
        torchpatches.coverage(Nested())
    assert _fused_common.observer is None


SCRIPT = """
import sys
import torch
from torchpatches.ops import force_tier
from torchpatches.testing import build_model, tiny_inputs

transformer = build_model("flux1")
inputs = tiny_inputs("flux1")
with force_tier("torch"), torch.no_grad():
    transformer(**inputs)
print("ran", sys.argv[1:])
"""


def test_cli_runs_the_script_here_and_reports_its_models(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from torchpatches.__main__ import run

    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    assert run(["coverage", "--json", str(script), "--flag"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ran ['--flag']")
    data = json.loads(out[out.index("{"):])
    assert data["target"] == str(script) and data["timing"]["skipped"].startswith("not timed")
    assert {row["pattern"] for row in data["rows"] if row["fused"]} >= {"adaln", "qk_norm_rope", "gate_residual"}
    assert any(row["class"] == "TimestepEmbedding" for row in data["untargeted"])
    assert _fused_common.observer is None
    with pytest.raises(SystemExit) as stop:
        run(["coverage", str(tmp_path / "missing.py")])
    assert stop.value.code == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times with CUDA events")
def test_timing_on_cuda() -> None:
    """The Triton tier on the GPU (no tier forced): fused, and timed with and without torchpatches."""
    model, inputs = tiny("flux1", dtype=torch.bfloat16)
    model, inputs = model.cuda(), {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    with torch.no_grad():
        report = torchpatches.coverage(model, **inputs)
    assert report.fused_calls("adaln") and report.fused_calls("qk_norm_rope") and report.fused_calls("gelu_gemm")
    assert report.timing["rounds"] == 7
    assert 0.2 < report.timing["ratio"] < 5, report.timing  # switching patches is not timed (it read 0.05x)


def test_timing_switches_patches_outside_the_timed_call() -> None:
    """The eager variant runs inside ``disabled()``, entered before the clock starts: a switch that costs host time
    (it cost 0.65 s with diffusers' targets) must not show up as eager time (it read Ideogram 4 as 0.055x)."""
    from torchpatches._coverage import timing

    log: List[str] = []

    @contextlib.contextmanager
    def switched(name: str) -> Iterator[None]:
        log.append(f"enter {name}")
        yield
        log.append(f"leave {name}")

    def timed() -> float:
        log.append("timed")
        return 1.0 if log[-2] == "enter eager" else 2.0

    times = timing.alternate({"eager": lambda: switched("eager"), "tp": lambda: switched("tp")},
                             lambda: log.append("call"), timed)
    assert times == {"eager": [1.0] * timing.ROUNDS, "tp": [2.0] * timing.ROUNDS}
    rounds = log[-6 * timing.ROUNDS:]
    assert rounds[:6] == ["enter eager", "timed", "leave eager", "enter tp", "timed", "leave tp"]
    assert log[:2 + timing.WARMUP] == ["enter eager"] + ["call"] * timing.WARMUP + ["leave eager"]
