"""The benchmarks' own checks that need no GPU: ``dit.py``'s charts are drawn from its results (a fixture of its JSON
layout in-process, and a ``--tiny`` run through the command line), matplotlib's absence is a clear error, and the
benchmarks import torchpatches' public names only.

matplotlib is in the ``test`` extra, so the chart tests run wherever the extra is installed (every tests-<torch>
nox session); under CI they fail rather than skip without it.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
PNG = b"\x89PNG\r\n\x1a\n"


def _matplotlib() -> None:
    if os.environ.get("CI"):
        import matplotlib  # noqa: F401  (CI installs the test extra: a skip there would hide the charts)
    else:
        pytest.importorskip("matplotlib")


@pytest.fixture
def charts(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _dit_charts

    return _dit_charts


def _row(ms: float, ratio: float, profile: bool) -> Dict[str, Any]:
    row: Dict[str, Any] = {"median_ms": ms, "ratio_vs_eager_vanilla": ratio, "error": None}
    if profile:
        row["profile"] = {"gpu_kernel_ms": ms * 0.95, "launches_per_step": 300.0,
                          "ms_by_class": {"gemm": ms * 0.5, "attention": ms * 0.3, "other": ms * 0.15}}
    return row


def _results(profile: bool = True) -> Dict[str, Any]:
    """dit.py's JSON layout (--json / --summary --json), two models: one with full compile on a block subset (not
    drawn), one with every variant."""
    versions = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "diffusers": "0.42.1",
                "torchpatches": "0.1.0", "commit": "abc1234"}
    flux1 = {"class": "FluxTransformer2DModel", "layers": [19, 38], "model_layers": [19, 38],
             "full_compile_layers": [2, 4], "dtype": "torch.bfloat16",
             "rows": {"eager/vanilla": _row(177.0, 1.0, profile), "eager/all": _row(126.0, 0.71, profile),
                      "regional/vanilla": _row(137.0, 0.77, profile), "regional/all": _row(134.0, 0.76, profile),
                      "full/vanilla": _row(15.0, 0.74, profile), "eager/-adaln": _row(138.0, 0.78, profile)}}
    sd3 = {"class": "SD3Transformer2DModel", "layers": [6], "model_layers": [38], "full_compile_layers": [6],
           "dtype": "torch.bfloat16",
           "rows": {key: _row(ms, ms / 16.0, profile) for key, ms in (
               ("eager/vanilla", 16.0), ("eager/all", 10.9), ("graph/all", 10.5), ("regional/vanilla", 11.2),
               ("regional/all", 11.3), ("full/vanilla", 11.1), ("full/all", 10.9))}}
    sd3["rows"]["graph/vanilla"] = {"error": "first call: RuntimeError: capture failed"}
    return {"versions": versions, "commands": ["dit.py ..."], "models": {"flux1": flux1, "sd3": sd3}}


def test_the_charts_are_drawn_from_the_results(charts: Any, tmp_path: Path) -> None:
    _matplotlib()
    paths = charts.draw(_results(), str(tmp_path))
    assert [Path(p).name for p in paths] == ["dit-h200-step.png", "dit-h200-gpu-time.png"]
    for path in paths:
        data = Path(path).read_bytes()
        assert data.startswith(PNG) and len(data) > 20_000
    # full compile on a block subset is not the model's step: left out; a failed row too
    assert [key for key, _, _ in charts._bars(_results()["models"]["flux1"])] == [
        "eager/vanilla", "eager/all", "regional/vanilla", "regional/all"]
    assert "graph/vanilla" not in [key for key, _, _ in charts._bars(_results()["models"]["sd3"])]


def test_rows_without_a_profile_are_drawn_too(charts: Any, tmp_path: Path) -> None:
    _matplotlib()
    results = _results(profile=False)
    results["versions"] = {"torch": "2.13.0+cpu"}
    paths = charts.draw(results, str(tmp_path), "dit-test")
    assert [Path(p).name for p in paths] == ["dit-test-step.png", "dit-test-gpu-time.png"]
    assert all(Path(p).read_bytes().startswith(PNG) for p in paths)


def test_device_tag_and_title(charts: Any) -> None:
    assert charts.device_tag({"gpu": "NVIDIA H200"}) == "h200"
    assert charts.device_tag({"gpu": "NVIDIA H100 80GB HBM3"}) == "h100"
    assert charts.device_tag({}) == "cpu"
    assert charts.title(_results()["versions"]) == (
        "NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, diffusers 0.42.1, torchpatches 0.1.0 (abc1234)")


def test_without_matplotlib_the_plot_says_what_to_install(charts: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        charts.require_matplotlib()


@pytest.mark.slow
def test_a_tiny_run_is_merged_and_plotted_from_the_command_line(tmp_path: Path) -> None:
    """dit.py --tiny (one model, eager rows, one round) writes its JSON and charts; --summary merges and redraws."""
    _matplotlib()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = [sys.executable, str(BENCHMARKS / "dit.py")]
    first = subprocess.run(run + ["--tiny", "--models", "sd3", "--variants", "eager", "--rounds", "1", "--steps", "1",
                                  "--warmup", "0", "--json", str(tmp_path / "sd3.json"), "--plot", str(tmp_path / "a")],
                           env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["dit-cpu-gpu-time.png", "dit-cpu-step.png"]
    merged = subprocess.run(run + ["--summary", str(tmp_path / "sd3.json"), "--json", str(tmp_path / "merged.json"),
                                   "--plot", str(tmp_path / "b"), "--plot-name", "merged"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert merged.returncode == 0, merged.stdout[-2000:] + merged.stderr[-2000:]
    data = json.loads((tmp_path / "merged.json").read_text())
    assert set(data) == {"versions", "commands", "models"} and set(data["models"]) == {"sd3"}
    assert {"eager/vanilla", "eager/all"} <= set(data["models"]["sd3"]["rows"])
    assert data["models"]["sd3"]["patterns"]["sd3_qk_norm"]["fused"] > 0  # found by torchpatches.coverage
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["merged-gpu-time.png", "merged-step.png"]


#: torchpatches' public modules: what a benchmark may import
PUBLIC = {"torchpatches", "torchpatches.ops", "torchpatches.testing", "torchpatches.cuda_graphs",
          "torchpatches.compile"}


def test_code_ab_compares_each_tree_against_its_own_eager_and_refuses_a_bad_tree(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """code_ab.py's table: per tree the median over repeats of eager + torchpatches / eager diffusers (each run's own
    ratio, not a ratio of medians), and the last tree over the first; a tree without a package is refused by name."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import code_ab

    def entry(vanilla: float, fused: float) -> Dict[str, Any]:
        return {"rows": {"eager/vanilla": {"median_ms": vanilla}, "eager/all": {"median_ms": fused, "host_ms": 1.0}}}

    runs = {"sd3": {"old": [code_ab.row_numbers(entry(100.0, 80.0)), code_ab.row_numbers(entry(50.0, 41.0)),
                            code_ab.row_numbers(entry(100.0, 90.0))],
                    "new": [code_ab.row_numbers(entry(200.0, 160.0))] * 3}}
    (line,) = code_ab.table(runs, ["old", "new"])
    assert line["old_ratio"] == pytest.approx(0.82) and line["new_ratio"] == pytest.approx(0.8)
    assert line["last_over_first"] == pytest.approx(0.8 / 0.82)
    with pytest.raises(SystemExit, match="nowhere"):
        code_ab.parse_trees(f"a={ROOT},b={tmp_path / 'nowhere'}")


