"""The QwenImage eager fusion patterns: qwenimage_block and qwenimage_qk_norm_rope.

On the tiny ``qwenimage-fused`` transformer (2 double-stream blocks, a padded text mask; CPU): the fused
paths (a forced tier stands in for the GPU) compute what diffusers computes, bit for bit with the PyTorch
tier (fp32 on a GPU within 1e-5: ``_fused_models.same``); every call form they do not cover gets diffusers' code (op call counters show which path ran). The
registry's promises per pattern (fingerprints, revert by identity, ``disabled()``, importing nothing heavy) and
gradients are asserted by test_fused_patches.py; forward AD, vmap/jvp and autocast by test_fused_step_aside.py.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import (DEVICE, FUSED, exact, regional_compile_run, reverted, run, run_hooked,  # noqa: E402
                           same, tiny)
from diffusers.models import normalization  # noqa: E402
from diffusers.models.transformers import transformer_qwenimage as qwen  # noqa: E402
from harness import build_model, count_kernels, registry, tiny_inputs  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402
from torchpatches.patches import _per_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

QWEN = ("qwenimage_block", "qwenimage_qk_norm_rope")
#: Fused op calls per forward of qwenimage-fused with every pattern on: per block norm1 x2, residual +
#: norm2 x2, residual x2 (modulate) and one qk_norm_rope; the model's norm_out is adaln's (modulate).
EXPECTED = registry.FAMILIES["qwenimage"].calls

try:
    import triton  # noqa: F401

    TIERS = ["torch", "triton"]
except ImportError:  # pragma: no cover
    TIERS = ["torch"]


def _model(dtype: torch.dtype = torch.float32):
    return tiny("qwenimage", dtype)


# ---- the fused path computes what diffusers computes ------------------------------------------


def test_batch_of_two_with_different_masks(calls: Dict[str, int]) -> None:
    """Two samples (per-sample modulation vectors and text masks; the attention output split into
    non-contiguous slices before the output projections), PyTorch tier: diffusers' values bit for bit."""
    model, inputs = _model(torch.bfloat16)
    for name in ("hidden_states", "encoder_hidden_states"):
        inputs[name] = torch.cat([inputs[name], inputs[name] * 0.5])
    inputs.update(timestep=torch.tensor([0.5, 0.7], device=DEVICE, dtype=torch.bfloat16),
                  encoder_hidden_states_mask=torch.tensor([[1] * 8, [1] * 5 + [0] * 3], device=DEVICE),
                  img_shapes=[[(1, 4, 4)], [(1, 4, 4)]])
    ref = reverted(model, inputs)
    with exact():
        out = run(model, inputs)
    assert same(out, ref, "qwenimage") and dict(calls) == EXPECTED


#: Head dim -> axes_dims_rope (summing to it). torch's CPU complex multiply runs the complex64 values of a row in
#: vectors (8 with AVX-512, 4 with AVX2) and the rest in a scalar loop that contracts ``a*c - b*d`` to an FMA; a
#: real-form rotation (cos/sin tables) then differs by an ulp in those last values: at 8, 12, 24 and 40 on AVX-512
#: (4, 6, 4, 4 of 4, 6, 12, 20 values), never at 16, 32 and 64. The PyTorch tier multiplies as diffusers does.
HEAD_DIMS = {8: (2, 2, 4), 12: (4, 4, 4), 16: (4, 6, 6), 24: (8, 8, 8), 32: (8, 12, 12), 40: (8, 16, 16),
             64: (16, 24, 24)}
#: The Triton tier (interpreter on CPU) in fp32: measured up to 3.0 x eps x max|out| (7.2e-7 at head dim 12).
TRITON_FP32_EPS = 4


