"""Every op of ``torchpatches.ops`` against the PyTorch code it replaces, at the shapes the models run it.

One case per op and shape (``OPS``: op -> the shapes it is measured at; each ``case_<op>`` builds the op's call and
the PyTorch expression diffusers writes for it, or for Wan's forms the op's PyTorch tier, which is diffusers' op
sequence). For each case, on the same fresh random inputs:

- correctness: outputs NaN-poisoned through the caching allocator first; the fraction of elements bit-identical to
  the PyTorch code's, the largest difference in ulps of the output dtype (taken at the magnitude of the last rounded
  intermediate, so a one-ulp difference that cancels to a tiny output reads as one ulp), the relative error, NaNs;
- the bound: bytes the op must move (each input read once, each output written once) over the device-to-device
  copy rate measured in the same run (``floor us``), and the op's share of it (``% copy``);
- GPU us of the PyTorch code and of the op, each from CUDA-graph replays (no Python, no launch cost);
- host us per call of each at a tiny shape of the same case (a batch of calls whose kernels finish at once, so its
  wall time is the host's: argument checks, tier choice, allocation, launches).

    python benchmarks/fused_ops.py --json ops.json                         # GPU: every op, production shapes
    python benchmarks/fused_ops.py --ops qk_norm_rope,swiglu --shapes flux1  # some
    python benchmarks/fused_ops.py --tiny                                  # CPU smoke test (PyTorch tiers)
    TRITON_INTERPRET=1 python benchmarks/fused_ops.py --tiny --tier triton  # CPU, the Triton kernels interpreted

Imports public names only (``torchpatches.ops``, ``torchpatches.disabled``).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable, Dict, List, Optional  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

#: Production shapes: FLUX.1-dev, FLUX.2-dev, Wan2.1-14B (480x832x81), SD3.5-large, Qwen-Image (1328x1328), and an
#: LLM's RoPE (8192 tokens, 32 q / 8 k heads); batch 1, bf16.
SHAPES: Dict[str, Dict[str, int]] = {
    "flux1": dict(D=3072, H=24, Dh=128, S_img=4096, S_txt=512, mlp=12288),
    "flux2": dict(D=6144, H=48, Dh=128, S_img=4096, S_txt=512, mlp=18432),
    "wan": dict(D=5120, H=40, Dh=128, S_img=32760, S_txt=512, mlp=13824),
    "sd3": dict(D=2432, H=38, Dh=64, S_img=4096, S_txt=333, mlp=9728),
    "qwenimage": dict(D=3072, H=24, Dh=128, S_img=6889, S_txt=256, mlp=12288),
    "llm": dict(D=4096, H=32, Dh=128, S_img=8192, S_txt=0, mlp=0, H_kv=8, positions=32768),
}
#: The same cases, tiny: the host-cost shapes on a GPU, everything with --tiny.
TINY: Dict[str, Dict[str, int]] = {
    name: dict(shape, D=64, H=4, Dh=16, S_img=16, S_txt=8 if shape["S_txt"] else 0, mlp=256 if shape["mlp"] else 0,
               **({"H_kv": 2, "positions": 64} if "H_kv" in shape else {}))
    for name, shape in SHAPES.items()
}
RANK = 64  # lora_linear's adapter rank (TINY: 4)


class Case:
    """One op at one shape: ``op()`` and ``ref()`` (each returns a tensor or a tuple of them), the bytes the op must
    move, the magnitude of the last rounded intermediate per output (``scales(ref_outputs)``, optional), FLOPs
    (GEMM ops), and which code ``ref`` is."""

    def __init__(self, op: Callable[[], Any], ref: Callable[[], Any], nbytes: int,
                 scales: Optional[Callable[[List[torch.Tensor]], List[Optional[torch.Tensor]]]] = None,
                 flops: int = 0, ref_is: str = "diffusers") -> None:
        self.op, self.ref, self.nbytes, self.scales, self.flops, self.ref_is = op, ref, nbytes, scales, flops, ref_is


def rnd(*shape: int, device: torch.device, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, device=device) * scale).to(dtype)


def pair_norm(t: torch.Tensor) -> torch.Tensor:
    """|(a, b)| of each rotated pair, for both elements: the ulp scale of a RoPE output."""
    p = t.float().unflatten(-1, (-1, 2))
    return p.norm(dim=-1, keepdim=True).expand_as(p).flatten(-2)


def _vectors(shape: Dict[str, int], device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Any:
    """shift, scale, gate as views of one chunked embedding, as diffusers' adaLN hands them."""
    D = shape["D"]
    emb = rnd(1, 3 * D, device=device, scale=0.5, dtype=dtype)
    return emb[:, :D], emb[:, D:2 * D], emb[:, 2 * D:]


