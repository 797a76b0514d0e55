"""``status()`` tells the truth and revert/apply converge under hostile use.

Reloads of a target module (``importlib.reload`` or ``del sys.modules[...]`` + import), a second
registry over the same targets (what ``importlib.reload(torchpatches)`` makes), code edited on disk
after import, and a third party that wraps our replacement and later restores it.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import time
import unittest.mock
from pathlib import Path
from typing import Any, Callable, Tuple

import pytest

from torchpatches._core import gates as _gates
from torchpatches._core.declare import Patch, Target
from torchpatches._core.registry import PatchState, Registry

REPO = Path(__file__).resolve().parents[1]

TARGET_SOURCE = """
PREFIX = "hello "

def greet(name):
    return PREFIX + name
"""


def _loud(original: Callable[[str], str]) -> Callable[[str], str]:
    def greet(name: str) -> str:
        return original(name).upper()

    return greet


def _same_source_copy(original: Any) -> Any:
    """A replacement compiled from the original's own source, file and lines (as compile_warnings
    makes them), with one global rebound: reading the file at its code's lines finds the original."""
    from torchpatches.patches.compile_warnings._rebind import rebind_globals

    return rebind_globals(original, {"PREFIX": "HEY "})


def _patch(module_name: str, fingerprint: str, make: Callable[[Any], Any] = _loud, aliases: Tuple[str, ...] = ()) -> Patch:
    return Patch(
        name="loud",
        summary="test",
        targets=(Target(f"{module_name}:greet", make, frozenset({fingerprint}), aliases),),
    )


@pytest.fixture
def target(make_module: Callable[..., str]) -> Tuple[str, str]:
    name = make_module(TARGET_SOURCE)
    fingerprint = _gates.fingerprint(importlib.import_module(name).greet)
    return name, fingerprint


def _state(registry: Registry) -> PatchState:
    return registry.status()["loud"].state


# ---- reloads of a target module ---------------------------------------------------------------


def test_reload_of_the_target_module_is_followed_and_revert_converges(target, make_module) -> None:
    name, fingerprint = target
    alias_name = make_module(f"from {name} import greet\n")
    module, alias = sys.modules[name], importlib.import_module(alias_name)
    registry = Registry([_patch(name, fingerprint, aliases=(f"{alias_name}:greet",))])
    registry.apply()
    assert module.greet("a") == "HELLO A" and alias.greet("a") == "HELLO A"

    importlib.reload(module)  # the module body runs again: a fresh, unpatched greet
    # Either the patch follows the reload, or status says it is not in effect: never "applied" over
    # an unpatched module. This registry follows reloads (the module loaded again).
    assert module.greet("a") == "HELLO A", "the reloaded module holds an unpatched function"
    assert _state(registry) is PatchState.APPLIED
    assert alias.greet is module.greet

    registry.revert()
    assert module.greet("a") == "hello a" and alias.greet("a") == "hello a"
    assert alias.greet is module.greet  # the reloaded original, at the alias too
    assert _state(registry) is PatchState.DISABLED
    registry.apply()
    assert module.greet("a") == "HELLO A" and alias.greet is module.greet
    registry.revert()
    assert module.greet("a") == "hello a" and alias.greet is module.greet


def test_target_module_removed_from_sys_modules_and_imported_again(target) -> None:
    name, fingerprint = target
    registry = Registry([_patch(name, fingerprint)])
    registry.apply()
    del sys.modules[name]
    fresh = importlib.import_module(name)
    assert fresh.greet("a") == "HELLO A"
    assert _state(registry) is PatchState.APPLIED
    registry.revert()
    assert fresh.greet("a") == "hello a"
    assert _state(registry) is PatchState.DISABLED


def test_status_is_read_from_what_is_bound(target) -> None:
    """Someone rebinds the target behind torchpatches' back: status does not claim 'applied'."""
    name, fingerprint = target
    module = sys.modules[name]
    registry = Registry([_patch(name, fingerprint)])
    registry.apply()
    module.greet = lambda who: "theirs"
    status = registry.status()["loud"]
    assert status.state is not PatchState.APPLIED
    assert "someone else" in status.reason or "not in effect" in status.reason


def test_revert_under_a_users_function_gives_aliases_the_original(make_module: Callable[..., str], target) -> None:
    """A user's function at the target (a mock) while the patch is reverted (``disabled()``): the target keeps the
    user's function, the aliases get the original they imported, as without torchpatches (not the user's function,
    which they would keep after the mock is undone); applying again patches the target and the aliases."""
    name, fingerprint = target
    module = sys.modules[name]
    original = module.greet
    alias = importlib.import_module(make_module(f"from {name} import greet\n", prefix="tp_alias"))
    registry = Registry([_patch(name, fingerprint, aliases=(f"{alias.__name__}:greet",))])
    registry.apply()
    replacement = module.greet
    assert alias.greet is replacement
    with unittest.mock.patch.object(module, "greet", lambda who: "mocked"):
        registry.revert()
        assert module.greet("a") == "mocked" and alias.greet is original
    assert module.greet is replacement  # the mock undone: it put back what it found
    registry.apply()
    assert alias.greet("a") == "HELLO A" and _state(registry) is PatchState.APPLIED