def _model_with_head_dim(head_dim: int, heads: int = 2, dtype: torch.dtype = torch.float32):
    """qwenimage-fused (2 blocks, padded text mask) with another head dim / head count, built as build_model does."""
    from harness import CONFIGS

    class_name, config = CONFIGS["qwenimage-fused"]
    config = {**config, "attention_head_dim": head_dim, "num_attention_heads": heads,
              "axes_dims_rope": HEAD_DIMS[head_dim]}
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(DEVICE):
            torch.manual_seed(0)
            model = getattr(diffusers, class_name)(**config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(previous)
    inputs = tiny_inputs("qwenimage-fused", dtype=dtype, device=DEVICE)
    inputs.pop("return_dict")
    return model, inputs


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("head_dim", sorted(HEAD_DIMS))
def test_every_head_dim_fp32(head_dim: int, tier: str, calls: Dict[str, int]) -> None:
    """fp32, 2 heads: the PyTorch tier equals diffusers bit for bit at every head dim (before the tier ran
    diffusers' complex multiply, 8, 12, 24 and 40 differed by 1-2 ulp in up to 107 of 256 outputs); the Triton
    tier stays within TRITON_FP32_EPS x eps x max|out|."""
    if tier == "triton" and DEVICE.type != "cpu":
        pytest.skip("the compiled kernels' fp32 bound is measured on the GPU, not here")
    model, inputs = _model_with_head_dim(head_dim)
    ref = reverted(model, inputs)
    with force_tier(tier), torchpatches.disabled("gelu_gemm"):
        out = run(model, inputs)
    assert dict(calls) == EXPECTED
    if tier == "torch":
        assert torch.equal(out, ref), f"max |diff| {(out - ref).abs().max().item():.3g}"
    else:
        bound = TRITON_FP32_EPS * torch.finfo(torch.float32).eps * ref.abs().max().item()
        assert (out - ref).abs().max().item() <= bound


def test_one_head_batch_of_two_fp32(calls: Dict[str, int]) -> None:
    """One head (torch coalesces a row's tokens into one loop) and two samples (the per-stream slices of the
    joint tensors are not contiguous), head dim 24, fp32, PyTorch tier: diffusers' values bit for bit."""
    model, inputs = _model_with_head_dim(24, heads=1)
    for name in ("hidden_states", "encoder_hidden_states"):
        inputs[name] = torch.cat([inputs[name], inputs[name] * 0.5])
    inputs.update(timestep=torch.tensor([0.5, 0.7], device=DEVICE),
                  encoder_hidden_states_mask=torch.tensor([[1] * 8, [1] * 5 + [0] * 3], device=DEVICE),
                  img_shapes=[[(1, 4, 4)], [(1, 4, 4)]])
    ref = reverted(model, inputs)
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, ref) and dict(calls) == EXPECTED


def test_triton_kernels_in_the_model(calls: Dict[str, int]) -> None:
    """The Triton kernels (interpreter), bf16: one-ulp differences at most, carried through two blocks of bf16
    GEMMs (fp32 models run the kernels in test_a_rebound_global_is_what_runs, within 1e-5)."""
    pytest.importorskip("triton")
    model, inputs = _model(torch.bfloat16)
    ref = reverted(model, inputs)
    with force_tier("triton"):
        out = run(model, inputs)
    assert dict(calls) == EXPECTED
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU the automatic tier is the kernels'")
def test_cpu_without_a_forced_tier_runs_diffusers(calls: Dict[str, int]) -> None:
    model, inputs = _model()
    assert torch.equal(run(model, inputs), reverted(model, inputs))
    assert not calls


def test_float64_gets_diffusers_code(calls: Dict[str, int]) -> None:
    model, inputs = _model(torch.float64)
    with exact():
        out = run(model, inputs)
    assert torch.equal(out, reverted(model, inputs)) and not calls


@pytest.mark.parametrize("off", QWEN)
def test_each_pattern_off_alone_still_equal(off: str, calls: Dict[str, int]) -> None:
    model, inputs = _model(torch.bfloat16)
    ref = reverted(model, inputs)
    with exact(), torchpatches.disabled(off):
        out = run(model, inputs)
    assert same(out, ref, "qwenimage")
    want = {"qwenimage_block": {"modulate": 1, "qk_norm_rope": 2}, "qwenimage_qk_norm_rope": {"modulate": 13}}
    assert dict(calls) == want[off]


@pytest.mark.parametrize("mask", ["none", "padded", "all ones"])
def test_mask_forms_equal_diffusers(mask: str, calls: Dict[str, int]) -> None:
    """Direct block calls: no text mask, a padded bool mask (as the model passes it), all ones."""
    model, inputs = _model(torch.bfloat16)
    block = model.transformer_blocks[0]
    g = torch.Generator().manual_seed(4)
    img = torch.randn(1, 16, 32, generator=g).to(DEVICE, torch.bfloat16)
    txt = torch.randn(1, 8, 32, generator=g).to(DEVICE, torch.bfloat16)
    temb = torch.randn(1, 32, generator=g).to(DEVICE, torch.bfloat16)
    text_mask = {"none": None, "padded": inputs["encoder_hidden_states_mask"].bool(),
                 "all ones": torch.ones(1, 8, dtype=torch.bool, device=DEVICE)}[mask]
    rotary = model.pos_embed([(1, 4, 4)], max_txt_seq_len=8, device=DEVICE)
    args = dict(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=text_mask, temb=temb,
                image_rotary_emb=rotary)
    with torch.no_grad():
        with torchpatches.disabled(*FUSED):
            ref = block(**args)
        with exact():
            out = block(**args)
    assert all(same(o, r, "qwenimage") for o, r in zip(out, ref))
    assert dict(calls) == {"modulate": 6, "qk_norm_rope": 1}


