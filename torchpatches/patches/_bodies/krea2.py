"""The ``krea2`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/krea2.py``. The block's glue runs on the table-modulated block body
(``patches/_table_modulated.py``)."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from ..._core.lazy import lazy_module
from ...ops._runtime.tiers import FLOAT_DTYPES
from .._fused_common import _CALL_IMPL, _MODULE_CALL, FALLBACK, declined, fusable, linear, remembered, stock
from .._modulate_calls import _rows_fit
from .._table_modulated import Stream, Table

_KREA2 = "diffusers.models.transformers.transformer_krea2"
_BLOCK_NORMS = ("norm1", "norm2")
#: Krea 2's glue on the table-modulated body: zero-centered RMSNorms, diffusers' rounding after each op.
KREA2 = Table(once=False, zero_centered=True)
_QK_NORMS = ("norm_q", "norm_k")

#: The op, imported at the first fused call (importing it registers torch.library ops).
_swiglu = lazy_module("torchpatches.ops._swiglu")


def _plain_norm(norm: Any, width: int, device: torch.device) -> bool:
    """A stock ``Krea2RMSNorm(width)``: a plain ``[width]`` float weight on ``device`` (fp32 as its checkpoints keep
    it, or the model's dtype; the ops round ``1 + weight`` to its dtype, as diffusers' ``weight + 1.0``), a number
    for eps."""
    if not stock(norm, sys.modules[_KREA2].Krea2RMSNorm):
        return False
    d, weight = norm.__dict__, norm._parameters.get("weight")
    return (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.dtype in FLOAT_DTYPES
            and weight.shape == (width,) and weight.device == device and d.get("dim") == width
            and type(d.get("eps")) in (int, float))


def _norms_fit(module: Any, x: torch.Tensor, names: tuple) -> bool:
    """The submodules ``names`` of ``module`` are :func:`_plain_norm` for x's last dim, with one weight dtype:
    decided once per module instance and x's device and width while they are the same objects in the same state."""
    def check() -> bool:
        modules = module._modules
        norms = [modules.get(name) for name in names]
        return all(_plain_norm(norm, x.shape[-1], x.device) for norm in norms) and \
            len({norm._parameters["weight"].dtype for norm in norms}) == 1

    if remembered(module, (x.device, x.shape[-1]), check, names):
        return True
    declined("a norm is not a stock Krea2RMSNorm with a float weight of the input's width")
    return False


# ---- the attention processor --------------------------------------------------------------------------------


def _fused_qk(attn: Any, query: torch.Tensor, key: torch.Tensor, image_rotary_emb: Any, groups: int
              ) -> Optional[tuple]:
    """(q, k) normalized, rotated (when tables are given) and k repeated ``groups`` times over heads, in one launch of
    ``ops.qk_norm_rope``; None where a tensor does not fit it."""
    if type(key) is not torch.Tensor or key.dtype != query.dtype or not _norms_fit(attn, query, _QK_NORMS):
        return None
    tables = (None, None)
    if image_rotary_emb is not None:
        if not (isinstance(image_rotary_emb, tuple) and len(image_rotary_emb) == 2
                and all(type(t) is torch.Tensor for t in image_rotary_emb)):
            declined("image_rotary_emb is not a (cos, sin) pair of tensors")
            return None
        tables = image_rotary_emb
    from ...ops._qk_norm_rope import qk_norm_rope  # lazily: importing an op registers torch.library ops

    modules = attn._modules
    norm_q, norm_k = modules["norm_q"], modules["norm_k"]
    try:
        q, k, _ = qk_norm_rope(query, key, *tables, q_weight=norm_q.weight, k_weight=norm_k.weight,
                               eps_q=norm_q.eps, eps_k=norm_k.eps, rounding="zero_centered", k_repeat=groups)
    except ValueError:  # tables of another form, a forced tier that cannot run: checked before computing
        declined("image_rotary_emb is not fp32 (cos, sin) [S, D], or a forced tier cannot run")
        return None
    return q, k


