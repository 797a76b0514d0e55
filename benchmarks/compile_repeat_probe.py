"""Does a fullgraph Inductor compile of a tiny model give the same bits twice, and with the fused patches applied?

``tests/patches/test_fused_patches.py::test_compile_same_kernels_and_outputs`` compiles a tiny model with the fused
patterns disabled, then applied (they step aside while Dynamo traces), and asserts the same kernel count and the
same output bit for bit. On a GPU, Inductor benchmarks several configs of a reduction at its first run and keeps
the fastest, so two compiles of one graph may sum in another order. This probe compiles the same model three times
(patterns off, off again, on), each from scratch (no FX graph cache), and prints, per pair, whether the generated
kernels have the same names and the outputs are equal (max abs difference), for each ids dtype given. (The raw
file of round 13 also has a "code equal" column, always False: the generated code carries paths and times.)

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
import re  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402

import torchpatches  # noqa: E402
from torchpatches import testing  # noqa: E402
from torchpatches.ops._tiers import force_tier  # noqa: E402


#: the eager fusion patterns (tests/patches/_fused_models.py's FUSED)
FUSED = ("adaln", "qk_norm_rope", "gate_residual", "gelu_gemm", "swiglu", "rope_tables", "sd3_qk_norm", "sd3_block",
         "wan_block", "wan_qk_norm_rope", "qwenimage_block", "qwenimage_qk_norm_rope")


def compile_once(model: torch.nn.Module, inputs: Dict[str, Any]) -> Dict[str, Any]:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        out, codes = run_and_get_code(lambda: compiled(**inputs, return_dict=False)[0])
    code = "\n".join(codes)
    # kernel names carry a hash of their source: the same names, the same kernels
    names = sorted(set(re.findall(r"\b(triton_\w+|cpp_fused_\w+)\b", code)))
    return {"out": out.float().cpu(), "code": code, "kernels": names}


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
        rows.append({"pair": f"{a} / {b}", "same_kernel_names": runs[a]["kernels"] == runs[b]["kernels"],
                     "kernels": (len(runs[a]["kernels"]), len(runs[b]["kernels"])),
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
                print(f"{which:8} ids {ids:8} {row['pair']:18} kernel names equal "
                      f"{row['same_kernel_names']!s:5} kernels {row['kernels']} outputs equal "
                      f"{row['equal_outputs']!s:5} max |diff| {row['max_abs_diff']:.3e}", flush=True)
    if args.json:
        _bench.save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
