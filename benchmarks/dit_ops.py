"""SD3.5 and QwenImage fused ops on the GPU at production shapes, against diffusers' own code on the same inputs.

For one real diffusers block of each model (random weights; SD3.5-large: 38 x 64 = 2432 wide, 4096 image + 333
text tokens, also the ``context_pre_only`` last block; QwenImage: 24 x 128 = 3072 wide, 83 x 83 = 6889 image +
256 text tokens with a padded mask; bf16), NaN-poisoned outputs, fraction bit-identical and max ulp of the output
dtype (``fused.compare``), relative error:

- ``op``: each fused op called as its pattern calls it (the patch's own helper: ``_fused_qkv``, ``_modulate_calls``)
  against the diffusers code it replaces: the q, k, v diffusers hands to its attention call (captured there), and
  the block's LayerNorm + modulate / gate + residual expressions;
- ``processor`` / ``block``: the attention processor's and the whole block's outputs with only the named
  patterns on against every pattern off (GEMMs after a fused stretch amplify a one-ulp difference: read these for
  the relative error, the ``op`` rows for the ulps).

``--qwen-sdpa-probe`` (fp32) localizes why QwenImage's fp32 bit-for-bit tests (PyTorch tier forced) fail on CUDA:
diffusers' complex-form RoPE against the op's real form, the whole q/k/v stretch, SDPA on diffusers' layout vs
the patch's (same values) with the backend SDPA picks, and ``vmap`` of diffusers' processor.

    python benchmarks/dit_ops.py --json dit_ops.json [--qwen-sdpa-probe]      # GPU
    python benchmarks/dit_ops.py --tiny [--qwen-sdpa-probe] [--tier triton]   # CPU (TRITON_INTERPRET=1 for triton)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _bench, fused beside this file
import _bench  # noqa: E402,I001  (before torch: turns Inductor's caches off)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import types  # noqa: E402
from typing import Any, Callable, Dict, Iterator, List, Optional  # noqa: E402

import torch  # noqa: E402

from fused import as_list, compare, poison  # noqa: E402

SHAPES = {"sd3": dict(H=38, Dh=64, S_img=4096, S_txt=333),
          "qwenimage": dict(H=24, Dh=128, side=83, S_txt=256, valid=230, axes=(16, 56, 56))}
TINY = {"sd3": dict(H=2, Dh=16, S_img=16, S_txt=8),
        "qwenimage": dict(H=2, Dh=16, side=4, S_txt=8, valid=6, axes=(4, 6, 6))}
#: Every fused pattern that can run on the model's blocks ("all" rows).
ALL = {"sd3": ("adaln", "gate_residual", "gelu_gemm", "sd3_block", "sd3_qk_norm"),
       "qwenimage": ("adaln", "gate_residual", "gelu_gemm", "qwenimage_block", "qwenimage_qk_norm_rope")}
PROCESSOR = {"sd3": ("sd3_qk_norm",), "qwenimage": ("qwenimage_qk_norm_rope",)}
BLOCK = {"sd3": (("sd3_qk_norm",), ("sd3_block", "adaln")), "qwenimage": (("qwenimage_qk_norm_rope",), ("qwenimage_block",))}


# ----------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def captured(module: Any, name: str, calls: List[tuple]) -> Iterator[None]:
    """``module.name`` records (args, kwargs) of each call, then calls through (diffusers' code, patches off)."""
    original = getattr(module, name)

    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(module, name, record)
    try:
        yield
    finally:
        setattr(module, name, original)


def checked(name: str, got: Any, ref: Any, scales: Optional[List[Any]] = None) -> Dict[str, Any]:
    """One row: per output (``fused.compare``) plus the relative error."""
    got, ref = as_list(got), as_list(ref)
    assert len(got) == len(ref), (name, len(got), len(ref))
    out = []
    for g, r, s in zip(got, ref, scales or [None] * len(ref)):
        c = compare(g, r, s)
        c["rel_err"] = _bench.rel_err(g, r)
        c["shape"] = list(g.shape)
        out.append(c)
    return dict(stretch=name, checks=out)


def poisoned(device: torch.device, fn: Callable[[], Any]) -> Any:
    poison(device)
    with torch.no_grad():
        return fn()


def pair_mag(t: torch.Tensor) -> torch.Tensor:
    """|(a, b)| of each rotated pair (the ulp scale of a RoPE output)."""
    p = t.float().unflatten(-1, (-1, 2))
    return p.norm(dim=-1, keepdim=True).expand_as(p).flatten(-2)


def perturb_norms(block: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights of 1 +- 0.1 (diffusers initializes them to ones: a weight multiply would be exact)."""
    for name, p in block.named_parameters():
        if "norm" in name and name.endswith("weight"):
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen, device=p.device))


def make_block(cls: type, device: torch.device, dtype: torch.dtype, *args: Any, **kwargs: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        block = cls(*args, **kwargs)
    block = block.to(dtype).eval().requires_grad_(False)
    with torch.no_grad():
        perturb_norms(block, torch.Generator(device=device).manual_seed(0))
    return block


def variants(tp: Any, model: str, device: torch.device, label: str, fn: Callable[[], Any],
             sets: List[tuple]) -> List[Dict[str, Any]]:
    """``fn()`` with each set of patterns on against every pattern off."""
    with tp.only():
        ref = poisoned(device, fn)
    known = set(tp.status())
    from torchpatches.ops import _modulate as modulate, _qk_norm_rope as qk_norm_rope

    rows = []
    for names in sets:
        calls: List[tuple] = []  # fused op bodies that ran: a row whose patterns all stepped aside says so
        with tp.only(*[n for n in names if n in known]), captured(modulate, "_impl", calls), \
                captured(qk_norm_rope, "_impl", calls):
            got = poisoned(device, fn)
        label_on = '+'.join(names) if names != ALL[model] else 'all'
        rows.append(checked(f"{label} [{label_on} on; {len(calls)} fused calls]", got, ref))
    return rows


# --------------------------------------------------------------------------------- the glue ops


def glue_rows(norm: torch.nn.Module, S: int, D: int, stream: str, device: torch.device, dtype: torch.dtype,
              gen: torch.Generator) -> List[Dict[str, Any]]:
    """The block glue ops as ``_modulate_calls`` calls them (``fuse=True``) against diffusers' expressions."""
    from torchpatches.patches._modulate_calls import modulated, residual, residual_modulated

    rnd = lambda *s, k=1.0: (k * torch.randn(*s, generator=gen, device=device)).to(dtype)  # noqa: E731
    x, y = rnd(1, S, D), rnd(1, S, D)
    gate, scale, shift = rnd(1, D, k=0.3), rnd(1, D, k=0.3), rnd(1, D, k=0.3)
    pre = lambda h: norm(h.float()) * (1 + scale.float()[:, None])  # noqa: E731 - the last rounded intermediate
    res = x.float().abs() + (gate.float()[:, None] * y.float()).abs()
    h_ref = x + gate.unsqueeze(1) * y
    return [
        checked(f"op layer_norm_modulate ({stream})", poisoned(device, lambda: modulated(norm, x, scale, shift, fuse=True)),
                poisoned(device, lambda: norm(x) * (1 + scale[:, None]) + shift[:, None]), [pre(x)]),
        checked(f"op gate_residual_layer_norm_modulate ({stream})",
                poisoned(device, lambda: residual_modulated(norm, x, gate, y, scale, shift, fuse=True)),
                poisoned(device, lambda: (h_ref, norm(h_ref) * (1 + scale[:, None]) + shift[:, None])),
                [res, pre(h_ref)]),
        checked(f"op gate_residual ({stream})", poisoned(device, lambda: residual(x, gate, y, clip=True)),
                poisoned(device, lambda: x + gate.unsqueeze(1) * y), [res]),
    ]


# ------------------------------------------------------------------------------------------ SD3.5


def sd3_rows(tp: Any, shape: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> List[Dict[str, Any]]:
    from diffusers.models import attention_processor
    from diffusers.models.attention import JointTransformerBlock
    from torchpatches.patches import sd3_qk_norm

    H, Dh, S, T = shape["H"], shape["Dh"], shape["S_img"], shape["S_txt"]
    D = H * Dh
    gen = torch.Generator(device=device).manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device).to(dtype)  # noqa: E731
    h, c, temb = rnd(1, S, D), rnd(1, T, D), rnd(1, D)
    rows: List[Dict[str, Any]] = []
    for last in (False, True):
        tag = "last block" if last else "block"
        block = make_block(JointTransformerBlock, device, dtype, D, H, Dh, context_pre_only=last, qk_norm="rms_norm")
        attn = block.attn
        # diffusers' q, k, v as JointAttnProcessor2_0 hands them to F.scaled_dot_product_attention
        calls: List[tuple] = []
        proxy = types.SimpleNamespace(**{**vars(torch.nn.functional),
                                         "scaled_dot_product_attention": torch.nn.functional.scaled_dot_product_attention})
        old_f = attention_processor.F
        attention_processor.F = proxy
        try:
            with captured(proxy, "scaled_dot_product_attention", calls), tp.only(), torch.no_grad():
                poison(device)
                attn(hidden_states=h, encoder_hidden_states=c)
        finally:
            attention_processor.F = old_f
        ref_qkv = calls[0][0][:3]

        def fused_qkv() -> Any:
            split = lambda t: t.view(1, -1, H, Dh)  # noqa: E731 - sd3_qk_norm._heads
            img = [split(p(h)) for p in (attn.to_q, attn.to_k, attn.to_v)]
            txt = [split(p(c)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            out = sd3_qk_norm._fused_qkv(attn, *img, *txt)
            if out is None:
                raise RuntimeError("sd3_qk_norm._fused_qkv declined the inputs")
            return [t.transpose(1, 2) for t in out]  # as the patch hands them to the attention

        with tp.only("sd3_qk_norm"):
            rows.append(checked(f"op qk_norm (sd3_qk_norm, {tag}): q, k, v", poisoned(device, fused_qkv), ref_qkv))
        rows += variants(tp, "sd3", device, f"processor ({tag})",
                         lambda: attn(hidden_states=h, encoder_hidden_states=c), [PROCESSOR["sd3"]])
        rows += variants(tp, "sd3", device, tag, lambda: block(hidden_states=h, encoder_hidden_states=c, temb=temb),
                         list(BLOCK["sd3"]) + [ALL["sd3"]])
    rows += glue_rows(block.norm2, S, D, "image", device, dtype, gen)
    rows += glue_rows(block.norm2, T, D, "text", device, dtype, gen)
    return rows


# -------------------------------------------------------------------------------------- QwenImage


def qwen_setup(shape: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope, QwenImageTransformerBlock

    H, Dh, side, T = shape["H"], shape["Dh"], shape["side"], shape["S_txt"]
    D = H * Dh
    gen = torch.Generator(device=device).manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device).to(dtype)  # noqa: E731
    mask = torch.zeros(1, T, dtype=torch.bool, device=device)  # the model hands blocks a bool mask
    mask[:, :shape["valid"]] = True
    with torch.device(device):
        rope = QwenEmbedRope(theta=10000, axes_dim=list(shape["axes"]), scale_rope=True)
    freqs = rope([[(1, side, side)]], max_txt_seq_len=T, device=device)
    block = make_block(QwenImageTransformerBlock, device, dtype, D, H, Dh)
    return dict(block=block, h=rnd(1, side * side, D), c=rnd(1, T, D), temb=rnd(1, D), mask=mask, freqs=freqs,
                gen=gen, H=H, Dh=Dh, D=D)


def qwen_qkv(tp: Any, s: Dict[str, Any], device: torch.device) -> tuple:
    """(patch's q, k, v from ``_fused_qkv``, diffusers' q, k, v and mask as given to ``dispatch_attention_fn``)."""
    from diffusers.models.transformers import transformer_qwenimage as qwen
    from torchpatches.patches import qwenimage_qk_norm_rope as patch

    attn, h, c = s["block"].attn, s["h"], s["c"]
    calls: List[tuple] = []
    with captured(qwen, "dispatch_attention_fn", calls), tp.only(), torch.no_grad():
        poison(device)
        attn(hidden_states=h, encoder_hidden_states=c, encoder_hidden_states_mask=s["mask"],
             image_rotary_emb=s["freqs"])
    (args, kwargs), = calls

    def fused_qkv() -> Any:
        img = [p(h).unflatten(-1, (-1, s["Dh"])) for p in (attn.to_q, attn.to_k, attn.to_v)]
        txt = [p(c).unflatten(-1, (-1, s["Dh"])) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        out = patch._fused_qkv(attn, img, txt, s["freqs"])
        if out is None:
            raise RuntimeError("qwenimage_qk_norm_rope._fused_qkv declined the inputs")
        return out

    with tp.only("qwenimage_qk_norm_rope"):
        got = poisoned(device, fused_qkv)
    return got, args[:3], kwargs.get("attn_mask")


def qwen_rows(tp: Any, shape: Dict[str, Any], device: torch.device, dtype: torch.dtype) -> List[Dict[str, Any]]:
    s = qwen_setup(shape, device, dtype)
    block, attn = s["block"], s["block"].attn
    got, ref, _ = qwen_qkv(tp, s, device)
    rows = [checked("op qk_norm_rope (qwenimage_qk_norm_rope): q, k, v", got, ref,
                    [pair_mag(ref[0]), pair_mag(ref[1]), None])]
    kw = dict(encoder_hidden_states_mask=s["mask"], image_rotary_emb=s["freqs"])
    rows += variants(tp, "qwenimage", device, "processor",
                     lambda: attn(hidden_states=s["h"], encoder_hidden_states=s["c"], **kw), [PROCESSOR["qwenimage"]])
    rows += variants(tp, "qwenimage", device, "block",
                     lambda: block(s["h"], s["c"], s["mask"], s["temb"], s["freqs"]),
                     list(BLOCK["qwenimage"]) + [ALL["qwenimage"]])
    rows += glue_rows(block.img_norm2, s["h"].shape[1], s["D"], "image", device, dtype, s["gen"])
    rows += glue_rows(block.txt_norm2, s["c"].shape[1], s["D"], "text", device, dtype, s["gen"])
    return rows


# --------------------------------------------------------------------------- --qwen-sdpa-probe


def sdpa_probe(tp: Any, shape: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """fp32, PyTorch tier forced (the failing tests' setting): where do diffusers and the patch part?"""
    import torch.nn.functional as F
    from diffusers.models.transformers import transformer_qwenimage as qwen
    from torchpatches.ops import force_tier
    from torchpatches.ops._qk_norm_rope import _rope_torch
    from torchpatches.patches._qwenimage_tables import rope_tables

    s = qwen_setup(shape, device, torch.float32)
    out: Dict[str, Any] = {}
    # 1. RoPE alone: diffusers' complex multiply vs the op's torch tier (x * cos + rotate(x) * sin)
    img_freqs, txt_freqs = s["freqs"]
    x = torch.randn(1, img_freqs.shape[0], s["H"], s["Dh"], generator=s["gen"], device=device)
    cos, sin = rope_tables(img_freqs, txt_freqs, x.shape[1], txt_freqs.shape[0], s["Dh"], x.device)  # "cuda:0", not "cuda"
    T = txt_freqs.shape[0]
    complex_form = qwen.apply_rotary_emb_qwen(x, img_freqs, use_real=False)
    real_form = _rope_torch(x, cos[T:], sin[T:])
    out["rope complex vs real form"] = compare(real_form, complex_form, pair_mag(complex_form))
    # the complex product written as separate (unfused) fp32 ops: equal to the real form, so any difference
    # above is how the complex multiply rounds (an FMA in CUDA's complex<float> operator*)
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    fc, fs = img_freqs.real[None, :, None], img_freqs.imag[None, :, None]
    by_hand = torch.stack([a * fc - b * fs, a * fs + b * fc], -1).flatten(-2)
    out["rope complex vs unfused a*c-b*d"] = compare(by_hand, complex_form, pair_mag(complex_form))
    # 2. the whole stretch, PyTorch tier
    with force_tier("torch"):
        got, ref, mask = qwen_qkv(tp, s, device)
    out["q,k,v (torch tier) vs diffusers"] = [compare(g, r) for g, r in zip(got, ref)]
    out["strides patch / diffusers"] = [[list(g.stride()), list(r.stride())] for g, r in zip(got, ref)]
    out["mask"] = None if mask is None else dict(dtype=str(mask.dtype), shape=list(mask.shape))
    # 3. SDPA: diffusers' values in the patch's layout and in diffusers' own: same output? which backend?
    relaid = [torch.empty_strided(g.shape, g.stride(), device=device).copy_(r) for g, r in zip(got, ref)]
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731 - diffusers' native backend
        *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
    with torch.no_grad():
        out["sdpa same values, patch layout vs diffusers layout"] = compare(sdpa(*relaid), sdpa(*ref))
        out["sdpa patch q,k,v vs diffusers q,k,v"] = compare(sdpa(*got), sdpa(*ref))
    try:
        from torch.nn.attention import SDPBackend

        pick = lambda qkv: SDPBackend(torch._fused_sdp_choice(*(t.transpose(1, 2) for t in qkv), attn_mask=mask)).name  # noqa: E731
        out["sdpa backend patch / diffusers"] = [pick(got), pick(ref)]
    except Exception as error:  # noqa: BLE001 - a private API
        out["sdpa backend patch / diffusers"] = f"{type(error).__name__}: {error}"
    if x.shape[1] <= 1024:  # the math backend's fp32 attention matrices at 7145 tokens: not worth the memory
        out["vmap"] = vmap_probe(tp, s, device)
    return out


def vmap_probe(tp: Any, s: Dict[str, Any], device: torch.device) -> Dict[str, str]:
    """diffusers' processor (patches off) under vmap over hidden_states: default SDPA backends vs math only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attn = s["block"].attn
    batch = torch.stack([s["h"], s["h"] * 0.5])

    def one(h: torch.Tensor) -> torch.Tensor:
        return attn(hidden_states=h, encoder_hidden_states=s["c"], encoder_hidden_states_mask=s["mask"],
                    image_rotary_emb=s["freqs"])[0]

    result = {}
    for name, ctx in (("default backends", contextlib.nullcontext()), ("math only", sdpa_kernel([SDPBackend.MATH]))):
        try:
            with ctx, tp.only(), torch.no_grad():
                torch.func.vmap(one)(batch)
            result[name] = "ok"
        except Exception as error:  # noqa: BLE001 - the probe reports it
            result[name] = f"{type(error).__name__}: {str(error)[:120]}"
    return result


# ------------------------------------------------------------------------------------------- main


def table(rows: List[Dict[str, Any]]) -> None:
    print(f"{'model':<10} {'stretch':<62} {'out':>3} {'identical':>9} {'max ulp':>8} {'rel err':>9} {'NaN':>4}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<10} {r['stretch']:<62} FAILED: {r['error'][:100]}")
            continue
        for i, c in enumerate(r["checks"]):
            print(f"{r['model'] if i == 0 else '':<10} {r['stretch'] if i == 0 else '':<62} {i:>3} "
                  f"{c['identical_frac']:>9.6f} {c['max_ulp']:>8.2f} {c['rel_err']:>9.2e} {c['nan']:>4}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny dims, a forced tier (--tier)")
    parser.add_argument("--tier", default="torch", choices=("torch", "triton"), help="--tiny: the tier forced")
    parser.add_argument("--models", default="sd3,qwenimage")
    parser.add_argument("--qwen-sdpa-probe", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import torchpatches as tp
    from torchpatches.ops import force_tier

    device = torch.device("cpu" if args.tiny else "cuda")
    shapes = TINY if args.tiny else SHAPES
    results: Dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                               "versions": _bench.versions(), "rows": []}
    build = {"sd3": sd3_rows, "qwenimage": qwen_rows}
    with force_tier(args.tier) if args.tiny else contextlib.nullcontext():
        for model in args.models.split(","):
            try:
                rows = build[model](tp, shapes[model], device, torch.bfloat16)
            except Exception as error:  # noqa: BLE001 - one broken model must not cost the run
                rows = [dict(stretch="(all)", error=f"{type(error).__name__}: {error}")]
            for r in rows:
                r["model"] = model
            results["rows"] += rows
    table(results["rows"])
    if args.qwen_sdpa_probe:
        probes = {"tiny (test config)": TINY["qwenimage"]} if args.tiny else {"tiny (test config)": TINY["qwenimage"],
                                                                            "production": SHAPES["qwenimage"]}
        results["qwen_sdpa_probe"] = {name: sdpa_probe(tp, shape, device) for name, shape in probes.items()}
        for name, probe in results["qwen_sdpa_probe"].items():
            print(f"\nqwen sdpa probe, {name}:")
            for key, value in probe.items():
                print(f"  {key}: {json.dumps(value)}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    bad = [r for r in results["rows"] if "error" in r or any(c["nan"] > c["ref_nan"] for c in r["checks"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
