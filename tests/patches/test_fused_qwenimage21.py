"""QwenImage 2.1's eager fusion: the qwenimage21 pattern (block glue, SwiGLU product, q/k RMSNorm + complex RoPE with
k behind the cached keys, the final norm).

The registry-wide tests (test_fused_families.py) run the KV-cached step (every step after the first) of the tiny
``qwenimage21-fused`` transformer. Here what only this family has (CPU, a forced tier standing in for the GPU): the
prefill step that writes the KV cache (text tokens modulated from ``t = 0``: each token's modulation row chosen by the
op's ``select`` form; the processor's per-segment attention, with a condition image and a padded prompt), a run
without the cache, a batch of two with its own timesteps, no ``causal_condition`` (one modulation row per sample), all
with random q/k norm weights; a hook on the final norm's Linear.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import DEVICE, FUSED, run  # noqa: E402
from harness import build_model, registry, tiny_inputs  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

#: Per block: img_norm1 + modulate, gate + residual + img_norm2 + modulate, gate + residual (modulate), the SwiGLU
#: product (swiglu), q/k norm + RoPE with k written behind the cached keys (qk_norm_rope; the cached step only): the
#: registry's row.
EXPECTED = registry.FAMILIES["qwenimage21"].calls


def _model(dtype: torch.dtype, **config: Any) -> torch.nn.Module:
    """The tiny ``qwenimage21-fused`` model with random q/k norm weights (the constructor's ones would hide a wrong
    weight)."""
    model = build_model("qwenimage21-fused", dtype=dtype, device=DEVICE) if not config else _built(dtype, config)
    g = torch.Generator().manual_seed(3)
    for name, p in model.named_parameters():
        if ".norm_q." in name or ".norm_k." in name:
            p.data = (1 + 0.3 * torch.randn(p.shape, generator=g)).to(device=p.device, dtype=p.dtype)
    return model


def _built(dtype: torch.dtype, config: Dict[str, Any]) -> torch.nn.Module:
    import diffusers

    cfg = dict(registry.FAMILIES["qwenimage21"].fused_config(), **config)
    torch.manual_seed(0)
    return diffusers.QwenImage21Transformer2DModel(**cfg).to(device=DEVICE, dtype=dtype).eval()


def _inputs(dtype: torch.dtype, mode: Any = "cached") -> Dict[str, Any]:
    inputs = tiny_inputs("qwenimage21-fused", dtype=dtype, device=DEVICE, kv_cache_mode=mode or "extract")
    inputs.pop("return_dict")
    if mode is None:  # no cache: every step a prefill
        inputs.update(kv_cache=None, kv_cache_mode=None)
    return inputs


def _batch_of_two(inputs: Dict[str, Any]) -> Dict[str, Any]:
    """The inputs for two samples (the layout shared, as the pipeline's CFG-free batch), timesteps 0.5 and 0.25."""
    g = torch.Generator().manual_seed(5)
    out = dict(inputs)
    for name in ("hidden_states", "encoder_hidden_states"):
        t = inputs[name]
        out[name] = torch.cat([t, torch.randn(t.shape, generator=g).to(t)])
    out["encoder_hidden_states_mask"] = inputs["encoder_hidden_states_mask"].repeat(2, 1)
    out["timestep"] = torch.tensor([0.5, 0.25], dtype=inputs["timestep"].dtype, device=DEVICE)
    cache = inputs["kv_cache"]
    if cache is not None and inputs["kv_cache_mode"] == "cached":
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

        two = QwenImage21KVCache(len(cache.layer_caches))
        for layer, old in zip(two.layer_caches, cache.layer_caches):
            layer.store(*(torch.cat([t, torch.randn(t.shape, generator=g).to(t)]) for t in old.get()))
        out["kv_cache"] = two
    return out


def _fresh_cache(inputs: Dict[str, Any]) -> Dict[str, Any]:
    """The inputs with an empty cache of the same size (an "extract" run fills it)."""
    if inputs["kv_cache"] is None:
        return inputs
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    return dict(inputs, kv_cache=QwenImage21KVCache(len(inputs["kv_cache"].layer_caches)))


def _both(model: torch.nn.Module, inputs: Dict[str, Any], tier: Any) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The output and what the run left in its KV cache (the prefill stores each block's text keys and values)."""
    inputs = _fresh_cache(inputs) if inputs["kv_cache_mode"] == "extract" else inputs
    if tier is None:
        with torchpatches.disabled(*FUSED, "rope"):
            out = run(model, inputs)
    else:
        with force_tier(tier), torchpatches.disabled("gelu_gemm"):
            out = run(model, inputs)
    cache = inputs["kv_cache"]
    stored = [t for layer in cache.layer_caches for t in (layer.k, layer.v) if t is not None] if cache else []
    return out, stored


def _check(got: Tuple[torch.Tensor, List[torch.Tensor]], ref: Tuple[torch.Tensor, List[torch.Tensor]],
           tier: str) -> None:
    pairs = [(got[0], ref[0])] + list(zip(got[1], ref[1]))
    assert len(got[1]) == len(ref[1])
    for out, want in pairs:
        if tier == "torch":
            assert torch.equal(out, want)
        elif out.dtype == torch.float32:
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
        else:  # one bf16 ulp where the fp32 statistics cross a rounding boundary, carried through the GEMMs
            torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def _against_diffusers(model: torch.nn.Module, inputs: Dict[str, Any], tier: str, calls: Dict[str, int]) -> None:
    """The fused run (``tier`` forced) against diffusers': the output and the stored cache, the op calls of a
    forward."""
    if tier == "triton":
        pytest.importorskip("triton")
    ref = _both(model, inputs, None)
    assert not calls
    got = _both(model, inputs, tier)
    assert dict(calls) == EXPECTED
    _check(got, ref, tier)


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["cached", "extract", None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_step_kind_equals_diffusers(dtype: torch.dtype, mode: Any, tier: str, calls: Dict[str, int]) -> None:
    """The cached step, the prefill that fills the cache (its stored keys and values too) and a run without the
    cache, with random q/k norm weights."""
    model, inputs = _model(dtype), _inputs(dtype, mode)
    _against_diffusers(model, inputs, tier, calls)


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["cached", "extract"])
def test_a_batch_of_two_with_its_own_timesteps(mode: str, tier: str, calls: Dict[str, int]) -> None:
    """Two samples: each target token reads its own sample's modulation row, the text tokens the ``t = 0`` row (the
    third): a wrong row index moves the output by order 1e-1."""
    model, inputs = _model(torch.float32), _batch_of_two(_inputs(torch.float32, mode))
    _against_diffusers(model, inputs, tier, calls)


@pytest.mark.parametrize("tier", ["torch", "triton"])
def test_without_causal_condition(tier: str, calls: Dict[str, int]) -> None:
    """``causal_condition=False`` (no KV cache): one modulation row per sample, ``[B, 1, D]`` vectors."""
    model, inputs = _model(torch.float32, causal_condition=False), _batch_of_two(_inputs(torch.float32, None))
    _against_diffusers(model, inputs, tier, calls)


def _with_condition_image(inputs: Dict[str, Any]) -> Dict[str, Any]:
    """An edit prompt: 3 text tokens, a condition image of 2 x 2 latents (one vision slot), 2 text tokens (the last
    padding), then the 4 x 4 target's slots: the prefill attends per segment (text, image block, text)."""
    g = torch.Generator().manual_seed(7)
    x, text = inputs["hidden_states"], inputs["encoder_hidden_states"]
    slots = torch.tensor([[False] * 3 + [True] + [False] * 2 + [True] * 4], device=DEVICE)
    mask = torch.ones(1, 6, dtype=inputs["encoder_hidden_states_mask"].dtype, device=DEVICE)
    mask[:, -1] = 0
    return dict(inputs, hidden_states=torch.cat([torch.randn(1, 4, x.shape[2], generator=g).to(x), x], dim=1),
                encoder_hidden_states=torch.randn(1, 6, text.shape[2], generator=g).to(text),
                encoder_hidden_states_mask=mask, img_mask=slots, img_shapes=[[(1, 2, 2), (1, 4, 4)]])


@pytest.mark.parametrize("tier", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["extract", None])
def test_a_condition_image_and_a_padded_prompt(mode: Any, tier: str, calls: Dict[str, int]) -> None:
    """The prefill's segments: a text segment (causal), the condition image's block (bidirectional), a text segment
    with a padded key, then the target."""
    model, inputs = _model(torch.float32), _with_condition_image(_inputs(torch.float32, mode))
    _against_diffusers(model, inputs, tier, calls)


def test_the_final_norms_linear_is_a_module_call(calls: Dict[str, int]) -> None:
    """A forward hook on the final norm's Linear (a LoRA layer's place) sees its one call and what it returns is
    used; the norm and its modulation stay fused."""
    model, inputs = _model(torch.float32), _inputs(torch.float32)
    seen = []

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        seen.append(1)
        return out * 2

    handle = model.norm_out.linear.register_forward_hook(hook)
    try:
        _against_diffusers(model, inputs, "torch", calls)
    finally:
        handle.remove()
    assert seen == [1, 1]
