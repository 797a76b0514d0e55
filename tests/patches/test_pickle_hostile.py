"""Every patched object pickles by reference (a ``spawn`` worker gets it by name).

Pickle stores a function as ``__module__`` + ``__qualname__`` and checks that the name resolves to
the same object; a replacement whose names point into torchpatches, where no such attribute exists,
cannot be sent to a worker.
"""
from __future__ import annotations

import importlib
import multiprocessing
import pickle
from typing import Any, List, Tuple

import pytest

import torchpatches
from torchpatches.patches import PATCH_MODULES


def _bound_targets() -> List[Tuple[str, Any]]:
    found = []
    for module_name in PATCH_MODULES:
        patch = importlib.import_module(f"torchpatches.patches.{module_name}").PATCH
        if torchpatches.status()[patch.name].state.value != "applied":
            continue
        for target in patch.targets:
            obj: Any = importlib.import_module(target.module)
            for part in target.qualname.split("."):
                obj = getattr(obj, part)
            found.append((target.path, obj))
    return found


@pytest.fixture(scope="module", autouse=True)
def _diffusers_loaded() -> None:
    pytest.importorskip("diffusers")
    for module in ("diffusers.models.embeddings", "diffusers.models.transformers.transformer_flux",
                   "diffusers.models.transformers.transformer_flux2", "diffusers.models.attention",
                   "diffusers.models.attention_processor", "diffusers.models.attention_dispatch",
                   "diffusers.models.transformers.transformer_sd3", "diffusers.models.transformers.transformer_wan",
                   "diffusers.models.transformers.transformer_qwenimage",
                   "diffusers.models.transformers.transformer_hunyuan_video"):
        importlib.import_module(module)


def test_every_patched_object_pickles_to_itself() -> None:
    targets = _bound_targets()
    assert any(path.endswith(":apply_rotary_emb") for path, _ in targets)
    for path, obj in targets:
        assert pickle.loads(pickle.dumps(obj)) is obj, path


def _call_in_worker(fn: Any) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


# a spawn worker: pickling by qualified name, the same on every torch release
@pytest.mark.once
def test_patched_apply_rotary_emb_goes_to_a_spawn_worker() -> None:
    import diffusers.models.embeddings as embeddings

    fn = embeddings.apply_rotary_emb
    assert torchpatches.status()["rope"].state.value == "applied"
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_call_in_worker, (fn,)) == "diffusers.models.embeddings.apply_rotary_emb"
