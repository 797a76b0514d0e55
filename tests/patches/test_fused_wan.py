"""The Wan eager fusion patterns: wan_block, wan_qk_norm_rope (and gelu_gemm on Wan's feed-forward).

On the tiny ``wan-fused`` transformer (Wan2.1 T2V's block options, 2 blocks; CPU): the fused path (a forced
tier stands in for the GPU) computes what diffusers computes; the I2V image context, hooks, LoRA layers,
gradients, other rotary dtypes and torch.compile get diffusers' code (context-parallel processors are covered). Op call
counters show which path ran. The shared step-aside cases (forward AD, vmap/jvp, autocast) run on ``wan``
through ``_fused_models.MODELS``.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Dict, Tuple

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import DEVICE, FUSED, exact_run, reverted, run, run_hooked  # noqa: E402
from harness import registry  # noqa: E402
from diffusers.models import activations  # noqa: E402
from diffusers.models.transformers import transformer_wan  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

#: Fused op calls per forward of tiny Wan (2 blocks): per block 4 modulate (norm1 + modulate, gate +
#: residual + norm2, residual + norm3 + modulate, gate + residual) and 2 rms_norm_rope (self, cross).
EXPECTED = registry.FAMILIES["wan"].calls


def tiny(name: str, dtype: torch.dtype = torch.float32, config: str = "wan-fused"):
    """The harness's ``wan-fused`` (2 blocks) on 2 frames of 4 x 4 latents: 8 video tokens, 8 text tokens
    (few token rows keep Triton's interpreter quick)."""
    from harness import build_model, tiny_inputs

    assert name == "wan"
    model = build_model(config, dtype=dtype, device=DEVICE)
    inputs = tiny_inputs(config, dtype=dtype, device=DEVICE, side=4)
    inputs.pop("return_dict")
    return model, inputs


def _block_inputs(model: torch.nn.Module, inputs: Dict[str, Any]):
    """(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb) as the model hands them to block 0."""
    seen: Dict[str, Any] = {}

    def grab(module, args):
        seen["args"] = args

    handle = model.blocks[0].register_forward_pre_hook(grab)
    try:
        with torchpatches.disabled(*FUSED):
            run(model, inputs)
    finally:
        handle.remove()
    return seen["args"]


def _patched_and_diffusers(block: torch.nn.Module, *args: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """The block's output with the patterns (PyTorch tier forced) and with every pattern reverted."""
    with torchpatches.disabled(*FUSED):
        ref = block(*args)
    with force_tier("torch"):
        return block(*args), ref


# ---- the fused path computes what diffusers computes ----------------------------------------------


def test_fp32_tables_of_a_bf16_checkpoint(calls: Dict[str, int]) -> None:
    """As ``from_pretrained(torch_dtype=bf16)`` leaves Wan: norms and modulation tables in fp32 (the
    class's ``_keep_in_fp32_modules``), the rest bf16. Still bit for bit, still fused."""
    model, inputs = tiny("wan", torch.bfloat16)
    for block in model.blocks:
        for module in (block.norm2,):
            module.float()
        block.scale_shift_table.data = block.scale_shift_table.data.float()
    ref = reverted(model, inputs)
    out = exact_run(model, inputs)
    assert dict(calls) == EXPECTED and torch.equal(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_in_the_model(dtype: torch.dtype, calls: Dict[str, int]) -> None:
    """The Triton kernels (interpreter) inside the model: fp32 within 1e-5; bf16 one-ulp differences at
    most, carried through two blocks of bf16 GEMMs."""
    pytest.importorskip("triton")
    model, inputs = tiny("wan", dtype)
    ref = reverted(model, inputs)
    with force_tier("triton"):
        out = run(model, inputs)
    assert dict(calls) == EXPECTED
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(DEVICE.type != "cpu", reason="on a GPU the automatic tier is the kernels'")
def test_cpu_without_a_forced_tier_runs_diffusers(calls: Dict[str, int]) -> None:
    model, inputs = tiny("wan")
    assert torch.equal(run(model, inputs), reverted(model, inputs))
    assert not calls


@pytest.mark.parametrize("off", ["wan_block", "wan_qk_norm_rope"])
def test_each_pattern_alone(off: str, calls: Dict[str, int]) -> None:
    model, inputs = tiny("wan")
    ref = reverted(model, inputs)
    with force_tier("torch"), torchpatches.disabled(off):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    assert calls["modulate"] == (0 if off == "wan_block" else 8)
    assert calls["rms_norm_rope"] == (0 if off == "wan_qk_norm_rope" else 4)


def test_fused_projections(calls: Dict[str, int]) -> None:
    """``attn.fuse_projections()``: q, k, v are chunks of one ``to_qkv`` output (strided rows)."""
    model, inputs = tiny("wan")
    for block in model.blocks:
        block.attn1.fuse_projections()
        block.attn2.fuse_projections()
    ref = reverted(model, inputs)
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref) and dict(calls) == EXPECTED


def test_without_cross_attn_norm(calls: Dict[str, int]) -> None:
    """``cross_attn_norm=False`` (norm2 is ``nn.Identity``): the gated residual alone fused, norm2 called."""
    model, inputs = tiny("wan")
    for block in model.blocks:
        block.norm2 = torch.nn.Identity()
    ref = reverted(model, inputs)
    out = exact_run(model, inputs)
    assert torch.equal(out, ref) and dict(calls) == EXPECTED


def test_wan22_per_token_modulation(calls: Dict[str, int]) -> None:
    """Wan 2.2 TI2V hands blocks a per-token ``temb`` ``[B, S, 6, D]``: per-token vectors, still fused."""
    model, inputs = tiny("wan")
    hidden, text, temb, rotary = _block_inputs(model, inputs)
    per_token = temb[:, None].expand(-1, hidden.shape[1], -1, -1) * torch.linspace(
        0.5, 1.5, hidden.shape[1], device=DEVICE)[None, :, None, None]
    block = model.blocks[0]
    with torch.no_grad():
        out, ref = _patched_and_diffusers(block, hidden, text, per_token, rotary)
    assert torch.equal(out, ref)
    assert calls["modulate"] == 4


def test_gelu_gemm_serves_wans_feed_forward() -> None:
    """Wan's FeedForward("gelu-approximate") projects through diffusers' tanh ``GELU``: the class whose
    forward the gelu_gemm patch replaces (it runs the cuBLASLt epilogue on CUDA; CPU keeps diffusers' ops)."""
    model, _ = tiny("wan")
    act = model.blocks[0].ffn.net[0]
    assert type(act) is activations.GELU and act.approximate == "tanh"
    assert activations.GELU.forward.__torchpatches_patch__ == "gelu_gemm"


# ---- what the fused paths hand back ---------------------------------------------------------------


def test_i2v_image_context_runs_diffusers_cross_attention(calls: Dict[str, int]) -> None:
    """Wan2.1 I2V's cross-attention (``add_k_proj``, a second attention over the image tokens) runs
    diffusers' processor; the self-attention and the block glue stay fused."""
    model, inputs = tiny("wan", config="wan-fused-i2v")
    ref = reverted(model, inputs)
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref)
    assert dict(calls) == {"modulate": 8, "rms_norm_rope": 2}


def test_forward_hooks_get_diffusers_code(calls: Dict[str, int]) -> None:
    model, inputs = tiny("wan")
    ref = reverted(model, inputs)
    seen: Dict[str, int] = collections.Counter()
    first, second = model.blocks
    hooks = [
        first.norm1.register_forward_hook(lambda m, a, o: seen.update(["norm1"])),
        second.norm2.register_forward_hook(lambda m, a, o: seen.update(["norm2"])),
        second.attn1.norm_q.register_forward_hook(lambda m, a, o: seen.update(["norm_q"])),
    ]
    out = run_hooked(model, inputs, hooks, force_tier("torch"))
    assert torch.equal(out, ref)
    assert seen == {"norm1": 1, "norm2": 1, "norm_q": 1}
    # Block 0 ran diffusers' forward (its processors stay fused); block 1 fused its glue, with norm2 called as
    # a module (the gated residual alone fused), and its self-attention processor fell back.
    assert dict(calls) == {"modulate": 4, "rms_norm_rope": 3}


def test_subclassed_norm_gets_diffusers_code(calls: Dict[str, int]) -> None:
    class MyRMSNorm(torch.nn.RMSNorm):
        pass

    model, inputs = tiny("wan")
    attn = model.blocks[0].attn2
    mine = MyRMSNorm(attn.inner_dim, eps=attn.norm_k.eps).to(DEVICE)
    mine.load_state_dict(attn.norm_k.state_dict())
    attn.norm_k = mine.requires_grad_(False)
    ref = reverted(model, inputs)
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, ref) and calls["rms_norm_rope"] == 3


