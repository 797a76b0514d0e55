"""The ``rms_sandwich_block`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/rms_sandwich_block.py``. One body, :func:`_sandwich`, serves every block of this
shape; a family is a signature adapter (how its ``forward`` forms the four modulation vectors and calls attention)
and a row of :data:`_FEED_FORWARDS`."""
from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from ..._core.gates import fingerprint
from ..._core.lazy import lazy_module
from .._diffusers_norms import diffusers_rms_norms_fit
from .._fused_common import FALLBACK, declined, fusable, linear, stock
from .._modulate_calls import _rows_fit, _vectors_fit

_ZIMAGE = "diffusers.models.transformers.transformer_z_image"
_IDEOGRAM4 = "diffusers.models.transformers.transformer_ideogram4"

#: The feed-forward classes whose ``w2(silu(w1(y)) * w3(y))`` the fused path computes in their place, with the
#: fingerprints of the methods that define it (diffusers 0.42.1): another source runs the module.
_FEED_FORWARDS = {
    (_ZIMAGE, "FeedForward"): {"forward": "bc7925c2aa12ed0f", "_forward_silu_gating": "3e54b1328aa425ff"},
    (_IDEOGRAM4, "Ideogram4MLP"): {"forward": "78677b817b4cbead"},
}
_NORMS = ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")

#: The ops, imported at the first fused call (importing them registers torch.library ops).
_rms = lazy_module("torchpatches.ops._rms_modulate")
_swiglu = lazy_module("torchpatches.ops._swiglu")

#: feed-forward class -> its methods are the source the fused path was written from (checked once per class).
_VERIFIED: dict = {}


def _verified(cls: type) -> bool:
    ok = _VERIFIED.get(cls)
    if ok is None:
        methods = _FEED_FORWARDS.get((cls.__module__, cls.__name__))
        ok = _VERIFIED[cls] = methods is not None and all(
            fingerprint(vars(cls).get(name)) == expected for name, expected in methods.items())
    return ok


def _feed_forward(ff: Any, y: torch.Tensor) -> torch.Tensor:
    """``ff(y)``; for a stock feed-forward of a verified class, ``w2(silu(w1(y)) * w3(y))`` with the product in one
    kernel (the Linears called as :func:`linear` does: LoRA layers and hooked ones as modules)."""
    if not (stock(ff, type(ff)) and _verified(type(ff)) and "_forward_silu_gating" not in ff.__dict__):
        return ff(y)
    modules = ff._modules
    gate, up = linear(modules["w1"], y), linear(modules["w3"], y)
    if not _rows_fit(gate, up) or gate.dim() < 2:
        return ff(y)
    return linear(modules["w2"], _swiglu().prechecked(gate, up))


