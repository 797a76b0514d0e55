"""The harness shared by the tests, the benchmarks and ``python -m torchpatches demo``.

- tiny diffusers models by name (:data:`CONFIGS`, :func:`build_model`) and their inputs
  (:func:`tiny_inputs`): FLUX.1, FLUX.2, SD3, QwenImage, Wan, HunyuanVideo, ``FeedForward``. A pinned
  number in a test (kernels, graph breaks) belongs to a named config: change a config and the numbers
  measured on it change meaning, so add a config instead;
- programs measured by tests and benchmarks alike: :data:`GRAPH_BREAK_CASES` (``compile_warnings``),
  :data:`REALIZE_PROGRAMS` (``inductor_realize``);
- what a compile did: :func:`graph_report` (graphs, breaks, whether ``fullgraph=True`` compiles) and
  :func:`inductor_report` (the generated code and its kernels, loop nests, loads, buffers, bytes);
- references and helpers: :func:`rope_reference` (float64), :func:`rel_err`, :func:`capture_logs`,
  :func:`quiet`, :func:`attn_checks`; alternatives a patch decided against: :func:`replacing`.

Not imported by ``import torchpatches``; Dynamo, Inductor and diffusers are imported when used.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from ._declare import Patch, Target
from ._registry import Registry
from ._status import PatchState

__all__ = [
    "CONFIGS",
    "build_model",
    "tiny_inputs",
    "GraphBreakCase",
    "GRAPH_BREAK_CASES",
    "Program",
    "REALIZE_PROGRAMS",
    "GraphReport",
    "graph_report",
    "InductorReport",
    "inductor_report",
    "count_kernels",
    "rope_reference",
    "rel_err",
    "LogRecords",
    "capture_logs",
    "quiet",
    "attn_checks",
    "replacing",
    "rope_op_under_compile",
]

Device = Union[str, torch.device]


# ---- tiny models ------------------------------------------------------------------------------------

#: name -> (diffusers class, constructor arguments). Random weights, no download.
CONFIGS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    # 1 double + 1 single block. Pinned on it: compile_warnings' graph breaks, inductor_realize's
    # flux_tiny counts (18 kernels, 84 nests, 45 buffers, 619,316 bytes on torch 2.11).
    "flux1": ("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
        axes_dims_rope=(4, 4, 8),
    )),
    # FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128 (11.9 B parameters; benchmarks/flux.py).
    "flux1-dev": ("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )),
    "flux2": ("Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    )),
    # 1 double + 2 single blocks, so a single block also gets its inputs as two slices of one tensor
    # (the eager fusion patches' zero-copy concat). Pinned on them: the fused-op call counts and the
    # tiny compile kernel counts of tests/patches/test_fused_patches.py.
    "flux1-fused": ("FluxTransformer2DModel", dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )),
    "flux2-fused": ("Flux2Transformer2DModel", dict(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=16, mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True,
    )),
    "sd3": ("SD3Transformer2DModel", dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=8,
    )),
    "qwenimage": ("QwenImageTransformer2DModel", dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
    )),
    "wan": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=32, freq_dim=32, ffn_dim=32, num_layers=1, rope_max_seq_len=32,
    )),
    "hunyuanvideo": ("HunyuanVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4),
    )),
    "feedforward": ("FeedForward", dict(dim=16, mult=2, activation_fn="gelu-approximate")),
    # Models whose warning sites compile_warnings covers since the whole-diffusers scan (issue 10): one
    # per kind of site, measured before/after in tests/patches/test_compile_warnings.py.
    "chroma": ("ChromaTransformer2DModel", dict(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8), approximator_num_channels=8,
        approximator_hidden_dim=32, approximator_layers=1,
    )),
    "ovis": ("OvisImageTransformer2DModel", dict(
        patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8),
    )),
    "auraflow": ("AuraFlowTransformer2DModel", dict(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
        out_channels=4, pos_embed_max_size=16,
    )),
    # PixArt-style Transformer2DModel: BasicTransformerBlock + Attention (attention_processor) + AttnProcessor2_0.
    "pixart": ("Transformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1,
        cross_attention_dim=16, sample_size=8, patch_size=2, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
        caption_channels=32, use_additional_conditions=False,
    )),
    "dreamlite": ("DreamLiteTransformer2DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=16, out_channels=16, num_layers=1,
        norm_num_groups=4, cross_attention_dim=16,
    )),
}  # fmt: skip


def build_model(name: str, *, dtype: torch.dtype = torch.float32, device: Device = "cpu") -> torch.nn.Module:
    """The model of ``CONFIGS[name]`` with seeded random weights, created on ``device`` in ``dtype``
    directly (casting afterwards makes diffusers warn, and a large model would pass through the host)."""
    import diffusers
    from diffusers.models.attention import FeedForward

    class_name, config = CONFIGS[name]
    cls = FeedForward if class_name == "FeedForward" else getattr(diffusers, class_name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = cls(**config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def tiny_inputs(
    name: str, *, dtype: torch.dtype = torch.float32, device: Device = "cpu", **options: Any
) -> Dict[str, Any]:
    """Keyword arguments for a forward of ``build_model(name)``, seeded, with ``return_dict=False``.

    Options (each model takes those that apply to it): ``attention_kwargs`` (passed as
    ``joint_attention_kwargs`` or ``attention_kwargs``, as the model names it); for FLUX.1/FLUX.2
    ``side`` (the latent grid is side x side tokens, 4), ``text_tokens`` (8); for FLUX.1 ``ids_3d``
    (the deprecated ``[1, S, 3]`` ids); for ``feedforward`` any extra call argument (``scale=0.5``).
    """
    generator = torch.Generator().manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    config = CONFIGS[name][1]
    builder = _INPUTS[name.split("-")[0]]
    attention_kwargs = options.pop("attention_kwargs", None)
    kwargs = builder(config, randn, torch.device(device), dtype, **options)
    if attention_kwargs is not None:
        kwargs[_ATTENTION_KWARGS.get(name.split("-")[0], "attention_kwargs")] = dict(attention_kwargs)
    return kwargs


def _flux1_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                  dtype: torch.dtype, ids_3d: bool = False, side: int = 4, text_tokens: int = 8) -> Dict[str, Any]:
    """As FluxPipeline passes them: packed latents, ids ``[S, 3]`` of the latent grid, timestep in [0, 1]."""
    rows = torch.arange(float(side))
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), rows, rows, indexing="ij"), -1).reshape(-1, 3).to(device)
    txt_ids = torch.zeros(text_tokens, 3, device=device)
    kwargs = dict(
        hidden_states=randn(1, side * side, config["in_channels"]),
        encoder_hidden_states=randn(1, text_tokens, config["joint_attention_dim"]),
        pooled_projections=randn(1, config["pooled_projection_dim"]),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=img_ids[None] if ids_3d else img_ids,
        txt_ids=txt_ids[None] if ids_3d else txt_ids,
        return_dict=False,
    )
    if config["guidance_embeds"]:
        kwargs["guidance"] = torch.tensor([3.5], device=device)
    return kwargs


def _flux2_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                  dtype: torch.dtype, side: int = 4, text_tokens: int = 8) -> Dict[str, Any]:
    """As Flux2Pipeline passes them: ids ``[1, S, 4]`` (t, h, w, l) of the latent grid and of the text."""
    zero, grid = torch.zeros(1), torch.arange(float(side))
    kwargs = dict(
        hidden_states=randn(1, side * side, config["in_channels"]),
        encoder_hidden_states=randn(1, text_tokens, config["joint_attention_dim"]),
        timestep=torch.tensor([0.5], device=device, dtype=dtype),
        img_ids=torch.cartesian_prod(zero, grid, grid, zero)[None].to(device),
        txt_ids=torch.cartesian_prod(zero, zero, zero, torch.arange(float(text_tokens)))[None].to(device),
        return_dict=False,
    )
    if config["guidance_embeds"]:
        kwargs["guidance"] = torch.tensor([3.5], device=device)
    return kwargs


def _sd3_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 8, 8), encoder_hidden_states=randn(1, 8, 32),
                pooled_projections=randn(1, 32), timestep=torch.tensor([500], device=device), return_dict=False)


def _qwenimage_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                      dtype: torch.dtype, mixed_sizes: bool = False) -> Dict[str, Any]:
    """``mixed_sizes``: a batch of two images of different sizes (4x4 and 2x8 latent patches), which
    QwenImage's RoPE does not support and warns about (using the first image's size for both)."""
    batch = 2 if mixed_sizes else 1
    shapes = [[(1, 4, 4)], [(1, 2, 8)]] if mixed_sizes else [[(1, 4, 4)]]
    return dict(hidden_states=randn(batch, 16, 16), encoder_hidden_states=randn(batch, 8, 32),
                encoder_hidden_states_mask=torch.ones(batch, 8, dtype=torch.long, device=device),
                timestep=torch.full((batch,), 0.5, device=device, dtype=dtype), img_shapes=shapes, return_dict=False)


def _wan_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 2, 8, 8), timestep=torch.tensor([500], device=device),
                encoder_hidden_states=randn(1, 8, 32), return_dict=False)


def _hunyuanvideo_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                         dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 1, 4, 4), timestep=torch.tensor([500], device=device),
                encoder_hidden_states=randn(1, 6, 16), encoder_attention_mask=torch.ones(1, 6, device=device),
                pooled_projections=randn(1, 8), guidance=torch.tensor([3500.0], device=device), return_dict=False)


def _feedforward_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                        dtype: torch.dtype, **call_kwargs: Any) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, config["dim"]), **call_kwargs)


def _flux_like_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                      dtype: torch.dtype, ids_3d: bool = False) -> Dict[str, Any]:
    """Chroma and Ovis-Image: FLUX.1's inputs without pooled projections (4x4 latent grid, 8 text tokens)."""
    kwargs = _flux1_inputs(dict(config, pooled_projection_dim=1, guidance_embeds=False), randn, device, dtype, ids_3d)
    del kwargs["pooled_projections"]
    return kwargs


