"""The ``qwenimage21`` patch's replacement code, imported when the registry patches its first target.

Its banner and declaration: ``patches/qwenimage21.py``."""
from __future__ import annotations

import sys
from typing import Any, Optional

import torch

from ..._core.lazy import lazy_module
from .._diffusers_norms import diffusers_rms_norms_fit
from .._fused_common import FALLBACK, declined, dropout, fusable, linear, plain_layer_norm, remembered, stock
from .._modulate_calls import _rows_fit

_Q21 = "diffusers.models.transformers.transformer_qwenimage21"
_QK_NORMS = ("norm_q", "norm_k")
_BLOCK_NORMS = ("img_norm1", "img_norm2")

#: The ops and the per-step tables, imported at the first fused call (importing an op registers torch.library ops).
_modulate = lazy_module("torchpatches.ops._modulate")
_swiglu = lazy_module("torchpatches.ops._swiglu")
_per_step = lazy_module("torchpatches.patches._per_step")


# ---- the attention processor --------------------------------------------------------------------------------


def _prefix_fits(cached_k: Any, key: torch.Tensor) -> bool:
    """The cached keys ``[B, P, H, D]`` of the new keys' dtype, device, batch, heads and head dim."""
    return (type(cached_k) is torch.Tensor and cached_k.dtype == key.dtype and cached_k.device == key.device
            and cached_k.dim() == 4 and cached_k.shape[0] == key.shape[0] and cached_k.shape[2:] == key.shape[2:])


def _fused_qk(attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary_emb: Any,
              cached_k: Any) -> Optional[tuple]:
    """``(q, k, prefixed)``: q and k normalized as diffusers' ``RMSNorm`` rounds (``.to(value.dtype)`` then a no-op)
    and rotated in one ``ops.qk_norm_rope`` launch, k behind the KV cache's keys where ``prefixed`` (``cached_k``:
    the cached step's, else None); None where a tensor does not fit it (diffusers' stretch runs).

    The PyTorch tier has the op normalize only and rotates with diffusers' own complex multiply, as the QwenImage
    (v1) processor does (``_joint_attention._fused_qkv``: torch rounds a complex product differently from the
    real-form rotation where its vectorized loop does not reach); the caller then concatenates as diffusers does."""
    if not (type(key) is torch.Tensor and type(value) is torch.Tensor and key.shape == query.shape
            and key.dtype == value.dtype == query.dtype and query.shape[-1] % 2 == 0
            and diffusers_rms_norms_fit(attn, query, _QK_NORMS)):
        return None
    from ...ops._qk_norm_rope import prechecked  # lazily: importing an op registers torch.library ops
    from ...ops._runtime.tiers import choose_tier

    tables = (None, None)
    own_rotation = False
    if rotary_emb is not None:
        found = None if getattr(rotary_emb, "ndim", None) != 2 else \
            _per_step().complex_tables(rotary_emb, query.shape[1], query.shape[-1], query.device)
        if found is None:
            declined("rotary_emb is not a complex64 [S, D/2] table of the queries' length")
            return None
        own_rotation = choose_tier(query.device.type, None) == "torch"  # never under autograd: fusable() said so
        tables = (None, None) if own_rotation else found
    modules = attn._modules
    norm_q, norm_k = modules["norm_q"], modules["norm_k"]
    prefix = cached_k if not own_rotation and cached_k is not None and _prefix_fits(cached_k, key) else None
    q, k, _ = prechecked(query, key, *tables, norm_q.weight, norm_k.weight, (norm_q.eps, norm_k.eps, 0.0, 0.0),
                         rounding="each", k_prefix=prefix)
    if own_rotation:
        rotate = sys.modules[_Q21].apply_rotary_emb_qwen
        q, k = rotate(q, rotary_emb, use_real=False), rotate(k, rotary_emb, use_real=False)
    return q, k, prefix is not None