def _sandwich(block: Any, x: torch.Tensor, scale_msa: torch.Tensor, gate_msa: torch.Tensor,
              scale_mlp: torch.Tensor, gate_mlp: torch.Tensor, attend: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """diffusers 0.42.1's modulated RMSNorm-sandwich block after its vectors are formed (Z-Image's, Ideogram 4's):

        x = x + gate_msa * attention_norm2(attention(attention_norm1(x) * scale_msa))
        x = x + gate_mlp * ffn_norm2(feed_forward(ffn_norm1(x) * scale_mlp))

    with each norm, product and residual between the module calls in three kernels."""
    modules = block._modules
    norm1, norm2, ffn_norm1, ffn_norm2 = (modules[name] for name in _NORMS)
    ops = _rms()
    y = ops.prechecked(x, None, None, None, norm1.weight, scale_msa, 0.0, norm1.eps)[0]
    attn_out = attend(y)
    if not _rows_fit(x, attn_out):  # a processor that returns another form: diffusers' expression from here
        x = x + gate_msa * norm2(attn_out)
        return x + gate_mlp * ffn_norm2(block.feed_forward(ffn_norm1(x) * scale_mlp))
    x, y = ops.prechecked(x, gate_msa, attn_out, norm2.weight, ffn_norm1.weight, scale_mlp, norm2.eps, ffn_norm1.eps)
    ff_out = _feed_forward(modules["feed_forward"], y)
    if not _rows_fit(x, ff_out):
        return x + gate_mlp * ffn_norm2(ff_out)
    return ops.prechecked(x, gate_mlp, ff_out, ffn_norm2.weight, None, None, ffn_norm2.eps, 0.0)[0]


def _fits(block: Any, x: Any, *tensors: Any) -> bool:
    return fusable(x, (block,), *tensors) and x.dim() == 3 and diffusers_rms_norms_fit(block, x, _NORMS)


def _modulated(block: Any, x: torch.Tensor, scale_msa: Any, gate_msa: Any, scale_mlp: Any, gate_mlp: Any,
               attend: Callable[[torch.Tensor], Any]) -> torch.Tensor:
    """:func:`_sandwich` where the vectors fit the op, else the rest of diffusers' ``forward`` with them (the
    modulation Linear has run: handing the call back would run it, and its hooks, twice)."""
    if _vectors_fit(x, scale_msa, gate_msa, scale_mlp, gate_mlp):
        return _sandwich(block, x, scale_msa, gate_msa, scale_mlp, gate_mlp, attend)
    attn_out = attend(block.attention_norm1(x) * scale_msa)
    x = x + gate_msa * block.attention_norm2(attn_out)
    return x + gate_mlp * block.ffn_norm2(block.feed_forward(block.ffn_norm1(x) * scale_mlp))


def zimage(self, x, attn_mask, freqs_cis, adaln_input=None, noise_mask=None, adaln_noisy=None, adaln_clean=None):
    if not self.modulation:
        return declined("an unmodulated block (Z-Image's context refiner): diffusers' code")
    if not _fits(self, x, adaln_input, adaln_noisy, adaln_clean):
        return FALLBACK
    # diffusers 0.42.1 ZImageTransformerBlock.forward's modulation, verbatim.
    seq_len = x.shape[1]
    if noise_mask is not None:
        select_per_token = sys.modules[_ZIMAGE].select_per_token
        mod_noisy = self.adaLN_modulation(adaln_noisy)
        mod_clean = self.adaLN_modulation(adaln_clean)

        scale_msa_noisy, gate_msa_noisy, scale_mlp_noisy, gate_mlp_noisy = mod_noisy.chunk(4, dim=1)
        scale_msa_clean, gate_msa_clean, scale_mlp_clean, gate_mlp_clean = mod_clean.chunk(4, dim=1)

        gate_msa_noisy, gate_mlp_noisy = gate_msa_noisy.tanh(), gate_mlp_noisy.tanh()
        gate_msa_clean, gate_mlp_clean = gate_msa_clean.tanh(), gate_mlp_clean.tanh()

        scale_msa_noisy, scale_mlp_noisy = 1.0 + scale_msa_noisy, 1.0 + scale_mlp_noisy
        scale_msa_clean, scale_mlp_clean = 1.0 + scale_msa_clean, 1.0 + scale_mlp_clean

        scale_msa = select_per_token(scale_msa_noisy, scale_msa_clean, noise_mask, seq_len)
        scale_mlp = select_per_token(scale_mlp_noisy, scale_mlp_clean, noise_mask, seq_len)
        gate_msa = select_per_token(gate_msa_noisy, gate_msa_clean, noise_mask, seq_len)
        gate_mlp = select_per_token(gate_mlp_noisy, gate_mlp_clean, noise_mask, seq_len)
    else:
        mod = self.adaLN_modulation(adaln_input)
        scale_msa, gate_msa, scale_mlp, gate_mlp = mod.unsqueeze(1).chunk(4, dim=2)
        gate_msa, gate_mlp = gate_msa.tanh(), gate_mlp.tanh()
        scale_msa, scale_mlp = 1.0 + scale_msa, 1.0 + scale_mlp
    return _modulated(self, x, scale_msa, gate_msa, scale_mlp, gate_mlp,
                     lambda y: self.attention(y, attention_mask=attn_mask, freqs_cis=freqs_cis))


def ideogram4(self, hidden_states, attention_mask, image_rotary_emb, adaln_input):
    if not _fits(self, hidden_states, adaln_input):
        return FALLBACK
    # diffusers 0.42.1 Ideogram4TransformerBlock.forward's modulation, verbatim.
    mod = self.adaln_modulation(adaln_input)
    scale_msa, gate_msa, scale_mlp, gate_mlp = mod.chunk(4, dim=-1)
    gate_msa = torch.tanh(gate_msa)
    gate_mlp = torch.tanh(gate_mlp)
    scale_msa = 1.0 + scale_msa
    scale_mlp = 1.0 + scale_mlp
    return _modulated(self, hidden_states, scale_msa, gate_msa, scale_mlp, gate_mlp,
                     lambda y: self.attention(y, attention_mask=attention_mask, image_rotary_emb=image_rotary_emb))
