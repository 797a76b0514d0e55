"""compile_warnings: diffusers' forward-time warnings without graph breaks (tiny models, CPU).

The models and argument forms are torchpatches._harness.GRAPH_BREAK_CASES, which
benchmarks/graph_breaks.py measures for the README table.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import warnings
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch

pytest.importorskip("diffusers")

import torchpatches  # noqa: E402  (applies the patches)
import harness  # noqa: E402
from torchpatches._doctor import sites as _sites  # noqa: E402
from torchpatches._doctor.capture import capture  # noqa: E402
from torchpatches.patches import compile_warnings  # noqa: E402
from torchpatches.compile import reset_once  # noqa: E402

CASES = {(case.model, case.form): case for case in harness.GRAPH_BREAK_CASES}

#: torch minors whose Dynamo aborts the unpatched DIFFUSERS_ATTN_CHECKS=1 compile (a bare AssertionError
#: on ``set(kwargs) - set(...)``), as measured: 2.11.0 and 2.12.1. 2.13.0, 2.14.1 and 2.15.0 compile it.
ATTN_CHECKS_CRASH = {(2, 11), (2, 12)}
TORCH_MINOR = tuple(int(part) for part in torch.__version__.split(".")[:2])

#: (model, form) -> (graphs, breaks, fullgraph ok) before the patch, as measured (torch 2.11 and 2.13).
#: After the patch every row is (1, 0, True).
BEFORE: Dict[Tuple[str, str], Tuple[int, int, bool]] = {
    ("flux1", "2-D ids"): (1, 0, True),
    ("flux1", "3-D ids"): (3, 2, False),
    ("flux1", "unknown attn kwarg"): (9, 8, False),
    ("flux1", "scale, no PEFT"): (1, 0, False),  # explain under-reports: fullgraph still fails
    ("flux2", "unknown attn kwarg"): (12, 11, False),
    ("flux2", "scale, no PEFT"): (1, 0, False),
    ("sd3", "unknown attn kwarg"): (6, 5, False),
    ("qwenimage", "scale, no PEFT"): (1, 0, False),
    ("wan", "scale, no PEFT"): (1, 0, False),
    ("hunyuanvideo", "scale, no PEFT"): (1, 0, False),
    ("feedforward", "scale= (deprecate)"): (1, 0, False),  # explain under-reports here too
    # Sites covered since the whole-diffusers scan (one case per kind of site):
    ("chroma", "3-D ids"): (3, 2, False),
    ("chroma", "scale, no PEFT"): (1, 0, False),
    ("auraflow", "scale, no PEFT"): (1, 0, False),
    ("ovis", "unknown attn kwarg"): (10, 9, False),
    ("qwenimage", "mixed image sizes"): (3, 2, False),
    ("pixart", "scale (deprecated)"): (7, 6, False),
    ("dreamlite", "default (return_dict=True)"): (1, 0, False),  # DreamLite's default form breaks
}

def _call_line(module: str, qualname: str, call: str, nth: int) -> int:
    """First line of the ``nth`` ``call`` in ``qualname`` of the installed diffusers (lines move between releases)."""
    path = importlib.import_module(f"diffusers.models.transformers.{module}").__file__
    return _sites.calls_in_function(path, qualname, call)[nth][0]


#: (model, form) -> where Dynamo breaks the graph before the patch (file name, line; the same in diffusers
#: 0.40.0-0.42.1 except where the line is looked up in the installed source).
#: The breaks inside deprecate() are on another line on 2.11 (its import) than on 2.13 (warnings.warn).
SITES_BEFORE: Dict[Tuple[str, str], Tuple[Tuple[str, int], ...]] = {
    ("flux1", "3-D ids"): (("transformer_flux.py", 737), ("transformer_flux.py", 743)),
    ("flux1", "scale, no PEFT"): (("peft_utils.py", 313),),
    ("chroma", "3-D ids"): tuple(  # 525 and 531 in 0.41-0.42.1, 536 and 542 in 0.40
        ("transformer_chroma.py", _call_line("transformer_chroma", "ChromaTransformer2DModel.forward", "logger.warning", n))
        for n in (0, 1)
    ),
    ("chroma", "scale, no PEFT"): (("peft_utils.py", 313),),
    ("auraflow", "scale, no PEFT"): (("peft_utils.py", 313),),
    ("ovis", "unknown attn kwarg"): (("transformer_ovis_image.py", 207),),
    ("qwenimage", "mixed image sizes"): (  # 265 in 0.42.1, 302 in 0.40/0.41
        ("transformer_qwenimage.py", _call_line("transformer_qwenimage", "QwenEmbedRope.forward", "logger.warning", 0)),
    ),
    ("pixart", "scale (deprecated)"): (
        ("attention.py", 973), ("attention_processor.py", 602), ("transformer_2d.py", 376),
    ),
    ("dreamlite", "default (return_dict=True)"): (("deprecation_utils.py", 72 if TORCH_MINOR == (2, 11) else 98),),
}

FLUX_MODULE = "diffusers.models.transformers.transformer_flux"

#: The cases of the fast set (each torch release): one per kind of site, and the one whose site moves with
#: torch's release (dreamlite). Every case runs in the full sessions and in the diffusers-<version> ones.
FAST_CASES = {
    ("flux1", "3-D ids"),  # logger.warning in a model forward
    ("flux1", "unknown attn kwarg"),  # "not expected by" in an attention processor
    ("flux1", "scale, no PEFT"),  # @apply_lora_scale wrapper: a break before the first graph
    ("feedforward", "scale= (deprecate)"),  # deprecate() in a forward
    ("dreamlite", "default (return_dict=True)"),  # deprecate() in an output class's __init__
}


def _cases(keys: Any, fast: Any = FAST_CASES, by_diffusers: bool = True) -> List[Any]:
    """``keys`` as parameters; those not in ``fast`` marked slow (and by_diffusers: the sites differ by release)."""
    slow = (pytest.mark.slow, pytest.mark.by_diffusers) if by_diffusers else (pytest.mark.slow,)
    return [pytest.param(key, marks=() if key in fast else slow) for key in keys]


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    torchpatches.apply("compile_warnings")
    reset_once()
    torch._dynamo.reset()
    yield
    torchpatches.apply("compile_warnings")
    torch._dynamo.reset()
    reset_once()


@pytest.fixture
def diffusers_log() -> Iterator[harness.LogRecords]:
    """Messages on the 'diffusers' logger tree (diffusers stops propagation at its root logger)."""
    with harness.capture_logs("diffusers") as records:
        yield records


def _explain(model: torch.nn.Module, kwargs: Dict[str, Any]) -> Tuple[int, int]:
    report = harness.graph_report(model, **kwargs)
    return report.graphs, report.breaks


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


# ---- graph breaks, fullgraph, recompiles, outputs -----------------------------------------------


@pytest.mark.parametrize("key", _cases(sorted(BEFORE)), ids=lambda k: f"{k[0]}-{k[1]}")
def test_graph_breaks_before_and_after(key: Tuple[str, str]) -> None:
    """Before the patch, explain (capturing every logged break: no break logged is what fullgraph=True needs) and,
    where a row says fullgraph fails, a real fullgraph=True compile that must fail: explain under-reports some rows
    (a break before a frame's first graph: 1 graph, 0 breaks, yet fullgraph fails). After the patch, the fullgraph
    compile, under a capture: one graph, no break or recompile logged (an explain pass would add nothing to that)."""
    case = CASES[key]
    model = case.build()
    graphs, breaks, fullgraph = BEFORE[key]
    with torch.no_grad(), harness.quiet():
        with torchpatches.disabled("compile_warnings"):
            report = harness.graph_report(model, backend=None if fullgraph else "eager", **case.inputs())
            assert (report.graphs, report.breaks, report.fullgraph) == (graphs, breaks, fullgraph)
            assert fullgraph or (report.error and report.output is None)
            eager_before = _first(model(**case.inputs()))
        if key in SITES_BEFORE:
            assert report.break_sites == SITES_BEFORE[key]
        # Ground truth for the doctor: every break before the patch is at a site compile_warnings declares.
        declared = _sites.declared_sites([compile_warnings.PATCH])
        assert [site for site in report.sites if _sites.find_site(site.stack, declared) is None] == []
        assert bool(report.sites) == (not fullgraph)
        eager_after = _first(model(**case.inputs()))
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)  # fullgraph after the patch: tried
        with capture() as after:
            first = _first(compiled(**case.inputs()))
            with torch._dynamo.config.patch(error_on_recompile=True):
                second = _first(compiled(**case.inputs()))  # same shapes: no recompile
        assert (after.graphs, after.breaks, after.recompiles) == (1, [], []), after.notes
    torch.testing.assert_close(eager_after, eager_before, rtol=0, atol=0)
    torch.testing.assert_close(first, eager_before)
    torch.testing.assert_close(second, first, rtol=0, atol=0)


def test_attn_checks_flux() -> None:
    """DIFFUSERS_ATTN_CHECKS=1: torch 2.11/2.12 abort the compile before the patch; every torch compiles after."""
    case = CASES[("flux1", "DIFFUSERS_ATTN_CHECKS=1")]
    model = case.build()
    with torch.no_grad(), harness.quiet(), harness.attn_checks(True):
        with torchpatches.disabled("compile_warnings"):
            expected = _first(model(**case.inputs()))
            if TORCH_MINOR in ATTN_CHECKS_CRASH:
                with pytest.raises(AssertionError):
                    torch._dynamo.reset()
                    torch.compile(model, backend="eager", fullgraph=True)(**case.inputs())
            else:
                assert _explain(model, case.inputs()) == (1, 0)
        assert _explain(model, case.inputs()) == (1, 0)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        torch.testing.assert_close(_first(compiled(**case.inputs())), expected)
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled(**case.inputs())


def test_dispatch_attention_fn_rebound_in_modules_that_import_it() -> None:
    from diffusers.models import attention_dispatch
    from diffusers.models.transformers import transformer_flux

    assert transformer_flux.dispatch_attention_fn is attention_dispatch.dispatch_attention_fn
    patched = attention_dispatch.dispatch_attention_fn
    with torchpatches.disabled("compile_warnings"):
        original = attention_dispatch.dispatch_attention_fn
        assert original is not patched and transformer_flux.dispatch_attention_fn is original
    assert transformer_flux.dispatch_attention_fn is attention_dispatch.dispatch_attention_fn is not original


# ---- the messages -----------------------------------------------------------------------------------

FLUX_3D = [
    "Passing `txt_ids` 3d torch.Tensor is deprecated.Please remove the batch dimension and pass it as a 2d torch Tensor",
    "Passing `img_ids` 3d torch.Tensor is deprecated.Please remove the batch dimension and pass it as a 2d torch Tensor",
]
FLUX_UNKNOWN = ["joint_attention_kwargs ['foo'] are not expected by FluxAttnProcessor and will be ignored."]
FLUX_SCALE = ["Passing `scale` via `joint_attention_kwargs` when not using the PEFT backend is ineffective."]


#: Where diffusers 0.42.1 calls logger.warning (the records must point there, eager and compiled).
SITES = {
    "3-D ids": {("transformer_flux.py", 737), ("transformer_flux.py", 743)},
    "unknown attn kwarg": {("transformer_flux.py", 351)},
    "scale, no PEFT": {("peft_utils.py", 313)},
}


@pytest.mark.parametrize(
    "form, expected",
    [("3-D ids", FLUX_3D), ("unknown attn kwarg", FLUX_UNKNOWN), ("scale, no PEFT", FLUX_SCALE)],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flux_messages_once_and_identical(
    diffusers_log: harness.LogRecords, form: str, expected: List[str], compiled: bool
) -> None:
    case = CASES[("flux1", form)]
    model = case.build()
    with torch.no_grad():
        with torchpatches.disabled("compile_warnings"):
            model(**case.inputs())
        original = list(dict.fromkeys(diffusers_log.messages))  # the unpatched text, de-duplicated
        assert original == expected
        original_sites = set(diffusers_log.sites)
        diffusers_log.records.clear()
        run = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
        for _ in range(3):
            run(**case.inputs())
    assert diffusers_log.messages == expected  # same text, each once
    assert set(diffusers_log.sites) == original_sites == SITES[form]  # same file and line


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_deprecate_future_warning_once(compiled: bool) -> None:
    case = CASES[("feedforward", "scale= (deprecate)")]
    model = case.build()
    run = torch.compile(model, backend="eager", fullgraph=True) if compiled else model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            run(**case.inputs())
    texts = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert texts and set(texts) == {
        "`scale` is deprecated and will be removed in version 1.0.0. The `scale` argument is deprecated and will be"
        " ignored. Please remove it, as passing it will raise an error in the future. `scale` should directly be"
        " passed while calling the underlying pipeline component i.e., via `cross_attention_kwargs`."
    }
    if compiled:
        assert len(texts) == 1  # at trace time, once
        assert caught[0].filename.endswith("attention.py")  # the traced diffusers line, not Dynamo's


# ---- Inductor: nothing changes where nothing broke ---------------------------------------------------


def _kernel_count(model: torch.nn.Module, kwargs: Dict[str, Any]) -> Tuple[int, int]:
    """(fused kernels defined in the generated code, graphs compiled) for one fresh Inductor compile."""
    with harness.quiet():
        report = harness.inductor_report(model, fullgraph=False, **kwargs)
    return report.kernels, len(report.codes)


@pytest.mark.slow
def test_inductor_kernels_equal_with_2d_ids_and_fewer_graphs_with_3d_ids() -> None:
    model = CASES[("flux1", "2-D ids")].build()
    with torchpatches.disabled("compile_warnings"):
        before_2d = _kernel_count(model, CASES[("flux1", "2-D ids")].inputs())
        before_3d = _kernel_count(model, CASES[("flux1", "3-D ids")].inputs())
    after_2d = _kernel_count(model, CASES[("flux1", "2-D ids")].inputs())
    after_3d = _kernel_count(model, CASES[("flux1", "3-D ids")].inputs())
    print(f"inductor kernels/graphs: 2-D {before_2d} -> {after_2d}; 3-D {before_3d} -> {after_3d}")
    assert after_2d == before_2d
    assert before_2d[1] == 1 and after_3d[1] == 1 and before_3d[1] == 3
    assert after_3d[0] <= before_3d[0]


# ---- revert / disabled: originals by identity ----------------------------------------------------------


def _flux_targets() -> List[Tuple[Any, str]]:
    from diffusers.models.transformers import transformer_flux

    return [(transformer_flux.FluxAttention, "forward"), (transformer_flux.FluxTransformer2DModel, "forward")]


def test_revert_and_disabled_restore_originals_by_identity() -> None:
    import diffusers.models.attention  # noqa: F401 - import every target module
    from diffusers.models.transformers import transformer_flux

    assert torchpatches.status()["compile_warnings"].state == "applied"
    patched = [vars(owner)[name] for owner, name in _flux_targets()]
    torchpatches.revert("compile_warnings")
    originals = [vars(owner)[name] for owner, name in _flux_targets()]
    assert torchpatches.status()["compile_warnings"].state == "disabled"
    assert all(p is not o for p, o in zip(patched, originals))
    assert originals[0].__code__.co_filename == transformer_flux.__file__
    assert transformer_flux.FluxAttention.forward.__globals__["logger"] is transformer_flux.logger
    with torchpatches.disabled("compile_warnings"):
        assert [vars(o)[n] for o, n in _flux_targets()] == originals
    torchpatches.apply("compile_warnings")
    again = [vars(owner)[name] for owner, name in _flux_targets()]
    assert all(a is not o for a, o in zip(again, originals))
    with torchpatches.disabled("compile_warnings"):
        assert all(vars(o)[n] is orig for (o, n), orig in zip(_flux_targets(), originals))
    assert transformer_flux.logger.__class__ is logging.Logger  # the module's logger was never swapped


#: diffusers release -> compile_warnings targets skipped there (a model module newer than the release, or a
#: source read and not accepted); on 0.42.x every target applies.
_T = "diffusers.models.transformers"
SKIPPED_ON: Dict[str, Dict[str, str]] = {
    "0.40.0": {
        f"{_T}.transformer_flux3:Flux3Transformer2DModel.forward": "does not exist",
        f"{_T}.transformer_qwenimage21:QwenImage21Transformer2DModel.forward": "does not exist",
        f"{_T}.transformer_rfd4_proteina:RFD4ProteinaTransformer.forward": "does not exist",
        f"{_T}.transformer_sana_wm_refiner:SanaWMLTX2RefinerTransformer3DModel.forward": "does not exist",
        f"{_T}.transformer_sana_wm_refiner:SanaWMLTX2Attention.forward": "does not exist",
        f"{_T}.transformer_hidream_image:HiDreamImageTransformer2DModel.forward": "differs from the verified",
        f"{_T}.transformer_z_image:ZImageTransformer2DModel.forward": "differs from the verified",
    },
    "0.41.0": {
        f"{_T}.transformer_flux3:Flux3Transformer2DModel.forward": "does not exist",
        f"{_T}.transformer_rfd4_proteina:RFD4ProteinaTransformer.forward": "does not exist",
        f"{_T}.transformer_sana_wm_refiner:SanaWMLTX2RefinerTransformer3DModel.forward": "does not exist",
        f"{_T}.transformer_sana_wm_refiner:SanaWMLTX2Attention.forward": "does not exist",
        f"{_T}.transformer_z_image:ZImageTransformer2DModel.forward": "differs from the verified",
    },
}


def test_every_target_applied_on_verified_diffusers() -> None:
    """Every target applies, except those a release in the gate lacks: skipped, each with its reason."""
    import diffusers
    import diffusers.models.attention  # noqa: F401
    import diffusers.models.transformers  # noqa: F401 - imports every model module the release has

    for target in compile_warnings.PATCH.targets:
        if importlib.util.find_spec(target.module) is not None:
            importlib.import_module(target.module)
    status = torchpatches.status()["compile_warnings"]
    expected = SKIPPED_ON.get(diffusers.__version__, {})
    assert status.state == "applied", status.reason
    skipped = {t.path: t.reason for t in status.targets if t.state != "applied"}
    assert set(skipped) == set(expected), skipped
    for path, reason in skipped.items():
        assert expected[path] in reason, reason
        assert {t.state for t in status.targets if t.path == path} == {"skipped"}
    applied = len(status.targets) - len(expected)
    assert status.reason.startswith(f"{applied}/{len(status.targets)} target(s) patched"), status.reason


def test_replacement_reads_other_globals_live(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another patch (rope) rebinding a FLUX module global is seen by our copies."""
    from diffusers.models.transformers import transformer_flux

    replaced = transformer_flux.FluxAttention.forward
    assert replaced.__globals__ is vars(transformer_flux)
    assert "logger" in replaced.__code__.co_freevars  # the one name we bound
