"""The CPU compute path: a loaded model's large linears run on one prepacked weight (oneDNN's, or specstop's bf16 GEMM)
and its attention on the row-invariant kernel.

A pack made once for every row count keeps a target forward of up to 16 tokens near the cost of one, so verification
stays cheap; on the packed paths a forward is batch-invariant, so greedy speculative decoding reproduces the path's own
one-token decoding bit for bit. The paths (``packed-bf16``, ``packed``, ``eager``, ``auto``) and why each piece exists:
docs/compute-path.md. The names of ``path_choice``, ``packed_layers``, ``row_attention`` and ``precision`` are
importable from here.

Usage::

    path = resolve_compute_path("auto", torch.device("cpu"))        # e.g. "packed-bf16"
    stats = apply_compute_path(model, path)                         # {"packed_layers": 197, ...}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from compute import bf16_gemm, native_layers
from compute.packed_layers import (
    FUSED_GROUPS,
    GATED_MLPS,
    MIN_ROWS,
    FusedLinears,
    GatedMLP,
    PackedLinear,
    PackedSlice,
)
from compute.path_choice import COMPUTE_PATHS, auto_cpu_path, cpu_info, native_bf16, resolve_compute_path
from compute.precision import (
    PRECISION_OPTIONS,
    compute_path_of,
    gemm_of,
    gemm_resume_hint,
    head_dtype_of,
    layer_head_dtype,
    pack_layout_of,
    precision_diffs,
    precision_option,
    weights_of,
)
from compute.row_attention import ROW_INVARIANT_ATTENTION, register_attention, row_invariant_attention

__all__ = [
    "COMPUTE_PATHS",
    "FUSED_GROUPS",
    "GATED_MLPS",
    "MIN_PACK_ELEMENTS",
    "MIN_ROWS",
    "PRECISION_OPTIONS",
    "ROW_INVARIANT_ATTENTION",
    "FusedLinears",
    "GatedMLP",
    "PackedLinear",
    "PackedSlice",
    "apply_compute_path",
    "auto_cpu_path",
    "compute_path_of",
    "cpu_info",
    "gemm_of",
    "gemm_resume_hint",
    "head_dtype_of",
    "native_bf16",
    "pack_layout_of",
    "precision_diffs",
    "precision_option",
    "resolve_compute_path",
    "row_invariant_attention",
    "use_row_invariant_attention",
    "weights_of",
]

MIN_PACK_ELEMENTS = 1 << 18
"""Linear layers with fewer weights than this stay eager (262,144: a 512 x 512 layer)."""


def use_row_invariant_attention(model: nn.Module, on: bool = True) -> bool:
    """Switch a packed model's attention to :func:`row_invariant_attention` (``on``) or back to SDPA; returns whether it
    runs it. A long teacher-forced pass that needs no batch invariance runs faster on SDPA."""
    cfg = getattr(model, "config", None)
    if compute_path_of(model) == "eager" or cfg is None or not hasattr(model, "set_attn_implementation"):
        return False
    current = getattr(cfg, "_attn_implementation", None)
    if not on:
        if current == ROW_INVARIANT_ATTENTION:
            native_layers.uninstall(model)  # they run the row-invariant kernel: back to transformers' layers
            model.set_attn_implementation("sdpa")
        return False
    if current not in ("sdpa", "eager", ROW_INVARIANT_ATTENTION):
        return False
    register_attention()
    model.set_attn_implementation(ROW_INVARIANT_ATTENTION)
    if getattr(model, "specstop_native_layers", False) and not native_layers.installed(model):
        native_layers.install(model)
    return True


@dataclass
class _Packing:
    """How one model's linears are packed (from :func:`apply_compute_path`'s options and this CPU)."""

    path: str
    dtype: torch.dtype
    native: bool
    """bf16 packs on specstop's kernel (else oneDNN's)."""
    int8: bool
    head: nn.Module | None
    head_bf16: bool
    """The LM head packed in the path's dtype (else fp32)."""
    min_elements: int

    @property
    def weight_bytes(self) -> int:
        return 1 if self.int8 else self.dtype.itemsize