def test_benchmarks_import_public_names_only() -> None:
    found = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{path.name}: {name}" for name in names
                      if name.split(".")[0] == "torchpatches" and name not in PUBLIC]
    assert found == []


#: dit.py's families whose forward cannot run on the meta device (data-dependent host code) -> where
META_FORWARD_FAILS = {
    "qwenimage21": "repeat_interleave of img_mask without output_size",
    "hunyuanvideo15": "`if torch.all(image_embeds == 0)` (.item())",
    "ideogram4": "torch.autocast(device_type='meta') in its MRoPE",
    "hidream": "the MoE's bincount().cpu().numpy() routing",
}
#: dit.py's other families torchpatches fuses nothing in yet -> their output's shape (the latents', per sample for
#: Z-Image)
FAMILY_OUTPUTS = {
    "flux3": (1, 4096, 128), "zimage": (16, 1, 128, 128), "krea2": (1, 4096, 64), "wan22-ti2v": (1, 48, 31, 44, 80),
    "ltx2": (1, 14080, 128), "kandinsky6": (1, 31, 60, 108, 16), "chroma": (1, 4096, 64),
}


@pytest.mark.parametrize("name", [*FAMILY_OUTPUTS, *META_FORWARD_FAILS])
def test_a_family_spec_builds_on_meta_and_takes_its_inputs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The production config with its default layer subset builds (meta device, bf16: no memory), its block lists
    hold the default layer counts, every input is one the forward takes, and where the forward runs on meta it
    returns the latents' shape."""
    import inspect

    diffusers = pytest.importorskip("diffusers")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from _dit_models import SPECS, layers_of

    spec, meta = SPECS[name], torch.device("meta")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with meta:
            model = getattr(diffusers, spec.cls_name)(**spec.config).eval()
    finally:
        torch.set_default_dtype(previous)
    assert tuple(len(getattr(model, attr)) for attr in spec.block_lists) == layers_of(spec, spec.config)
    assert all(n <= full for n, full in zip(layers_of(spec, spec.config), spec.full_layers))
    feed = spec.inputs(spec.config, lambda *shape: torch.empty(*shape, device=meta, dtype=torch.bfloat16), meta,
                       torch.bfloat16)
    inspect.signature(model.forward).bind(**feed)
    assert all(t.device == meta for t in feed.values() if isinstance(t, torch.Tensor))
    if name in META_FORWARD_FAILS:
        return
    with torch.no_grad():
        out = model(**feed)[0]
    assert tuple((out[0] if isinstance(out, list) else out).shape) == FAMILY_OUTPUTS[name]
