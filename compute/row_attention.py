"""The decoding attention of the packed paths: causal attention whose output for a query row depends only on that row
and the keys it sees, registered with transformers as :data:`ROW_INVARIANT_ATTENTION`.

Usage::

    register_attention()
    model.set_attn_implementation(ROW_INVARIANT_ATTENTION)
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from compute import cpu
from compute.native import NativeExtension

__all__ = ["ATTENTION", "ROW_INVARIANT_ATTENTION", "register_attention", "row_invariant_attention"]

ROW_INVARIANT_ATTENTION = "specstop_row_invariant"
"""The attention implementation packed models run with (registered with transformers' ``AttentionInterface``)."""


def row_invariant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention with each query row summed over exactly the keys before it, in an order of its own, so a row has
    the same bits alone, in a verification forward or in the prompt (SDPA picks kernels by the number of rows).

    One native call per layer on the CPU, else one SDPA call per row. Shapes: query [B, H, q, d]; key, value [B, Hkv, T,
    d]; attention_mask None or [B|1, 1, q, T]. Returns ([B, q, H, d], None) as transformers expects.
    """
    b, h, q, d = query.shape
    hkv, t_all = key.shape[1], key.shape[2]
    if module.training or dropout > 0 or h % hkv or (attention_mask is not None and attention_mask.shape[-1] != t_all):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    native = _native_attention(query, key, value, attention_mask)
    if native is not None:
        mask = query.new_empty(0, dtype=torch.bool) if attention_mask is None else attention_mask
        scale = float(d**-0.5 if scaling is None else scaling)
        return native.row_attention(query, key, value, mask, scale, cpu.avx512_allowed()), None
    if attention_mask is None:  # causal without padding (each row's key slice is its causal window); a bool mask
        # is passed anyway so that every forward takes the same SDPA path
        attention_mask = torch.ones(1, 1, q, t_all, dtype=torch.bool, device=query.device)
    out = query.new_empty(b, q, h, d)
    for i in range(q):
        t = t_all - q + i + 1
        qi = query[:, :, i].reshape(b, hkv, h // hkv, d)  # query head j reads key head j // (h / hkv)
        mi = attention_mask[:, :, i : i + 1, :t]  # [B|1, 1, 1, t]
        oi = torch.nn.functional.scaled_dot_product_attention(qi, key[:, :, :t], value[:, :, :t], attn_mask=mi,
                                                              scale=scaling)
        out[:, i] = oi.reshape(b, h, d)
    return out, None


ATTENTION = NativeExtension("specstop_row_attention", "row_attention.cpp", "native decoding attention")
"""The native kernel (one build for every ISA: its AVX-512 path is chosen per call, ``allow_avx512``)."""


def _native_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: torch.Tensor | None) -> Any:
    """The native kernel when it applies to these tensors (fp32 CPU, bool or no mask, key and value laid out alike),
    else None."""
    if query.device.type != "cpu" or not (query.dtype == key.dtype == value.dtype == torch.float32):
        return None
    if mask is not None and mask.dtype != torch.bool:
        return None
    if key.stride(-1) != 1 or key.stride() != value.stride():
        return None
    return ATTENTION.module()


@functools.lru_cache(maxsize=1)
def register_attention() -> None:
    """Register :func:`row_invariant_attention` with transformers as :data:`ROW_INVARIANT_ATTENTION` (once)."""
    AttentionInterface.register(ROW_INVARIANT_ATTENTION, row_invariant_attention)
    AttentionMaskInterface.register(ROW_INVARIANT_ATTENTION, sdpa_mask)  # SDPA's bool masks (None: causal, no padding)