def _wan_vectors(shape: Dict[str, int], device: torch.device) -> Any:
    """Wan's fp32 modulation: [1, 1, D] rows of ``scale_shift_table + temb``."""
    table = torch.randn(1, 6, shape["D"], device=device) * 0.1
    return table[:, 0:1], table[:, 1:2], table[:, 2:3]


# ---- the cases: one builder per op ------------------------------------------------------------------


def case_layer_norm_modulate(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    from torchpatches.ops import layer_norm_modulate

    S, D = shape["S_img"] + shape["S_txt"], shape["D"]
    x = rnd(1, S, D, device=device, scale=2.0)
    if model == "wan":  # fp32 compute, rounded once (.type_as)
        shift, scale, _ = _wan_vectors(shape, device)
        return Case(lambda: layer_norm_modulate(x, scale, shift, rounding="once"),
                    lambda: layer_norm_modulate(x, scale, shift, rounding="once", tier="torch"), 2 * S * D * 2,
                    ref_is="torch tier")
    shift, scale, _ = _vectors(shape, device)
    norm = torch.nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
    return Case(lambda: layer_norm_modulate(x, scale, shift, eps=1e-6),
                lambda: norm(x) * (1 + scale[:, None]) + shift[:, None], 2 * S * D * 2,
                scales=lambda r: [(r[0].float() - shift[:, None].float()).abs()])


def case_gate_residual(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    from torchpatches.ops import gate_residual

    S, D = shape["S_img"] + shape["S_txt"], shape["D"]
    x, y = rnd(1, S, D, device=device, scale=2.0), rnd(1, S, D, device=device)
    if model == "wan":
        _, _, gate = _wan_vectors(shape, device)
        return Case(lambda: gate_residual(x, gate, y, rounding="once"),
                    lambda: gate_residual(x, gate, y, rounding="once", tier="torch"), 3 * S * D * 2,
                    ref_is="torch tier")
    _, _, gate = _vectors(shape, device)
    mag = torch.maximum(x.float().abs(), (gate[:, None].float() * y.float()).abs())
    return Case(lambda: gate_residual(x, gate, y), lambda: x + gate.unsqueeze(1) * y, 3 * S * D * 2,
                scales=lambda r: [mag])


def case_gate_residual_layer_norm_modulate(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    from torchpatches.ops import gate_residual_layer_norm_modulate

    S, D = shape["S_img"] + shape["S_txt"], shape["D"]
    x, y = rnd(1, S, D, device=device, scale=2.0), rnd(1, S, D, device=device)
    shift, scale, gate = _vectors(shape, device)
    norm = torch.nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
    mag = torch.maximum(x.float().abs(), (gate[:, None].float() * y.float()).abs())

    def ref() -> Any:
        h = x + gate.unsqueeze(1) * y
        return h, norm(h) * (1 + scale[:, None]) + shift[:, None]

    return Case(lambda: gate_residual_layer_norm_modulate(x, gate, y, scale, shift, eps=1e-6), ref, 4 * S * D * 2,
                scales=lambda r: [mag, (r[1].float() - shift[:, None].float()).abs()])


def case_gate_residual_layer_norm(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """Wan's gated residual, then its cross-attention norm (an affine fp32 LayerNorm), rounded once."""
    from torchpatches.ops import gate_residual_layer_norm

    S, D = shape["S_img"], shape["D"]
    x, y = rnd(1, S, D, device=device, scale=2.0), rnd(1, S, D, device=device)
    _, _, gate = _wan_vectors(shape, device)
    weight, bias = 1 + 0.1 * torch.randn(D, device=device), 0.1 * torch.randn(D, device=device)
    return Case(lambda: gate_residual_layer_norm(x, gate, y, weight, bias, rounding="once"),
                lambda: gate_residual_layer_norm(x, gate, y, weight, bias, rounding="once", tier="torch"),
                4 * S * D * 2, ref_is="torch tier")


def case_residual_layer_norm_modulate(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """Wan: the cross-attention's residual add, then the feed-forward's LayerNorm + modulate, rounded once."""
    from torchpatches.ops import residual_layer_norm_modulate

    S, D = shape["S_img"], shape["D"]
    x, y = rnd(1, S, D, device=device, scale=2.0), rnd(1, S, D, device=device)
    shift, scale, _ = _wan_vectors(shape, device)
    return Case(lambda: residual_layer_norm_modulate(x, y, scale, shift, rounding="once"),
                lambda: residual_layer_norm_modulate(x, y, scale, shift, rounding="once", tier="torch"),
                4 * S * D * 2, ref_is="torch tier")


def _rms_norms(count: int, dim: int, device: torch.device) -> List[torch.nn.RMSNorm]:
    """bf16 RMSNorms with weights of 1 +- 0.5 (diffusers initializes them to ones: the multiply would be exact),
    without grad, as in an inference model (a call autograd records takes the PyTorch tier)."""
    norms = []
    for _ in range(count):
        norm = torch.nn.RMSNorm(dim, eps=1e-6).to(device=device, dtype=torch.bfloat16).requires_grad_(False)
        norm.weight.data = (torch.rand(dim, device=device) + 0.5).to(torch.bfloat16)
        norms.append(norm)
    return norms


def _interleaved_tables(S: int, Dh: int, device: torch.device) -> Any:
    angles = torch.rand(S, Dh // 2, device=device, dtype=torch.float64) * 100
    return angles.cos().repeat_interleave(2, -1).float(), angles.sin().repeat_interleave(2, -1).float()


def _apply_rotary_emb(*args: Any, **kwargs: Any) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb``, looked up per call (the ``rope`` patch replaces it; refs run with every
    patch off)."""
    from diffusers.models import embeddings

    return embeddings.apply_rotary_emb(*args, **kwargs)


def case_qk_norm_rope(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """FLUX.1 (double block: q/k RMSNorm per head, RoPE, text before image), FLUX.2 (single block: q and k as chunks of
    one fused projection), SD3.5 (RMSNorm and concat, no RoPE), QwenImage (RoPE tables of its complex RoPE)."""
    from torchpatches.ops import qk_norm_rope

    Si, St, H, Dh = shape["S_img"], shape["S_txt"], shape["H"], shape["Dh"]
    S = Si + St
    norms = _rms_norms(4, Dh, device)
    w = [n.weight for n in norms]
    if model == "flux2":  # q, k as views into the single block's fused projection row
        proj = rnd(1, S, 3 * H * Dh + 2 * shape["mlp"], device=device, scale=3.0)
        q, k, _ = proj[..., : 3 * H * Dh].chunk(3, dim=-1)
        q, k = q.unflatten(-1, (-1, Dh)), k.unflatten(-1, (-1, Dh))
        cos, sin = _interleaved_tables(S, Dh, device)
        return Case(lambda: qk_norm_rope(q, k, cos, sin, q_weight=w[0], k_weight=w[1], eps_q=1e-6, eps_k=1e-6)[:2],
                    lambda: (_apply_rotary_emb(norms[0](q), (cos, sin), sequence_dim=1),
                             _apply_rotary_emb(norms[1](k), (cos, sin), sequence_dim=1)),
                    4 * S * H * Dh * 2 + 2 * S * Dh * 4, scales=lambda r: [pair_norm(r[0]), pair_norm(r[1])])
    q, k, v = (rnd(1, Si, H, Dh, device=device, scale=3.0) for _ in range(3))
    qt, kt, vt = (rnd(1, St, H, Dh, device=device, scale=3.0) for _ in range(3))
    text = dict(v=v, q_txt=qt, k_txt=kt, v_txt=vt, q_txt_weight=w[2], k_txt_weight=w[3], eps_q_txt=1e-6,
                eps_k_txt=1e-6)
    nbytes = 6 * S * H * Dh * 2
    if model == "sd3":  # image before text, no RoPE
        def ref_sd3() -> Any:
            return (torch.cat([norms[0](q), norms[2](qt)], dim=1), torch.cat([norms[1](k), norms[3](kt)], dim=1),
                    torch.cat([v, vt], dim=1))

        return Case(lambda: qk_norm_rope(q, k, q_weight=w[0], k_weight=w[1], eps_q=1e-6, eps_k=1e-6,
                                         text_first=False, **text), ref_sd3, nbytes)
    cos, sin = _interleaved_tables(S, Dh, device)

    def ref_joint() -> Any:  # FLUX.1's processor; QwenImage's computes the same rotation in complex form
        qq = torch.cat([norms[2](qt), norms[0](q)], dim=1)
        kk = torch.cat([norms[3](kt), norms[1](k)], dim=1)
        return (_apply_rotary_emb(qq, (cos, sin), sequence_dim=1), _apply_rotary_emb(kk, (cos, sin), sequence_dim=1),
                torch.cat([vt, v], dim=1))

    return Case(lambda: qk_norm_rope(q, k, cos, sin, q_weight=w[0], k_weight=w[1], eps_q=1e-6, eps_k=1e-6, **text),
                ref_joint, nbytes + 2 * S * Dh * 4, scales=lambda r: [pair_norm(r[0]), pair_norm(r[1]), None])


def case_rms_norm_rope(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """Wan's self-attention: q and k RMSNorm across all heads (one [D] weight), then its RoPE."""
    from torchpatches.ops import rms_norm_rope

    S, D, Dh = shape["S_img"], shape["D"], shape["Dh"]
    q, k = rnd(1, S, D, device=device), rnd(1, S, D, device=device)
    weight = (1 + 0.1 * torch.randn(D, device=device)).to(torch.bfloat16)
    angles = torch.rand(S, Dh // 2, device=device) * 100
    cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    kwargs = dict(q_weight=weight, k_weight=weight, eps_q=1e-6, eps_k=1e-6, cos=cos, sin=sin)
    return Case(lambda: rms_norm_rope(q, k, **kwargs), lambda: rms_norm_rope(q, k, tier="torch", **kwargs),
                4 * S * D * 2 + 2 * S * Dh * 4, scales=lambda r: [pair_norm(r[0]), pair_norm(r[1])],
                ref_is="torch tier")


def case_apply_rope_qk(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """FLUX: q and k [1, S, H, D], interleaved, diffusers' ``apply_rotary_emb`` per tensor. LLM: NeoX halves from a
    cos/sin cache indexed by positions, vLLM's native form, out of place."""
    from torchpatches.ops import apply_rope_qk, apply_rope_qk_with_cache

    S, H, Dh = shape["S_img"] + shape["S_txt"], shape["H"], shape["Dh"]
    if model == "llm":
        hk, positions = shape["H_kv"], shape["positions"]
        q, k = rnd(S, H, Dh, device=device), rnd(S, hk, Dh, device=device)
        angles = torch.rand(positions, Dh // 2, device=device) * 50
        cache = torch.cat([angles.cos(), angles.sin()], -1).contiguous()
        pos = torch.randint(0, positions, (S,), device=device)

        def native() -> Any:
            half = Dh // 2
            cs = cache[pos]
            cos, sin = (torch.cat([cs[:, :half]] * 2, -1)[:, None], torch.cat([cs[:, half:]] * 2, -1)[:, None])

            def one(x: torch.Tensor) -> torch.Tensor:
                a, b = x.chunk(2, -1)
                return (x.float() * cos + torch.cat([-b, a], -1).float() * sin).to(x.dtype)

            return one(q), one(k)

        return Case(lambda: apply_rope_qk_with_cache(q, k, cache, pos, interleaved=False), native,
                    2 * (q.numel() + k.numel()) * 2 + S * Dh * 4 + S * 8, ref_is="vLLM native")
    q, k = rnd(1, S, H, Dh, device=device), rnd(1, S, H, Dh, device=device)
    cos, sin = _interleaved_tables(S, Dh, device)
    return Case(lambda: apply_rope_qk(q, k, cos, sin, interleaved=True, sequence_dim=1),
                lambda: (_apply_rotary_emb(q, (cos, sin), sequence_dim=1),
                         _apply_rotary_emb(k, (cos, sin), sequence_dim=1)),
                4 * S * H * Dh * 2 + 2 * S * Dh * 4, scales=lambda r: [pair_norm(r[0]), pair_norm(r[1])])


def case_rope_tables(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """FLUX.1's rotary tables from the position ids of 4096 image + 512 text tokens (``FluxPosEmbed``)."""
    from diffusers.models.embeddings import FluxPosEmbed

    from torchpatches.ops import rope_tables

    S, side = shape["S_img"] + shape["S_txt"], int(round(shape["S_img"] ** 0.5))
    ids = torch.zeros(S, 3, device=device)
    grid = torch.arange(side * side, device=device)
    ids[shape["S_txt"]:shape["S_txt"] + side * side, 1] = (grid // side).float()
    ids[shape["S_txt"]:shape["S_txt"] + side * side, 2] = (grid % side).float()
    axes = (16, 56, 56) if shape["Dh"] == 128 else (4, 6, 6)
    embed = FluxPosEmbed(theta=10000, axes_dim=list(axes))
    return Case(lambda: rope_tables(ids, axes, 10000.0), lambda: embed(ids), S * 3 * 4 + 2 * S * sum(axes) * 4)


def case_swiglu(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """FLUX.2's single block: the MLP half of the fused projection row (a strided view), diffusers' Flux2SwiGLU."""
    from diffusers.models.transformers.transformer_flux2 import Flux2SwiGLU

    from torchpatches.ops import swiglu

    S, H, Dh, mlp = shape["S_img"] + shape["S_txt"], shape["H"], shape["Dh"], shape["mlp"]
    proj = rnd(1, S, 3 * H * Dh + 2 * mlp, device=device, scale=3.0)
    x = proj[..., 3 * H * Dh:]
    act = Flux2SwiGLU()
    return Case(lambda: swiglu(x), lambda: act(x), 3 * S * mlp * 2)


def case_gelu_tanh_into(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """FLUX.1's single block: [attention | gelu(mlp)] written into one buffer (``gelu_tanh_into`` + ``copy_into``)
    against diffusers' ``torch.cat([attn, gelu(mlp)])``."""
    from torchpatches.ops import copy_into, gelu_tanh_into

    S, width, mlp = shape["S_img"] + shape["S_txt"], shape["H"] * shape["Dh"], shape["mlp"]
    attn, x = rnd(1, S, width, device=device), rnd(1, S, mlp, device=device, scale=2.0)

    def op() -> torch.Tensor:
        buf = attn.new_empty((1, S, width + mlp))
        gelu_tanh_into(x, buf[..., width:])
        copy_into(attn, buf[..., :width])
        return buf

    return Case(op, lambda: torch.cat([attn, F.gelu(x, approximate="tanh")], dim=2), 2 * S * (width + mlp) * 2,
                scales=lambda r: [torch.cat([attn.float(), 1.13 * x.float()], dim=2).abs()])  # ulps of GELU's input


def case_linear_gelu_tanh(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """FLUX.1's double-block MLP input: addmm + tanh GELU against the GELU in cuBLASLt's epilogue."""
    from torchpatches.ops import linear_gelu_tanh

    M, D = shape["S_img"], shape["D"]
    x, w, b = rnd(M, D, device=device), rnd(4 * D, D, device=device, scale=D ** -0.5), rnd(4 * D, device=device)
    return Case(lambda: linear_gelu_tanh(x, w, b), lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
                (M * D + 4 * D * D + 4 * D + M * 4 * D) * 2, flops=2 * M * D * 4 * D,
                scales=lambda r: [1.13 * F.linear(x, w, b).float().abs()])  # GELU's slope <= 1.13


def case_lora_linear(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """FLUX.1's ``to_q`` with one rank-64 adapter: peft's order (base GEMM, then ``B(A(x)) * scale`` added) against
    the adapter's product added in the GEMM's epilogue."""
    from torchpatches.ops import lora_linear

    M, D = shape["S_img"], shape["D"]
    rank = RANK if D >= 1024 else 4
    x, w, b = rnd(M, D, device=device), rnd(D, D, device=device, scale=D ** -0.5), rnd(D, device=device)
    A, B = rnd(rank, D, device=device, scale=D ** -0.5), rnd(D, rank, device=device, scale=rank ** -0.5)
    return Case(lambda: lora_linear(x, w, b, [(A, B, 0.7)]), lambda: F.linear(x, w, b) + F.linear(F.linear(x, A), B) * 0.7,
                (M * D + D * D + D + 2 * rank * D + M * D) * 2, flops=2 * M * D * D + 4 * M * D * rank, ref_is="peft")


def case_lse_merge(model: str, shape: Dict[str, int], device: torch.device) -> Case:
    """Ring attention on two ranks: one rank's two partial outputs merged by their log-sum-exps, diffusers'
    ``TemplatedRingAttention`` merge (convert_to_fp32)."""
    from torchpatches.ops import lse_merge

    shard, H, Dh = (shape["S_img"] + shape["S_txt"]) // 2, shape["H"], shape["Dh"]
    outs = [rnd(1, shard, H, Dh, device=device) for _ in range(2)]
    lses = [rnd(1, shard, H, device=device, scale=2.0, dtype=torch.float32) for _ in range(2)]

    def ref() -> Any:
        prev_o = prev_l = None
        for o, l in zip(outs, lses):
            o, l = o.to(torch.float32), l.to(torch.float32).unsqueeze(-1)
            if prev_o is not None:
                o = prev_o - F.sigmoid(l - prev_l) * (prev_o - o)
                l = prev_l - F.logsigmoid(prev_l - l)
            prev_o, prev_l = o, l
        return o.to(torch.bfloat16), l.squeeze(-1)

    return Case(lambda: lse_merge(outs[0], lses[0], outs[1], lses[1], out_dtype=torch.bfloat16), ref,
                3 * shard * H * Dh * 2 + 3 * shard * H * 4)


#: op -> the shapes it is measured at (the models that run it)
OPS: Dict[str, tuple] = {
    "layer_norm_modulate": ("flux1", "flux2", "wan"),
    "gate_residual": ("flux1", "flux2", "wan"),
    "gate_residual_layer_norm_modulate": ("flux1", "flux2"),
    "gate_residual_layer_norm": ("wan",),
    "residual_layer_norm_modulate": ("wan",),
    "qk_norm_rope": ("flux1", "flux2", "sd3", "qwenimage"),
    "rms_norm_rope": ("wan",),
    "apply_rope_qk": ("flux1", "llm"),
    "rope_tables": ("flux1",),
    "swiglu": ("flux2",),
    "gelu_tanh_into": ("flux1",),
    "linear_gelu_tanh": ("flux1",),
    "lora_linear": ("flux1",),
    "lse_merge": ("flux1",),
}
BUILDERS: Dict[str, Callable[[str, Dict[str, int], torch.device], Case]] = {
    name: globals()[f"case_{name}"] for name in OPS}


# ---- measuring ----------------------------------------------------------------------------------------


def poison(device: torch.device) -> None:
    """Fill the caching allocator's free memory with NaN, so an output element nobody writes shows up."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info()
    n = max(0, int(free * 0.6) // 4)
    if n:
        torch.full((n,), float("nan"), device=device)  # freed at once: the allocator keeps the NaN-filled block


def compare(out: torch.Tensor, ref: torch.Tensor, scale: Optional[torch.Tensor] = None) -> Dict[str, Any]:
    """Bit-identical fraction, largest |diff| in ulps of the output dtype (at max(|out|, |ref|, scale)), relative
    error, NaNs."""
    a, b = out.float(), ref.float()
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}.get(out.dtype, 23)
    mag = torch.maximum(a.abs(), b.abs())
    if scale is not None:
        mag = torch.maximum(mag, scale.float().abs())
    ulp = torch.exp2(torch.floor(torch.log2(mag.clamp_min(1e-30))) - mant)
    diff = (a - b).abs()
    return {"identical_frac": float((out == ref).float().mean()), "max_ulp": float((diff / ulp).nan_to_num(0).max()),
            "rel_err": _bench.rel_err(out, ref), "nan": int(torch.isnan(out).sum()),
            "ref_nan": int(torch.isnan(ref).sum())}


def outputs(result: Any) -> List[torch.Tensor]:
    return [t for t in (list(result) if isinstance(result, (tuple, list)) else [result]) if isinstance(t, torch.Tensor)]


def graph_us(fn: Callable[[], Any], device: torch.device, reps: int = 10, iters: int = 30) -> float:
    """Median GPU microseconds per call from CUDA-graph replays (``reps`` calls per graph); on the CPU the wall time."""
    if device.type != "cuda":
        fn()
        t = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t) / 3 * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def copy_rate(device: torch.device) -> float:
    """Device-to-device copy, GB/s counting bytes read plus written (eager: the SM copy kernel, as the ops' own)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times) / 1e9


def host_us(fn: Callable[[], Any], device: torch.device, batch: int = 100, repeats: int = 7) -> float:
    """Median wall microseconds per call of batches of tiny calls (host time where the kernels finish at once)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return _bench.host_us_per_call(fn, batch, repeats, sync)


def run_case(op: str, model: str, device: torch.device, gbps: float, tiny: bool, host: bool) -> Dict[str, Any]:
    """Correctness (NaN-poisoned outputs), GPU us of both, host us of both at the tiny shape."""
    import torchpatches

    torch.manual_seed(0)
    with torchpatches.disabled():  # diffusers' modules as shipped
        case = BUILDERS[op](model, (TINY if tiny else SHAPES)[model], device)
    with torch.inference_mode():
        poison(device)
        with torchpatches.disabled():
            ref = outputs(case.ref())
        poison(device)
        got = outputs(case.op())
        scales = case.scales(ref) if case.scales else [None] * len(ref)
        checks = [compare(g, r, s) for g, r, s in zip(got, ref, scales)]
        row: Dict[str, Any] = {"op": op, "shape": model, "ref": case.ref_is, "bytes": case.nbytes, "checks": checks,
                               "floor_us": case.nbytes / (gbps * 1e3) if gbps == gbps else None}
        with torchpatches.disabled():
            row["torch_us"] = graph_us(case.ref, device)
        row["op_us"] = graph_us(case.op, device)
        if row["floor_us"]:
            row["pct_copy"] = 100 * row["floor_us"] / row["op_us"]
        if case.flops:
            row["op_tflops"], row["torch_tflops"] = case.flops / row["op_us"] / 1e6, case.flops / row["torch_us"] / 1e6
        if host:
            small = BUILDERS[op](model, TINY[model], device) if not tiny else case
            with torchpatches.disabled():
                row["host_torch_us"] = host_us(small.ref, device)
            row["host_op_us"] = host_us(small.op, device)
    return row


def _f(value: Optional[float], fmt: str, width: int) -> str:
    return (format(value, fmt) if value is not None and value == value else "-").rjust(width)


def print_table(results: Dict[str, Any]) -> None:
    print(f"\n{results['versions'].get('gpu', 'CPU')}: copy rate {_f(results['copy_GBps'], '.0f', 0)} GB/s "
          f"(read + write); us per call, GPU from CUDA-graph replays, host at a tiny shape")
    print(f"{'op':<34}{'shape':<10}{'MB':>8}{'floor':>8}{'torch':>9}{'op':>9}{'x':>7}{'%copy':>7}{'host':>8}"
          f"{'host op':>8}{'identical':>10}{'max ulp':>8}{'rel err':>9}{'NaN':>4}  ref")
    for r in results["rows"]:
        if "error" in r:
            print(f"{r['op']:<34}{r['shape']:<10}FAILED: {r['error'][:100]}")
            continue
        checks = r["checks"]
        speedup = r["torch_us"] / r["op_us"] if r["op_us"] else None
        print(f"{r['op']:<34}{r['shape']:<10}{r['bytes'] / 1e6:>8.1f}{_f(r['floor_us'], '.1f', 8)}"
              f"{r['torch_us']:>9.1f}{r['op_us']:>9.1f}{_f(speedup, '.2f', 7)}{_f(r.get('pct_copy'), '.1f', 7)}"
              f"{_f(r.get('host_torch_us'), '.1f', 8)}{_f(r.get('host_op_us'), '.1f', 8)}"
              f"{min(c['identical_frac'] for c in checks):>10.6f}{max(c['max_ulp'] for c in checks):>8.2f}"
              f"{max(c['rel_err'] for c in checks):>9.1e}{sum(c['nan'] for c in checks):>4}  {r['ref']}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (the PyTorch tier unless --tier)")
    parser.add_argument("--tier", choices=("torch", "triton"), help="force the ops' tier (--tiny: torch)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)}")
    parser.add_argument("--shapes", default="", help="comma-separated models: only their cases")
    parser.add_argument("--no-host", action="store_true", help="skip the host-time columns")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {unknown}")
    shapes = [s for s in args.shapes.split(",") if s]
    from torchpatches.ops import force_tier

    device = torch.device("cpu" if args.tiny else "cuda")
    tier = args.tier or ("torch" if args.tiny else None)
    results: Dict[str, Any] = {"versions": _bench.versions(), "command": _bench.command_line(argv), "tier": tier,
                               "copy_GBps": copy_rate(device), "rows": []}
    with force_tier(tier) if tier else contextlib.nullcontext():
        for op in ops:
            for model in OPS[op]:
                if shapes and model not in shapes:
                    continue
                try:
                    row = run_case(op, model, device, results["copy_GBps"], args.tiny, not args.no_host)
                except Exception as error:  # noqa: BLE001 - one broken case must not cost the run
                    row = {"op": op, "shape": model, "error": f"{type(error).__name__}: {error}"[:500]}
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
                _bench.save_json(args.json, results)
    print_table(results)
    bad = [r for r in results["rows"] if "error" in r or any(c["nan"] > c["ref_nan"] for c in r["checks"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