def apply_compute_path(
    model: nn.Module, path: str, bf16_head: bool = False, min_elements: int = MIN_PACK_ELEMENTS, fuse: bool = True,
    native_gemm: bool = True, int8_weights: bool = False, fp32_logits: bool = False, native_layers_on: bool = True,
) -> dict[str, Any]:
    """Swap the large ``nn.Linear`` layers for packed ones, in place, for a resolved ``path``; returns the stats.

    Args:
        model: a float32 model on the CPU, in eval mode.
        path: ``packed``, ``packed-bf16`` or ``eager`` (no change); resolve ``auto`` first.
        bf16_head: with ``packed-bf16``, pack the LM head in bf16 too (int8 with ``int8_weights``); specstop's kernel
            returns fp32 logits, oneDNN rounds them to bf16 (a step of 0.125 at logit 16-32).
        fp32_logits: the head keeps fp32 resolution (the target's): bf16 only where the kernel returns fp32 sums.
        min_elements: layers with fewer weights stay eager (a fused group counts its members together).
        fuse: pack each :data:`FUSED_GROUPS` of siblings (q/k/v, gate/up) as one GEMM.
        native_gemm: run bf16 packs on specstop's kernel where the CPU has it, else oneDNN's (recorded as ``gemm``).
        int8_weights: on specstop's kernel, int8 weights with per-channel scales; for draft-side models only.
        native_layers_on: run each decoder layer :mod:`compute.native_layers` reproduces as one native call.
    Raises:
        ValueError: for ``auto`` or unknown paths, a model not float32 on the CPU, or bf16 where oneDNN has none.
        MemoryError: when packing runs out of memory (the message says how much and how to turn it off).
    """
    if path == "eager":
        return {"compute_path": "eager", "packed_layers": 0}
    plan = _packing(model, path, native_gemm, int8_weights, bf16_head, fp32_logits, min_elements)
    stats = {"compute_path": path, "packed_layers": 0, "bytes_before": 0, "bytes_after": 0,
             "gemm": bf16_gemm.gemm_name() if plan.native else "onednn",
             "weights": "int8" if plan.int8 else str(plan.dtype).removeprefix("torch.")}
    if fuse:
        stats["fused_groups"] = _pack_fused_groups(model, plan, stats)
    _pack_linears(model, plan, stats)
    if fuse:
        for parent, name, mlp in _gated_mlps(model):
            setattr(parent, name, GatedMLP(mlp.gate_proj.fused.packed, mlp.down_proj, mlp.gate_proj.out_features))
    if not stats["packed_layers"]:  # nothing packed: the model computes as eager
        stats["compute_path"] = "eager"
        return stats
    model.specstop_compute_path = path  # read back by compute_path_of and the other fingerprint fields
    model.specstop_pack_layout = "fused" if stats.get("fused_groups") else "per-layer"
    model.specstop_head_dtype = layer_head_dtype(model.get_output_embeddings() if plan.head is not None else None)
    model.specstop_gemm = stats["gemm"]
    model.specstop_weights = stats["weights"]
    _detach_from_file(model)  # first: a native layer keeps its norms' tensors, which must not hold the file
    model.specstop_native_layers = bool(native_layers_on and fuse)
    stats["row_invariant_attention"] = use_row_invariant_attention(model)
    stats["native_layers"] = native_layers.installed(model)
    return stats


def _packing(model: nn.Module, path: str, native_gemm: bool, int8_weights: bool, bf16_head: bool, fp32_logits: bool,
             min_elements: int) -> _Packing:
    """The packing plan of ``path`` for this model and CPU (ValueError for what cannot be packed here)."""
    if path not in ("packed", "packed-bf16"):
        raise ValueError(f"apply_compute_path: resolve {path!r} first (packed, packed-bf16 or eager)")
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(f"compute path {path!r} needs a float32 model on the CPU (got {p.dtype} on {p.device}); "
                         f"load with --models.dtype float32 or use --models.compute eager")
    dtype = torch.bfloat16 if path == "packed-bf16" else torch.float32
    native = bool(native_gemm and dtype == torch.bfloat16 and bf16_gemm.available())
    if dtype == torch.bfloat16 and not native and not native_bf16():
        raise ValueError(f"compute path packed-bf16 on oneDNN needs oneDNN's bf16 (AVX512-BF16 or AMX-BF16), which "
                         f"this CPU lacks; use --models.native_gemm true (specstop's kernel: "
                         f"{bf16_gemm.unavailable_reason() or 'available'}) or --models.compute packed")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    sums_out = native and isinstance(head, nn.Linear) and head.in_features % 2 == 0  # the head's fp32 sums returned
    head_bf16 = bool(bf16_head and dtype == torch.bfloat16 and (sums_out or not fp32_logits))
    return _Packing(path, dtype, native, bool(int8_weights and native), head, head_bf16, min_elements)


