"""The bfloat16 GEMM of the packed-bf16 path: y = x W^T with fp32 accumulation, batch-invariant, one native kernel per
ISA (``csrc/bf16_gemm.cpp``: AVX512-BF16 and AMX tiles; ``csrc/bf16_gemm_avx2.cpp``: AVX2 + FMA).

Up to 16 rows stream the weights once, and each output is the same chain over K whatever the row count, so a row has the
same bits alone or in a verification forward (oneDNN re-reads the weights past ~6 rows, and has no bf16 pack on AVX2).
The kernels sum in other orders, so a process uses one for all its packs and records which (:func:`gemm_name`); a pack
is multiplied by the kernel that made it. ISA choice and ``SPECSTOP_ISA`` / ``SPECSTOP_AMX``: docs/compute-path.md.

Usage::

    wp = bf16_gemm.pack(linear.weight)                                  # [ceil(N/16), K/2, 16, 2] bfloat16
    y = bf16_gemm.gemm(x.to(torch.bfloat16), wp, linear.out_features)   # [M, N] bfloat16
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

from compute import cpu
from compute.native import AVX2_CFLAGS, NativeExtension

__all__ = ["ISAS", "isa", "available", "unavailable_reason", "chain", "gemm_name", "isa_of_gemm", "library", "pack",
           "pack_int8", "gemm"]

ISAS = tuple(cpu.ISA_FLAGS)
"""The kernels' ISAs, best first: ``avx512`` (AVX512-BF16 / AMX) and ``avx2``."""

_EXTS = {
    "avx512": NativeExtension("specstop_bf16_gemm", "bf16_gemm.cpp", "native bf16 GEMM (AVX512-BF16)"),
    "avx2": NativeExtension("specstop_bf16_gemm_avx2", "bf16_gemm_avx2.cpp", "native bf16 GEMM (AVX2)", AVX2_CFLAGS),
}


def isa() -> str:
    """The ISA specstop's kernels run on in this process: ``SPECSTOP_ISA`` when set, else the best the CPU has
    (``avx512``, ``avx2``) or ``none``; ValueError for an ISA unknown or missing on this CPU."""
    return _isa(os.environ.get("SPECSTOP_ISA", ""), tuple(cpu.cpu_model()["simd_flags"]), cpu.is_x86())


@functools.lru_cache(maxsize=8)
def _isa(_env: str, flags: tuple[str, ...], x86: bool) -> str:
    """:func:`isa` for one value of ``SPECSTOP_ISA`` and of the CPU facts (the arguments key the cache)."""
    wanted = cpu.requested_isa()
    if flags or not x86:
        return wanted or next(iter(cpu.isas_of(flags)), "none")
    for name in (wanted,) if wanted else ISAS:  # flags unknown: the kernels check the CPU themselves
        mod = _EXTS[name].module()
        if mod is not None and mod.available():
            return name
        if wanted and mod is not None:
            raise ValueError(f"SPECSTOP_ISA={wanted}: this CPU lacks it (its kernel says so); leave it unset")
    return wanted or "none"


def _ext(which: str | None) -> tuple[str, NativeExtension | None]:
    name = isa() if which is None else which
    if name not in ISAS and name != "none":
        raise ValueError(f"bf16_gemm: isa={name!r}: use one of {', '.join(ISAS)}")
    return name, _EXTS.get(name)


def available(which: str | None = None) -> bool:
    """The kernel of ISA ``which`` (default :func:`isa`) runs on this CPU and is built (builds it on the first call)."""
    _, ext = _ext(which)
    mod = None if ext is None else ext.module()
    return mod is not None and bool(mod.available())


def unavailable_reason(which: str | None = None) -> str:
    """Why the kernel of ISA ``which`` (default :func:`isa`) does not run here ('' when it does)."""
    name, ext = _ext(which)
    if ext is None:
        model = cpu.cpu_model()["model_name"] or "this CPU"
        return f"{model} has neither AVX512-BF16 nor AVX2 with FMA" if cpu.is_x86() else f"{model} is not x86-64"
    if available(name):
        return ""
    return ext.failed or f"this CPU lacks the {name} kernel's instructions"


def chain(which: str | None = None) -> str:
    """The instructions bf16 packs run on with that kernel: ``amx``, ``avx512-bf16``, ``avx2`` or ``none``; decided once
    per process."""
    _, ext = _ext(which)
    if ext is None or not available(which):
        return "none"
    return str(ext.module().chain())


def gemm_name(which: str | None = None) -> str:
    """What a fingerprint records as ``gemm`` on that kernel: ``specstop`` (AVX512-BF16 / AMX) or ``specstop-avx2``."""
    name, _ = _ext(which)
    return "specstop" if name == "avx512" else f"specstop-{name}"


def isa_of_gemm(gemm: str) -> str | None:
    """The kernel ISA a fingerprint's ``gemm`` names (:func:`gemm_name`'s inverse), None for oneDNN or eager."""
    return next((name for name in ISAS if gemm_name(name) == gemm), None)


def library(which: str | None = None) -> str | None:
    """The built extension file of that kernel (None when it is unavailable), e.g. to inspect its machine code."""
    _, ext = _ext(which)
    mod = None if ext is None else ext.module()
    return None if mod is None else str(mod.__file__)


def pack(weight: Tensor, which: str | None = None) -> Tensor:
    """[N, K] weight (any float dtype, K even) -> the kernels' layout, [ceil(N / 16), K / 2, 16, 2] bfloat16 (the
    weights rounded to bfloat16 once, zero columns past N)."""
    return _module("pack", weight, which).pack(weight.detach())


def pack_int8(weight: Tensor, which: str | None = None) -> tuple[Tensor, Tensor]:
    """[N, K] weight -> (int8 pack, fp32 scales [ceil(N / 16) * 16]): each output row symmetric-quantised by ``max|w| /
    127``, in the ISA's byte order; half the bytes of :func:`pack`, still batch-invariant."""
    return _module("pack_int8", weight, which).pack_int8(weight.detach())


def _module(what: str, weight: Tensor, which: str | None) -> Any:
    """The built kernel for packing ``weight``: RuntimeError when unavailable, ValueError for an odd in_features."""
    mod = _built(what, which)
    if weight.shape[-1] % 2:
        raise ValueError(f"bf16_gemm.{what}: in_features={weight.shape[-1]} must be even")
    return mod


def _built(what: str, which: str | None) -> Any:
    name, ext = _ext(which)
    mod = None if ext is None else ext.module()
    if mod is None:
        why = "no kernel ISA on this CPU" if ext is None else ext.failed
        raise RuntimeError(f"bf16_gemm.{what}: the native kernel ({name}) is unavailable ({why})")
    return mod


def gemm(x: Tensor, packed: Tensor, out_features: int, scale: Tensor | None = None, fp32_out: bool = False,
         which: str | None = None) -> Tensor:
    """[M, K] bf16 rows times a pack of the same ISA (int8 with its ``scale``) -> [M, out_features] bf16, or the fp32
    sums unrounded with ``fp32_out`` (for LM heads)."""
    mod = _built("gemm", which)
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        x = x.to(torch.bfloat16).contiguous()
    return mod.gemm(x, packed, int(out_features), scale, bool(fp32_out))
