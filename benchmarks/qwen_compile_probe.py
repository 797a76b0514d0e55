"""Why tests/patches/test_fused_qwenimage.py::test_compile_same_kernels_and_outputs fails on CUDA (round 10's note).

The test compiles tiny QwenImage's blocks regionally (``compile_repeated_blocks(fullgraph=True)``, fp32) twice, with
the fused patterns reverted and applied (the patterns step aside under compile: Dynamo traces diffusers' code), and
asserts equal kernel counts and bit-identical outputs. It passes on CPU; on an H100 / H200 the outputs differed by
up to 2.4e-7. This probe separates the candidate causes, in one process:

  vanilla-again   the reverted run compiled a second time: does Inductor give the same code and bits twice?
  patched         the applied run (PyTorch tier forced, as in the test): the same generated code?
  eager           the three eager models' outputs (compile off): does the eager part outside the blocks differ?

It prints, per run, the kernel count, whether the generated code equals the first run's (kernel names and
comments aside) and the largest difference of its output from the first run's; ``--json`` keeps it.

    python benchmarks/qwen_compile_probe.py --device cuda
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import re  # noqa: E402
from typing import Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402

import torchpatches  # noqa: E402
from torchpatches._harness import build_model, count_kernels, tiny_inputs  # noqa: E402
from torchpatches.ops._tiers import force_tier  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "patches"))
from _fused_models import FUSED, regional_compile_run  # noqa: E402

_NOISE = re.compile(r"#.*|'''[\s\S]*?'''|\"\"\"[\s\S]*?\"\"\"|/tmp/\S+|[a-z0-9]{52}")


def normalized(codes: List[str]) -> str:
    """The generated code without comments, docstrings, temp paths and cache hashes."""
    return "\n".join(_NOISE.sub("", code) for code in codes)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model = build_model("qwenimage-fused", device=device)
    inputs = tiny_inputs("qwenimage-fused", device=device)
    inputs.pop("return_dict", None)
    runs: Dict[str, Tuple[torch.Tensor, List[str]]] = {}
    with torchpatches.disabled(*FUSED):
        runs["vanilla"] = regional_compile_run(model, inputs)
        runs["vanilla-again"] = regional_compile_run(model, inputs)
    with force_tier("torch"):
        runs["patched"] = regional_compile_run(model, inputs)
    torch._dynamo.reset()
    with torch.no_grad():
        with torchpatches.disabled(*FUSED):
            eager_vanilla = model(**inputs, return_dict=False)[0]
        with force_tier("torch"):
            eager_patched = model(**inputs, return_dict=False)[0]
    base_out, base_codes = runs["vanilla"]
    rows = {}
    print(f"tiny qwenimage, fp32, {device}, torch {torch.__version__}")
    print(f"{'run':<15} {'kernels':>7} {'same code':>9} {'max |diff| vs vanilla':>22}")
    for name, (out, codes) in runs.items():
        row = {"kernels": count_kernels(codes), "same_code": normalized(codes) == normalized(base_codes),
               "max_diff": float((out - base_out).abs().max())}
        rows[name] = row
        print(f"{name:<15} {row['kernels']:>7} {str(row['same_code']):>9} {row['max_diff']:>22.3e}")
    rows["eager"] = {"max_diff_patched_vs_vanilla": float((eager_patched - eager_vanilla).abs().max()),
                     "max_diff_compiled_vs_eager": float((base_out - eager_vanilla).abs().max())}
    print(f"eager: patched vs vanilla {rows['eager']['max_diff_patched_vs_vanilla']:.3e}, "
          f"compiled vs eager {rows['eager']['max_diff_compiled_vs_eager']:.3e}")
    if rows["patched"]["same_code"] is False:
        a, b = normalized(base_codes).splitlines(), normalized(runs["patched"][1]).splitlines()
        import difflib

        diff = list(difflib.unified_diff(a, b, "vanilla", "patched", n=1, lineterm=""))
        rows["code_diff"] = diff[:200]
        print("\n".join(diff[:60]))
    _bench.save_json(args.json, {"command": _bench.command_line(argv), "versions": _bench.versions(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
