"""Host time of diffusers' per-forward LoRA scale walk: ``scale_lora_layers`` + ``unscale_lora_layers``.

A forward given ``joint_attention_kwargs={"scale": s}`` (s != 1) runs both once. This times the pair on FLUX.1's
module tree (19 + 38 blocks, the tiny widths: the walk depends on the modules, not their sizes) with
``flux_lora.py``'s adapters in each case's state, diffusers' functions (``lora_scale`` reverted) and the patched
ones alternated A B A B in one process: median wall microseconds per pair over ``--repeats`` batches. The host
CPU is what it measures; the model stays on the CPU.

    python benchmarks/lora_scale.py --json lora-scale.json
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402,I001

import torch  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    import diffusers.utils.peft_utils as peft_utils
    import flux_lora
    from _dit_models import SPECS, tiny_config

    import torchpatches

    config = dict(tiny_config("flux1"), num_layers=19, num_single_layers=38)
    model = _bench.build(SPECS["flux1"].cls_name, config, torch.device("cpu"), torch.float32)
    results: Dict[str, Any] = {"versions": _bench.versions(), "command": _bench.command_line(argv), "cases": {}}
    print(f"{'case':<8}{'modules':>8}{'layers':>8}{'diffusers us':>14}{'patched us':>12}{'ratio':>8}")

    def pair() -> None:
        peft_utils.scale_lora_layers(model, 0.8)
        peft_utils.unscale_lora_layers(model, 0.8)

    for name, setup, _ in flux_lora.cases(model, 4):
        setup()
        model.eval()
        row: Dict[str, Any] = {"modules": sum(1 for _ in model.modules()),
                               "layers": sum(1 for m in model.modules() if hasattr(m, "scale_layer"))}
        for variant in ("vanilla", "all", "vanilla+", "all+"):
            with _bench.state(variant):
                row[variant] = _bench.host_us_per_call(pair, args.batch, args.repeats, lambda: None)
        row["diffusers_us"] = min(row["vanilla"], row["vanilla+"])
        row["patched_us"] = min(row["all"], row["all+"])
        results["cases"][name] = row
        print(f"{name:<8}{row['modules']:>8}{row['layers']:>8}{row['diffusers_us']:>14.0f}{row['patched_us']:>12.0f}"
              f"{row['patched_us'] / row['diffusers_us']:>8.3f}", flush=True)
    _bench.save_json(args.json, results)
    print(torchpatches.status()["lora_scale"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
