"""torchpatches._cache_key: our tokens enter torch.compiler.config.cache_key_tag and leave it exactly.

The end-to-end proof that a patched compile is not served an unpatched cache entry (same process
and a second process) lives in tests/patches/test_inductor_realize.py, where a patch really
changes the generated code.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Iterator, List

import pytest
import torch
import torch.compiler.config as compiler_config

from torchpatches import _cache_key

TOKEN_A = "torchpatches:inductor_realize@1d32e5f50cbc847e"
TOKEN_B = "torchpatches:other@0123456789abcdef"


@pytest.fixture
def clean_tag(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Start with no tokens and an empty tag; whatever the registry added is restored afterwards.

    The tag is saved and restored by hand: pytest's monkeypatch cannot undo an attribute of a
    torch config module (its undo ends in ``delattr``, which deletes the config entry itself).
    """
    monkeypatch.setattr(_cache_key, "_tokens", [])
    monkeypatch.setattr(_cache_key, "_global_base", None)
    # On thread-local-config torch (2.13) tokens also go into the process-wide layer.
    entry = compiler_config._config["cache_key_tag"]
    for layer in ("default", "env_value_default"):
        if hasattr(entry, layer):
            monkeypatch.setattr(entry, layer, getattr(entry, layer))
    saved = compiler_config.cache_key_tag
    compiler_config.cache_key_tag = ""
    try:
        yield
    finally:
        compiler_config.cache_key_tag = saved


def test_this_torch_has_the_tag() -> None:
    # torch >= 2.6 has it; both torch versions we test (2.11, 2.13) do.
    assert _cache_key.is_supported()
    source = Path(compiler_config.__file__).read_text()
    assert 'cache_key_tag: str = Config(env_name_default="TORCH_COMPILE_CACHE_KEY_TAG"' in source


@pytest.mark.parametrize("user_tag", ["", "my-tag", "a;b", " spaced tag "])
def test_add_appends_and_remove_restores_the_user_tag(clean_tag: None, user_tag: str) -> None:
    compiler_config.cache_key_tag = user_tag
    _cache_key.add_token(TOKEN_A)
    assert compiler_config.cache_key_tag == user_tag + ";" + TOKEN_A
    assert compiler_config.cache_key_tag.startswith(user_tag)
    _cache_key.remove_token(TOKEN_A)
    assert compiler_config.cache_key_tag == user_tag
    assert _cache_key.active_tokens() == []


def test_add_and_remove_are_idempotent(clean_tag: None) -> None:
    compiler_config.cache_key_tag = "mine"
    _cache_key.add_token(TOKEN_A)
    _cache_key.add_token(TOKEN_A)
    assert compiler_config.cache_key_tag == "mine;" + TOKEN_A
    _cache_key.remove_token(TOKEN_A)
    _cache_key.remove_token(TOKEN_A)
    _cache_key.remove_token("never-added")
    assert compiler_config.cache_key_tag == "mine"


def test_two_tokens_removed_in_either_order(clean_tag: None) -> None:
    compiler_config.cache_key_tag = "mine"
    _cache_key.add_token(TOKEN_A)
    _cache_key.add_token(TOKEN_B)
    assert compiler_config.cache_key_tag == f"mine;{TOKEN_A};{TOKEN_B}"
    _cache_key.remove_token(TOKEN_A)
    assert compiler_config.cache_key_tag == f"mine;{TOKEN_B}"
    _cache_key.add_token(TOKEN_A)
    _cache_key.remove_token(TOKEN_B)
    assert compiler_config.cache_key_tag == f"mine;{TOKEN_A}"
    _cache_key.remove_token(TOKEN_A)
    assert compiler_config.cache_key_tag == "mine"


def test_user_changing_the_tag_while_tokens_are_active(clean_tag: None) -> None:
    compiler_config.cache_key_tag = "old"
    _cache_key.add_token(TOKEN_A)
    # The user appends to the tag themselves: our token is no longer the suffix.
    compiler_config.cache_key_tag = compiler_config.cache_key_tag + "-extra"
    _cache_key.remove_token(TOKEN_A)
    # "<token>-extra" is no longer our token, so the user's tag is left exactly as they set it.
    assert compiler_config.cache_key_tag == f"old;{TOKEN_A}-extra"
    compiler_config.cache_key_tag = "old"
    _cache_key.add_token(TOKEN_A)
    _cache_key.add_token(TOKEN_B)
    compiler_config.cache_key_tag = "new;" + TOKEN_A  # the user replaced it, keeping one token
    _cache_key.remove_token(TOKEN_A)
    assert compiler_config.cache_key_tag == "new"
    _cache_key.remove_token(TOKEN_B)
    assert compiler_config.cache_key_tag == "new"
    # And a fresh add after that builds on the user's new tag.
    _cache_key.add_token(TOKEN_B)
    assert compiler_config.cache_key_tag == "new;" + TOKEN_B


