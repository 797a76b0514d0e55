"""torchpatches._core.cache_key: active tokens enter Inductor's FX-graph and AOTAutograd cache keys
through a component computed at every lookup, and leave them exactly.

The end-to-end proofs (a patched process is never served an unpatched artifact, whatever the user
does with ``cache_key_tag``) are in tests/test_cache_key_hostile.py and, for the shipped patch on
torch 2.11, tests/patches/test_inductor_realize.py.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Iterator, List

import pytest
import torch

from torchpatches._core import cache_key as _cache_key

from _fresh import run_forked

TOKEN_A = "torchpatches:inductor_realize@1d32e5f50cbc847e.0123456789abcdef"
TOKEN_B = "torchpatches:other@0123456789abcdef.fedcba9876543210"


@pytest.fixture
def no_tokens(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start with no tokens; whatever the registry had is back afterwards."""
    monkeypatch.setattr(_cache_key, "_tokens", [])
    yield


def _key() -> str:
    from torch._inductor.codecache import compiled_fx_graph_hash

    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    return compiled_fx_graph_hash(gm, [torch.zeros(2)], {}, [])[0]


def test_add_and_remove_are_idempotent_and_ordered(no_tokens: None) -> None:
    _cache_key.add_token(TOKEN_A)
    _cache_key.add_token(TOKEN_B)
    _cache_key.add_token(TOKEN_A)
    assert _cache_key.active_tokens() == [TOKEN_A, TOKEN_B]
    assert _cache_key.key_component() == (TOKEN_A, TOKEN_B)
    _cache_key.remove_token(TOKEN_A)
    _cache_key.remove_token(TOKEN_A)
    _cache_key.remove_token("never-added")
    assert _cache_key.active_tokens() == [TOKEN_B]
    _cache_key.remove_token(TOKEN_B)
    assert _cache_key.key_component() == ()


@pytest.mark.parametrize("bad", ["", "has;separator", None, 3])
def test_bad_tokens_are_refused(no_tokens: None, bad: object) -> None:
    with pytest.raises(ValueError):
        _cache_key.add_token(bad)  # type: ignore[arg-type]
    assert _cache_key.active_tokens() == []


def test_the_tokens_enter_the_fx_graph_and_aotautograd_cache_keys(no_tokens: None) -> None:
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCacheDetails
    from torch._inductor.codecache import FxGraphHashDetails

    assert _cache_key.is_supported()
    plain = _key()
    _cache_key.add_token(TOKEN_A)
    # AOTAutograd's details are built by FxGraphHashDetails.__init__ (super()), which carries the hook.
    assert issubclass(AOTAutogradCacheDetails, FxGraphHashDetails)
    assert getattr(FxGraphHashDetails.__init__, "__torchpatches_cache_key_hook__", False)
    with_a = _key()
    _cache_key.add_token(TOKEN_B)
    with_both = _key()
    _cache_key.remove_token(TOKEN_A)
    _cache_key.remove_token(TOKEN_B)
    assert len({plain, with_a, with_both}) == 3
    assert _key() == plain  # no token: the key of plain torch


def test_the_hook_is_installed_once(no_tokens: None) -> None:
    from torch._inductor.codecache import FxGraphHashDetails

    _cache_key.add_token(TOKEN_A)
    init = FxGraphHashDetails.__init__
    _cache_key.install_hook()
    _cache_key.install_hook()
    assert FxGraphHashDetails.__init__ is init
    assert init.__wrapped__.__qualname__ == "FxGraphHashDetails.__init__"  # one layer, wrapping torch's
    assert not hasattr(init.__wrapped__, "__torchpatches_cache_key_hook__")