def test_processor_replacement_shows_the_original_signature() -> None:
    """diffusers' ``Attention.forward`` drops keyword arguments the processor's signature does not name."""
    import inspect

    replacement = vars(qwen.QwenDoubleStreamAttnProcessor2_0)["__call__"]
    original = replacement.__torchpatches_original__
    assert replacement is not original

    def parameters(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert parameters(replacement) == parameters(original)  # names, kinds and defaults; no annotations
    names = inspect.signature(qwen.QwenDoubleStreamAttnProcessor2_0().__call__).parameters
    assert {"encoder_hidden_states_mask", "image_rotary_emb"} <= set(names)


def test_external_attention_mask_gets_diffusers_error(calls: Dict[str, int]) -> None:
    model, inputs = _model()
    with exact(), pytest.raises(ValueError, match="external attention_mask"):
        run(model, {**inputs, "attention_kwargs": {"attention_mask": torch.ones(1, 24, dtype=torch.bool)}})
    assert calls["qk_norm_rope"] == 0


def test_new_freqs_and_masks_are_not_served_from_the_cache(calls: Dict[str, int]) -> None:
    """Another image size, another mask, and the same tensors written in place: diffusers' values each time."""
    model, inputs = _model(torch.bfloat16)
    other = {**inputs, "hidden_states": inputs["hidden_states"][:, :8], "img_shapes": [[(1, 2, 4)]],
             "encoder_hidden_states_mask": torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0]], device=DEVICE)}
    for case in (inputs, other, inputs):
        with exact():
            out = run(model, case)
        assert same(out, reverted(model, case))
    # In place: the cached tables and mask are rebuilt when their sources change.
    freqs = model.pos_embed([(1, 4, 4)], max_txt_seq_len=8, device=DEVICE)
    on = freqs[0].device  # "cuda:0": the tables are made for the device the tensors are on, as the pattern asks
    cos, _ = _per_step.rope_tables(*freqs, 16, 8, 16, on)
    freqs[0].mul_(1j)
    cos2, sin2 = _per_step.rope_tables(*freqs, 16, 8, 16, on)
    assert not torch.equal(cos2[8:], cos[8:]) and torch.equal(cos2[8:, ::2], freqs[0].real)
    assert torch.equal(sin2[8:, 1::2], freqs[0].imag)
    mask = torch.ones(1, 8, dtype=torch.bool, device=DEVICE)
    hidden = torch.zeros(1, 16, 32, device=DEVICE)
    first = _per_step.joint_mask(mask, hidden)
    assert _per_step.joint_mask(mask, hidden) is first  # cached within a step
    mask[0, 7] = False
    assert not _per_step.joint_mask(mask, hidden)[0, 0, 0, 7]


def test_inference_mode_is_served_without_the_cache(calls: Dict[str, int]) -> None:
    """Inference tensors have no version counter: served, but nothing cached (each block builds its own)."""
    model, inputs = _model(torch.bfloat16)
    ref = reverted(model, inputs)
    seen: Dict[str, Any] = {}
    hook = model.transformer_blocks[0].register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    try:
        with torch.inference_mode(), exact():
            out = model(**inputs, return_dict=False)[0]
    finally:
        hook.remove()
    img_freqs, mask = seen["image_rotary_emb"][0], seen["encoder_hidden_states_mask"]  # alive: entries would be
    assert img_freqs.is_inference() and mask.is_inference()
    assert img_freqs not in _per_step._TABLES and mask not in _per_step._MASKS
    assert same(out, ref, "qwenimage") and dict(calls) == EXPECTED


def test_cache_entries_die_with_their_tensors() -> None:
    import gc

    freqs = (torch.polar(torch.ones(4, 8), torch.rand(4, 8)), torch.polar(torch.ones(2, 8), torch.rand(2, 8)))
    _per_step.rope_tables(*freqs, 4, 2, 16, torch.device("cpu"))
    mask = torch.ones(1, 2, dtype=torch.bool)
    _per_step.joint_mask(mask, torch.zeros(1, 4, 8))
    before = (len(_per_step._TABLES), len(_per_step._MASKS))
    del freqs, mask
    gc.collect()
    assert (len(_per_step._TABLES), len(_per_step._MASKS)) == (before[0] - 1, before[1] - 1)


