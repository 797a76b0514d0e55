"""Host microseconds of one fused-op call, layer by layer, against plain torch calls on the same host.

For ``ops.layer_norm_modulate`` at a tiny shape (the kernel takes a few microseconds on the GPU, so
a batch's wall time is host time): the public entry (argument checks, tier choice, output allocation, the
Triton launch through ``ops._runtime.launch``), its ``prechecked`` entry (what the fusion patterns call after their
own checks), the Triton tier's ``launch`` called directly with prepared tensors,
``torch.empty`` of the output and ``x + 1`` for scale, and the helper the adaln pattern calls (its checks, then
the op); medians of ``--repeats`` batches of ``--batch`` calls.
Then cProfile over ``--profile-calls`` entry calls: the top functions by self time, per call.

``--python-only`` (any machine, no GPU): the same calls on CPU tensors with the Triton tier forced and the
kernel launch replaced by a no-op, so what is timed is the Python from the entry to the launch (and a CPU
``torch.empty``); best of repeats, for A/B of two trees on a quiet machine (``PYTHONPATH=TREE``).

    python benchmarks/op_host_cost.py [--json out.json]      # GPU
    python benchmarks/op_host_cost.py --python-only          # CPU
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from _bench import host_us_per_call, stubbed_launches


def python_only(repeats: int) -> List[Dict[str, Any]]:
    """Best-of-``repeats`` microseconds of each modulate entry's Python (CPU tensors, launch stubbed)."""
    import timeit

    from torchpatches.ops import _modulate as modulate
    from torchpatches.ops import force_tier

    x, y = torch.randn(1, 16, 64, dtype=torch.bfloat16), torch.randn(1, 16, 64, dtype=torch.bfloat16)
    v, g = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(1, 64, dtype=torch.bfloat16)
    from torchpatches.patches import _modulate_calls as helpers

    norm = torch.nn.LayerNorm(64, elementwise_affine=False, eps=1e-6)
    calls: Dict[str, Callable[[], Any]] = {
        "layer_norm_modulate ([B, D] vectors)": lambda: modulate.layer_norm_modulate(x, v, v),
        "gate_residual_layer_norm_modulate": lambda: modulate.gate_residual_layer_norm_modulate(x, g, y, v, v),
        "gate_residual": lambda: modulate.gate_residual(x, g, y),
        # The entry the patterns call once their checks passed.
        "prechecked (norm + modulate)": lambda: modulate.prechecked(x, None, None, v, v, 1e-6),
        "prechecked (gate + residual + norm + modulate)": lambda: modulate.prechecked(x, g, y, v, v, 1e-6),
        # What the adaln / gate_residual patterns call: their own checks, then the op.
        "patterns: modulated (adaln)": lambda: helpers.modulated(norm, x, v, v, fuse=True),
        "patterns: residual_modulated": lambda: helpers.residual_modulated(norm, x, g, y, v, v, fuse=True),
        "patterns: residual": lambda: helpers.residual(x, g, y, clip=False),
    }
    rows = []
    with force_tier("triton"), stubbed_launches():
        for name, fn in calls.items():
            fn()
            best = min(timeit.repeat(fn, number=3000, repeat=repeats)) / 3000 * 1e6
            rows.append(dict(call=name, host_us=best))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--profile-calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--python-only", action="store_true", help="CPU: the entries' Python, launch stubbed")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.python_only:
        rows = python_only(max(args.repeats, 9))
        print("Python from the entry to the launch (CPU tensors, Triton tier forced, launch stubbed), best us:")
        for r in rows:
            print(f"  {r['call']:<52}{r['host_us']:>9.2f}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(dict(machine="cpu", torch=torch.__version__, rows=rows), handle, indent=2)
        return 0
    from torchpatches.ops import _modulate_triton, _modulate as modulate

    x = torch.randn(1, 16, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)  # [B, D], as FLUX's adaLN chunks are
    v3, out = v.unsqueeze(1), torch.empty_like(x)
    calls: Dict[str, Callable[[], Any]] = {
        "ops.layer_norm_modulate (public entry)": lambda: modulate.layer_norm_modulate(x, v, v),
        "_modulate_triton.launch (kernel tier, prepared)": lambda: _modulate_triton.launch(
            x, None, None, v3, v3, None, out, eps=1e-6, clip=False),
        "ops.prechecked (what the patterns call)": lambda: modulate.prechecked(x, None, None, v, v, 1e-6),
        "torch.empty (the output)": lambda: torch.empty(x.shape, dtype=x.dtype, device=x.device),
        "x + 1 (one torch op)": lambda: x + 1,
    }
    from torchpatches.patches import _modulate_calls as helpers

    norm = torch.nn.LayerNorm(64, elementwise_affine=False, eps=1e-6)
    calls["patterns: modulated (what adaln calls)"] = lambda: helpers.modulated(norm, x, v, v, fuse=True)
    for fn in calls.values():
        fn()
    rows = [dict(call=name, host_us=host_us_per_call(fn, args.batch, args.repeats, torch.cuda.synchronize))
            for name, fn in calls.items()]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.profile_calls):
        modulate.layer_norm_modulate(x, v, v)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    top = sorted(((tt * 1e6 / args.profile_calls, nc / args.profile_calls, ct * 1e6 / args.profile_calls,
                   f"{fn.rsplit('site-packages/', 1)[-1]}:{line} {name}")
                  for (fn, line, name), (_, nc, tt, ct, _) in stats.items()), reverse=True)[:args.top]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call, median of "
          f"{args.repeats} batches of {args.batch}")
    for r in rows:
        print(f"  {r['call']:<52}{r['host_us']:>9.1f}")
    print(f"\ncProfile, {args.profile_calls} public-entry calls; per call: self us, calls, cumulative us")
    for self_us, ncalls, cum_us, where in top:
        print(f"  {self_us:8.2f}{ncalls:6.1f}{cum_us:9.2f}  {where[:110]}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, top=top), handle,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
