"""Eligibility decided once per module instance and input signature (``_fused_common.remembered``), and
decided again after every change it depends on: hooks added or removed, ``forward`` replaced on the
instance, ``.to()`` of a dtype, a submodule replaced (a wrapper, as peft's) or rebound, training mode.

On tiny FLUX.1 with the PyTorch tier forced: the double block's attention processor fuses its q/k stretch
(``qk_norm_rope`` op call) only while its four RMSNorms are stock and fit; each change must show in the
op count of the next forward, and the output must stay diffusers'.
"""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

pytest.importorskip("diffusers")

from _fused_models import reverted, run, tiny  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402
from torchpatches.patches import _fused_common  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

#: qk_norm_rope calls per forward of tiny FLUX.1 (1 double + 2 single blocks) with every pattern on.
ALL = 3


def _qk_calls(model: torch.nn.Module, inputs: Dict[str, Any], calls: Dict[str, int]) -> int:
    before = calls["qk_norm_rope"]
    with force_tier("torch"):
        out = run(model, inputs)
    assert torch.equal(out, reverted(model, inputs))
    return calls["qk_norm_rope"] - before


@pytest.fixture
def flux1(calls: Dict[str, int]):
    model, inputs = tiny("flux1")
    assert _qk_calls(model, inputs, calls) == ALL  # the verdicts are made and remembered
    return model, inputs


def test_verdict_is_made_once_per_instance_and_signature(flux1, calls: Dict[str, int],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = flux1
    made = []
    real = _fused_common.plain_rms_norm
    monkeypatch.setattr("torchpatches.patches._joint_attention.plain_rms_norm",
                        lambda norm, x: made.append(norm) or real(norm, x))
    assert _qk_calls(model, inputs, calls) == ALL
    assert made == []  # remembered: no norm looked at again
    bf16_model, bf16_inputs = tiny("flux1", torch.bfloat16)
    with force_tier("torch"):
        run(bf16_model, bf16_inputs)
    assert len(made) == 4 + 2 * 2  # new instances: 4 norms in the double block, 2 in each single block


def test_hook_added_then_removed(flux1, calls: Dict[str, int]) -> None:
    model, inputs = flux1
    handle = model.transformer_blocks[0].attn.norm_added_k.register_forward_pre_hook(lambda m, a: None)
    assert _qk_calls(model, inputs, calls) == ALL - 1
    handle.remove()
    assert _qk_calls(model, inputs, calls) == ALL


def test_forward_replaced_on_the_instance(flux1, calls: Dict[str, int]) -> None:
    model, inputs = flux1
    norm = model.transformer_blocks[0].attn.norm_q
    norm.forward = norm.forward  # what accelerate's and diffusers' hooks do: an instance attribute
    assert _qk_calls(model, inputs, calls) == ALL - 1
    del norm.forward
    assert _qk_calls(model, inputs, calls) == ALL


def test_dtype_changed_by_to(flux1, calls: Dict[str, int]) -> None:
    model, inputs = flux1
    norm = model.single_transformer_blocks[1].attn.norm_k
    norm.to(torch.float64)  # the weight no longer has the activations' dtype: diffusers' code
    assert _qk_calls(model, inputs, calls) == ALL - 1
    norm.to(torch.float32)
    assert _qk_calls(model, inputs, calls) == ALL


def test_weight_of_another_shape_set_through_data(flux1, calls: Dict[str, int]) -> None:
    """``weight.data = ...`` keeps the parameter object: the remembered verdict must still see the new shape (the
    fused path hands the weight to the op's unchecked entry, whose kernel would read past its end)."""
    from torchpatches.patches._bodies.qk_norm_rope import _FLUX1
    from torchpatches.patches._joint_attention import _norms_fit

    model, inputs = flux1
    attn = model.single_transformer_blocks[0].attn
    weight = attn.norm_k.weight
    q = torch.randn(1, 4, attn.heads, attn.head_dim, device=weight.device)
    assert _norms_fit(_FLUX1, attn, q, ("norm_q", "norm_k"))
    kept = weight.data
    weight.data = torch.ones(attn.head_dim + 2, device=weight.device)
    try:
        assert not _norms_fit(_FLUX1, attn, q, ("norm_q", "norm_k"))
    finally:
        weight.data = kept
    assert _norms_fit(_FLUX1, attn, q, ("norm_q", "norm_k"))


def test_eps_set_to_none_after_the_verdict(flux1, calls: Dict[str, int]) -> None:
    """An RMSNorm's ``eps`` is read per call, not remembered: ``None`` (torch's default eps) after a fused run gives
    diffusers' code for that block, with diffusers' result."""
    model, inputs = flux1
    norm = model.single_transformer_blocks[0].attn.norm_q
    kept, norm.eps = norm.eps, None
    try:
        assert _qk_calls(model, inputs, calls) == ALL - 1
    finally:
        norm.eps = kept


def test_submodule_wrapped_as_an_adapter_then_rebound(flux1, calls: Dict[str, int]) -> None:
    model, inputs = flux1
    attn = model.transformer_blocks[0].attn
    original = attn.norm_k

    class Wrapper(torch.nn.Module):  # how peft wraps a layer: a new module holding the original
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base_layer = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x)

    attn.norm_k = Wrapper(original)
    assert _qk_calls(model, inputs, calls) == ALL - 1
    attn.norm_k = original  # rebound
    assert _qk_calls(model, inputs, calls) == ALL
    affine_free = torch.nn.RMSNorm(original.normalized_shape, eps=original.eps, elementwise_affine=False)
    attn.norm_k = affine_free  # a stock RMSNorm without a weight: the op needs one
    assert _qk_calls(model, inputs, calls) == ALL - 1


def test_training_mode_decides_again(flux1, calls: Dict[str, int], monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = flux1
    made = []
    real = _fused_common.plain_rms_norm
    monkeypatch.setattr("torchpatches.patches._joint_attention.plain_rms_norm",
                        lambda norm, x: made.append(norm) or real(norm, x))
    model.train()
    assert _qk_calls(model, inputs, calls) == ALL  # nothing in these checks depends on it, but they ran again
    assert len(made) == 4 + 2 * 2
    model.eval()


def test_lora_adapter_loaded_after_a_fused_run(flux1, calls: Dict[str, int]) -> None:
    peft = pytest.importorskip("peft")
    model, inputs = flux1
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                      target_modules=["to_q", "to_k", "add_k_proj", "proj_out"]))
    assert _qk_calls(model, inputs, calls) == ALL  # projections are module calls: still fused, peft's output


def test_a_remembered_module_can_still_be_collected() -> None:
    import gc
    import weakref

    model, inputs = tiny("flux1")
    block_attn = model.transformer_blocks[0].attn
    block_attn.forward = block_attn.forward  # a bound method on the instance refers back to the module
    with force_tier("torch"):
        run(model, inputs)
    attn = weakref.ref(block_attn)
    del block_attn
    assert attn() in _fused_common._VERDICTS
    del model
    gc.collect()
    assert attn() is None


def test_modules_that_cannot_be_remembered_are_checked_each_call() -> None:
    class Unhashable(torch.nn.Module):
        __hash__ = None  # type: ignore[assignment]

    made = []
    for module in (Unhashable(), object.__new__(torch.nn.Linear), "not a module"):
        assert _fused_common.remembered(module, "key", lambda: made.append(1) or True)
        assert _fused_common.remembered(module, "key", lambda: made.append(1) or True)
    assert len(made) == 6