# ---- never in the way ------------------------------------------------------------------------


def test_hooked_norms_get_diffusers_code(calls: Dict[str, int]) -> None:
    model, inputs = _model()
    ref = reverted(model, inputs)
    seen = []
    block = model.transformer_blocks[0]
    hooks = [block.img_norm2.register_forward_hook(lambda m, a, o: seen.append("img_norm2")),
             model.transformer_blocks[1].attn.norm_added_k.register_forward_hook(lambda m, a, o: seen.append("k"))]
    out = run_hooked(model, inputs, hooks, exact())
    assert same(out, ref, "qwenimage") and seen == ["img_norm2", "k"]
    # block 0 fell back (its processor still fused), block 1's processor fell back (its block still fused)
    assert dict(calls) == {"modulate": 7, "qk_norm_rope": 1}


def test_accelerate_and_diffusers_hooks_get_diffusers_code(calls: Dict[str, int]) -> None:
    """Hooks that replace an instance's ``forward`` (accelerate's offloading, diffusers' hook registry) on a
    module the fused path would skip: that block / that processor runs diffusers' code."""
    accelerate_hooks = pytest.importorskip("accelerate.hooks")
    from diffusers.hooks import HookRegistry, ModelHook

    model, inputs = _model()
    ref = reverted(model, inputs)
    accelerate_hooks.add_hook_to_module(model.transformer_blocks[0].txt_norm1, accelerate_hooks.ModelHook())
    HookRegistry.check_if_exists_or_initialize(model.transformer_blocks[1].attn.norm_q).register_hook(
        ModelHook(), "spy")
    with exact():
        out = run(model, inputs)
    assert same(out, ref, "qwenimage")
    assert dict(calls) == {"modulate": 7, "qk_norm_rope": 1}


