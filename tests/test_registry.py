"""The registry's promises, on throwaway modules: gate, fingerprint, apply, revert by identity, pending."""
from __future__ import annotations

import importlib
import logging
import sys
import textwrap
import threading
import uuid

import pytest

from torchpatches._core import gates as _gates
from torchpatches._core.declare import Patch, Target
from torchpatches._core.registry import Registry
from torchpatches._core.status import PatchState

TARGET_SOURCE = """
    def greet(name):
        return "hello " + name

    class Greeter:
        def greet(self, name):
            return "hi " + name
"""


def _fingerprint_of(module_name: str, qualname: str) -> str:
    module = importlib.import_module(module_name)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return _gates.fingerprint(obj)


def _loud(original):
    def greet(name):
        return original(name).upper()

    return greet


def _patch(module_name, fingerprint, *, name="loud", qualname="greet", make=_loud, aliases=(), **extra):
    return Patch(
        name=name,
        summary="shout the greeting",
        targets=(Target(f"{module_name}:{qualname}", make, frozenset({fingerprint}), tuple(aliases)),),
        **extra,
    )


@pytest.fixture
def target(make_module):
    name = make_module(TARGET_SOURCE)
    fingerprint = _fingerprint_of(name, "greet")
    sys.modules.pop(name)  # start unimported: tests choose when it loads
    return name, fingerprint


def test_applies_now_when_target_is_imported_and_reverts_to_the_same_object(target):
    name, fingerprint = target
    module = importlib.import_module(name)
    original = module.greet
    registry = Registry([_patch(name, fingerprint)])

    registry.apply()
    assert module.greet("ada") == "HELLO ADA"
    assert registry.status()["loud"].state is PatchState.APPLIED

    registry.revert()
    assert module.greet is original
    assert registry.status()["loud"].state is PatchState.DISABLED
    assert "revert" in registry.status()["loud"].reason


def test_pending_until_the_target_module_is_imported(target):
    name, fingerprint = target
    registry = Registry([_patch(name, fingerprint)])
    registry.apply()
    entry = registry.status()["loud"]
    assert entry.state is PatchState.PENDING and name in entry.reason
    assert name not in sys.modules

    module = importlib.import_module(name)
    assert module.greet("ada") == "HELLO ADA"
    assert registry.status()["loud"].state is PatchState.APPLIED


def test_reverted_before_import_does_not_apply_on_import(target):
    name, fingerprint = target
    registry = Registry([_patch(name, fingerprint)])
    registry.apply()
    registry.revert()
    module = importlib.import_module(name)
    assert module.greet("ada") == "hello ada"
    assert registry.status()["loud"].state is PatchState.DISABLED


def test_apply_is_idempotent(target):
    name, fingerprint = target
    module = importlib.import_module(name)
    registry = Registry([_patch(name, fingerprint)])
    registry.apply()
    patched = module.greet
    registry.apply()
    registry.apply("loud")
    assert module.greet is patched
    assert module.greet("x") == "HELLO X"


def test_aliases_bound_by_name_are_rebound_and_restored(make_module, target):
    name, fingerprint = target
    alias_early = make_module(f"from {name} import greet\n")
    alias_late = make_module(f"from {name} import greet\n")
    early = importlib.import_module(alias_early)
    original = sys.modules[name].greet
    registry = Registry([_patch(name, fingerprint, aliases=(f"{alias_early}:greet", f"{alias_late}:greet"))])

    registry.apply()
    assert early.greet("a") == "HELLO A"
    late = importlib.import_module(alias_late)
    assert late.greet is sys.modules[name].greet

    registry.revert()
    assert early.greet is original and late.greet is original and sys.modules[name].greet is original


def test_alias_imported_while_reverted_keeps_the_original(make_module, target):
    name, fingerprint = target
    alias = make_module(f"from {name} import greet\n")
    importlib.import_module(name)
    original = sys.modules[name].greet
    registry = Registry([_patch(name, fingerprint, aliases=(f"{alias}:greet",))])
    registry.apply()
    registry.revert()
    assert importlib.import_module(alias).greet is original


