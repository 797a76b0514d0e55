"""compile_warnings steps aside where torch traces diffusers' warning sites itself (measured, not assumed).

On every torch in the matrix: the default configuration still breaks on both kinds of site (so the
patch applies), and a configuration under which Dynamo does trace both (``ignore_logging_functions``)
makes the patch report ``skipped: torch <version> traces these sites itself``.
"""
from __future__ import annotations

import json
import logging
import textwrap
import warnings
from typing import Dict, Iterator

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402
from torchpatches.patches.compile_warnings import _probe as sites  # noqa: E402

from _fresh import Result, run_forked  # noqa: E402


@pytest.fixture
def ignore_logging_functions() -> Iterator[set]:
    """Dynamo's ``ignore_logging_functions`` set, restored afterwards."""
    config = torch._dynamo.config
    saved = set(config.ignore_logging_functions)
    try:
        yield config.ignore_logging_functions
    finally:
        config.ignore_logging_functions.clear()
        config.ignore_logging_functions.update(saved)


def test_torch_breaks_on_both_kinds_of_site_by_default() -> None:
    """Measured on 2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0: neither call form traces (#181476 and #186072
    are in no release; #190840 is opt-in)."""
    assert sites.probe_warning_sites() == {"logger.warning": False, "warnings.warn": False}
    assert sites.torch_traces_warning_sites() is False


def test_one_kind_traced_is_not_enough(ignore_logging_functions: set) -> None:
    ignore_logging_functions.add(logging.Logger.warning)
    assert sites.probe_warning_sites() == {"logger.warning": True, "warnings.warn": False}
    ignore_logging_functions.add(warnings.warn)
    assert sites.probe_warning_sites() == {"logger.warning": True, "warnings.warn": True}


def test_the_probe_emits_nothing(ignore_logging_functions: set, capfd: pytest.CaptureFixture) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sites.probe_warning_sites()
        ignore_logging_functions.update({logging.Logger.warning, warnings.warn})
        sites.probe_warning_sites()
    assert caught == []
    assert "probe" not in capfd.readouterr().err


def test_patch_applies_where_torch_still_breaks() -> None:
    import diffusers.models.transformers.transformer_flux  # noqa: F401 - a target module

    status = torchpatches.status()["compile_warnings"]
    assert status.state.value == "applied", status.reason


_FIRST_IMPORT = textwrap.dedent(
    """
    import json, logging, os, warnings
    import torch
    if os.environ["TP_DYNAMO_CONFIG"] == "ignore":
        torch._dynamo.config.ignore_logging_functions.update({logging.Logger.warning, warnings.warn})
    import torchpatches
    from diffusers.models.transformers import transformer_flux
    import harness
    status = torchpatches.status()["compile_warnings"]
    case = next(c for c in harness.GRAPH_BREAK_CASES if (c.model, c.form) == ("flux1", "3-D ids"))
    model = case.build()
    try:
        with torch.no_grad(), harness.quiet():
            torch.compile(model, backend="eager", fullgraph=True)(**case.inputs())
        fullgraph = True
    except Exception:
        fullgraph = False
    print(json.dumps({"state": status.state.value, "reason": status.reason, "fullgraph": fullgraph,
                      # the replacement is the same source with ``logger`` bound in a closure
                      "patched": "logger" in transformer_flux.FluxAttention.forward.__code__.co_freevars}))
    """
)


CONFIGS = ["ignore", "default"]


@pytest.fixture(scope="module")
def first_imports(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Result]:
    """Each configuration set before a first ``import torchpatches`` (forks of one child that imported torch)."""
    cases = [(_FIRST_IMPORT, {"TP_DYNAMO_CONFIG": config}) for config in CONFIGS]
    return dict(zip(CONFIGS, run_forked(cases, tmp_path_factory.mktemp("dynamo-config"), "import torch._dynamo")))


@pytest.mark.parametrize("config", CONFIGS)
def test_skipped_where_torch_traces_the_sites_itself(config: str, first_imports: Dict[str, Result]) -> None:
    """A first import: with Dynamo told to trace (drop) both call forms, the patch is skipped and the
    unpatched FLUX forward with deprecated 3-D ids compiles with ``fullgraph=True``; by default it applies."""
    result = first_imports[config]
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    if config == "ignore":
        assert found == {"state": "skipped", "reason": f"torch {torch.__version__} traces these sites itself",
                         "fullgraph": True, "patched": False}
    else:
        assert found["state"] == "applied" and found["patched"] and found["fullgraph"], found