def test_context_parallel_processor_hands_attention_what_diffusers_does(calls: Dict[str, int],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Processors with a parallel config (context parallelism) run the fused q/k stretch, and the
    attention backend receives what diffusers' processor hands it: the config and the joint mask. The backend here
    records them and attends locally; two gloo ranks run tiny QwenImage under real Ulysses (the text and its mask
    split with the image) in test_fused_context_parallel.py."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    model, inputs = _model()
    config = object()
    for block in model.transformer_blocks:
        monkeypatch.setattr(block.attn.processor, "_parallel_config", config, raising=False)
    name, real = _AttentionBackendRegistry.get_active_backend()
    seen: list = []

    def recording(*args: Any, _parallel_config: Any = None, **kwargs: Any) -> torch.Tensor:
        mask = kwargs.get("attn_mask")
        seen.append((_parallel_config, None if mask is None else mask.clone()))
        return real(*args, **kwargs)

    monkeypatch.setitem(_AttentionBackendRegistry._backends, name, recording)
    ref = reverted(model, inputs)
    with exact():
        out = run(model, inputs)
    assert same(out, ref, "qwenimage") and dict(calls) == EXPECTED
    assert len(seen) == 4 and all(c is config for c, _ in seen)  # 2 blocks, diffusers' processor then the patched
    for (_, theirs), (_, ours) in zip(seen[:2], seen[2:]):
        assert theirs is not None and torch.equal(ours, theirs)  # the padded text's joint mask


def test_subclasses_get_their_own_code(calls: Dict[str, int]) -> None:
    """A block subclass with its own ``_modulate``; a tensor subclass as input."""

    class Halved(qwen.QwenImageTransformerBlock):
        def _modulate(self, x, mod_params, index=None):
            out, gate = super()._modulate(x, mod_params, index)
            return out * 0.5, gate

    model, inputs = _model()
    block = model.transformer_blocks[0]
    block.__class__ = Halved
    ref = reverted(model, inputs)
    with exact():
        out = run(model, inputs)
    assert same(out, ref, "qwenimage") and calls["modulate"] == 7
    calls.clear()

    class Marked(torch.Tensor):
        pass

    block.__class__ = qwen.QwenImageTransformerBlock
    temb = torch.randn(1, 32, device=DEVICE).as_subclass(Marked)
    args = dict(hidden_states=torch.randn(1, 16, 32, device=DEVICE).as_subclass(Marked),
                encoder_hidden_states=torch.randn(1, 8, 32, device=DEVICE),
                encoder_hidden_states_mask=None, temb=temb,
                image_rotary_emb=model.pos_embed([(1, 4, 4)], max_txt_seq_len=8, device=DEVICE))
    with torch.no_grad(), exact():
        out = block(**args)
        with torchpatches.disabled(*FUSED):
            ref = block(**args)
    assert all(torch.equal(o, r) for o, r in zip(out, ref)) and not calls


def test_zero_cond_t_edit_model_steps_aside_in_the_block(calls: Dict[str, int]) -> None:
    """QwenImage-Edit-2511's ``zero_cond_t`` (per-token modulation of the reference image through
    ``modulate_index``): the blocks run diffusers' code, the processors stay fused."""
    from harness import CONFIGS

    name = "qwenimage-fused"
    CONFIGS["qwenimage-fused-zero-cond"] = (CONFIGS[name][0], dict(CONFIGS[name][1], zero_cond_t=True))
    try:
        model = build_model("qwenimage-fused-zero-cond", device=DEVICE)
    finally:
        del CONFIGS["qwenimage-fused-zero-cond"]
    inputs = tiny_inputs(name, device=DEVICE)
    inputs.pop("return_dict")
    inputs["img_shapes"] = [[(1, 2, 4), (1, 2, 4)]]  # the image, then the reference image
    ref = reverted(model, inputs)
    with exact():
        out = run(model, inputs)
    assert same(out, ref, "qwenimage")
    assert dict(calls) == {"modulate": 1, "qk_norm_rope": 2}


def _identity_rope(x: torch.Tensor, freqs_cis: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x


REBINDS = {
    "apply_rotary_emb_qwen": (qwen, "apply_rotary_emb_qwen", lambda real: _identity_rope),
    "RMSNorm.forward": (normalization.RMSNorm, "forward", lambda real: lambda self, x: real(self, x) * 0.5),
    "F.layer_norm": (torch.nn.functional, "layer_norm", lambda real: lambda *a, **k: real(*a, **k) * 0.5),
}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("case", sorted(REBINDS))
def test_a_rebound_global_is_what_runs(case: str, tier: str, monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name, make = REBINDS[case]
    model, inputs = _model()
    monkeypatch.setattr(owner, name, make(getattr(owner, name)))
    ref = reverted(model, inputs)
    with force_tier(tier):
        got = run(model, inputs)
    if tier == "torch":
        assert same(got, ref, "qwenimage"), case
    else:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


# ---- torch.compile: the patterns step aside --------------------------------------------------------


@pytest.mark.slow
def test_compile_same_kernels_and_outputs(calls: Dict[str, int], record_property: Callable[[str, Any], None]) -> None:
    model, inputs = _model()

    def compile_and_count():
        """Regional compile: the blocks, where the patterns act."""
        out, codes = regional_compile_run(model, inputs)
        return out, count_kernels(codes)

    with torchpatches.disabled(*FUSED):
        ref, ref_kernels = compile_and_count()
    with force_tier("torch"):  # even with the fused path allowed on CPU, tracing keeps diffusers' code
        out, kernels = compile_and_count()
    torch._dynamo.reset()
    record_property("inductor_fused_kernels", dict(vanilla=ref_kernels, patched=kernels))
    print(f"\ninductor kernels, tiny qwenimage, CPU, torch {torch.__version__}: vanilla {ref_kernels}, "
          f"patched {kernels}")
    assert dict(calls) == {"modulate": 1}  # only the model's norm_out (adaln), eager outside the compiled blocks
    assert kernels == ref_kernels
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.slow
def test_compile_reads_the_processor_signature_without_a_graph_break(calls: Dict[str, int]) -> None:
    """Attention.forward reads the processor's signature under compile too: an attention kwarg the processor
    does not take (diffusers warns and drops it) compiles in one graph, as without the patterns."""
    from harness import graph_report

    model, inputs = _model()
    inputs["attention_kwargs"] = {"not_a_parameter": 1}
    with torchpatches.disabled(*FUSED):
        torch._dynamo.reset()
        ref = graph_report(model, **inputs)
    torch._dynamo.reset()
    got = graph_report(model, **inputs)
    torch._dynamo.reset()
    assert (got.graphs, got.breaks, got.fullgraph) == (ref.graphs, ref.breaks, ref.fullgraph) == (1, 0, True)
    assert not calls
