"""The summary of a patch from its targets' states: a pure function, checked from a table of cases."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import pytest

from torchpatches._core.status import PatchState, PatchStatus, Status, TargetStatus, summarise

A, S, D, F, P = PatchState.APPLIED, PatchState.SKIPPED, PatchState.DISABLED, PatchState.FAILED, PatchState.PENDING


def _target(state: PatchState, module: str = "m", reason: str = "") -> TargetStatus:
    return TargetStatus(f"{module}:f", state, reason or f"{module} {state.value}")


# name -> (targets, wanted, gate_reason, previewed gate, expected (state, reason))
CASES: Dict[str, Tuple[Tuple[TargetStatus, ...], bool, Optional[str], Optional[str], Tuple[PatchState, str]]] = {
    "not wanted wins over everything": ((_target(A), _target(F)), False, "gate", None, (D, "off")),
    "gate refused": ((_target(A),), True, "torch 2.13 is outside torch<2.12", None,
                     (S, "torch 2.13 is outside torch<2.12")),
    "all applied": ((_target(A, "a"), _target(A, "b")), True, None, None, (A, "2/2 target(s) patched")),
    "a failure wins over applied": ((_target(A), _target(F, reason="boom"), _target(F, reason="bang")), True,
                                    None, None, (F, "boom; bang")),
    "applied, one waiting, one skipped": (
        (_target(A, "a"), _target(P, "b"), _target(S, "c", "c differs")), True, None, None,
        (A, "1/3 target(s) patched; waiting for b; c differs")),
    "all waiting": ((_target(P, "b"), _target(P, "a"), _target(P, "a")), True, None, None,
                    (P, "waits for a and b to be imported")),
    "waiting for many modules": (tuple(_target(P, name) for name in "dcba"), True, None, None,
                                 (P, "waits for a, b and 2 more to be imported")),
    "waiting and skipped": ((_target(P, "a"), _target(S, "b", "b not found")), True, None, None,
                            (P, "waits for a to be imported; b not found")),
    "waiting, but the imported packages already fail the gate": (
        (_target(P),), True, None, "diffusers 0.30 is outside diffusers>=0.35", (S, "diffusers 0.30 is outside diffusers>=0.35")),
    "all skipped": ((_target(S, reason="x differs"), _target(S, reason="y not found")), True, None, None,
                    (S, "x differs; y not found")),
    "wanted, nothing attempted": ((_target(D),), True, None, None, (P, "not attempted yet")),
    "applied, many skipped: three reasons and a count": (
        (_target(A, "a"),) + tuple(_target(S, name, f"{name} does not exist") for name in "bcdef"), True, None, None,
        (A, "1/6 target(s) patched; b does not exist; c does not exist; d does not exist; "
            "and 2 more skipped target(s) (PatchStatus.targets lists each)")),
    "the same skip reason twice is said once": ((_target(S, "a", "same"), _target(S, "b", "same")), True, None,
                                                 None, (S, "same")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_summary(case: str) -> None:
    targets, wanted, gate_reason, previewed, expected = CASES[case]
    got = summarise(targets, wanted=wanted, off_reason="off", gate_reason=gate_reason, preview_gate=lambda: previewed)
    assert got == expected


def test_the_gate_preview_is_asked_only_while_every_target_waits() -> None:
    asked = []

    def preview() -> Optional[str]:
        asked.append(True)
        return None

    summarise((_target(A), _target(P)), wanted=True, off_reason="", gate_reason=None, preview_gate=preview)
    assert asked == []
    summarise((_target(P),), wanted=True, off_reason="", gate_reason=None, preview_gate=preview)
    assert asked == [True]


def test_status_is_a_mapping_with_a_table() -> None:
    status = Status([PatchStatus("rope", A, "1/1 target(s) patched", "s", ()),
                     PatchStatus("inductor_realize", S, "torch 2.13.0 is outside torch>=2.11,<2.12", "s", ())])
    assert list(status) == ["rope", "inductor_realize"] and status["rope"].state is A
    assert str(status).splitlines() == [
        "patch             state    reason",
        "rope              applied  1/1 target(s) patched",
        "inductor_realize  skipped  torch 2.13.0 is outside torch>=2.11,<2.12",
    ]
    assert str(status["rope"]) == "rope: applied — 1/1 target(s) patched"
    assert str(A) == "applied" and A == "applied"


def test_a_lazy_table_not_built_yet_waits_for_its_module() -> None:
    """No targets yet: the patch waits for the module whose import builds them (and previews the gate)."""
    waiting = summarise((), wanted=True, off_reason="", gate_reason=None, table_waits_for="diffusers")
    assert waiting == (P, "waits for diffusers to be imported")
    refused = summarise((), wanted=True, off_reason="", gate_reason=None, table_waits_for="diffusers",
                        preview_gate=lambda: "torch 2.10 is outside torch>=2.11")
    assert refused == (S, "torch 2.10 is outside torch>=2.11")
    assert summarise((), wanted=False, off_reason="off", gate_reason=None, table_waits_for="diffusers") == (D, "off")
