"""``qwenimage_text_seq_len``: QwenImage's text-length helper gives diffusers' results without a host-to-device copy.

The three results (length, per-sample lengths, boolean mask) equal the original's bit for bit, dtypes and devices
included, for every kind of text mask (none, full, padded, with holes, a row with no token, a long 0/1 mask) and the
shape error; the tiny QwenImage model gives the same output with the patch and without; the controlnet module's
by-name import is the replacement and revert restores both; under torch.compile the original runs. On a GPU
(``TORCHPATCHES_TEST_DEVICE=cuda``) the helper is captured in a CUDA graph where the original fails, and
``cuda_graphs.graphed`` captures the tiny QwenImage and replays it equal to eager.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from harness import build_model, tiny_inputs  # noqa: E402
from torchpatches._core.slot import MARK_ORIGINAL  # noqa: E402
from torchpatches.patches._bodies import qwenimage_text_seq_len  # noqa: E402

CUDA = os.environ.get("TORCHPATCHES_TEST_DEVICE") == "cuda"
DEVICE = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA (TORCHPATCHES_TEST_DEVICE=cuda)")


@pytest.fixture
def qwen() -> Any:
    torchpatches.apply(["qwenimage_text_seq_len"])
    from diffusers.models.transformers import transformer_qwenimage

    return transformer_qwenimage


def _original(qwen: Any) -> Any:
    return getattr(qwen.compute_text_seq_len_from_mask, MARK_ORIGINAL)


def _mask(kind: str) -> Optional[torch.Tensor]:
    full = torch.ones(3, 6, dtype=torch.bool, device=DEVICE)
    if kind == "none":
        return None
    if kind == "full":
        return full
    mask = full.clone()
    if kind == "padded":
        mask[1, 4:] = False
        mask[2, 2:] = False
    elif kind == "holes":
        mask[0, 1] = mask[1, 3] = mask[2, ::2] = False
    elif kind == "empty row":
        mask[1] = False
    return mask.long() if kind == "long" else mask


@pytest.mark.parametrize("kind", ["none", "full", "padded", "holes", "empty row", "long"])
def test_the_results_are_diffusers(qwen: Any, kind: str) -> None:
    states = torch.randn(3, 6, 4, device=DEVICE)
    expected = _original(qwen)(states, _mask(kind))
    got = qwen.compute_text_seq_len_from_mask(states, _mask(kind))
    assert got[0] == expected[0] and type(got[0]) is int
    for g, e in zip(got[1:], expected[1:]):
        if e is None:
            assert g is None
        else:
            assert g.dtype == e.dtype and g.device == e.device and g.shape == e.shape and torch.equal(g, e)


def test_a_mask_of_another_shape_raises_diffusers_error(qwen: Any) -> None:
    states, mask = torch.randn(3, 6, 4), torch.ones(3, 5, dtype=torch.bool)
    with pytest.raises(ValueError) as expected:
        _original(qwen)(states, mask)
    with pytest.raises(ValueError) as got:
        qwen.compute_text_seq_len_from_mask(states, mask)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("compiling", [False, True])
def test_the_host_copy_is_gone_but_under_compile(qwen: Any, monkeypatch: pytest.MonkeyPatch, compiling: bool) -> None:
    """The original's ``torch.as_tensor(text_seq_len, device=...)`` runs only where Dynamo traces diffusers' code."""
    copies = []
    real = torch.as_tensor
    monkeypatch.setattr(torch, "as_tensor", lambda *args, **kwargs: copies.append(args) or real(*args, **kwargs))
    monkeypatch.setattr(qwenimage_text_seq_len, "is_compiling", lambda: compiling)
    qwen.compute_text_seq_len_from_mask(torch.randn(1, 4, 2), torch.ones(1, 4, dtype=torch.bool))
    assert copies == ([(4,)] if compiling else [])


def test_the_model_gives_the_same_output(qwen: Any) -> None:
    model = build_model("qwenimage-fused")
    inputs = tiny_inputs("qwenimage-fused")
    with torch.no_grad():
        with torchpatches.disabled("qwenimage_text_seq_len"):
            expected = model(**inputs)[0]
        got = model(**inputs)[0]
    assert torch.equal(got, expected)


def test_the_controlnet_import_follows_and_revert_restores_both(qwen: Any) -> None:
    from diffusers.models.controlnets import controlnet_qwenimage

    patched = qwen.compute_text_seq_len_from_mask
    assert controlnet_qwenimage.compute_text_seq_len_from_mask is patched
    torchpatches.revert("qwenimage_text_seq_len")
    try:
        original = qwen.compute_text_seq_len_from_mask
        assert original is getattr(patched, MARK_ORIGINAL)
        assert controlnet_qwenimage.compute_text_seq_len_from_mask is original
    finally:
        torchpatches.apply(["qwenimage_text_seq_len"])
    assert controlnet_qwenimage.compute_text_seq_len_from_mask is qwen.compute_text_seq_len_from_mask is patched


@gpu
def test_gpu_the_helper_is_captured_where_the_original_fails(qwen: Any) -> None:
    states, mask = torch.randn(2, 6, 4, device="cuda"), _mask("padded")[:2]
    for fn, captures in ((qwen.compute_text_seq_len_from_mask, True), (_original(qwen), False)):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn(states, mask)
            captured = True
        except RuntimeError as error:
            assert "during CUDA graph capture" in str(error)
            captured = False
            torch.cuda.synchronize()
        assert captured is captures


@gpu
def test_gpu_graphed_captures_the_tiny_qwenimage() -> None:
    from torchpatches.cuda_graphs import graphed

    model = build_model("qwenimage-fused", device="cuda", dtype=torch.bfloat16)
    inputs = tiny_inputs("qwenimage-fused", device="cuda", dtype=torch.bfloat16)
    wrapper = graphed(model)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed capture warns
        expected = model(**inputs)[0]
        for _ in range(2):
            assert torch.equal(wrapper(**inputs)[0], expected)
    assert wrapper.info()[:3] == (1, 2, 0)