def test_threads_adding_and_removing(no_tokens: None) -> None:
    tokens = [f"torchpatches:p{i}@{i:016x}" for i in range(8)]
    barrier = threading.Barrier(len(tokens))
    errors: List[BaseException] = []

    def churn(token: str) -> None:
        try:
            barrier.wait()
            for _ in range(200):
                _cache_key.add_token(token)
                assert token in _cache_key.key_component()
                _cache_key.remove_token(token)
            _cache_key.add_token(token)
        except BaseException as error:  # reported below; a thread's assert would be lost
            errors.append(error)

    threads = [threading.Thread(target=churn, args=(token,)) for token in tokens]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(_cache_key.active_tokens()) == sorted(tokens)
    # Other threads read the same component: it is process-wide, not a per-context config value.
    seen: List[tuple] = []
    thread = threading.Thread(target=lambda: seen.append(_cache_key.key_component()))
    thread.start()
    thread.join()
    assert sorted(seen[0]) == sorted(tokens)


#: TORCHINDUCTOR_FX_COMPILE_MODE -> whether Inductor lowers elsewhere (a child process).
LOWERING_MODES = [(None, False), ("", False), ("normal", False), ("serialize", False), ("subprocess", True),
                  ("SUBPROCESS", True), ("async+subprocess", True), ("progressive+subprocess", True), ("bogus", False)]

_LOWERING_CASE = (
    "import sys, torchpatches._core.cache_key as ck\n"
    "before = ck.lowering_elsewhere()\n"
    "import torch._inductor.compile_fx\n"
    "after = ck.lowering_elsewhere()\n"
    "print(before is not None, after is not None, 'torch._inductor.compile_fx' in sys.modules)\n"
)


def test_where_inductor_lowers_is_read_like_inductor_reads_it(tmp_path: Path) -> None:
    """Before Inductor is imported the variable is parsed as compile_fx will parse it; after, its globals. One first
    import of torchpatches and of compile_fx per value (forks of one child process). One test, not one per value: a
    module fixture would run the forks once per pytest-xdist worker (about 18 s each)."""
    cases = [(_LOWERING_CASE, {"TORCHPATCHES_DISABLE": "all", "TORCHINDUCTOR_FX_COMPILE_MODE": value})
             for value, _ in LOWERING_MODES]
    # Inductor's modules except compile_fx (which parses the variable when imported): each fork then imports
    # compile_fx alone (0.1 s instead of 5 s).
    prelude = """
        import sys, torch._dynamo, torch._inductor.graph, torch._inductor.codecache
        assert "torch._inductor.compile_fx" not in sys.modules
    """
    results = run_forked(cases, tmp_path, prelude)
    for (value, elsewhere), result in zip(LOWERING_MODES, results):
        assert result.returncode == 0, (value, result.stderr[-2000:])
        assert result.stdout.split() == [str(elsewhere), str(elsewhere), "True"], value


def test_lowering_elsewhere_empties_the_component(no_tokens: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _cache_key.add_token(TOKEN_A)
    monkeypatch.setattr(_cache_key, "lowering_elsewhere", lambda: "not in effect: test")
    assert _cache_key.key_component() == ()
    assert _cache_key.active_tokens() == [TOKEN_A]
    _cache_key.remove_token(TOKEN_A)


def test_cache_token_of_a_patch_without_source_code() -> None:
    """A patch built in ``python -c`` or shipped without .py files still gets a token naming its code
    (the bytecode of make_replacement), never a shared placeholder."""
    from torchpatches._core.declare import Patch, Target

    def patch_from(source: str) -> Patch:
        namespace: dict = {}
        exec(compile(source, "<no source>", "exec"), namespace)  # noqa: S102
        target = Target("torch._inductor.ir:StorageBox.should_realize_on_reuse", namespace["make"],
                        frozenset({"0" * 16}))
        return Patch(name="p", summary="", targets=(target,), inductor_cache_key=True)

    first = patch_from("def make(original):\n    return lambda self, users: True\n")
    second = patch_from("def make(original):\n    return lambda self, users: False\n")
    token_1 = _cache_key.cache_token(first, first.targets[0], "f" * 16)
    token_2 = _cache_key.cache_token(second, second.targets[0], "f" * 16)
    assert token_1.startswith("torchpatches:p@" + "f" * 16 + ".") and token_1 != token_2