def test_prompt_requiring_grad_gets_diffusers_code(calls: Dict[str, int]) -> None:
    """A frozen model with only the prompt requiring grad: the cross-attention's k needs it."""
    model, inputs = tiny("wan")
    hidden, text, temb, rotary = _block_inputs(model, inputs)
    text = text.detach().requires_grad_(True)
    block = model.blocks[0]
    out, ref = _patched_and_diffusers(block, hidden, text, temb, rotary)
    assert torch.equal(out, ref) and calls["modulate"] == 0 and calls["rms_norm_rope"] == 1  # self-attention only
    out.sum().backward()
    assert text.grad is not None


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rotary_of_another_dtype_gets_diffusers_self_attention(dtype: torch.dtype, calls: Dict[str, int]) -> None:
    """Wan's RoPE computes in the promoted dtype of its tables: only fp32 tables take the kernel."""
    model, inputs = tiny("wan")
    hidden, text, temb, (cos, sin) = _block_inputs(model, inputs)
    rotary = (cos.to(dtype), sin.to(dtype))
    block = model.blocks[0]
    with torch.no_grad():
        out, ref = _patched_and_diffusers(block, hidden, text, temb, rotary)
    assert torch.equal(out, ref)
    assert calls["rms_norm_rope"] == 1 and calls["modulate"] == 4  # cross-attention and the glue only