def processor(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
    if not (fusable(hidden_states, (attn,), attention_mask) and hidden_states.dim() == 3):
        return FALLBACK
    module = sys.modules[_KREA2]
    # diffusers 0.42.1 Krea2AttnProcessor.__call__, with the q/k stretch (norms, RoPE, k's GQA repeat) and the
    # sigmoid gate fused.
    query = linear(attn.to_q, hidden_states).unflatten(-1, (attn.num_heads, attn.head_dim))
    key = linear(attn.to_k, hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
    value = linear(attn.to_v, hidden_states).unflatten(-1, (attn.num_kv_heads, attn.head_dim))
    gate = linear(attn.to_gate, hidden_states)

    num_key_value_groups = attn.num_heads // attn.num_kv_heads
    qk = _fused_qk(attn, query, key, image_rotary_emb, max(num_key_value_groups, 1))
    if qk is None:
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if image_rotary_emb is not None:
            query = module.apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = module.apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        if num_key_value_groups > 1:
            key = key.repeat_interleave(num_key_value_groups, dim=2)
    else:
        query, key = qk
    if num_key_value_groups > 1:
        value = value.repeat_interleave(num_key_value_groups, dim=2)

    hidden_states = module.dispatch_attention_fn(
        query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
        parallel_config=self._parallel_config,
    )
    hidden_states = hidden_states.flatten(2, 3)
    if _rows_fit(gate, hidden_states):  # hidden_states * torch.sigmoid(gate) in one kernel
        hidden_states = _swiglu().prechecked(gate, hidden_states, "sigmoid")
    else:
        hidden_states = hidden_states * torch.sigmoid(gate)
    return linear(attn.to_out[0], hidden_states)


# ---- the block ----------------------------------------------------------------------------------------------

def _feed_forward(y: torch.Tensor, ff: Any) -> torch.Tensor:
    """``ff(y)``; for a stock ``Krea2SwiGLU``, ``down(silu(gate(y)) * up(y))`` with the product in one kernel (the
    Linears called as :func:`linear` does: LoRA layers and hooked ones as modules)."""
    if not stock(ff, sys.modules[_KREA2].Krea2SwiGLU):
        return ff(y)
    modules = ff._modules
    gate, up = linear(modules["gate"], y), linear(modules["up"], y)
    if not _rows_fit(gate, up):
        return modules["down"](torch.nn.functional.silu(gate) * up)
    return linear(modules["down"], _swiglu().prechecked(gate, up))


def _attend(y: torch.Tensor, attn: Any, attention_mask: Any, image_rotary_emb: Any) -> Any:
    """``attn(y, attention_mask=..., image_rotary_emb=...)``; for a stock ``Krea2Attention`` (no hooks, torch's own
    call path) what its ``forward`` does without extra keyword arguments, ``processor(attn, y, mask, rope)``,
    without its per-call ``inspect.signature`` of the processor (nothing to filter). The block's target assumes
    ``Krea2Attention.forward`` (checked per call)."""
    cls = sys.modules[_KREA2].Krea2Attention
    if stock(attn, cls) and cls.__call__ is _MODULE_CALL and cls._call_impl is _CALL_IMPL:
        return attn.processor(attn, y, attention_mask, image_rotary_emb)
    return attn(y, attention_mask=attention_mask, image_rotary_emb=image_rotary_emb)


def _temb_fits(x: torch.Tensor, temb: Any, table: Any) -> bool:
    """``temb`` ``[B, 1, 6 * D]`` and the block's ``[6, D]`` table, plain tensors of x's dtype and device: the
    modulation diffusers forms (``temb.unflatten(-1, (6, -1)) + table``) is then six ``[B, 1, D]`` vectors of that
    dtype, which the op adds in its kernels."""
    B, _, D = x.shape
    ok = (type(temb) is torch.Tensor and type(table) in (torch.Tensor, torch.nn.Parameter)
          and temb.dtype == table.dtype == x.dtype and temb.device == table.device == x.device
          and tuple(temb.shape) == (B, 1, 6 * D) and tuple(table.shape) == (6, D))
    if not ok:
        declined("temb is not [B, 1, 6 * D] of the activations' dtype, or the table not [6, D] of it")
    return ok


def block(self, hidden_states, temb, image_rotary_emb, attention_mask=None):
    x = hidden_states
    if not (fusable(x, (self,), temb) and x.dim() == 3 and _norms_fit(self, x, _BLOCK_NORMS)):
        return FALLBACK
    table = self._parameters.get("scale_shift_table")
    if not _temb_fits(x, temb, table):
        return FALLBACK
    # diffusers 0.42.1 Krea2TransformerBlock.forward: modulation = temb.unflatten(-1, (6, -1)) + scale_shift_table,
    # its six vectors (prescale, preshift, pregate, postscale, postshift, postgate) summed in the kernels.
    prescale, preshift, pregate, postscale, postshift, postgate = zip(
        temb.unflatten(-1, (6, -1)).unbind(-2), table.expand(x.shape[0], 1, *table.shape).unbind(-2))
    modules = self._modules
    stream = Stream(KREA2, x)
    y = stream.step(None, None, prescale, preshift, modules["norm1"])
    attn_out = _attend(y, modules["attn"], attention_mask, image_rotary_emb)
    y = stream.step(pregate, attn_out, postscale, postshift, modules["norm2"])
    stream.step(postgate, _feed_forward(y, modules["ff"]))
    return stream.x