def processor(self, attn, hidden_states, attention_mask=None, rotary_emb=None, layer_cache=None, kv_cache_mode=None,
              cache_write_slice=None, segments=None, key_valid=None):
    if not (fusable(hidden_states, (attn,)) and hidden_states.dim() == 3):
        return FALLBACK
    module = sys.modules[_Q21]
    # diffusers 0.42.1 QwenImage21AttnProcessor.__call__ (its _qwenimage21_prepare_qkv inlined), with the q/k
    # stretch (norms, the cast, RoPE, the cached keys' concat) fused.
    query = linear(attn.to_q, hidden_states)
    key = linear(attn.to_k, hidden_states)
    value = linear(attn.to_v, hidden_states)
    head_dim = attn.inner_dim // attn.heads
    query = query.unflatten(-1, (-1, head_dim))
    key = key.unflatten(-1, (-1, head_dim))
    value = value.unflatten(-1, (-1, head_dim))
    cached = layer_cache.get() if layer_cache is not None and kv_cache_mode == "cached" else None
    qk = _fused_qk(attn, query, key, value, rotary_emb, None if cached is None else cached[0])
    prefixed = False
    if qk is None:
        query = attn.norm_q(query).to(value.dtype)
        key = attn.norm_k(key).to(value.dtype)
        if rotary_emb is not None:
            query = module.apply_rotary_emb_qwen(query, rotary_emb, use_real=False)
            key = module.apply_rotary_emb_qwen(key, rotary_emb, use_real=False)
    else:
        query, key, prefixed = qk
    if layer_cache is not None:
        if kv_cache_mode == "extract" and cache_write_slice is not None:
            layer_cache.store(key[:, cache_write_slice].clone(), value[:, cache_write_slice].clone())
        elif kv_cache_mode == "cached":
            cached_k, cached_v = cached
            if not prefixed:  # else the op wrote k behind the cached keys
                key = torch.cat([cached_k, key], dim=1)
            value = torch.cat([cached_v, value], dim=1)
    seq_len_q = query.shape[1]
    hidden_states = _attention(self, module, query, key, value, attention_mask, segments, key_valid)
    hidden_states = hidden_states[:, :seq_len_q]
    hidden_states = hidden_states.flatten(2, 3).type_as(query)
    hidden_states = linear(attn.to_out[0], hidden_states)
    return dropout(attn.to_out[1], hidden_states)


def _attention(self: Any, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, segments: Any, key_valid: Any) -> torch.Tensor:
    """diffusers 0.42.1 ``QwenImage21AttnProcessor.__call__``'s attention calls, verbatim: one over the cached prefix
    and the target (decode), or the prefill's one per prefix segment and one for the target."""
    if segments is None:
        # decode: full attention over [cached prefix, target]
        return module.dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
    # prefill: every segment attends to the keys `[0, end)`; text segments get a causal triangle over their own
    # keys; padded text keys are dropped.
    prefix_len = segments[-1][1] if segments else 0
    outputs = []
    for start, end, is_text in segments:
        seg_mask = None
        if is_text:
            seg_len = end - start
            seg_mask = torch.cat(
                [
                    torch.ones(seg_len, start, dtype=torch.bool, device=query.device),
                    torch.tril(torch.ones(seg_len, seg_len, dtype=torch.bool, device=query.device)),
                ],
                dim=1,
            )[None, None]
        if key_valid is not None:
            seg_key_valid = key_valid[:, None, None, :end]
            seg_mask = seg_key_valid if seg_mask is None else (seg_mask & seg_key_valid)
        outputs.append(module.dispatch_attention_fn(
            query[:, start:end], key[:, :end], value[:, :end], attn_mask=seg_mask, dropout_p=0.0, backend=None,
            parallel_config=self._parallel_config,
        ))
    outputs.append(module.dispatch_attention_fn(
        query[:, prefix_len:], key, value, attn_mask=None if key_valid is None else key_valid[:, None, None, :],
        dropout_p=0.0, backend=None, parallel_config=self._parallel_config,
    ))
    return torch.cat(outputs, dim=1)


# ---- the block ----------------------------------------------------------------------------------------------


