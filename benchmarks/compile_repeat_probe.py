"""Does a fullgraph Inductor compile of a tiny model give the same bits twice, and with the fused patches applied?

``tests/patches/test_fused_patches.py::test_compile_same_kernels_and_outputs`` compiles a tiny model with the fused
patterns disabled, then applied (they step aside while Dynamo traces), and asserts the same kernel count and the
same output bit for bit. On a GPU, Inductor benchmarks several configs of a reduction at its first run and keeps
the fastest, so two compiles of one graph may sum in another order. This probe compiles the same model three times
(patterns off, off again, on), each from scratch (no FX graph cache), and prints, per pair, whether the generated
code is the same (``qwen_compile_probe.normalized``: without comments, temp paths and hashes), the kernel counts
and whether the outputs are equal (max abs difference), for each ids dtype given. (The raw file of round 13 came
from a first version that compared the raw code, always unequal, and kernel names.)

    python benchmarks/compile_repeat_probe.py --models flux2 --device cuda --json probe.json
    python benchmarks/compile_repeat_probe.py --models flux2 --ids float,int64      # CPU
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402

import torchpatches  # noqa: E402
from qwen_compile_probe import normalized  # noqa: E402  (the same code comparison, for a regional compile)
from torchpatches import testing  # noqa: E402
from torchpatches._harness import count_kernels  # noqa: E402
from torchpatches.ops._tiers import force_tier  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "patches"))
from _fused_models import FUSED  # noqa: E402


def compile_once(model: torch.nn.Module, inputs: Dict[str, Any]) -> Dict[str, Any]:
    """One fresh fullgraph compile (Dynamo reset, no FX graph cache; Inductor's default choices, timed ones included:
    what the probe looks at): the output, the generated code without comments, paths and hashes, its kernels."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        out, codes = run_and_get_code(lambda: compiled(**inputs, return_dict=False)[0])
    return {"out": out.float().cpu(), "code": normalized(codes), "kernels": count_kernels(codes)}


def probe(which: str, ids_dtype: str, device: torch.device) -> Dict[str, Any]:
    model = testing.build_model(which, device=device)
    inputs = testing.tiny_inputs(which, device=device)
    for key in ("img_ids", "txt_ids"):
        if key in inputs:
            inputs[key] = inputs[key].to(getattr(torch, ids_dtype))
    inputs.pop("return_dict", None)
    runs = {}
    with torchpatches.disabled(*FUSED):
        runs["off"] = compile_once(model, inputs)
        runs["off again"] = compile_once(model, inputs)
    with force_tier("torch"):
        runs["on"] = compile_once(model, inputs)
    rows = []
    for a, b in (("off", "off again"), ("off", "on"), ("off again", "on")):
        diff = (runs[a]["out"] - runs[b]["out"]).abs().max().item()
        rows.append({"pair": f"{a} / {b}", "same_code": runs[a]["code"] == runs[b]["code"],
                     "kernels": (runs[a]["kernels"], runs[b]["kernels"]),
                     "equal_outputs": diff == 0.0, "max_abs_diff": diff})
    return {"model": which, "ids": ids_dtype, "device": str(device), "rows": rows}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="flux2")
    p.add_argument("--ids", default="float32,int64", help="comma-separated dtypes of the position ids")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    args = p.parse_args(argv)
    results = {"versions": _bench.versions(), "probes": []}
    for which in args.models.split(","):
        for ids in args.ids.split(","):
            result = probe(which, ids, torch.device(args.device))
            results["probes"].append(result)
            for row in result["rows"]:
                print(f"{which:8} ids {ids:8} {row['pair']:18} code equal {row['same_code']!s:5} "
                      f"kernels {row['kernels']} outputs equal "
                      f"{row['equal_outputs']!s:5} max |diff| {row['max_abs_diff']:.3e}", flush=True)
    if args.json:
        _bench.save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
