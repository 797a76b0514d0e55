"""HunyuanVideo 1.5's eager fusion: the hunyuanvideo15 pattern (block glue, the attention mask once per step).

On the tiny ``hunyuanvideo15-fused`` transformer (2 blocks, a padded prompt; CPU, a forced tier standing in for the
GPU): the ``[B, 1, S, S]`` mask is built once per forward and handed to every block, again when the text mask
changes. Its values against diffusers' (both tiers) and op calls: test_fused_families.py; the step-aside cases:
through ``_fused_models.MODELS``.
"""
from __future__ import annotations

from typing import Dict, List

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from _fused_models import reverted, run, tiny  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402
from torchpatches.patches import _per_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("fused_on")

@pytest.fixture
def masks(monkeypatch: pytest.MonkeyPatch) -> List[torch.Tensor]:
    seen: List[torch.Tensor] = []
    real = _per_step.square_mask
    monkeypatch.setattr(_per_step, "square_mask", lambda *args: seen.append(real(*args)) or seen[-1])
    return seen


def test_one_mask_per_forward(calls: Dict[str, int], masks: List[torch.Tensor]) -> None:
    """The ``[B, 1, S, S]`` mask is built once per forward and every block gets it (values and op calls:
    test_fused_families.py)."""
    model, inputs = tiny("hunyuanvideo15", torch.bfloat16)
    ref = reverted(model, inputs)
    assert not calls and not masks
    with force_tier("torch"), torchpatches.disabled("gelu_gemm"):
        out = run(model, inputs)
    assert len(masks) == 2 and masks[0] is masks[1]
    assert torch.equal(out, ref)


def test_a_new_mask_each_step(calls: Dict[str, int], masks: List[torch.Tensor]) -> None:
    """Each forward stacks its own text mask: another step (here a prompt one token shorter) gets its own square
    mask, diffusers' values."""
    model, inputs = tiny("hunyuanvideo15", torch.float32)
    mask_name = next(k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dtype != torch.float32
                     and v.dim() == 2)
    with force_tier("torch"):
        run(model, inputs)
        text_mask = inputs[mask_name]
        text_mask[:, -1] = 0  # the prompt one token shorter, in place
        ref = reverted(model, inputs)
        out = run(model, inputs)
    assert torch.equal(out, ref)
    assert len({id(m) for m in masks}) == 2


def test_processor_keeps_its_parameters() -> None:
    """diffusers' Attention passes ``image_rotary_emb`` only to a processor whose signature names it."""
    import inspect

    from diffusers.models.transformers import transformer_hunyuan_video15 as hv

    tiny("hunyuanvideo15")
    params = inspect.signature(hv.HunyuanVideo15AttnProcessor2_0.__call__).parameters
    assert "image_rotary_emb" in params and "attention_mask" in params


def test_square_mask_is_rebuilt_after_an_in_place_write() -> None:
    text = torch.tensor([[1, 1, 0], [1, 0, 0]])
    first = _per_step.square_mask(text, 7)
    assert _per_step.square_mask(text, 7) is first
    assert _per_step.square_mask(text, 8) is not first  # another length
    text[1, 1] = 1
    again = _per_step.square_mask(text, 7)
    assert again is not first and bool(again[1, 0, -2, -2]) and not bool(first[1, 0, -2, -2])
    with torch.inference_mode():  # no version counter: never cached
        frozen = torch.tensor([[1, 0]])
        assert _per_step.square_mask(frozen, 4) is not _per_step.square_mask(frozen, 4)


def test_additive_mask_is_what_sdpa_makes_of_the_boolean_one() -> None:
    """With the native backend the processor hands SDPA the additive mask SDPA would make itself (zeros, -inf where
    False), built once per step: the same attention, bit for bit."""
    text = torch.tensor([[1, 1, 0], [1, 0, 0]])
    square = _per_step.square_mask(text, 6)
    additive = _per_step.square_mask(text, 6, torch.bfloat16)
    assert additive.dtype == torch.bfloat16 and _per_step.square_mask(text, 6, torch.bfloat16) is additive
    assert torch.equal(additive == 0, square) and torch.isinf(additive[~square]).all()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g).to(torch.bfloat16) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert torch.equal(sdpa(q, k, v, attn_mask=additive), sdpa(q, k, v, attn_mask=square))


def _diffusers_square(attention_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    # diffusers 0.42.1 HunyuanVideo15AttnProcessor2_0, verbatim
    batch_size = attention_mask.shape[0]
    mask = torch.nn.functional.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True)
    mask = mask.bool()
    self_attn_mask_1 = mask.view(batch_size, 1, 1, seq_len).repeat(1, 1, seq_len, 1)
    self_attn_mask_2 = self_attn_mask_1.transpose(2, 3)
    return (self_attn_mask_1 & self_attn_mask_2).bool()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16, torch.float32])
def test_square_mask_is_diffusers_mask_in_one_pass(dtype: torch.dtype) -> None:
    """The one-pass square equals diffusers' repeat-and-transpose mask (and, with a dtype, ATen's conversion of it:
    zeros, -inf where False) for masks with kept, dropped and fully dropped rows, an int and a bool text mask."""
    g = torch.Generator().manual_seed(0)
    for text in (torch.randint(0, 2, (3, 5), generator=g), torch.tensor([[0, 0, 0], [1, 1, 1]]).bool()):
        expected = _diffusers_square(text, 9)
        square = _per_step.square_mask(text, 9, dtype)
        if dtype is None:
            assert square.dtype == torch.bool and torch.equal(square, expected)
        else:
            reference = torch.zeros_like(expected, dtype=dtype).masked_fill_(expected.logical_not(), float("-inf"))
            assert square.dtype == dtype and torch.equal(square, reference)
            assert not torch.signbit(square[expected]).any()  # +0, as ATen's zeros
        assert square.shape == expected.shape and square.is_contiguous()