def _block_fits(block: Any, x: torch.Tensor) -> bool:
    """Stock ``nn.LayerNorm``s without affine parameters of x's width: decided once per block and width."""
    def check() -> bool:
        modules = block._modules
        return all(plain_layer_norm(modules.get(name), x.shape[-1]) for name in _BLOCK_NORMS)

    if remembered(block, (x.shape[-1],), check, _BLOCK_NORMS):
        return True
    declined("a block norm is not a stock nn.LayerNorm without affine parameters of the input's width")
    return False


#: A zero ``[D]`` row per (dtype, device, width): the shift the modulate op adds where diffusers adds none.
_ZEROS: dict = {}


def _zero_shift(x: torch.Tensor, rows: int, select: Optional[torch.Tensor]) -> torch.Tensor:
    """A zero vector of ``rows`` rows (batch stride 0; ``[B + 1, D]`` with ``select``, else ``[B, 1, D]``):
    ``round(round(n * (1 + scale)) + 0)`` is diffusers' ``n * (1 + scale)`` (up to the sign of a zero). Made outside
    inference mode: usable in every mode after."""
    key = (x.dtype, x.device, x.shape[-1])
    zero = _ZEROS.get(key)
    if zero is None:
        with torch.inference_mode(False):
            zero = _ZEROS[key] = torch.zeros(1, x.shape[-1], dtype=x.dtype, device=x.device)
    return zero.expand(rows, x.shape[-1]) if select is not None else zero.expand(rows, 1, x.shape[-1])


def _mask_fits(mask: Any, x: torch.Tensor) -> bool:
    """No mask, or a bool ``[S]`` tensor on x's device (``target_token_mask``)."""
    if mask is None or (type(mask) is torch.Tensor and mask.dtype == torch.bool and mask.device == x.device
                        and tuple(mask.shape) == (x.shape[1],)):
        return True
    declined("target_token_mask is not a bool [S] tensor")
    return False


def _vectors(x: torch.Tensor, modulation: Any, mask: Any) -> Optional[tuple]:
    """``(scale1, tanh(gate1), scale2, tanh(gate2), select)`` for the modulate op: without a mask the ``[B, 1, D]``
    vectors diffusers' ``_select_modulation_rows`` makes (``select`` None); with one the ``[B + 1, D]`` rows and the
    mask as ``select`` (the op picks each token's row as ``_select_modulation_rows`` does, without its ``[B, S, D]``
    tensors: ``tanh`` of the selected rows is the selected ``tanh`` rows). None where they do not fit (diffusers'
    block runs)."""
    B, S, D = x.shape
    rows = B if mask is None else B + 1
    if not (type(modulation) is torch.Tensor and modulation.dtype == x.dtype and modulation.device == x.device
            and tuple(modulation.shape) == (rows, 4 * D)):
        declined("modulation is not [B (+ 1), 4 * D] of the activations' dtype")
        return None
    if not _mask_fits(mask, x):
        return None
    scale1, gate1, scale2, gate2 = modulation.chunk(4, dim=-1)  # = chunk(2) of each chunk(2) half
    if mask is None:
        return scale1.unsqueeze(1), gate1.tanh().unsqueeze(1), scale2.unsqueeze(1), gate2.tanh().unsqueeze(1), None
    return scale1, gate1.tanh(), scale2, gate2.tanh(), mask


def _feed_forward(ff: Any, y: torch.Tensor) -> torch.Tensor:
    """``ff(y)``; for a stock ``QwenImage21SwiGLUFeedForward`` with a stock ``nn.SiLU``,
    ``out(silu(gate_layer(y)) * proj(y))`` with the product in one kernel (the Linears called as :func:`linear`
    does: LoRA layers and hooked ones as modules)."""
    if not stock(ff, sys.modules[_Q21].QwenImage21SwiGLUFeedForward):
        return ff(y)
    modules = ff._modules
    if not stock(modules["activation_fn"], torch.nn.SiLU):
        return ff(y)
    gate, up = linear(modules["gate_layer"], y), linear(modules["proj"], y)
    if not _rows_fit(gate, up):
        return modules["out"](modules["activation_fn"](gate) * up)
    return linear(modules["out"], _swiglu().prechecked(gate, up))


