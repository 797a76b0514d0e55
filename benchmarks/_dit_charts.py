"""The charts of ``dit.py --plot``, drawn with matplotlib from the runner's results (``dit.py --json`` or
``--summary``'s merge). Not a benchmark itself; matplotlib is needed here only (it is no dependency of torchpatches).

- ``<name>-step.png``: per model, the median step time of each variant measured (eager, eager + torchpatches, the
  CUDA graph of eager + torchpatches, regional and full compile with and without torchpatches), each bar labelled
  with its ms and its ratio to eager; eager + torchpatches also with its ratio to the faster vanilla compile;
- ``<name>-gpu-time.png``: the same bars split into GPU kernel time by class (GEMM, attention, other: norms,
  modulation, RoPE, gates, residuals, casts, copies) and the rest of the step (host / idle: the GPU waiting for
  the host, launch gaps). Rows without a profile (the CPU) are one "not profiled" segment.

Each chart's title names the device and the versions the results were measured with.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Tuple

#: (row key, label) of the bars, top to bottom; rows not measured are left out.
BARS: List[Tuple[str, str]] = [
    ("eager/vanilla", "eager"),
    ("eager/all", "eager + torchpatches"),
    ("graph/all", "eager + tp, CUDA graph"),
    ("regional/vanilla", "regional compile"),
    ("regional/all", "regional compile + tp"),
    ("full/vanilla", "full compile"),
    ("full/all", "full compile + tp"),
]
#: bar colour per row key: diffusers' own code grey, torchpatches blue, compiled green
COLOURS = {"eager/vanilla": "#9e9e9e", "eager/all": "#1f77b4", "graph/all": "#6baed6",
           "regional/vanilla": "#74c476", "regional/all": "#238b45", "full/vanilla": "#bcbddc", "full/all": "#6a51a3"}
#: stacked segments of the GPU-time chart: (profile class or "idle", label, colour)
SEGMENTS = [("gemm", "GEMM", "#4c72b0"), ("attention", "attention", "#dd8452"), ("other", "other kernels", "#c44e52"),
            ("idle", "host / idle (step - kernels)", "#d9d9d9")]


def _below_title(fig: Any) -> float:
    """The top of the subplots' area: 0.6 inch below the figure's top is the two-line title's (tight_layout does not
    reserve it: in a tall figure the first row's titles ran into it)."""
    return 1.0 - 0.6 / fig.get_size_inches()[1]


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or SystemExit with what to install."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which torchpatches does not depend on: pip install matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def device_tag(versions: Dict[str, Any]) -> str:
    """A short name of the device for file names: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100"."""
    gpu = str(versions.get("gpu") or "cpu")
    found = re.search(r"\b([A-Za-z]{1,2}\d{2,4}[A-Za-z]?)\b", gpu)
    return (found.group(1) if found else re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")).lower() or "device"


def title(versions: Dict[str, Any]) -> str:
    parts = [str(versions.get("gpu") or "CPU")]
    for key in ("torch", "triton", "diffusers", "torchpatches"):
        if versions.get(key):
            parts.append(f"{key} {versions[key]}")
    if versions.get("commit"):
        parts[-1] += f" ({versions['commit']})"
    return ", ".join(parts)


def _bars(entry: Dict[str, Any]) -> List[Tuple[str, str, Dict[str, Any]]]:
    """The (key, label, row) drawn for one model: measured without error; full compile only on the whole model
    (on a block subset its times are not the model's)."""
    rows = entry.get("rows", {})
    whole = list(entry.get("full_compile_layers") or []) == list(entry.get("layers") or [])
    out = []
    for key, label in BARS:
        row = rows.get(key)
        if not row or row.get("error") or row.get("median_ms") is None:
            continue
        if key.startswith("full/") and not whole:
            continue
        out.append((key, label, row))
    return out


def _subtitle(name: str, entry: Dict[str, Any]) -> str:
    layers = "+".join(map(str, entry.get("layers", [])))
    total = "+".join(map(str, entry.get("model_layers", [])))
    dtype = str(entry.get("dtype", "")).replace("torch.", "")
    text = f"{name}: {entry.get('class', '')}\n{layers} of {total} blocks, {dtype}"
    if any(k.startswith("full/") for k in entry.get("rows", {})) and \
            list(entry.get("full_compile_layers") or []) != list(entry.get("layers") or []):
        text += " (full compile: a block subset, not shown)"
    return text


def _grid(plt: Any, models: List[Tuple[str, Dict[str, Any]]]) -> Tuple[Any, List[Any]]:
    """Two panels a row, each as tall as its bars need."""
    cols = min(len(models), 2)
    rows = (len(models) + cols - 1) // cols
    most = max(len(_bars(entry)) for _, entry in models)
    fig, axes = plt.subplots(rows, cols, figsize=(7.2 * cols, (0.34 * most + 1.3) * rows + 1.1), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(models):]:
        ax.axis("off")
    return fig, flat[:len(models)]


def _models(results: Dict[str, Any]) -> List[Tuple[str, Dict[str, Any]]]:
    return [(name, entry) for name, entry in results.get("models", {}).items() if _bars(entry)]


def _axes(ax: Any, bars: List[Tuple[str, str, Dict[str, Any]]], right: float, xlabel: str, name: str,
          entry: Dict[str, Any]) -> None:
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([label for _, label, _ in bars], fontsize=8.5)
    ax.invert_yaxis()  # eager on top
    ax.set_xlim(0, right)
    ax.set_xlabel(xlabel, fontsize=8.5)
    ax.set_title(_subtitle(name, entry), fontsize=9.5)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.tick_params(axis="x", labelsize=8)


def step_chart(plt: Any, results: Dict[str, Any], path: str) -> None:
    models = _models(results)
    fig, axes = _grid(plt, models)
    for ax, (name, entry) in zip(axes, models):
        bars = _bars(entry)
        ms = [row["median_ms"] for _, _, row in bars]
        ax.barh(range(len(bars)), ms, color=[COLOURS[key] for key, _, _ in bars], edgecolor="black", linewidth=0.4,
                height=0.7)
        compiled = [row["median_ms"] for key, _, row in bars if key in ("regional/vanilla", "full/vanilla")]
        for i, (key, _, row) in enumerate(bars):
            label = f"{row['median_ms']:.1f} ms"
            if row.get("ratio_vs_eager_vanilla") is not None and key != "eager/vanilla":
                label += f"  {row['ratio_vs_eager_vanilla']:.3f}x eager"
            if key in ("eager/all", "graph/all") and compiled:
                label += f", {row['median_ms'] / min(compiled):.3f}x compile"
            weight = "bold" if key == "eager/all" else "normal"
            ax.annotate(label, (row["median_ms"], i), xytext=(3, 0), textcoords="offset points", ha="left",
                        va="center", fontsize=8, fontweight=weight)
        _axes(ax, bars, max(ms) * 1.75, "ms per step (median of the alternated rounds)", name, entry)
    fig.suptitle(f"Step time, batch 1: {title(results.get('versions', {}))}\n"
                 "compile = the faster compile of stock diffusers shown; tp = torchpatches", fontsize=10.5)
    fig.tight_layout(rect=(0, 0, 1, _below_title(fig)))
    fig.savefig(path, dpi=120, pil_kwargs={"optimize": True})
    plt.close(fig)


def _segments(row: Dict[str, Any]) -> Optional[Dict[str, float]]:
    profile = row.get("profile")
    if not profile:
        return None
    by_class = profile.get("ms_by_class", {})
    parts = {cls: float(by_class.get(cls, 0.0)) for cls in ("gemm", "attention", "other")}
    parts["idle"] = max(0.0, row["median_ms"] - float(profile.get("gpu_kernel_ms", sum(parts.values()))))
    return parts


def gpu_time_chart(plt: Any, results: Dict[str, Any], path: str) -> None:
    models = _models(results)
    fig, axes = _grid(plt, models)
    drawn = set()
    for ax, (name, entry) in zip(axes, models):
        bars = _bars(entry)
        ends = []
        for i, (_, _, row) in enumerate(bars):
            parts = _segments(row)
            if parts is None:
                ax.barh(i, row["median_ms"], color="white", edgecolor="grey", hatch="//", linewidth=0.6, height=0.7,
                        label="not profiled (the step)" if "none" not in drawn else None)
                drawn.add("none")
                ends.append(row["median_ms"])
                continue
            left = 0.0
            for cls, label, colour in SEGMENTS:
                ax.barh(i, parts[cls], left=left, color=colour, edgecolor="black", linewidth=0.3, height=0.7,
                        label=label if cls not in drawn else None)
                drawn.add(cls)
                left += parts[cls]
            ends.append(left)
            launches = row["profile"].get("launches_per_step")
            text = f"other {parts['other']:.1f}, idle {parts['idle']:.1f} ms"
            if launches is not None:
                text += f", {launches:.0f} launches"
            ax.annotate(text, (left, i), xytext=(3, 0), textcoords="offset points", ha="left", va="center",
                        fontsize=8)
        _axes(ax, bars, max(ends) * 1.7, "ms per step", name, entry)
    handles, labels = [], []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle(f"GPU time per step by kernel class (torch.profiler) and the rest of the step (host / idle):\n"
                 f"{title(results.get('versions', {}))}", fontsize=10.5)
    fig.tight_layout(rect=(0, 0.03, 1, _below_title(fig)))
    fig.savefig(path, dpi=120, pil_kwargs={"optimize": True})
    plt.close(fig)


def draw(results: Dict[str, Any], out_dir: str, name: Optional[str] = None) -> List[str]:
    """Both charts of ``results`` into ``out_dir`` as ``<name>-step.png`` and ``<name>-gpu-time.png`` (``name``:
    ``dit-<device>`` by default); returns their paths."""
    plt = require_matplotlib()
    if not _models(results):
        raise SystemExit("--plot: no model in the results has a measured row")
    name = name or f"dit-{device_tag(results.get('versions', {}))}"
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f"{name}-step.png"), os.path.join(out_dir, f"{name}-gpu-time.png")]
    step_chart(plt, results, paths[0])
    gpu_time_chart(plt, results, paths[1])
    return paths
