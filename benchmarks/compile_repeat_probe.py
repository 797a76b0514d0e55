"""Does an Inductor compile of a tiny model give the same bits twice, and with the fused patches applied?

The compile checks of the fused patterns (``tests/patches/test_fused_patches.py``, ``test_fused_qwenimage.py``:
``test_compile_same_kernels_and_outputs``) compile a tiny model with the patterns disabled, then applied (they step
aside while Dynamo traces), and assert the same kernel count and the same output bit for bit. On a GPU, Inductor
times several configs of a reduction at its first run and keeps the fastest, so two compiles of one graph may sum
in another order (issue 17 round 13; round 10's CUDA-only QwenImage failure). This probe compiles the same model
three times (patterns off, off again, on), each from scratch (no FX graph cache), and prints, per pair, whether the
generated code is the same (:func:`normalized`: without comments, temp paths and hashes), the kernel counts and
whether the outputs are equal (max abs difference); for each model and ids dtype given. Then the eager outputs:
patterns on against off, and the first compile against eager. Where the patterns' code differs, the diff.

``--regional``: the repeated blocks compiled (diffusers' ``compile_repeated_blocks(fullgraph=True)``, as the
QwenImage check does) instead of the whole model (``torch.compile(fullgraph=True)``). ``--deterministic``: Inductor's
``deterministic`` mode (what the tests use on a GPU), to see the differences go. (Round 10's raw file came from
``qwen_compile_probe.py``, now this probe's ``--models qwenimage-fused --regional``; round 13's first file from a
version that compared the raw code, always unequal.)

    python benchmarks/compile_repeat_probe.py --models flux2 --device cuda --json probe.json
    python benchmarks/compile_repeat_probe.py --models qwenimage-fused --regional --ids float32 --device cuda
    python benchmarks/compile_repeat_probe.py --models flux2 --ids float32,int64      # CPU
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import difflib  # noqa: E402
import re  # noqa: E402
from typing import Any, Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402

import torchpatches  # noqa: E402
from torchpatches import testing  # noqa: E402
from harness import count_kernels  # noqa: E402
from torchpatches.ops import force_tier  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "patches"))
from _fused_models import FUSED, regional_compile_run  # noqa: E402

_NOISE = re.compile(r"#.*|'''[\s\S]*?'''|\"\"\"[\s\S]*?\"\"\"|/tmp/\S+|[a-z0-9]{52}")
RUNS = (("off", "off again"), ("off", "on"), ("off again", "on"))


def normalized(codes: List[str]) -> str:
    """The generated code without comments, docstrings, temp paths and cache hashes."""
    return "\n".join(_NOISE.sub("", code) for code in codes)


def compile_once(model: torch.nn.Module, inputs: Dict[str, Any], regional: bool) -> Tuple[torch.Tensor, List[str]]:
    """One fresh compile (Dynamo reset, no FX graph cache): the output and the generated code."""
    from torch._inductor.utils import run_and_get_code

    if regional:
        return regional_compile_run(model, inputs, repeatable=False)
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        return run_and_get_code(lambda: compiled(**inputs, return_dict=False)[0])


def probe(which: str, ids_dtype: str, device: torch.device, regional: bool) -> Dict[str, Any]:
    model = testing.build_model(which, device=device)
    inputs = testing.tiny_inputs(which, device=device)
    for key in ("img_ids", "txt_ids"):
        if key in inputs:
            inputs[key] = inputs[key].to(getattr(torch, ids_dtype))
    inputs.pop("return_dict", None)
    runs = {}
    with torchpatches.disabled(*FUSED):
        runs["off"] = compile_once(model, inputs, regional)
        runs["off again"] = compile_once(model, inputs, regional)
    with force_tier("torch"):
        runs["on"] = compile_once(model, inputs, regional)
    torch._dynamo.reset()
    with torch.no_grad():
        with torchpatches.disabled(*FUSED):
            eager_off = model(**inputs, return_dict=False)[0]
        with force_tier("torch"):
            eager_on = model(**inputs, return_dict=False)[0]
    rows = []
    for a, b in RUNS:
        (out_a, codes_a), (out_b, codes_b) = runs[a], runs[b]
        diff = (out_a - out_b).abs().max().item()
        rows.append({"pair": f"{a} / {b}", "same_code": normalized(codes_a) == normalized(codes_b),
                     "kernels": (count_kernels(codes_a), count_kernels(codes_b)),
                     "equal_outputs": diff == 0.0, "max_abs_diff": diff})
    result = {"model": which, "ids": ids_dtype, "device": str(device), "regional": regional, "rows": rows,
              "eager_on_vs_off": (eager_on - eager_off).abs().max().item(),
              "compiled_vs_eager": (runs["off"][0] - eager_off).abs().max().item()}
    if not rows[1]["same_code"]:
        result["code_diff"] = list(difflib.unified_diff(normalized(runs["off"][1]).splitlines(),
                                                        normalized(runs["on"][1]).splitlines(), "off", "on", n=1,
                                                        lineterm=""))[:200]
    return result


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="flux2",
                   help="comma-separated harness configs (flux1, flux2, qwenimage-fused...)")
    p.add_argument("--ids", default="float32,int64", help="comma-separated dtypes of the position ids (FLUX)")
    p.add_argument("--regional", action="store_true", help="compile the repeated blocks only")
    p.add_argument("--deterministic", action="store_true", help="Inductor's deterministic mode (torch >= 2.11)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    args = p.parse_args(argv)
    results = {"command": _bench.command_line(argv), "versions": _bench.versions(), "probes": []}
    with torch._inductor.config.patch(deterministic=True) if args.deterministic else contextlib.nullcontext():
        for which in args.models.split(","):
            for ids in args.ids.split(","):
                result = probe(which, ids, torch.device(args.device), args.regional)
                results["probes"].append(result)
                for row in result["rows"]:
                    print(f"{which:8} ids {ids:8} {row['pair']:18} code equal {row['same_code']!s:5} "
                          f"kernels {row['kernels']} outputs equal "
                          f"{row['equal_outputs']!s:5} max |diff| {row['max_abs_diff']:.3e}", flush=True)
                print(f"{which:8} ids {ids:8} eager on / off max |diff| {result['eager_on_vs_off']:.3e}, compiled / "
                      f"eager {result['compiled_vs_eager']:.3e}", flush=True)
                print("\n".join(result.get("code_diff", [])[:60]))
    if args.json:
        _bench.save_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
