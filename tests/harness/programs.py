"""Programs measured by tests and benchmarks alike: :data:`GRAPH_BREAK_CASES` (``compile_warnings``,
benchmarks/graph_breaks.py) and :data:`REALIZE_PROGRAMS` (``inductor_realize``, benchmarks/inductor_realize.py)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Tuple

import torch

from harness import build_model, tiny_inputs

__all__ = ["GraphBreakCase", "GRAPH_BREAK_CASES", "Program", "REALIZE_PROGRAMS"]


class GraphBreakCase:
    """One tiny model called in one argument form (the README's graph-break table, ``compile_warnings``)."""

    def __init__(self, model: str, form: str, *, attn_checks: bool = False, **options: Any) -> None:
        self.model, self.form, self.attn_checks, self.options = model, form, attn_checks, options

    def build(self) -> torch.nn.Module:
        return build_model(self.model)

    def inputs(self) -> Dict[str, Any]:
        return tiny_inputs(self.model, **self.options)

    def __repr__(self) -> str:
        return f"GraphBreakCase({self.model!r}, {self.form!r})"


GRAPH_BREAK_CASES: Tuple[GraphBreakCase, ...] = (
    GraphBreakCase("flux1", "2-D ids"),
    GraphBreakCase("flux1", "3-D ids", ids_3d=True),
    GraphBreakCase("flux1", "unknown attn kwarg", attention_kwargs={"foo": 1}),
    GraphBreakCase("flux1", "scale, no PEFT", attention_kwargs={"scale": 0.5}),
    GraphBreakCase("flux1", "DIFFUSERS_ATTN_CHECKS=1", attn_checks=True),
    GraphBreakCase("flux2", "3-D ids"),
    GraphBreakCase("flux2", "unknown attn kwarg", attention_kwargs={"foo": 1}),
    GraphBreakCase("flux2", "scale, no PEFT", attention_kwargs={"scale": 0.5}),
    GraphBreakCase("sd3", "default"),
    GraphBreakCase("sd3", "unknown attn kwarg", attention_kwargs={"foo": 1}),
    GraphBreakCase("sd3", "scale, no PEFT", attention_kwargs={"scale": 0.5}),
    GraphBreakCase("qwenimage", "default"),
    GraphBreakCase("qwenimage", "scale, no PEFT", attention_kwargs={"scale": 0.5}),
    GraphBreakCase("wan", "default"),
    GraphBreakCase("wan", "scale, no PEFT", attention_kwargs={"scale": 0.5}),
    GraphBreakCase("hunyuanvideo", "default"),
    GraphBreakCase("hunyuanvideo", "scale, no PEFT", attention_kwargs={"scale": 0.5}),
    GraphBreakCase("feedforward", "scale= (deprecate)", scale=0.5),
    # Sites covered since the whole-diffusers scan, one case per kind of site:
    GraphBreakCase("chroma", "3-D ids", ids_3d=True),  # logger.warning in a model forward
    GraphBreakCase("chroma", "scale, no PEFT", attention_kwargs={"scale": 0.5}),  # @apply_lora_scale wrapper
    GraphBreakCase("auraflow", "scale, no PEFT", attention_kwargs={"scale": 0.5}),
    GraphBreakCase("ovis", "unknown attn kwarg", attention_kwargs={"foo": 1}),  # "not expected by" in attention
    GraphBreakCase("qwenimage", "mixed image sizes", mixed_sizes=True),  # logger.warning in a RoPE module
    GraphBreakCase("pixart", "default"),
    GraphBreakCase("pixart", "scale (deprecated)", attention_kwargs={"scale": 0.5}),  # model, block and Attention
    GraphBreakCase("dreamlite", "default (return_dict=True)"),  # deprecate() in an output class's __init__
)


Args = Tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """A function and its arguments, built on a device (``inductor_realize``'s programs)."""

    name: str
    build: Callable[[torch.device], Tuple[Callable[..., Any], Args]]
    note: str


def _rms(h: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def residual_chain(x: torch.Tensor, ys: List[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """A residual stream: every ``x + y`` has 2 reads and 3 users (pow, mul, next add).

    torch 2.11's rule (2 reads <= 4) inlines each sum into all of its users, so the chain is
    recomputed again and again; the byte rule (2 reads * 2 >= 1 output * 4) realizes it.
    """
    outs = []
    for y in ys:
        x = x + y
        outs.append(_rms(x))
    return (x, *outs)


def norm_qkv(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """An RMSNorm output read by three matmuls: the matmuls need it realized whatever the rule says."""
    n = _rms(x) * w
    return n @ wq, n @ wk, n @ wv


def flip_to_realize(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``a + b`` (2 full reads) used by 3 reductions: 2.11's rule inlines it, the byte rule realizes it."""
    h = a + b
    return h.sum(0), h.sum(1), h.amax(0)


def flip_to_inline(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor, r: torch.Tensor, s: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """5 reads, but 4 are broadcast rows: 2.11's rule realizes (5 > 4), the byte rule inlines (bytes ~ output)."""
    h = x + p + q + r + s
    return h.sum(-1), h.amax(0)


def cpu_heavy_op(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``exp`` reused twice: both rules realize it on CPU (the heavy-op rule the patch keeps)."""
    h = (a + b).exp()
    return h.sum(0), h.sum(1)


def _random_args(fn: Callable[..., Any], *shapes: Any) -> Callable[[torch.device], Tuple[Callable[..., Any], Args]]:
    """A Program builder: ``fn`` with seeded random tensors of ``shapes`` (a list of shapes: a list of tensors)."""

    def build(device: torch.device) -> Tuple[Callable[..., Any], Args]:
        generator = torch.Generator().manual_seed(0)

        def make(shape: Any) -> Any:
            if isinstance(shape, list):
                return [make(s) for s in shape]
            return torch.randn(*shape, generator=generator).to(device)

        return fn, tuple(make(shape) for shape in shapes)

    return build


def _flux1_program(device: torch.device) -> Tuple[Callable[..., Any], Args]:
    model = build_model("flux1", device=device)
    inputs = tiny_inputs("flux1", device=device)
    names = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids")

    def flux_tiny(*tensors: torch.Tensor) -> torch.Tensor:
        return model(**dict(zip(names, tensors)), return_dict=False)[0]

    return flux_tiny, tuple(inputs[name] for name in names)


REALIZE_PROGRAMS: Dict[str, Program] = {
    program.name: program
    for program in (
        Program("residual_chain", _random_args(residual_chain, (64, 256), [(64, 256)] * 4), "x+y, 3 users, 4 layers"),
        Program("norm_qkv", _random_args(norm_qkv, (32, 128), (128,), (128, 128), (128, 128), (128, 128)), "norm -> 3 matmuls"),
        Program("flip_to_realize", _random_args(flip_to_realize, (128, 128), (128, 128)), "orig inlines, patch realizes"),
        Program("flip_to_inline", _random_args(flip_to_inline, (128, 128), (128,), (128,), (128,), (128,)), "orig realizes, patch inlines"),
        Program("cpu_heavy_op", _random_args(cpu_heavy_op, (128, 128), (128, 128)), "exp reused: both realize"),
        Program("flux_tiny", _flux1_program, "FluxTransformer2DModel 'flux1', 1+1 blocks"),
    )
}  # fmt: skip
