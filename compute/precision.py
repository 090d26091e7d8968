"""What a packed model computes in, as data folders and predictors record it (``compute_path``, ``head_dtype``,
``pack_layout``, ``gemm``, ``weights``), how two records differ, and the option that computes as a recorded one did.

Usage::

    precision_diffs(stored, current)      # {"gemm": ("specstop-avx2", "specstop")}
    precision_option("gemm")              # "--models.native_gemm"
"""
from __future__ import annotations

import torch
from torch import nn

from compute import bf16_gemm, cpu
from compute.packed_layers import PackedLinear

__all__ = ["PRECISION_OPTIONS", "compute_path_of", "gemm_of", "gemm_resume_hint",
           "head_dtype_of", "layer_head_dtype", "pack_layout_of", "precision_diffs", "precision_option", "weights_of"]


def compute_path_of(model: nn.Module) -> str:
    """The compute path a model was loaded with (``eager`` when none was applied)."""
    return str(getattr(model, "specstop_compute_path", "eager"))


def pack_layout_of(model: nn.Module) -> str:
    """``fused`` (q/k/v and gate/up as one GEMM each), ``per-layer`` or ``eager``; the two packed layouts differ in bits
    where fusing packs small k/v layers per-layer packing left eager."""
    if compute_path_of(model) == "eager":
        return "eager"
    return str(getattr(model, "specstop_pack_layout", "per-layer"))


def gemm_of(model: nn.Module) -> str:
    """The kernel its packed linears run on: ``specstop``, ``specstop-avx2``, ``onednn`` or ``eager``."""
    if compute_path_of(model) == "eager":
        return "eager"
    return str(getattr(model, "specstop_gemm", "onednn"))


_PACK_DTYPES = {"packed": "float32", "packed-bf16": "bfloat16", "eager": "eager"}


def weights_of(model: nn.Module) -> str:
    """What its packed linears store: ``int8``, the pack dtype (``bfloat16``, ``float32``) or ``eager``."""
    if compute_path_of(model) == "eager":
        return "eager"
    return str(getattr(model, "specstop_weights", _PACK_DTYPES.get(compute_path_of(model), "")))


PRECISION_OPTIONS = {"dtype": "--models.dtype", "compute_path": "--models.compute",
                     "head_dtype": "--models.bf16_draft_head", "pack_layout": "--models.fuse_linears",
                     "gemm": "--models.native_gemm", "weights": "--models.int8_draft"}
"""The option that sets each precision field of a draft-side model (:func:`precision_option` names the target's)."""


def precision_option(key: str, role: str = "draft") -> str:
    """The option that sets precision field ``key`` of the model in ``role`` (draft, target or companion)."""
    if key == "head_dtype" and role == "target":
        return "--models.bf16_target_head"
    return PRECISION_OPTIONS[key]


def gemm_resume_hint(was: str, now: str) -> str | None:
    """How to compute again with the kernel ISA a folder's ``gemm`` names when this process runs another; None when the
    ISA is not what differs."""
    wanted = bf16_gemm.isa_of_gemm(was)
    if wanted is None or wanted == bf16_gemm.isa_of_gemm(now) or (now == "onednn" and wanted == bf16_gemm.isa()):
        return None
    flags = cpu.cpu_model()["simd_flags"]
    if flags and wanted not in cpu.isas_of(flags):
        model = cpu.cpu_model()["model_name"] or "unknown"
        return f"its {cpu.ISA_NAMES[wanted]} kernel does not run on this CPU ({model}): label it on a CPU that has it"
    also = ""
    if now == "onednn":
        also = " and pass --models.native_gemm true (in the main job: --data.models.native_gemm true)"
    return f"set SPECSTOP_ISA={wanted}{also} to resume it"


def precision_diffs(stored: dict, current: dict) -> dict[str, tuple[str, str]]:
    """key -> (stored, current) for each precision field both fingerprints record and that differs; nothing when
    either has no ``compute_path``."""
    if not stored.get("compute_path") or not current.get("compute_path"):
        return {}
    out = {}
    for key in ("dtype", "compute_path", "head_dtype", "pack_layout", "gemm", "weights"):
        was, now = stored.get(key), current.get(key)
        if was and now and was != now:
            out[key] = (str(was), str(now))
    if "compute_path" in out:  # another path packs (or not) otherwise anyway
        out.pop("pack_layout", None)
        out.pop("gemm", None)
        out.pop("weights", None)
    return out


def layer_head_dtype(head: nn.Module | None) -> str:
    """What a packed LM head computes in: ``float32``, ``bfloat16`` (oneDNN, logits rounded) or ``bfloat16-fp32-logits``
    (specstop's kernel, fp32 sums)."""
    if not isinstance(head, PackedLinear) or head.pack_dtype != torch.bfloat16:
        return "float32"
    return "bfloat16-fp32-logits" if head.fp32_out else "bfloat16"


def head_dtype_of(model: nn.Module) -> str:
    """The dtype its LM head computes in (:func:`layer_head_dtype` on packed-bf16), else the model's own."""
    own = str(next(model.parameters()).dtype).removeprefix("torch.")
    return str(getattr(model, "specstop_head_dtype", own))
