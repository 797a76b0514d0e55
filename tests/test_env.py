"""TORCHPATCHES_DISABLE parsing: never crashes, warns once about names it does not know."""
from __future__ import annotations

import warnings

import pytest
from hypothesis import given, strategies as st

from torchpatches._core.env import disabled_names

KNOWN = ("inductor_realize", "compile_warnings", "rope")


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", set()),
        ("rope", {"rope"}),
        ("ROPE , Inductor_Realize", {"rope", "inductor_realize"}),
        ("rope compile_warnings", {"rope", "compile_warnings"}),
        ("all", set(KNOWN)),
        ("ALL,rope", set(KNOWN)),
        (",,, ", set()),
    ],
)
def test_values(value, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disabled_names(KNOWN, value) == expected


def test_unknown_names_warn_once_listing_known_names():
    with pytest.warns(RuntimeWarning, match=r"'ropee'.*known patches: inductor_realize, compile_warnings, rope") as got:
        assert disabled_names(KNOWN, "ropee,rope,bogus") == {"rope"}
    assert len(got) == 1 and "'bogus'" in str(got[0].message)


def test_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHPATCHES_DISABLE", "rope")
    assert disabled_names(KNOWN) == {"rope"}


@given(st.text())
def test_no_value_crashes(value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert disabled_names(KNOWN, value) <= set(KNOWN)