def _auraflow_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                     dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 8, 8), encoder_hidden_states=randn(1, 8, 32),
                timestep=torch.tensor([500], device=device), return_dict=False)


def _pixart_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                   dtype: torch.dtype) -> Dict[str, Any]:
    return dict(hidden_states=randn(1, 4, 8, 8), encoder_hidden_states=randn(1, 8, 32),
                timestep=torch.tensor([500], device=device), added_cond_kwargs={"resolution": None, "aspect_ratio": None},
                return_dict=False)


def _dreamlite_inputs(config: Dict[str, Any], randn: Callable[..., torch.Tensor], device: torch.device,
                      dtype: torch.dtype, return_dict: bool = True) -> Dict[str, Any]:
    """``return_dict=True`` is DreamLite's default: its forward then builds the deprecated
    ``transformer_2d.Transformer2DModelOutput``, whose ``__init__`` calls ``deprecate``."""
    return dict(hidden_states=randn(1, 16, 4, 4), encoder_hidden_states=randn(1, 8, 16), return_dict=return_dict)


_INPUTS: Dict[str, Callable[..., Dict[str, Any]]] = {
    "flux1": _flux1_inputs, "flux2": _flux2_inputs, "sd3": _sd3_inputs, "qwenimage": _qwenimage_inputs,
    "wan": _wan_inputs, "hunyuanvideo": _hunyuanvideo_inputs, "feedforward": _feedforward_inputs,
    "chroma": _flux_like_inputs, "ovis": _flux_like_inputs, "auraflow": _auraflow_inputs, "pixart": _pixart_inputs,
    "dreamlite": _dreamlite_inputs,
}
_ATTENTION_KWARGS = {
    "flux1": "joint_attention_kwargs", "flux2": "joint_attention_kwargs", "sd3": "joint_attention_kwargs",
    "chroma": "joint_attention_kwargs", "ovis": "joint_attention_kwargs", "pixart": "cross_attention_kwargs",
}


