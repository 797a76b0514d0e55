"""The families added after the first five (FLUX.3, QwenImage 2.1, Z-Image, Krea 2, Wan 2.2 TI2V, HunyuanVideo 1.5,
LTX-2, Ideogram 4, Kandinsky 6, Chroma, HiDream-I1), fused (Z-Image, Ideogram 4, HunyuanVideo 1.5) or not yet.

Their tiny models (``torchpatches/_harness/families.py``) give bit-identical outputs with and without torchpatches
on the CPU (no fused path runs there), and ``torchpatches.coverage`` reports, per family, which of its classes a
pattern targets (shared diffusers modules: Wan's blocks, ``AdaLayerNormZero``, FLUX.1's attention processor) and
which are targeted by none. A family that gains a fused pattern changes its registry row.
"""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, Iterator, List, Tuple

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from harness import build_model, registry, tiny_inputs  # noqa: E402

#: name -> (its own classes no pattern targets, the (pattern, class) pairs coverage reports): the registry's rows
#: that pin them (``torchpatches/_harness/registry.py``).
FAMILIES: Dict[str, Tuple[Tuple[str, ...], FrozenSet[Tuple[str, str]]]] = {
    name: (family.untargeted, family.targeted) for name, family in registry.FAMILIES.items()
    if family.targeted is not None}
#: tiny_inputs options: what the family's pipeline passes beyond the config's defaults
OPTIONS: Dict[str, Dict[str, Any]] = {"chroma": {"text_padding": 2}}


def _tiny(name: str) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    return build_model(name), tiny_inputs(name, **OPTIONS.get(name, {}))


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a model's output (a tensor, or tuples and lists of them: Z-Image's list, LTX-2's video and
    audio)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from _tensors(item)


def _run(model: torch.nn.Module, inputs: Dict[str, Any]) -> List[torch.Tensor]:
    with torch.no_grad():
        return list(_tensors(model(**inputs)))


@pytest.mark.parametrize("name", FAMILIES)
def test_outputs_are_bit_identical_with_and_without_torchpatches(name: str) -> None:
    model, inputs = _tiny(name)
    patched = _run(model, inputs)
    with torchpatches.disabled():
        stock = _run(model, inputs)
    assert patched and len(patched) == len(stock)
    assert all(torch.equal(a, b) for a, b in zip(patched, stock))


@pytest.mark.parametrize("name", FAMILIES)
def test_coverage_reports_what_no_pattern_targets(name: str) -> None:
    own, shared = FAMILIES[name]
    model, inputs = _tiny(name)
    with torch.no_grad():
        report = torchpatches.coverage(model, **inputs)
    untargeted = {row["class"] for row in report.untargeted}
    assert set(own) <= untargeted, untargeted
    assert {(row["pattern"], row["class"]) for row in report.rows} == shared, report.rows
    assert untargeted.isdisjoint(cls for _, cls in shared)
    assert not any(row["fused"] for row in report.rows)  # the CPU: the Triton tier needs CUDA
    assert type(model).__name__ in untargeted and not report.not_applied
