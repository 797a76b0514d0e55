"""An Inductor patch's token stays in Inductor's compile-cache keys whatever the user does
with ``torch.compiler.config.cache_key_tag``, and a lowering that happens in a child process that
does not import torchpatches is never stored under a key that claims the patch.

These tests use a test-only Inductor patch (realize every reused Pointwise) so they run on every
torch version: the shipped ``inductor_realize`` applies to torch 2.11 only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.compiler.config as compiler_config

REPO = Path(__file__).resolve().parents[1]

TESTS = Path(__file__).resolve().parent
# The test patch (tests/_inductor_test_patch.py) is imported here and in the children below.
CHILD_PATH = os.pathsep.join((str(REPO), str(TESTS)))


def _make_registry() -> Any:
    from torchpatches._core.registry import Registry

    from _inductor_test_patch import make_test_patch

    return Registry([make_test_patch()])


def _key_of(fn: Any) -> str:
    from torch._inductor.codecache import compiled_fx_graph_hash

    gm = torch.fx.symbolic_trace(lambda x: fn(x))
    return compiled_fx_graph_hash(gm, [torch.zeros(2)], {}, [])[0]


def _plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@pytest.fixture
def realize_patch() -> Any:
    """The test patch applied in this process; reverted (and the user's tag restored) afterwards."""
    import torch._inductor.ir  # noqa: F401 - the target must be importable for the fingerprint

    import torchpatches

    saved = compiler_config.cache_key_tag
    with torchpatches.only():  # the shipped patches off: inductor_realize replaces the same target on 2.11
        registry = _make_registry()
        try:
            yield registry
        finally:
            registry.revert()
            compiler_config.cache_key_tag = saved


def test_user_assigning_the_tag_later_keeps_the_patch_in_the_key(realize_patch: Any) -> None:
    compiler_config.cache_key_tag = "mine"
    unpatched = _key_of(_plus_one)
    realize_patch.apply()
    assert realize_patch.status()["test_realize"].state.value == "applied"
    assert _key_of(_plus_one) != unpatched
    compiler_config.cache_key_tag = "mine"  # a library sets the tag after torchpatches applied
    assert _key_of(_plus_one) != unpatched
    compiler_config.cache_key_tag = "something else"
    other = _key_of(_plus_one)
    realize_patch.revert()
    assert _key_of(_plus_one) != other  # the token left the key with the patch
    compiler_config.cache_key_tag = "mine"
    assert _key_of(_plus_one) == unpatched


def test_config_patch_of_the_tag_keeps_the_patch_in_the_key(realize_patch: Any) -> None:
    with compiler_config.patch(cache_key_tag="block"):
        unpatched_in_block = _key_of(_plus_one)
    compiler_config.cache_key_tag = ""
    unpatched = _key_of(_plus_one)
    realize_patch.apply()
    with compiler_config.patch(cache_key_tag="block"):
        assert _key_of(_plus_one) != unpatched_in_block
    assert _key_of(_plus_one) != unpatched


def test_patch_applied_inside_a_config_patch_block_stays_in_the_key_after_it(realize_patch: Any) -> None:
    """The first torch.compile inside ``config.patch(cache_key_tag=...)`` is where Inductor patches
    apply (they wait for torch._inductor to be imported); leaving the block must not drop them."""
    compiler_config.cache_key_tag = ""
    unpatched = _key_of(_plus_one)
    with compiler_config.patch(cache_key_tag=""):
        realize_patch.apply()
    assert realize_patch.status()["test_realize"].state.value == "applied"
    assert _key_of(_plus_one) != unpatched


_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    import torch.compiler.config as cc
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    from _inductor_test_patch import make_test_patch
    role = sys.argv[1]

    def flip_to_realize(a, b):
        h = a + b
        return h.sum(0), h.sum(1), h.amax(0)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g))

    def compile_once(label):
        torch._dynamo.reset()
        counters.clear()
        with inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \\
                functorch_config.patch(enable_autograd_cache=True), torch.no_grad():
            _, codes = run_and_get_code(torch.compile(flip_to_realize, fullgraph=True), *args)
        code = "\\n".join(codes)
        return {
            "label": label,
            "buffers": code.count("empty_strided_cpu("),
            "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        }

    runs = []
    if role == "unpatched":
        with cc.patch(cache_key_tag="mine"):
            runs.append(compile_once("unpatched"))
    else:
        from torchpatches._core.registry import Registry
        registry = Registry([make_test_patch()])
        registry.apply()  # pending: Inductor is not imported yet
        with cc.patch(cache_key_tag="mine"):
            runs.append(compile_once("first compile inside config.patch"))
        runs.append(compile_once("after the block"))
        cc.cache_key_tag = "mine"
        runs.append(compile_once("after assigning the tag"))
        runs.append({"label": "state", "state": registry.status()["test_realize"].state.value, "reason": registry.status()["test_realize"].reason})
    print(json.dumps(runs))
    """
)


def _child(cache_dir: Path, role: str) -> List[Dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=CHILD_PATH, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCHPATCHES_DISABLE="all")
    env.pop("TORCH_COMPILE_CACHE_KEY_TAG", None)
    env.pop("TORCHINDUCTOR_FX_COMPILE_MODE", None)
    result = subprocess.run([sys.executable, "-c", _CHILD, role], capture_output=True,
                            text=True, env=env, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_patched_process_is_never_served_an_unpatched_artifact(tmp_path: Path) -> None:
    """End to end, FX graph cache + AOTAutograd cache in a fresh directory, two processes.

    The unpatched process stores its artifact under the user's tag "mine". The patched process
    compiles first inside ``config.patch(cache_key_tag="mine")`` (the patch applies there), then
    after the block, then after assigning the tag: every compile must be its own patched code.
    """
    (unpatched,) = _child(tmp_path, "unpatched")
    assert (unpatched["buffers"], unpatched["fx_miss"]) == (3, 1)
    *patched, state = _child(tmp_path, "patched")
    assert state["state"] == "applied", state
    assert [run["buffers"] for run in patched] == [4, 4, 4], patched
    first = patched[0]
    assert (first["fx_miss"], first["fx_hit"], first["aot_hit"]) == (1, 0, 0), first


# ---- Inductor lowering in a child process -----------------------------------------------------


def test_lowering_in_a_child_process_skips_inductor_patches_and_keeps_them_out_of_the_key() -> None:
    code = textwrap.dedent(
        """
        import torch, torch._inductor.ir, torchpatches
        from torchpatches._core import cache_key as _cache_key
        from torchpatches._core.registry import Registry
        from _inductor_test_patch import make_test_patch
        registry = Registry([make_test_patch()])
        registry.apply()
        status = registry.status()["test_realize"]
        shipped = torchpatches.status()["inductor_realize"]
        print(status.state.value, "|", status.reason, "|", list(_cache_key.key_component()), "|",
              shipped.state.value, "|", shipped.reason)
        """
    )
    env = dict(os.environ, PYTHONPATH=CHILD_PATH, TORCHINDUCTOR_FX_COMPILE_MODE="subprocess")
    env.pop("TORCHPATCHES_DISABLE", None)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    state, reason, component, shipped_state, shipped_reason = result.stdout.strip().split(" | ")
    assert state == "skipped" and "child process" in reason and "subprocess" in reason
    assert component == "[]"
    assert shipped_state == "skipped"  # on 2.11 for this reason, on other torch versions for the version gate


_SUBPROCESS_MODE_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    from torchpatches._core.registry import Registry
    from _inductor_test_patch import make_test_patch

    def flip_to_realize(a, b):
        h = a + b
        return h.sum(0), h.sum(1), h.amax(0)

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g))
    registry = Registry([make_test_patch()])
    registry.apply()
    torch._dynamo.reset()
    counters.clear()
    with inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \\
            functorch_config.patch(enable_autograd_cache=True), torch.no_grad():
        out = torch.compile(flip_to_realize, fullgraph=True)(*args)
    print(json.dumps({"state": registry.status()["test_realize"].state.value,
                      "fx_miss": counters["inductor"]["fxgraph_cache_miss"]}))
    """
)


@pytest.mark.slow
def test_an_artifact_lowered_in_a_child_process_is_not_served_to_a_patched_process(tmp_path: Path) -> None:
    """A process in subprocess lowering mode stores its (unpatched: the child never imports torchpatches)
    artifact; a normal patched process must not be served it."""
    env = dict(os.environ, PYTHONPATH=CHILD_PATH, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), TORCHPATCHES_DISABLE="all",
               TORCHINDUCTOR_FX_COMPILE_MODE="subprocess")
    result = subprocess.run([sys.executable, "-c", _SUBPROCESS_MODE_CHILD], capture_output=True, text=True,
                            env=env, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    lowered_elsewhere = json.loads(result.stdout.strip().splitlines()[-1])
    assert lowered_elsewhere == {"state": "skipped", "fx_miss": 1}
    *patched, state = _child(tmp_path, "patched")
    assert state["state"] == "applied", state
    assert [run["buffers"] for run in patched] == [4, 4, 4], patched
    assert patched[0]["fx_hit"] == 0 and patched[0]["aot_hit"] == 0, patched[0]