def test_method_on_a_class_is_patched_and_restored(target):
    name, _ = target
    module = importlib.import_module(name)
    original = module.Greeter.__dict__["greet"]
    fingerprint = _gates.fingerprint(original)

    def make(original_method):
        def greet(self, who):
            return original_method(self, who) + "!"

        return greet

    registry = Registry([_patch(name, fingerprint, qualname="Greeter.greet", make=make)])
    registry.apply()
    assert module.Greeter().greet("bo") == "hi bo!"
    registry.revert()
    assert module.Greeter.__dict__["greet"] is original


def test_inherited_method_is_shadowed_then_removed(make_module):
    name = make_module(
        """
        class Base:
            def size(self):
                return 1

        class Child(Base):
            pass
        """
    )
    module = importlib.import_module(name)
    fingerprint = _gates.fingerprint(module.Base.size)
    registry = Registry([_patch(name, fingerprint, qualname="Child.size", make=lambda orig: lambda self: 2)])
    registry.apply()
    assert module.Child().size() == 2 and module.Base().size() == 1
    registry.revert()
    assert "size" not in vars(module.Child) and module.Child().size() == 1


def test_changed_source_is_skipped_with_the_fingerprints_in_the_reason(target, monkeypatch):
    name, fingerprint = target
    module = importlib.import_module(name)

    def greet(name):  # same behaviour, different source: not what the patch was verified against
        return "hello " + name + ""

    monkeypatch.setattr(module, "greet", greet)
    registry = Registry([_patch(name, fingerprint)])
    registry.apply()
    entry = registry.status()["loud"]
    assert entry.state is PatchState.SKIPPED
    assert "differs from the verified" in entry.reason and fingerprint in entry.reason
    assert module.greet is greet


def test_missing_target_is_skipped_not_raised(target, monkeypatch):
    name, fingerprint = target
    module = importlib.import_module(name)
    monkeypatch.delattr(module, "greet")
    registry = Registry([_patch(name, fingerprint), _patch(name, fingerprint, name="other", qualname="Nope.x")])
    registry.apply()
    assert registry.status()["loud"].state is PatchState.SKIPPED
    assert "not found" in registry.status()["loud"].reason
    assert "'Nope'" in registry.status()["other"].reason


def test_version_gate_skips_with_the_versions_named(target, monkeypatch):
    name, fingerprint = target
    importlib.import_module(name)
    monkeypatch.setattr(_gates, "installed_version", lambda module: {"torch": "2.12.0+cu130"}.get(module))
    registry = Registry(
        [
            _patch(name, fingerprint, requires={"torch": ">=2.11,<2.12"}),
            _patch(name, fingerprint, name="needs_flashinfer", requires={"flashinfer": ">=0.2"}),
        ]
    )
    registry.apply()
    gate = registry.status()["loud"]
    assert gate.state is PatchState.SKIPPED and "2.12.0+cu130" in gate.reason and ">=2.11,<2.12" in gate.reason
    assert "not installed" in registry.status()["needs_flashinfer"].reason
    assert sys.modules[name].greet("a") == "hello a"


def test_precondition_can_skip(target):
    name, fingerprint = target
    importlib.import_module(name)
    registry = Registry([_patch(name, fingerprint, precondition=lambda: "no GPU here")])
    registry.apply()
    assert registry.status()["loud"].state is PatchState.SKIPPED
    assert registry.status()["loud"].reason == "no GPU here"