def block(self, hidden_states, modulation, rotary_emb=None, attention_mask=None, target_token_mask=None,
          layer_cache=None, kv_cache_mode=None, cache_write_slice=None, segments=None, key_valid=None):
    x = hidden_states
    if not (fusable(x, (self,), modulation) and x.dim() == 3 and _block_fits(self, x)):
        return FALLBACK
    vectors = _vectors(x, modulation, target_token_mask)
    if vectors is None:
        return FALLBACK
    scale1, gate1, scale2, gate2, select = vectors
    zero = _zero_shift(x, modulation.shape[0], select)
    ops = _modulate()
    norm1, norm2 = self._modules["img_norm1"], self._modules["img_norm2"]
    # diffusers 0.42.1 QwenImage21TransformerBlock.forward: img_norm1(x) * (1 + scale1)
    y = ops.prechecked(x, None, None, scale1, zero, norm1.eps, select=select)[0]
    attn_output = self.attn(
        hidden_states=y, attention_mask=attention_mask, rotary_emb=rotary_emb, layer_cache=layer_cache,
        kv_cache_mode=kv_cache_mode, cache_write_slice=cache_write_slice, segments=segments, key_valid=key_valid,
    )
    if not _rows_fit(x, attn_output):  # a processor that returns another form: diffusers' expressions from here
        x = x + _per_token(gate1, select) * attn_output
        x = x + _per_token(gate2, select) * self.img_mlp(norm2(x) * (1 + _per_token(scale2, select)))
        return x.clip(-65504, 65504) if x.dtype == torch.float16 else x
    # x + tanh(gate1) * attn_output; img_norm2(x) * (1 + scale2)
    x, y = ops.prechecked(x, gate1, attn_output, scale2, zero, norm2.eps, select=select)
    ff_output = _feed_forward(self._modules["img_mlp"], y)
    if not _rows_fit(x, ff_output):
        x = x + _per_token(gate2, select) * ff_output
        return x.clip(-65504, 65504) if x.dtype == torch.float16 else x
    # x + tanh(gate2) * img_mlp(...), then the fp16 clip
    return ops.prechecked(x, gate2, ff_output, None, None, None, clip=True, select=select)[0]


def _per_token(v: torch.Tensor, select: Optional[torch.Tensor]) -> torch.Tensor:
    """A vector as diffusers' expressions take it: the ``[B + 1, D]`` rows selected per token (diffusers' own
    ``_select_modulation_rows``), or the ``[B, 1, D]`` vector itself."""
    return v if select is None else sys.modules[_Q21]._select_modulation_rows(v, select)


# ---- the final norm ---------------------------------------------------------------------------------------------


def norm_out(self, hidden_states, conditioning_embedding, target_token_mask=None):
    x = hidden_states
    modules = self._modules
    if not (fusable(x, (self,), conditioning_embedding) and x.dim() == 3
            and plain_layer_norm(modules["norm"], x.shape[-1])):
        return FALLBACK
    # diffusers 0.42.1 QwenImage21AdaLayerNormContinuous.forward (silu and linear as module calls), the row selection
    # and norm(x) * (1 + scale) in one kernel.
    scale = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    rows = x.shape[0] if target_token_mask is None else x.shape[0] + 1
    if not (type(scale) is torch.Tensor and scale.dtype == x.dtype and scale.device == x.device
            and tuple(scale.shape) == (rows, x.shape[-1]) and _mask_fits(target_token_mask, x)):
        scale = sys.modules[_Q21]._select_modulation_rows(scale, target_token_mask)  # diffusers' expressions
        return modules["norm"](x) * (1 + scale)
    vector = scale if target_token_mask is not None else scale.unsqueeze(1)
    return _modulate().prechecked(x, None, None, vector, _zero_shift(x, rows, target_token_mask), modules["norm"].eps,
                                  select=target_token_mask)[0]