# ---- programs measured by tests and benchmarks alike ---------------------------------------------


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


# ---- what a compile did ---------------------------------------------------------------------------


class GraphReport(NamedTuple):
    """What Dynamo made of a call: ``graphs``/``breaks`` from ``torch._dynamo.explain`` (None when
    explain itself raised) and whether ``fullgraph=True`` compiled, found by trying: explain under-reports
    (a break before its first graph, e.g. a warning in a decorator, shows as 0 breaks)."""

    graphs: Optional[int]
    breaks: Optional[int]
    fullgraph: bool
    reasons: Tuple[str, ...]  # first lines of the break reasons, sorted, without repeats
    error: str  # why explain or the fullgraph compile failed ("" when both worked)
    output: Any = None  # the fullgraph-compiled call's result
    seconds: float = 0.0  # compile and first call with fullgraph=True
    # Every graph break Dynamo logged during the explain run, as the doctor captures them
    # (torchpatches._capture: file, line, reason, traced stack), including those explain does not count.
    sites: Tuple[Any, ...] = ()

    @property
    def break_sites(self) -> Tuple[Tuple[str, int], ...]:
        """Distinct ``(file name, line)`` where Dynamo broke the graph, sorted."""
        return tuple(sorted({(os.path.basename(site.file), site.line) for site in self.sites}))


