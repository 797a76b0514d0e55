"""aot_compile_builtins: an aot_compile'd function whose bytecode reads a builtin saves and loads again without
``f_globals`` where the patch applies (torch 2.11), fails to load there without it, and is skipped by fingerprint
where torch carries the fix (the round trip then works on its own)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import torchpatches
from torchpatches.patches import aot_compile_builtins

from _torch_fixes import applied, assert_gated_by_fingerprint

NAME = "aot_compile_builtins"
MODULE = "torch._dynamo.convert_frame"  # the target's module: the patch is pending until it loads


def _reads_a_builtin(x: torch.Tensor) -> Any:
    return x + 1, len  # Dynamo reconstructs the builtin from the frame's __builtins_dict__


def _round_trip(path: Path) -> Any:
    """Compile ahead of time (Dynamo only: the eager backend), save, load with no f_globals, call."""
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled = torch.compile(_reads_a_builtin, fullgraph=True, backend="eager").aot_compile(
            ((torch.randn(3),), {}))
        compiled.save_compiled_function(str(path))
        with open(path, "rb") as fh:
            loaded = torch.compiler.load_compiled_function(fh)
    out, builtin = loaded(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
    return builtin


def test_round_trip_without_f_globals(tmp_path: Path) -> None:
    assert _round_trip(tmp_path / "f.bin") is len


def test_fails_without_the_patch_where_it_applies(tmp_path: Path) -> None:
    if not applied(NAME, MODULE):
        pytest.skip(f"{NAME} is not applied on torch {torch.__version__} (the fix is upstream)")
    with torchpatches.disabled(NAME), pytest.raises(RuntimeError, match="Missing required external references"):
        _round_trip(tmp_path / "f.bin")


def test_applies_exactly_on_the_verified_source() -> None:
    import torch._dynamo.convert_frame as convert_frame

    assert_gated_by_fingerprint(NAME, MODULE, lambda: convert_frame.GraphCaptureOutput.get_runtime_env,
                                aot_compile_builtins.FINGERPRINT_TORCH_2_11_0)