# ---- a second registry (what reload(torchpatches) makes) ----------------------------------------


def test_a_replacement_is_never_mistaken_for_an_original(target) -> None:
    name, fingerprint = target
    module = sys.modules[name]
    original = module.greet
    first = Registry([_patch(name, fingerprint, make=_same_source_copy)])
    first.apply()
    replacement = module.greet
    assert replacement("a") == "HEY a"

    second = Registry([_patch(name, fingerprint, make=_same_source_copy)])  # reload(torchpatches)
    second.apply()
    assert module.greet is replacement  # not patched on top of our own replacement
    assert _state(second) is PatchState.APPLIED
    second.revert()
    assert module.greet is original
    assert _state(second) is PatchState.DISABLED


# a fresh process (a reload in this one would leave other tests a second torchpatches): the registry's own
# bookkeeping across a reload, the same on every torch release
@pytest.mark.once
def test_reload_of_torchpatches_then_revert_restores_diffusers_originals() -> None:
    code = textwrap.dedent(
        """
        import importlib, os, sys
        import diffusers.models.attention_processor as ap
        import diffusers.models.embeddings as emb
        import diffusers.models.transformers.transformer_flux as tf
        originals = (ap.Attention.forward, emb.apply_rotary_emb, tf.apply_rotary_emb,
                     tf.FluxAttention.forward, tf.FluxTransformer2DModel.forward)
        import torchpatches
        os.environ["TORCHPATCHES_DISABLE"] = ""
        torchpatches.apply()
        assert ap.Attention.forward is not originals[0]
        importlib.reload(torchpatches)
        status = torchpatches.status()
        print(status["compile_warnings"].state.value, status["rope"].state.value)
        torchpatches.revert()
        now = (ap.Attention.forward, emb.apply_rotary_emb, tf.apply_rotary_emb,
               tf.FluxAttention.forward, tf.FluxTransformer2DModel.forward)
        print(all(a is b for a, b in zip(now, originals)))
        """
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHPATCHES_DISABLE="all")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["applied", "applied", "True"]


# ---- code edited on disk after import ---------------------------------------------------------


def test_code_edited_on_disk_after_import_is_not_patched_blindly(make_module, tmp_path: Path) -> None:
    name = make_module("def greet(name):\n    return 'bye ' + name\n")
    module = importlib.import_module(name)
    running = module.greet
    # The file now holds the source the patch was verified against; the process still runs 'bye'.
    path = Path(module.__file__)
    path.write_text(textwrap.dedent(TARGET_SOURCE))
    os.utime(path, (time.time() + 5, time.time() + 5))
    verified = _gates.fingerprint(_compile_greet(TARGET_SOURCE, str(path)))
    registry = Registry([_patch(name, verified)])
    registry.apply()
    assert module.greet is running
    status = registry.status()["loud"]
    assert status.state is PatchState.SKIPPED
    assert "disk" in status.reason


def _compile_greet(source: str, filename: str) -> Any:
    namespace: dict = {}
    exec(compile(textwrap.dedent(source), filename, "exec"), namespace)  # noqa: S102
    return namespace["greet"]


def test_fingerprint_describes_the_running_object(target) -> None:
    name, fingerprint = target
    module = sys.modules[name]
    copy = _same_source_copy(module.greet)  # same file and lines, different code
    with pytest.raises((OSError, TypeError)):
        _gates.fingerprint(copy)
    assert _gates.fingerprint(module.greet) == fingerprint


# ---- a third party that wraps our replacement and restores it later ---------------------------


def test_third_party_restoring_our_replacement_after_revert(target) -> None:
    name, fingerprint = target
    module = sys.modules[name]
    original = module.greet
    registry = Registry([_patch(name, fingerprint)])
    registry.apply()
    with unittest.mock.patch(f"{name}.greet", wraps=module.greet):
        registry.revert()  # the mock is bound: torchpatches leaves it alone
    # The mock put our replacement back on exit.
    assert module.greet("a") == "HELLO A"
    status = registry.status()["loud"]
    assert status.state is not PatchState.DISABLED or "in place" in status.reason, status
    registry.revert()  # and one call puts the original back
    assert module.greet is original
    assert _state(registry) is PatchState.DISABLED


def test_a_second_patch_on_the_same_target_is_skipped_naming_the_first(target) -> None:
    name, fingerprint = target
    module = sys.modules[name]
    original = module.greet
    first = Registry([_patch(name, fingerprint)])
    first.apply()
    other = Patch(name="other", summary="test", targets=(Target(f"{name}:greet", _loud, frozenset({fingerprint})),))
    second = Registry([other])
    second.apply()
    status = second.status()["other"]
    assert status.state is PatchState.SKIPPED and "'loud'" in status.reason, status
    assert module.greet("a") == "HELLO A"  # not wrapped twice
    second.revert()
    assert module.greet("a") == "HELLO A"  # the other patch's revert leaves ours alone
    first.revert()
    assert module.greet is original
