"""Decoder layers of a packed model as one native call each (``csrc/decoder_layer.cpp``): transformers' operations in
its order, so the same bits, without the ~2,000 Python calls a small draft's step spends around its GEMMs.

Applies to Qwen2 / Llama layers with fused q/k/v, a :class:`~compute.packed_layers.GatedMLP` and every pack on
specstop's bf16 GEMM; a call falls back to transformers' forward whenever it could differ (training, another cache,
mask, dtype or device). Forward hooks still run. ``SPECSTOP_NATIVE=0`` or ``apply_compute_path(native_layers_on=False)``
turns it off.

Usage::

    n = native_layers.install(model)      # layers now native (0 where it does not apply)
    native_layers.uninstall(model)        # back to transformers' forward
"""
from __future__ import annotations

import logging
import types
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from compute.cpu import avx512_allowed
from compute.native import AVX2_CFLAGS, NativeExtension
from compute.packed_layers import FusedLinears, GatedMLP, PackedLinear, PackedSlice
from compute.row_attention import ROW_INVARIANT_ATTENTION

log = logging.getLogger(__name__)

__all__ = ["install", "uninstall", "installed"]

_EXTS = {
    "avx512": NativeExtension("specstop_decoder_layer", "decoder_layer.cpp", "native decoder layers"),
    "avx2": NativeExtension("specstop_decoder_layer_avx2", "decoder_layer.cpp", "native decoder layers (AVX2)",
                            (*AVX2_CFLAGS, "-DSPECSTOP_GEMM_AVX2")),
}
"""The build per GEMM ISA (``compute.bf16_gemm``): a layer runs the GEMM its packs were made for."""

LAYERS = ("Qwen2DecoderLayer", "LlamaDecoderLayer")
"""Decoder layer classes whose forward the native layer reproduces (pre-norm RMSNorm, rotary q/k, causal attention,
gated MLP)."""


def installed(model: nn.Module) -> int:
    """How many of the model's decoder layers run natively."""
    return sum(1 for m in model.modules() if getattr(m, "specstop_native", None) is not None)


def install(model: nn.Module) -> int:
    """Make every qualifying decoder layer of a packed model one native call; returns how many. Install after the
    weights stop viewing the safetensors file, or the whole mapped file stays resident."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) != ROW_INVARIANT_ATTENTION:
        return 0
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"]):
        return 0
    layers = [m for m in model.modules() if type(m).__name__ in LAYERS]
    specs = [_layer_spec(layer) for layer in layers]
    if not layers or any(s is None for s in specs):
        return 0
    isas = {s[-1] for s in specs}
    mod = _EXTS[isas.pop()].module() if len(isas) == 1 else None
    if mod is None or not mod.available():
        return 0
    attention_avx512 = avx512_allowed()
    for layer, spec in zip(layers, specs):
        layer.specstop_native = _Native(mod.NativeLayer(*spec[:-1], attention_avx512))
        layer.forward = types.MethodType(_native_forward, layer)
    return len(layers)


class _Native:
    """A layer's native object; a deep copy of the model gets None (it cannot be copied) and runs transformers' layers.
    """

    def __init__(self, layer: Any) -> None:
        self.forward = layer.forward

    def __deepcopy__(self, memo: dict) -> None:
        return None


def uninstall(model: nn.Module) -> None:
    """Back to transformers' forward on every layer :func:`install` changed."""
    for m in model.modules():
        if "specstop_native" in vars(m):
            del m.specstop_native
            del m.forward  # the instance attribute: the class's forward shows again


