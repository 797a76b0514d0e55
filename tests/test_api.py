"""The public API (apply / revert / disabled / status / CLI) and what importing torchpatches does."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

import torchpatches
from torchpatches._core import gates as _gates
from torchpatches._core.declare import Patch, Target
from torchpatches._core.registry import Registry
from torchpatches._core.status import PatchState

from _fresh import run_forked

SOURCE = """
def one():
    return 1

def two():
    return 2
"""


@pytest.fixture
def fake(make_module, monkeypatch):
    """The public API wired to a registry of two patches over a throwaway module."""
    name = make_module(SOURCE)
    alias = make_module(f"from {name} import one, two\n")
    module = importlib.import_module(name)
    alias_module = importlib.import_module(alias)
    patches = [
        Patch(
            name=f"p_{fn}",
            summary=fn,
            targets=(
                Target(
                    f"{name}:{fn}",
                    lambda original: (lambda: original() * 10),
                    frozenset({_gates.fingerprint(getattr(module, fn))}),
                    (f"{alias}:{fn}",),
                ),
            ),
        )
        for fn in ("one", "two")
    ]
    registry = Registry(patches)
    monkeypatch.setattr(torchpatches, "_registry", registry)
    originals = {fn: getattr(module, fn) for fn in ("one", "two")}
    return module, alias_module, originals


def test_apply_revert_status_round_trip(fake):
    module, alias_module, originals = fake
    status = torchpatches.apply()
    assert {name: entry.state for name, entry in status.items()} == {
        "p_one": PatchState.APPLIED,
        "p_two": PatchState.APPLIED,
    }
    assert module.one() == 10 and alias_module.two() == 20
    torchpatches.revert("p_one")
    assert module.one is originals["one"] and alias_module.one is originals["one"]
    assert module.two() == 20
    torchpatches.revert()
    assert module.two is originals["two"] and alias_module.two is originals["two"]


def test_apply_all_respects_the_environment_but_an_explicit_name_wins(fake, monkeypatch):
    module, _, originals = fake
    monkeypatch.setenv("TORCHPATCHES_DISABLE", "P_ONE")
    status = torchpatches.apply()
    assert status["p_one"].state is PatchState.DISABLED and "TORCHPATCHES_DISABLE" in status["p_one"].reason
    assert module.one is originals["one"] and module.two() == 20
    assert torchpatches.apply("p_one")["p_one"].state is PatchState.APPLIED


def test_disabled_reverts_inside_and_restores_after_even_on_error(fake):
    module, _, originals = fake
    torchpatches.apply()
    torchpatches.revert("p_two")
    with pytest.raises(KeyError):
        with torchpatches.disabled("p_one", "p_two"):
            assert module.one is originals["one"] and module.two is originals["two"]
            assert torchpatches.status()["p_one"].state is PatchState.DISABLED
            raise KeyError("boom")
    assert module.one() == 10
    assert module.two is originals["two"], "a patch that was off before the block stays off"
    assert "revert()" in torchpatches.status()["p_two"].reason


def test_switching_patches_off_and_on_again_does_not_verify_the_sources_again(fake, monkeypatch):
    """``disabled()`` around each call (coverage's timing, a user's A/B) re-applies on exit: the targets'
    sources, verified once, are not compiled again (it cost ~0.65 s a switch with diffusers' targets)."""
    module, _, _ = fake
    torchpatches.apply()
    compiled = []
    real = _gates._compiles_to
    monkeypatch.setattr(_gates, "_compiles_to", lambda *args: compiled.append(args) or real(*args))
    with torchpatches.disabled():
        assert module.one() == 1
    assert module.one() == 10 and compiled == []


def test_disabled_with_no_names_means_all_and_nests(fake):
    module, _, originals = fake
    torchpatches.apply()
    with torchpatches.disabled():
        with torchpatches.disabled("p_one"):
            assert module.one is originals["one"]
        assert module.one is originals["one"] and module.two is originals["two"]
    assert module.one() == 10 and module.two() == 20


def test_only_turns_exactly_these_on_and_restores_every_state_after(fake, monkeypatch):
    module, alias_module, originals = fake
    monkeypatch.setenv("TORCHPATCHES_DISABLE", "p_two")
    torchpatches.apply()
    before = {name: (entry.state, entry.reason) for name, entry in torchpatches.status().items()}
    with pytest.raises(KeyError):
        with torchpatches.only("p_two"):
            assert module.one is originals["one"] and alias_module.one is originals["one"]
            assert module.two() == 20 and alias_module.two() == 20
            assert torchpatches.status()["p_one"].state is PatchState.DISABLED
            raise KeyError("boom")
    assert {name: (entry.state, entry.reason) for name, entry in torchpatches.status().items()} == before
    assert module.one() == 10 and module.two is originals["two"] and alias_module.two is originals["two"]
    with torchpatches.only():
        assert module.one is originals["one"] and module.two is originals["two"]
    assert module.one() == 10
    with pytest.raises(ValueError, match="'nope'"):
        with torchpatches.only("p_one", "nope"):
            pass
    assert {name: (entry.state, entry.reason) for name, entry in torchpatches.status().items()} == before


def test_unknown_name_raises_value_error_and_changes_nothing(fake):
    module, _, _ = fake
    torchpatches.apply()
    with pytest.raises(ValueError, match="'nope'"):
        torchpatches.revert(["p_one", "nope"])
    with pytest.raises(ValueError, match="'nope'"):
        with torchpatches.disabled("nope"):
            pass
    assert module.one() == 10


class ApplyRevertMachine(RuleBasedStateMachine):
    """Any order of apply / revert / disabled keeps originals restorable by identity."""

    def __init__(self, module, alias_module, originals):
        super().__init__()
        self.module, self.alias_module, self.originals = module, alias_module, originals
        torchpatches.revert()
        self.on = {"p_one": False, "p_two": False}

    names = st.lists(st.sampled_from(["p_one", "p_two"]), min_size=1, max_size=2, unique=True)

    @rule(names=names)
    def apply(self, names):
        torchpatches.apply(names)
        self.on.update({name: True for name in names})

    @rule()
    def apply_all(self):
        torchpatches.apply()
        self.on = {name: True for name in self.on}

    @rule(names=names)
    def revert(self, names):
        torchpatches.revert(names)
        self.on.update({name: False for name in names})

    @rule(names=names)
    def disabled_block(self, names):
        with torchpatches.disabled(*names):
            for name in names:
                self._check(name, on=False)

    @rule(names=names)
    def only_block(self, names):
        with torchpatches.only(*names):
            for name in self.on:
                self._check(name, on=name in names)

    def _check(self, name, on):
        fn = name[2:]
        original = self.originals[fn]
        for module in (self.module, self.alias_module):
            current = getattr(module, fn)
            if on:
                assert current is not original and current() == original() * 10
            else:
                assert current is original
        expected = PatchState.APPLIED if on else PatchState.DISABLED
        assert torchpatches.status()[name].state is expected

    @invariant()
    def targets_match_model(self):
        for name, on in self.on.items():
            self._check(name, on)


def test_any_order_of_operations_restores_originals(fake):
    run_state_machine_as_test(
        lambda: ApplyRevertMachine(*fake),
        settings=settings(max_examples=60, stateful_step_count=20, deadline=None),
    )


# ---- real package, first imports --------------------------------------------------------------

_NO_HEAVY = """
    import sys
    import torch
    before = set(sys.modules)
    import torchpatches
    heavy = ["diffusers", "triton", "flashinfer", "torch._inductor.ir", "torch._dynamo"]
    print([name for name in heavy if name in sys.modules and name not in before])
"""
_TWICE = """
    import importlib, torchpatches
    first = {name: (s.state, s.reason) for name, s in torchpatches.status().items()}
    import torchpatches as again
    torchpatches.apply()
    second = {name: (s.state, s.reason) for name, s in torchpatches.status().items()}
    assert again is torchpatches and first == second, (first, second)
    print("same")
"""
_STATES = "import torchpatches; print({n: s.state.value for n, s in torchpatches.status().items()})"
_COUNT = "import torchpatches; print(len(torchpatches.status()))"
_MESSY = (" rope , inductor_realize,compile_warnings adaln,qk_norm_rope, gate_residual,gelu_gemm,SWIGLU "
          " sd3_qk_norm,SD3_BLOCK lora wan_block,WAN_QK_NORM_ROPE ")
#: Every name spelled out: a messy list of the first ones (spaces, commas, case), then every later patch.
DISABLE_ALL = ["all", "ALL", _MESSY + ",".join(sorted(
    set(torchpatches.patch_names()) - {n.strip().lower() for n in _MESSY.replace(",", " ").split()}))]
BAD_VALUES = ["ropee", "\u00e9\u00e9,;;", "x" * 10000]


@pytest.fixture(scope="module")
def first_imports(tmp_path_factory):
    """Every case below as a first ``import torchpatches`` (forks of one child process that imported torch)."""
    cases = {
        "no heavy": (_NO_HEAVY, {}),
        "twice": (_TWICE, {}),
        **{("disable", value): (_STATES, {"TORCHPATCHES_DISABLE": value}) for value in DISABLE_ALL},
        **{("bad", value): (_COUNT, {"TORCHPATCHES_DISABLE": value}) for value in BAD_VALUES},
    }
    results = run_forked(list(cases.values()), tmp_path_factory.mktemp("first-imports"))
    return dict(zip(cases, results))


def test_import_loads_no_heavy_or_optional_module(first_imports):
    result = first_imports["no heavy"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_importing_twice_changes_nothing(first_imports):
    result = first_imports["twice"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "same"


@pytest.mark.parametrize("value", DISABLE_ALL)
def test_environment_disables_everything_before_it_applies(value, first_imports):
    result = first_imports[("disable", value)]
    assert result.returncode == 0, result.stderr
    assert set(eval(result.stdout).values()) == {"disabled"}


@pytest.mark.parametrize("value", BAD_VALUES)
def test_bad_environment_values_warn_and_import(value, first_imports):
    result = first_imports[("bad", value)]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(len(torchpatches.patch_names()))
    assert "unknown patch" in result.stderr and "known patches" in result.stderr


def test_cli_prints_the_table_and_json(capsys):
    """``python -m torchpatches`` in a process of its own (the entry point); ``--json`` through ``main``."""
    from torchpatches import __main__ as cli

    table = subprocess.run([sys.executable, "-m", "torchpatches"], capture_output=True, text=True, timeout=300)
    assert table.stdout.splitlines()[0].split() == ["patch", "state", "reason"]
    for name in torchpatches.patch_names():
        assert name in table.stdout
    assert cli.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == set(torchpatches.patch_names())
    assert all(entry["state"] != "failed" for entry in data.values()), data
    assert table.returncode == 0


def test_cli_exit_code_is_one_when_a_patch_failed(make_module, monkeypatch, capsys):
    from torchpatches import __main__ as cli

    module = importlib.import_module(make_module(SOURCE))

    def broken(original):
        raise RuntimeError("replacement exploded")

    target = Target(f"{module.__name__}:one", broken, frozenset({_gates.fingerprint(module.one)}))
    monkeypatch.setattr(torchpatches, "_registry", Registry([Patch("p_broken", "x", (target,))]))
    torchpatches.apply()
    assert cli.main([]) == 1
    assert "replacement exploded" in capsys.readouterr().out