def _pack_fused_groups(model: nn.Module, plan: _Packing, stats: dict[str, Any]) -> int:
    """Pack each fusable sibling group as one GEMM, counting into ``stats``; returns how many groups."""
    groups = _fusable_groups(model, plan.min_elements)
    for parent, group in groups:
        lins = [getattr(parent, n) for n in group]
        need = sum(lin.weight.numel() for lin in lins) * plan.weight_bytes
        fused = _pack_or_explain(model, "+".join(group), need, FusedLinears, lins, plan.dtype, plan.native, plan.int8)
        for i, (n, lin) in enumerate(zip(group, lins)):
            setattr(parent, n, PackedSlice(fused, i, lin.in_features, lin.out_features, plan.dtype))
            stats["bytes_before"] += lin.weight.numel() * lin.weight.element_size()
        stats["packed_layers"] += len(group)
        stats["bytes_after"] += need
    return len(groups)


def _pack_linears(model: nn.Module, plan: _Packing, stats: dict[str, Any]) -> None:
    """Pack every remaining large linear on its own (the LM head in fp32 unless ``plan.head_bf16``)."""
    tied = _tied_output_weight(model)
    for parent, name, lin in _linears(model):
        if lin.weight.numel() < plan.min_elements:
            continue
        fp32_head = lin is plan.head and not plan.head_bf16
        layer_dtype = torch.float32 if fp32_head else plan.dtype
        need = lin.weight.numel() * (layer_dtype.itemsize if fp32_head else plan.weight_bytes)
        packed = _pack_or_explain(model, f"{name} {tuple(lin.weight.shape)}", need, PackedLinear, lin, layer_dtype,
                                  plan.native, plan.int8 and not fp32_head, lin is plan.head)
        setattr(parent, name, packed)
        stats["packed_layers"] += 1
        stats["bytes_before"] += 0 if lin.weight is tied else lin.weight.numel() * lin.weight.element_size()
        stats["bytes_after"] += need


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]


def _gated_mlps(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, mlp) of every gated MLP whose gate/up is one fused pack and whose down has the same dtype."""
    out = []
    for parent in model.modules():
        for name, mlp in parent.named_children():
            if type(mlp).__name__ not in GATED_MLPS or type(getattr(mlp, "act_fn", None)).__name__ not in (
                    "SiLUActivation", "SiLU"):
                continue
            gate, up, down = (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
            if not (isinstance(gate, PackedSlice) and isinstance(up, PackedSlice) and gate.fused is up.fused
                    and (gate.index, up.index) == (0, 1) and isinstance(down, PackedLinear)):
                continue
            if gate.fused.packed.bias is None and down.pack_dtype == gate.pack_dtype:
                out.append((parent, name, mlp))
    return out


def _fusable_groups(model: nn.Module, min_elements: int) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(parent, names) of every sibling group of plain linears over one input, same bias presence, large enough."""
    out = []
    for parent in model.modules():
        for group in FUSED_GROUPS:
            lins = [getattr(parent, n, None) for n in group]
            if not all(type(lin) is nn.Linear for lin in lins):
                continue
            if len({lin.in_features for lin in lins}) != 1 or len({lin.bias is None for lin in lins}) != 1:
                continue
            if sum(lin.weight.numel() for lin in lins) >= min_elements:
                out.append((parent, group))
    return out


def _pack_or_explain(model: nn.Module, what: str, need: int, pack: Any, *args: Any) -> Any:
    """``pack(*args)``, with oneDNN's allocation failure raised as a MemoryError that says how to turn it off."""
    try:
        return pack(*args)
    except RuntimeError as e:  # oneDNN reports allocation failures as RuntimeError
        if "memory" not in str(e).lower() and "alloc" not in str(e).lower():
            raise
        raise MemoryError(
            f"packing {type(model).__name__}.{what} needs {need / 2**20:.0f} MiB more memory than is free; free memory "
            f"or turn the path off with --models.compute eager"
        ) from e


def _detach_from_file(model: nn.Module) -> None:
    """Copy the remaining weights into the process's own memory, so the safetensors file's mapping (and its resident
    pages) is released once nothing points into it."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PackedLinear):  # its buffers are copies already
                continue
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if t.device.type == "cpu":
                    t.data = t.data.clone()


def _tied_output_weight(model: nn.Module) -> torch.Tensor | None:
    """The LM head's weight when it is shared with the input embedding (freed only with the embedding)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    emb, head = get_in(), get_out()
    if isinstance(head, nn.Linear) and emb is not None and head.weight is emb.weight:
        return head.weight
    return None
