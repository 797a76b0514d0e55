"""Where ``ops.lse_merge``'s Triton kernel and diffusers' torch merge (the op's PyTorch tier) differ on CUDA, by
log-sum-exp gap.

For gaps ``lse_b - lse_a`` from -120 to 120 (both signs: which partial dominates), ``out_a`` with every other token
an exact zero (so a tiny weight is not lost against it) and random ``out_b``, fp32 out: per gap bucket the share of
output and log-sum-exp elements whose bits differ, the largest difference, and whether every differing reference
value is an fp32 subnormal (below 1.18e-38). Prints a table; ``--json`` writes it. GPU only.

    python benchmarks/lse_merge_edges.py
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional

import torch


def bucket_rows(edges: List[float], tokens: int = 64, heads: int = 4, width: int = 128) -> List[Dict[str, Any]]:
    from torchpatches.ops import lse_merge

    tiny = torch.finfo(torch.float32).tiny
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        shape = (1, tokens, heads, width)
        out_a = torch.randn(shape, device="cuda", generator=g)
        out_a[:, ::2] = 0.0
        out_b = torch.randn(shape, device="cuda", generator=g)
        lse_a = torch.randn(shape[:3], device="cuda", generator=g)
        gap = torch.linspace(lo, hi, tokens, device="cuda")[None, :, None]
        lse_b = (lse_a + gap).contiguous()
        got = lse_merge(out_a, lse_a, out_b, lse_b, tier="triton")
        want = lse_merge(out_a, lse_a, out_b, lse_b, tier="torch")  # diffusers' code (tests/ops/test_lse_merge.py)
        row: Dict[str, Any] = {"gap_from": lo, "gap_to": hi}
        for name, x, w in zip(("out", "lse"), got, want):
            differ = x != w
            row[f"{name}_differ_frac"] = float(differ.float().mean())
            row[f"{name}_max_abs"] = float((x - w).abs().max())
            row[f"{name}_all_subnormal"] = bool((w[differ].abs() < tiny).all()) if differ.any() else True
        rows.append(row)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 1
    edges = [-120, -103, -95, -87, -80, -60, -30, 0, 30, 60, 80, 87, 95, 103, 120]
    rows = bucket_rows([float(e) for e in edges])
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'gap lse_b - lse_a':>20} {'out differ':>11} {'out max':>10} {'subn.':>6} {'lse differ':>11} "
          f"{'lse max':>10} {'subn.':>6}")
    for r in rows:
        print(f"{r['gap_from']:>9.0f} .. {r['gap_to']:>6.0f} {r['out_differ_frac']:>11.4%} {r['out_max_abs']:>10.3g} "
              f"{str(r['out_all_subnormal']):>6} {r['lse_differ_frac']:>11.4%} {r['lse_max_abs']:>10.3g} "
              f"{str(r['lse_all_subnormal']):>6}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, handle,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