def graph_report(fn: Callable[..., Any], *args: Any, backend: str = "eager", **kwargs: Any) -> GraphReport:
    """Explain ``fn(*args, **kwargs)`` (capturing every break Dynamo logs, as the doctor does), then compile
    it with ``fullgraph=True`` and ``backend`` and call it.

    Warnings are silenced meanwhile; Dynamo's caches are reset before and after.
    """
    import torch._dynamo

    from ._capture import capture

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch._dynamo.reset()
        try:
            with capture() as captured:
                explanation = torch._dynamo.explain(fn)(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a hard Dynamo error is a result too (2.11 attn checks)
            torch._dynamo.reset()
            return GraphReport(None, None, False, (_first_line(error),), _first_line(error), sites=tuple(captured.breaks))
        reasons = tuple(sorted({str(r.reason).splitlines()[0][:90] for r in explanation.break_reasons}))
        torch._dynamo.reset()
        started = time.perf_counter()
        try:
            output, fullgraph, failure = torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs), True, ""
        except Exception as error:  # noqa: BLE001 - any failure means fullgraph does not compile
            output, fullgraph, failure = None, False, _first_line(error)
        seconds = time.perf_counter() - started
        torch._dynamo.reset()
    return GraphReport(explanation.graph_count, explanation.graph_break_count, fullgraph, reasons, failure,
                       output, seconds, tuple(captured.breaks))


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:120]}"


class InductorReport(NamedTuple):
    """What Inductor generated for a call (CPU: C++ kernels; GPU: Triton), from a fresh compile.

    kernels  kernel definitions (``cpp_fused_*`` / ``triton_*``), distinct per graph, summed over graphs;
    nests    fused scheduler nodes: loop nests on CPU, kernel launches on GPU (``metrics.nodes_num_elem``);
    loads    load sites in the kernel source (``loadu(``, ``= in_ptrN[``, ``tl.load(``): a static proxy
             for recomputation (an inlined value re-loads its inputs in every consumer);
    buffers  intermediate buffers the wrapper allocates (``empty_strided_*`` calls);
    bytes    Inductor's own estimate of bytes read and written (``metrics.num_bytes_accessed``).
    """

    output: Any
    codes: Tuple[str, ...]  # one generated module per graph
    kernels: int
    nests: int
    loads: int
    buffers: int
    bytes: int
    seconds: float

    @property
    def code(self) -> str:
        return "\n".join(self.codes)