def _layer_spec(layer: nn.Module) -> tuple[Any, ...] | None:
    """The NativeLayer constructor's arguments for one layer and its packs' GEMM ISA; None when its structure differs.
    """
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    n_in, n_post = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
    if attn is None or not isinstance(mlp, GatedMLP) or hasattr(attn, "q_norm"):
        return None
    if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in (n_in, n_post)):
        return None
    parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(p, PackedSlice) for p in parts) or len({id(p.fused) for p in parts}) != 1:
        return None
    fused: FusedLinears = parts[0].fused
    packs = [fused.packed, attn.o_proj, mlp.gate_up, mlp.down_proj]
    if len(fused.bounds) != 4 or not all(isinstance(p, PackedLinear) and p.kernel == "specstop" and not p.fp32_out
                                         for p in packs):
        return None
    if len({p.isa for p in packs}) != 1 or packs[0].isa not in _EXTS:
        return None
    if mlp.gate_up.bias is not None or mlp.down_proj.bias is not None or attn.training:
        return None
    head_dim = int(attn.head_dim)
    q_out, kv_out = parts[0].out_features, parts[1].out_features
    if parts[2].out_features != kv_out or q_out % head_dim or kv_out % head_dim:
        return None
    qkv, o = fused.packed, attn.o_proj
    return (n_in.weight.detach(), float(n_in.variance_epsilon), n_post.weight.detach(),
            float(n_post.variance_epsilon), qkv.packed_weight, qkv.weight_scale, qkv.bias, q_out, kv_out,
            o.packed_weight, o.weight_scale, o.bias, o.out_features, mlp.gate_up.packed_weight,
            mlp.gate_up.weight_scale, mlp.down_proj.packed_weight, mlp.down_proj.weight_scale, mlp.intermediate,
            q_out // head_dim, kv_out // head_dim, head_dim, float(attn.scaling), GatedMLP.CHUNK_ELEMENTS, qkv.isa)


_NO_MASK = torch.empty(0, dtype=torch.bool)


CACHE_ARGUMENTS = ("cache", "past_key_values")
"""The decoder layer's KV-cache keyword: ``cache`` from transformers 5.24 on, ``past_key_values`` before."""


def _native_forward(self: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The decoder layer's forward: native when that gives transformers' result, else transformers' own with the same
    arguments."""
    attention_mask = kwargs.get("attention_mask")
    position_embeddings = kwargs.get("position_embeddings")
    past = next((kwargs[k] for k in CACHE_ARGUMENTS if kwargs.get(k) is not None), None)
    cache = None if args else _cache_layer(past, self.self_attn.layer_idx)
    if cache is not None and _native_inputs(self, hidden_states, position_embeddings):
        if not cache.is_initialized:
            cache.lazy_initialization(hidden_states, hidden_states)  # empty keys / values of the activations' dtype
        if attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.dim() == 4
                                      and attention_mask.shape[-1] == _seq_len(cache) + hidden_states.shape[1]):
            cos, sin = position_embeddings  # type: ignore[misc]
            mask = _NO_MASK if attention_mask is None else attention_mask
            h, cache.keys, cache.values = self.specstop_native.forward(hidden_states, cos, sin, mask, cache.keys,
                                                                       cache.values)
            return h
    return type(self).forward(self, hidden_states, *args, **kwargs)


def _native_inputs(layer: nn.Module, h: torch.Tensor, position_embeddings: Any) -> bool:
    """This call is one the native layer computes: inference, fp32 [B, L, H] on the CPU, rotary embeddings given, a
    native object present."""
    if layer.specstop_native is None or position_embeddings is None or layer.training:
        return False
    if h.dtype != torch.float32 or h.device.type != "cpu" or h.dim() != 3:
        return False
    return not (torch.is_grad_enabled() and h.requires_grad)


def _cache_layer(cache: Any, idx: int) -> Any:
    """The plain ``DynamicLayer`` of layer ``idx`` (the native layer concatenates as it does), else None."""
    layers = getattr(cache, "layers", None)
    if layers is None or idx >= len(layers) or getattr(cache, "offloading", False):
        return None
    if type(layers[idx]) is not DynamicLayer:
        return None
    return layers[idx]


def _seq_len(layer: Any) -> int:
    keys = layer.keys
    return 0 if keys is None or keys.numel() == 0 else int(keys.shape[-2])