@pytest.mark.parametrize("bad", ["", "has;separator"])
def test_bad_tokens_are_refused(clean_tag: None, bad: str) -> None:
    with pytest.raises(ValueError):
        _cache_key.add_token(bad)
    assert compiler_config.cache_key_tag == ""


def test_threads_adding_and_removing_leave_the_user_tag(clean_tag: None) -> None:
    compiler_config.cache_key_tag = "user"
    tokens = [f"torchpatches:p{i}@{i:016x}" for i in range(8)]
    barrier = threading.Barrier(len(tokens))
    errors: List[BaseException] = []

    def churn(token: str) -> None:
        try:
            barrier.wait()
            for _ in range(200):
                _cache_key.add_token(token)
                assert token in compiler_config.cache_key_tag.split(";")
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
    if _cache_key.tag_is_thread_local():
        # torch 2.13: this thread's own override ("user") hides what the workers added; threads
        # without an override (a new one) read the process-wide layer, which has every token.
        assert compiler_config.cache_key_tag == "user"
        assert sorted(_tag_seen_by_a_new_thread().split(";")[1:]) == sorted(tokens)
        for token in tokens:
            _cache_key.remove_token(token)
        assert ";" not in _tag_seen_by_a_new_thread()
        return
    parts = compiler_config.cache_key_tag.split(";")
    assert parts[0] == "user" and sorted(parts[1:]) == sorted(tokens)
    for token in reversed(tokens):
        _cache_key.remove_token(token)
    assert compiler_config.cache_key_tag == "user"


def _tag_seen_by_a_new_thread() -> str:
    seen: List[str] = []
    thread = threading.Thread(target=lambda: seen.append(compiler_config.cache_key_tag))
    thread.start()
    thread.join()
    return seen[0]


def test_where_the_tag_is_thread_local() -> None:
    """Recorded, not wished for: 2.11 shares one tag per process, 2.13 keeps overrides per thread/context."""
    expected = _cache_key.tag_is_thread_local()
    saved = compiler_config.cache_key_tag
    compiler_config.cache_key_tag = "set-in-main-thread"
    try:
        seen = _tag_seen_by_a_new_thread()
    finally:
        compiler_config.cache_key_tag = saved
    assert (seen != "set-in-main-thread") == expected
    major_minor = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if major_minor == (2, 11):
        assert not expected
    if major_minor == (2, 13):
        assert expected


def test_torch_without_the_tag_warns_once_and_changes_nothing(
    clean_tag: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_cache_key, "_compiler_config", lambda: None)
    monkeypatch.setattr(_cache_key, "_warned_unsupported", False)
    with caplog.at_level(logging.WARNING, logger="torchpatches"):
        _cache_key.add_token(TOKEN_A)
        _cache_key.add_token(TOKEN_B)
    assert not _cache_key.is_supported()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "cache_key_tag does not exist" in caplog.records[0].message
    assert compiler_config.cache_key_tag == ""
    _cache_key.remove_token(TOKEN_A)
    _cache_key.remove_token(TOKEN_B)
    assert _cache_key.active_tokens() == []


def test_the_tag_enters_the_fx_graph_and_aotautograd_cache_keys(clean_tag: None) -> None:
    """The keys really move with our token (FX graph cache) and AOTAutograd reuses those details."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCacheDetails
    from torch._inductor.codecache import FxGraphHashDetails, compiled_fx_graph_hash

    assert issubclass(AOTAutogradCacheDetails, FxGraphHashDetails)
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    inputs = [torch.zeros(2)]

    def key() -> str:
        return compiled_fx_graph_hash(gm, inputs, {}, [])[0]

    compiler_config.cache_key_tag = "user"
    user_key = key()
    _cache_key.add_token(TOKEN_A)
    patched_key = key()
    _cache_key.remove_token(TOKEN_A)
    assert patched_key != user_key
    assert key() == user_key


def test_other_threads_see_our_tokens_and_then_the_tag_they_saw_before(clean_tag: None) -> None:
    """Also where overrides are per thread (2.13): tokens go into the process-wide layer too."""
    before_elsewhere = _tag_seen_by_a_new_thread()
    _cache_key.add_token(TOKEN_A)
    assert _tag_seen_by_a_new_thread().endswith(";" + TOKEN_A)
    _cache_key.add_token(TOKEN_B)
    assert _tag_seen_by_a_new_thread().endswith(f";{TOKEN_A};{TOKEN_B}")
    _cache_key.remove_token(TOKEN_A)
    _cache_key.remove_token(TOKEN_B)
    assert _tag_seen_by_a_new_thread() == before_elsewhere
    assert compiler_config.cache_key_tag == ""