_KERNEL_DEFINITION = re.compile(r"^(?:cpp_fused_\w*|triton_\w+) = async_compile\.", re.MULTILINE)
_LOAD_SITE = re.compile(r"::loadu\(|=\s*(?:in_ptr|in_out_ptr|out_ptr)\d+\[|\btl\.load\(")
_BUFFER_ALLOCATION = re.compile(r"\bempty_strided_\w+\(")
# Inductor writes its metrics through this artifact logger (torch/_inductor/compile_fx.py).
_METRICS_LOGGER = "torch._inductor.compile_fx.__inductor_metrics"


def count_kernels(codes: Sequence[str]) -> int:
    """Kernels defined in generated modules, each module's distinct definitions summed."""
    return sum(len(set(_KERNEL_DEFINITION.findall(code))) for code in codes)


def count_buffers(code: str) -> int:
    return len(_BUFFER_ALLOCATION.findall(code))


@contextlib.contextmanager
def _inductor_metrics_enabled() -> Iterator[None]:
    """Make Inductor compute ``metrics.num_bytes_accessed`` without printing its INFO log.

    ``compile_fx`` counts bytes only when its ``inductor_metrics`` artifact logger is enabled for
    INFO; ``torch._logging.set_logs(inductor_metrics=True)`` would also print the records and reset
    the user's other log settings, so we raise just that logger's level.
    """
    log = logging.getLogger(_METRICS_LOGGER)
    saved = (log.level, log.propagate, list(log.handlers))
    log.setLevel(logging.INFO)
    log.propagate = False
    log.handlers = [logging.NullHandler()]
    try:
        yield
    finally:
        log.level, log.propagate, log.handlers = saved[0], saved[1], saved[2]


def inductor_report(fn: Callable[..., Any], *args: Any, fullgraph: bool = True, **kwargs: Any) -> InductorReport:
    """A fresh Inductor compile of ``fn(*args, **kwargs)`` under ``torch.no_grad()`` (Dynamo reset; the
    FX-graph and AOTAutograd caches off, so nothing is served from an earlier compile) and its counts."""
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    metrics.reset()
    started = time.perf_counter()
    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=False), _inductor_metrics_enabled(), torch.no_grad():
        output, codes = run_and_get_code(torch.compile(fn, fullgraph=fullgraph), *args, **kwargs)
    seconds = time.perf_counter() - started
    torch._dynamo.reset()
    code = "\n".join(codes)
    return InductorReport(
        output=output, codes=tuple(codes), kernels=count_kernels(codes), nests=len(metrics.nodes_num_elem),
        loads=len(_LOAD_SITE.findall(code)), buffers=count_buffers(code), bytes=int(metrics.num_bytes_accessed),
        seconds=seconds,
    )


# ---- references -------------------------------------------------------------------------------------