def test_context_parallel_processor_hands_attention_what_diffusers_does(calls: Dict[str, int],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Processors with a parallel config (context parallelism) run the fused q/k stretch, and the
    attention backend receives what diffusers' processor hands it: the config in self-attention, none in
    cross-attention (the text is not split). The backend here records the config and attends locally; two gloo
    ranks run tiny Wan under real Ulysses and ring in test_fused_context_parallel.py."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    model, inputs = tiny("wan")
    hidden, text, temb, rotary = _block_inputs(model, inputs)
    block, config = model.blocks[0], object()
    for attn in (block.attn1, block.attn2):
        monkeypatch.setattr(attn.processor, "_parallel_config", config, raising=False)
    name, real = _AttentionBackendRegistry.get_active_backend()
    seen: list = []

    def recording(*args: Any, _parallel_config: Any = None, **kwargs: Any) -> torch.Tensor:
        seen.append(_parallel_config)
        return real(*args, **kwargs)

    monkeypatch.setitem(_AttentionBackendRegistry._backends, name, recording)
    with torch.no_grad():
        out, ref = _patched_and_diffusers(block, hidden, text, temb, rotary)
    assert torch.equal(out, ref)
    assert calls["rms_norm_rope"] == 2  # self- and cross-attention, both under the parallel config
    assert seen == [config, None, config, None]  # diffusers' processor, then the patched one


# ---- torch.compile: the patterns step aside --------------------------------------------------------


@pytest.mark.slow
def test_compile_same_kernels_and_outputs(calls: Dict[str, int], record_property: Callable[[str, Any], None],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUX's compile case (test_fused_patches.py) on tiny wan-fused: same Inductor kernels, same outputs."""
    import test_fused_patches as flux

    monkeypatch.setitem(flux.MODELS, "wan", lambda: tiny("wan"))
    flux.test_compile_same_kernels_and_outputs("wan", calls, record_property)


# ---- Wan 2.2 TI2V: per-token timesteps --------------------------------------------------------------------


#: Per block: norm1 + modulate, the norm3 residual + modulate and the feed-forward's gated residual take their vectors
#: as two terms (table row + temb chunk, added in the kernel); the gated residual + affine norm2 takes the gate
#: materialized (one [B, S, D] fp32 vector).
TI2V_EXPECTED = {"modulate": 8, "modulate two-term": 6, "rms_norm_rope": 4}


@pytest.fixture
def two_term_calls(calls: Dict[str, int], monkeypatch: pytest.MonkeyPatch) -> Dict[str, int]:
    """``calls``, and how many modulate calls took two-term vectors."""
    from torchpatches.ops import _modulate

    real = _modulate._impl

    def counting(*args: Any, **kwargs: Any):
        if kwargs.get("addends") is not None or (len(args) > 10 and args[10] is not None):
            calls["modulate two-term"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(_modulate, "_impl", counting)
    return calls


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ti2v_per_token_vectors_are_never_materialized(tier: str, dtype: torch.dtype,
                                                       two_term_calls: Dict[str, int]) -> None:
    """Wan 2.2 TI2V's ``[B, S, 6, D]`` temb: the kernel adds ``scale_shift_table`` and each chunk in fp32, as
    diffusers' ``scale_shift_table.unsqueeze(0) + temb.float()`` does; diffusers' values bit for bit with the PyTorch
    tier, within fp32 ulps (carried through attention) with the kernel."""
    if tier == "triton":
        pytest.importorskip("triton")
    model, inputs = tiny("wan", dtype, config="wan22-ti2v-fused")
    assert inputs["timestep"].dim() == 2, "per-token timesteps"
    ref = reverted(model, inputs)
    with force_tier(tier), torchpatches.disabled("gelu_gemm"):
        out = run(model, inputs)
    assert dict(two_term_calls) == TI2V_EXPECTED
    if tier == "torch" or dtype == torch.bfloat16:
        assert torch.equal(out, ref)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row", [dict(norm_span="inner"), dict(norm_span="inner", rope="joint_rows"),
                                 dict(rope="wan_rows"), dict(norm_span="heads")])
def test_the_joint_body_refuses_a_row_that_mixes_wans_norm_and_another_rope(row) -> None:
    """Norms across heads (``rms_norm_rope``) rotate with Wan's rows only; a row that pairs them otherwise would run
    one family's rotation on another's tables."""
    from torchpatches.patches._joint_attention import Joint

    with pytest.raises(ValueError, match="norm_span"):
        Joint("diffusers.models.transformers.transformer_wan", **row)
