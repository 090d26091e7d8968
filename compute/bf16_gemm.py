"""The bfloat16 GEMM of the packed-bf16 compute path: y = x W^T with fp32 accumulation, batch-invariant, in one
native kernel per CPU ISA: ``csrc/bf16_gemm.cpp`` (AVX512-BF16 ``vdpbf16ps``, and AMX-BF16 tiles where the CPU has
them) and ``csrc/bf16_gemm_avx2.cpp`` (AVX2: bf16 weights widened to fp32 in registers, fp32 FMA).

Why: oneDNN's bf16 kernels read the weights again past ~6 rows and sum one row in another order than many rows, and on
AVX2 CPUs oneDNN has no bf16 pack at all. Here up to 16 rows stream the weights once, and each output element is the
same chain of instructions over K whatever the number of rows, so a row has the same bits alone, in a verification
forward or inside a prompt.

ISA (:func:`isa`, ``compute.cpu``): a process runs the best kernel its CPU has, or the one ``SPECSTOP_ISA`` names
(``avx2`` on any x86 host: the AVX2 kernel is then built, tested and timed on AVX-512 hosts too). The two kernels sum
in other orders, so a process uses one of them for all its packs and data records which (``gemm``: ``specstop`` or
``specstop-avx2``, :func:`gemm_name`). Every function takes ``isa`` to address one kernel explicitly (tests and
benchmarks run both side by side); a pack must be multiplied by the kernel that made it (an int8 pack's byte order
differs). On the AVX-512 kernel a bfloat16 pack runs on AMX tiles where the CPU has them (:func:`chain`;
``SPECSTOP_AMX=0`` keeps vdpbf16ps), another chain again, decided once per process.

:func:`pack_int8` stores the weights as int8 with one scale per output channel, which the kernels widen exactly (half
the bytes; the compute path uses it for draft-side models, ``--models.int8_draft``).

:func:`available` is False where the CPU lacks the ISA, the build fails or ``SPECSTOP_NATIVE=0``; the compute path then
keeps oneDNN.

Usage::

    from compute import bf16_gemm
    if bf16_gemm.available():
        wp = bf16_gemm.pack(linear.weight)              # [ceil(N/16), K/2, 16, 2] bfloat16
        y = bf16_gemm.gemm(x.to(torch.bfloat16), wp, linear.out_features)   # [M, N] bfloat16
        wq, scale = bf16_gemm.pack_int8(linear.weight)  # int8 [ceil(N / 16), K / 2, 16, 2], fp32 [ceil(N / 16) * 16]
        y = bf16_gemm.gemm(x.to(torch.bfloat16), wq, linear.out_features, scale)
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
    """The ISA specstop's kernels run on in this process: ``SPECSTOP_ISA`` when set (checked against the CPU), else
    the best the CPU has (``avx512``, ``avx2``), or ``none``. Where the CPU flags are unknown (no /proc/cpuinfo) the
    kernels are asked (built).

    Raises:
        ValueError: ``SPECSTOP_ISA`` names an unknown ISA or one this CPU lacks (the message names what it has).
    """
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
    """The instructions bfloat16 packs run on with that kernel: ``amx`` (AMX-BF16 tiles), ``avx512-bf16``
    (vdpbf16ps), ``avx2`` (fp32 FMA), or ``none`` (the kernel is unavailable). Decided once per process."""
    _, ext = _ext(which)
    if ext is None or not available(which):
        return "none"
    return str(ext.module().chain())


def gemm_name(which: str | None = None) -> str:
    """What a model fingerprint records as its ``gemm`` on that kernel: ``specstop`` (AVX512-BF16 / AMX) or
    ``specstop-avx2``."""
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
    """[N, K] weight -> (int8 [ceil(N / 16), K / 2, 16, 2], float32 scales [ceil(N / 16) * 16]): each output row
    rounded to integers in [-127, 127] times its own scale ``max|w| / 127`` (symmetric, per output channel), in the
    byte order of the ISA's kernel. Half the bytes of :func:`pack`; the kernel widens the integers exactly and scales
    the fp32 sums, so a row's result is still the same whatever the number of rows."""
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
    """[M, K] bfloat16 contiguous rows times the packed weight (of :func:`pack`, or of :func:`pack_int8` with its
    ``scale``, made for the same ISA) -> [M, out_features] bfloat16 (fp32 sums, scaled for int8, rounded to nearest
    even), or with ``fp32_out`` float32: the same sums unrounded (an LM head's logits keep fp32 resolution)."""
    mod = _built("gemm", which)
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        x = x.to(torch.bfloat16).contiguous()
    return mod.gemm(x, packed, int(out_features), scale, bool(fp32_out))