def rope_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    *,
    interleaved: bool,
    seq_dim: int,
    cos_half: bool = False,
) -> torch.Tensor:
    """RoPE in float64 with explicit pair indexing, written independently of ``torchpatches.ops``.

    ``x``: ``[T, H, D]`` or ``[B, S, H, D]`` / ``[B, H, S, D]`` (``seq_dim`` 0, 1 or 2). ``cos``/``sin``:
    one value per element (``[S, r]``, or ``[B or 1, S, r]`` already gathered), or with ``cos_half`` one
    per pair (``[rows, r / 2]``); ``positions`` (``[S]`` or ``[B, S]``) gathers rows first.
    """
    x = x.double()
    xv = x.unsqueeze(0) if x.dim() == 3 else (x if seq_dim == 1 else x.transpose(1, 2))
    B, S = xv.shape[:2]
    c, s = cos.double(), sin.double()
    if positions is not None:
        p = positions.long()
        p = p.reshape(1, S) if x.dim() == 3 else (p.expand(B, S) if p.dim() == 1 else p)
        c, s = c[p], s[p]  # [B, S, width]
    elif c.dim() == 2:
        c, s = c[None], s[None]
    r = c.shape[-1] * (2 if cos_half else 1)
    out = xv.clone()
    for i in range(r // 2):
        ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
        if cos_half:
            ca = cb = c[..., i]
            sa = sb = s[..., i]
        else:
            ca, cb, sa, sb = c[..., ia], c[..., ib], s[..., ia], s[..., ib]
        a, b = xv[..., ia], xv[..., ib]
        out[..., ia] = a * ca[..., None] - b * sa[..., None]
        out[..., ib] = b * cb[..., None] + a * sb[..., None]
    if x.dim() == 3:
        return out.squeeze(0)
    return out if seq_dim == 1 else out.transpose(1, 2)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (L2, in float64); NaN when ``out`` has a NaN."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# ---- logs, warnings, switches -------------------------------------------------------------------------


class LogRecords(logging.Handler):
    """Keeps every record it handles."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @property
    def messages(self) -> List[str]:
        return [record.getMessage() for record in self.records]

    @property
    def sites(self) -> List[Tuple[str, int]]:
        """(file name, line) each record reports."""
        return [(os.path.basename(record.pathname), record.lineno) for record in self.records]


@contextlib.contextmanager
def capture_logs(name: str, level: Optional[int] = None) -> Iterator[LogRecords]:
    """Records logged on logger ``name`` and below, by a handler on that logger itself (so it works where
    propagation stops, as at diffusers' root logger); ``level`` is set for the block if given."""
    handler, logger = LogRecords(), logging.getLogger(name)
    saved = logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the models' own warnings and Dynamo's graph-break chatter while measuring."""
    loggers = [logging.getLogger(name) for name in ("diffusers", "torch._dynamo", "torch._inductor")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


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


# ---- alternatives a patch decided against --------------------------------------------------------------


@contextlib.contextmanager
def replacing(patch: Patch, make_replacement: Callable[[Any], Any]) -> Iterator[None]:
    """``patch``'s targets and their aliases bound to another replacement inside the block.

    For an alternative a patch decided against, measured or tested beside it. The binding goes through
    a registry of its own, so the originals are verified by fingerprint as the patch's are, and are back
    by identity after the block. Turn the real patch off first (``torchpatches.disabled(name)``).
    """
    targets = tuple(Target(t.path, make_replacement, t.fingerprints, t.aliases) for t in patch.targets)
    registry = Registry([Patch(patch.name, patch.summary, targets, patch.requires, verifies=patch.verifies)])
    registry.apply()
    try:
        state = registry.status()[patch.name]
        if state.state is not PatchState.APPLIED:
            raise RuntimeError(f"the variant of {patch.name} did not apply: {state.state.value}, {state.reason}")
        yield
    finally:
        registry.revert()


def rope_op_under_compile(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The alternative the ``rope`` patch decided against: FLUX-form calls go through the RoPE op under
    ``torch.compile`` too, where the op is a call Inductor cannot fuse (benchmarks/NOTES-flux.md)."""
    from .patches import rope as rope_patch

    def apply_rotary_emb(
        x: torch.Tensor, freqs_cis: Any, use_real: bool = True, use_real_unbind_dim: int = -1, sequence_dim: int = 2
    ) -> torch.Tensor:
        if rope_patch.is_flux_call(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim):
            return rope_patch._rotate(x, freqs_cis[0], freqs_cis[1], sequence_dim)
        return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)

    return apply_rotary_emb