def test_verified_dependency_gates_the_patch_with_the_targets_wording(make_module, target):
    name, fingerprint = target
    module = importlib.import_module(name)
    helper = make_module("def helper():\n    return 1\n")
    helper_fingerprint = _fingerprint_of(helper, "helper")
    verified = Registry([_patch(name, fingerprint, verifies={f"{helper}:helper": {helper_fingerprint}})])
    verified.apply()
    assert verified.status()["loud"].state is PatchState.APPLIED
    verified.revert()

    changed = Registry([_patch(name, fingerprint, verifies={f"{helper}:helper": {"0123456789abcdef"}})])
    changed.apply()
    entry = changed.status()["loud"]
    assert entry.state is PatchState.SKIPPED
    assert entry.reason == (
        f"{helper}:helper differs from the verified version(s) "
        f"(fingerprint {helper_fingerprint}, expected 0123456789abcdef)"
    )
    assert module.greet("a") == "hello a"
    missing = Registry([_patch(name, fingerprint, verifies={f"{helper}:gone": {helper_fingerprint}})])
    missing.apply()
    assert missing.status()["loud"].state is PatchState.SKIPPED
    assert missing.status()["loud"].reason == f"{helper}:gone not found: no attribute 'gone'"


def test_a_patch_that_raises_fails_alone_and_leaves_the_original(target, caplog):
    name, fingerprint = target
    module = importlib.import_module(name)
    original = module.greet

    def explode(original_function):
        raise RuntimeError("replacement cannot be built")

    registry = Registry([_patch(name, fingerprint, name="broken", make=explode), _patch(name, fingerprint)])
    with caplog.at_level(logging.WARNING, logger="torchpatches"):
        registry.apply()
    broken = registry.status()["broken"]
    assert broken.state is PatchState.FAILED and "replacement cannot be built" in broken.reason
    assert registry.status()["loud"].state is PatchState.APPLIED
    registry.revert()
    assert module.greet is original


def test_failure_while_rebinding_rolls_the_target_back(make_module, target):
    name, fingerprint = target
    module = importlib.import_module(name)
    original = module.greet
    frozen = make_module(
        f"""
        import sys
        from {name} import greet

        class _Frozen(type(sys)):
            def __setattr__(self, key, value):
                raise AttributeError("read-only module")

        sys.modules[__name__].__class__ = _Frozen
        """
    )
    importlib.import_module(frozen)
    registry = Registry([_patch(name, fingerprint, aliases=(f"{frozen}:greet",))])
    registry.apply()
    assert registry.status()["loud"].state is PatchState.FAILED
    assert "read-only module" in registry.status()["loud"].reason
    assert module.greet is original


def test_revert_leaves_a_later_third_party_patch_alone(target, caplog):
    name, fingerprint = target
    module = importlib.import_module(name)
    registry = Registry([_patch(name, fingerprint)])
    registry.apply()

    def theirs(name):
        return "theirs"

    module.greet = theirs
    with caplog.at_level(logging.WARNING, logger="torchpatches"):
        registry.revert()
    assert module.greet is theirs
    assert "someone else" in caplog.text


def test_unknown_names_raise_value_error_naming_them(target):
    name, fingerprint = target
    registry = Registry([_patch(name, fingerprint)])
    with pytest.raises(ValueError, match="'ropee'.*known patches: loud"):
        registry.apply("ropee")


def test_load_errors_are_reported_as_failed(target):
    name, fingerprint = target
    registry = Registry([_patch(name, fingerprint)], load_errors={"ghost": "SyntaxError: bad"})
    assert registry.status()["ghost"].state is PatchState.FAILED
    assert "SyntaxError" in str(registry.status())


def test_status_table_lists_every_patch(target):
    name, fingerprint = target
    registry = Registry([_patch(name, fingerprint), _patch(name, fingerprint, name="second")])
    registry.apply()
    table = str(registry.status()).splitlines()
    assert table[0].split() == ["patch", "state", "reason"]
    assert [line.split()[0] for line in table[1:]] == ["loud", "second"]
    assert all(line.split()[1] == "pending" for line in table[1:])


def test_threads_applying_and_reverting_leave_a_consistent_state(target):
    name, fingerprint = target
    module = importlib.import_module(name)
    original = module.greet
    registry = Registry([_patch(name, fingerprint)])
    barrier = threading.Barrier(8)
    errors = []

    def churn(seed: int) -> None:
        try:
            barrier.wait()
            for step in range(200):
                (registry.apply if (seed + step) % 3 else registry.revert)()
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    state = registry.status()["loud"].state
    assert (module.greet is original) == (state is PatchState.DISABLED)
    registry.revert()
    assert module.greet is original


