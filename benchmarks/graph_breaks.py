"""Graph breaks of tiny diffusers transformers under torch.compile, before and after `compile_warnings`.

Prints the README table: model x argument form -> graphs / graph breaks / whether `fullgraph=True`
compiles, with the patch reverted ("before") and applied ("after"). CPU only, tiny configs, Dynamo
with the `eager` backend (graph breaks do not depend on the backend).

    python benchmarks/graph_breaks.py                 # the table
    python benchmarks/graph_breaks.py --json out.json # and the rows as JSON
    python benchmarks/graph_breaks.py --model flux    # one model

The test suite (tests/patches/test_compile_warnings.py) imports CASES from this file, so the table
and the tests measure the same programs.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch


@dataclasses.dataclass(frozen=True)
class Case:
    """One model in one argument form."""

    model: str
    form: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], Dict[str, Any]]
    attn_checks: bool = False  # run with diffusers' DIFFUSERS_ATTN_CHECKS switched on
    note: str = ""


# ---- tiny models -----------------------------------------------------------------------------


def _flux() -> torch.nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
        axes_dims_rope=(4, 4, 8),
    ).eval()


def _flux_inputs(ids_3d: bool = False, **attn: Any) -> Callable[[], Dict[str, Any]]:
    def make() -> Dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        img_ids, txt_ids = torch.randn(16, 3, generator=gen), torch.zeros(8, 3)
        kwargs: Dict[str, Any] = dict(
            hidden_states=torch.randn(1, 16, 4, generator=gen),
            encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
            pooled_projections=torch.randn(1, 32, generator=gen),
            timestep=torch.tensor([0.5]),
            img_ids=img_ids[None] if ids_3d else img_ids,
            txt_ids=txt_ids[None] if ids_3d else txt_ids,
            return_dict=False,
        )
        if attn:
            kwargs["joint_attention_kwargs"] = dict(attn)
        return kwargs

    return make


def _flux2() -> torch.nn.Module:
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    ).eval()


def _flux2_inputs(**attn: Any) -> Callable[[], Dict[str, Any]]:
    def make() -> Dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        kwargs: Dict[str, Any] = dict(
            hidden_states=torch.randn(1, 16, 4, generator=gen),
            encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
            timestep=torch.tensor([0.5]),
            img_ids=torch.randn(1, 16, 4, generator=gen),
            txt_ids=torch.zeros(1, 8, 4),
            return_dict=False,
        )
        if attn:
            kwargs["joint_attention_kwargs"] = dict(attn)
        return kwargs

    return make


def _sd3() -> torch.nn.Module:
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=8,
    ).eval()


def _sd3_inputs(**attn: Any) -> Callable[[], Dict[str, Any]]:
    def make() -> Dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        kwargs: Dict[str, Any] = dict(
            hidden_states=torch.randn(1, 4, 8, 8, generator=gen),
            encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
            pooled_projections=torch.randn(1, 32, generator=gen),
            timestep=torch.tensor([500]),
            return_dict=False,
        )
        if attn:
            kwargs["joint_attention_kwargs"] = dict(attn)
        return kwargs

    return make


def _qwen() -> torch.nn.Module:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    ).eval()


def _qwen_inputs(**attn: Any) -> Callable[[], Dict[str, Any]]:
    def make() -> Dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        kwargs: Dict[str, Any] = dict(
            hidden_states=torch.randn(1, 16, 16, generator=gen),
            encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
            encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long),
            timestep=torch.tensor([0.5]),
            img_shapes=[[(1, 4, 4)]],
            return_dict=False,
        )
        if attn:
            kwargs["attention_kwargs"] = dict(attn)
        return kwargs

    return make


def _wan() -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    ).eval()


def _wan_inputs(**attn: Any) -> Callable[[], Dict[str, Any]]:
    def make() -> Dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        kwargs: Dict[str, Any] = dict(
            hidden_states=torch.randn(1, 4, 2, 8, 8, generator=gen),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
            return_dict=False,
        )
        if attn:
            kwargs["attention_kwargs"] = dict(attn)
        return kwargs

    return make


def _hunyuan() -> torch.nn.Module:
    from diffusers import HunyuanVideoTransformer3DModel

    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4),
    ).eval()


def _hunyuan_inputs(**attn: Any) -> Callable[[], Dict[str, Any]]:
    def make() -> Dict[str, Any]:
        gen = torch.Generator().manual_seed(1)
        kwargs: Dict[str, Any] = dict(
            hidden_states=torch.randn(1, 4, 1, 4, 4, generator=gen),
            timestep=torch.tensor([500]),
            encoder_hidden_states=torch.randn(1, 6, 16, generator=gen),
            encoder_attention_mask=torch.ones(1, 6),
            pooled_projections=torch.randn(1, 8, generator=gen),
            guidance=torch.tensor([3500.0]),
            return_dict=False,
        )
        if attn:
            kwargs["attention_kwargs"] = dict(attn)
        return kwargs

    return make


def _feed_forward() -> torch.nn.Module:
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    return FeedForward(16, mult=2, activation_fn="gelu-approximate").eval()


def _feed_forward_inputs() -> Dict[str, Any]:
    return dict(hidden_states=torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(1)), scale=0.5)


CASES: List[Case] = [
    Case("flux", "2-D ids", _flux, _flux_inputs()),
    Case("flux", "3-D ids", _flux, _flux_inputs(ids_3d=True)),
    Case("flux", "unknown attn kwarg", _flux, _flux_inputs(foo=1)),
    Case("flux", "scale, no PEFT", _flux, _flux_inputs(scale=0.5)),
    Case("flux", "DIFFUSERS_ATTN_CHECKS=1", _flux, _flux_inputs(), attn_checks=True),
    Case("flux2", "3-D ids", _flux2, _flux2_inputs()),
    Case("flux2", "unknown attn kwarg", _flux2, _flux2_inputs(foo=1)),
    Case("flux2", "scale, no PEFT", _flux2, _flux2_inputs(scale=0.5)),
    Case("sd3", "default", _sd3, _sd3_inputs()),
    Case("sd3", "unknown attn kwarg", _sd3, _sd3_inputs(foo=1)),
    Case("sd3", "scale, no PEFT", _sd3, _sd3_inputs(scale=0.5)),
    Case("qwenimage", "default", _qwen, _qwen_inputs()),
    Case("qwenimage", "scale, no PEFT", _qwen, _qwen_inputs(scale=0.5)),
    Case("wan", "default", _wan, _wan_inputs()),
    Case("wan", "scale, no PEFT", _wan, _wan_inputs(scale=0.5)),
    Case("hunyuanvideo", "default", _hunyuan, _hunyuan_inputs()),
    Case("hunyuanvideo", "scale, no PEFT", _hunyuan, _hunyuan_inputs(scale=0.5)),
    Case("FeedForward", "scale= (deprecate)", _feed_forward, _feed_forward_inputs),
]


# ---- measuring -------------------------------------------------------------------------------


@contextlib.contextmanager
def attn_checks(enabled: bool) -> Iterator[None]:
    """Switch diffusers' attention checks (read from DIFFUSERS_ATTN_CHECKS at import) for a block."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._checks_enabled
    _AttentionBackendRegistry._checks_enabled = enabled
    try:
        yield
    finally:
        _AttentionBackendRegistry._checks_enabled = before


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the models' own warnings and Dynamo's graph-break chatter while measuring."""
    loggers = [logging.getLogger(name) for name in ("diffusers", "torch._dynamo", "torch._inductor")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def explain_counts(model: torch.nn.Module, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """graphs / graph breaks from torch._dynamo.explain, and whether fullgraph=True compiles."""
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(model)(**kwargs)
    except Exception as exc:  # noqa: BLE001 - a hard Dynamo error is a result too (2.11 attn checks)
        torch._dynamo.reset()
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return {"graphs": None, "breaks": None, "fullgraph": False, "reasons": [error], "fullgraph_error": error}
    reasons = sorted({str(r.reason).splitlines()[0][:90] for r in explanation.break_reasons})
    torch._dynamo.reset()
    try:
        torch.compile(model, backend="eager", fullgraph=True)(**kwargs)
        fullgraph, error = True, ""
    except Exception as exc:  # noqa: BLE001 - any failure means fullgraph does not compile
        fullgraph, error = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    torch._dynamo.reset()
    return {
        "graphs": explanation.graph_count,
        "breaks": explanation.graph_break_count,
        "fullgraph": fullgraph,
        "reasons": reasons,
        "fullgraph_error": error,
    }


def measure(case: Case) -> Dict[str, Any]:
    import torchpatches

    model = case.build()
    row: Dict[str, Any] = {"model": case.model, "form": case.form}
    with quiet(), attn_checks(case.attn_checks), torch.no_grad():
        with torchpatches.disabled("compile_warnings"):
            row["before"] = explain_counts(model, case.inputs())
        row["after"] = explain_counts(model, case.inputs())
    row["patch_state"] = str(torchpatches.status()["compile_warnings"].state)
    return row


def format_table(rows: List[Dict[str, Any]]) -> str:
    def cell(m: Dict[str, Any]) -> str:
        if m["graphs"] is None:
            return "compile error"
        return f"{m['graphs']} / {m['breaks']} / {'yes' if m['fullgraph'] else 'no'}"

    header = "| model | argument form | before: graphs / breaks / fullgraph | after: graphs / breaks / fullgraph |"
    lines = [header, "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['form']} | {cell(r['before'])} | {cell(r['after'])} |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows (with break reasons) to this file")
    parser.add_argument("--model", action="append", help="only these models (repeatable)")
    parser.add_argument("--reasons", action="store_true", help="print the break reasons under the table")
    args = parser.parse_args(argv)

    import diffusers

    cases = [c for c in CASES if not args.model or c.model in args.model]
    rows = [measure(case) for case in cases]
    print(f"torch {torch.__version__}, diffusers {diffusers.__version__}, python {sys.version.split()[0]}")
    print(format_table(rows))
    if args.reasons:
        for r in rows:
            for when in ("before", "after"):
                for reason in r[when]["reasons"]:
                    print(f"  {r['model']} / {r['form']} / {when}: {reason}")
                if r[when]["fullgraph_error"]:
                    print(f"  {r['model']} / {r['form']} / {when} fullgraph: {r[when]['fullgraph_error']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"torch": torch.__version__, "diffusers": diffusers.__version__, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHDYNAMO_VERBOSE", "0")
    sys.exit(main())