def test_reapplying_reuses_the_same_replacement_object(target):
    name, fingerprint = target
    module = importlib.import_module(name)
    built = []

    def make(original):
        built.append(original)
        return _loud(original)

    registry = Registry([_patch(name, fingerprint, make=make)])
    registry.apply()
    first = module.greet
    registry.revert()
    registry.apply()
    assert module.greet is first and len(built) == 1


def test_a_target_module_its_imported_package_lacks_is_skipped_and_the_rest_apply(tmp_path, monkeypatch):
    """An older release without one model module: that target is skipped naming it, the others apply."""
    package = f"tp_pkg_{uuid.uuid4().hex[:8]}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("__version__ = '0.40.0'\n")
    (tmp_path / package / "present.py").write_text(textwrap.dedent(TARGET_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        fingerprint = _fingerprint_of(f"{package}.present", "greet")
        for name in [n for n in sys.modules if n.startswith(package)]:
            sys.modules.pop(name)
        targets = tuple(
            Target(f"{package}.{module}:greet", _loud, frozenset({fingerprint})) for module in ("present", "absent")
        )
        registry = Registry([Patch(name="loud", summary="s", targets=targets)])
        registry.apply()
        assert registry.status()["loud"].state is PatchState.PENDING  # the package is not imported yet

        importlib.import_module(f"{package}.present")
        entry = registry.status()["loud"]
        assert entry.state is PatchState.APPLIED
        assert entry.reason == f"1/2 target(s) patched; {package}.absent does not exist in {package} 0.40.0"
        assert [t.state for t in entry.targets] == [PatchState.APPLIED, PatchState.SKIPPED]

        # Should the module appear and be imported after all, the patch follows it there too.
        (tmp_path / package / "absent.py").write_text(textwrap.dedent(TARGET_SOURCE))
        importlib.invalidate_caches()
        module = importlib.import_module(f"{package}.absent")
        assert module.greet("ada") == "HELLO ADA"
        assert registry.status()["loud"].reason == "2/2 target(s) patched"
        registry.revert()
    finally:
        for name in [n for n in sys.modules if n.startswith(package)]:
            sys.modules.pop(name)


CLASS_ATTRIBUTE_SOURCE = """
    class Holder:
        @staticmethod
        def shout(name):
            return "hey " + name

        @classmethod
        def label(cls, name):
            return cls.__name__ + " " + name
"""


def _louder_static(original):
    function = original.__func__

    def shout(name):
        return function(name).upper()

    return staticmethod(shout)


def _louder_class(original):
    function = original.__func__

    def label(cls, name):
        return function(cls, name).upper()

    return classmethod(label)


@pytest.mark.parametrize("attribute, make, kind, expected", [
    ("shout", _louder_static, staticmethod, "HEY ADA"),
    ("label", _louder_class, classmethod, "HOLDER ADA"),
])
def test_a_staticmethod_or_classmethod_replacement_pickles_by_name_and_reverts_by_identity(
        make_module, attribute, make, kind, expected):
    """A class attribute gives code (and pickle) the function inside the descriptor: it carries the target's name."""
    import pickle

    name = make_module(CLASS_ATTRIBUTE_SOURCE)
    module = importlib.import_module(name)
    original = module.Holder.__dict__[attribute]
    registry = Registry([_patch(name, _gates.fingerprint(original), qualname=f"Holder.{attribute}", make=make)])
    registry.apply()
    patched = module.Holder.__dict__[attribute]
    assert isinstance(patched, kind) and patched is not original
    assert getattr(module.Holder, attribute)("ada") == expected
    assert patched.__func__.__module__ == name and patched.__func__.__qualname__ == f"Holder.{attribute}"
    reached = getattr(module.Holder, attribute)  # the function itself, or a method bound to the class
    assert pickle.loads(pickle.dumps(reached)) == reached
    registry.revert()
    assert module.Holder.__dict__[attribute] is original
    assert getattr(module.Holder, attribute)("ada") == expected.lower().replace("holder", "Holder")
