"""The bfloat16 GEMM of the packed-bf16 compute path: y = x W^T with fp32 accumulation, batch-invariant, in one
native kernel (``csrc/bf16_gemm.cpp``, AVX512-BF16, and AMX-BF16 tiles where the CPU has them).

Why: oneDNN's bf16 kernels read the weights again past ~6 rows, so a target forward of 8 new tokens cost 1.2-1.35x
one token, and their one-row path sums in another order than their many-row path (the compute path padded one-token
steps to 4 rows to stay batch-invariant). Here up to 16 rows stream the weights once, and each output element is the
same chain of ``vdpbf16ps`` over K whatever the number of rows, so a row has the same bits alone, in a verification
forward or inside a prompt. Measured on AMD EPYC Zen 5 (2 threads), the 1.5B target's 28 layers of linears: 13.8 /
16.5 / 23.4 / 41.7 ms at 1 / 4 / 8 / 16 rows against oneDNN's 22.2 / 22.8 / 31.9 / 47.4; 64 rows and more 3-9%
slower than oneDNN (``benchmarks/bench_bf16_gemm.py``).

On a CPU with AMX-BF16 (Intel Sapphire Rapids and later) a bfloat16 pack runs on the tile unit at every row count
(:func:`chain` says which; ``SPECSTOP_AMX=0`` keeps vdpbf16ps): 16 rows x 16 columns x 32 inputs an instruction, so the
GEMM stays bound by reading the weights up to 16 rows and more, where vdpbf16ps on 2 cores becomes compute-bound past
4 rows. Measured on an Intel Xeon with AMX (480 MB L3, 2 threads), the 1.5B target's 28 layers of linears, warm:
45.0 / 46.8 / 46.6 / 47.3 / 99.5 ms at 1 / 4 / 8 / 16 / 64 rows, against 44.4 / 48.4 / 96.3 / 204.0 / 799.4 on
vdpbf16ps and oneDNN's (AMX too) 51.2 / 50.9 / 51.1 / 52.8 / 94.6. Still batch-invariant (each output element is one
chain of ``tdpbf16ps`` over 32-input chunks in order, whatever the rows), but a different chain from vdpbf16ps', so
a process uses one of the two for all its calls. int8 packs stay on vdpbf16ps.

:func:`pack_int8` stores the weights as int8 with one scale per output channel, which the kernel widens to bfloat16
exactly (half the bytes; the compute path uses it for draft-side models, ``--models.int8_draft``).

:func:`available` is False where the CPU lacks AVX512-BF16, the build fails or ``SPECSTOP_NATIVE=0``; the compute
path then keeps oneDNN.

Usage::

    from compute import bf16_gemm
    if bf16_gemm.available():
        wp = bf16_gemm.pack(linear.weight)              # [ceil(N/16), K/2, 16, 2] bfloat16
        y = bf16_gemm.gemm(x.to(torch.bfloat16), wp, linear.out_features)   # [M, N] bfloat16
        wq, scale = bf16_gemm.pack_int8(linear.weight)  # int8 [ceil(N / 16), K / 2, 16, 2], fp32 [ceil(N / 16) * 16]
        y = bf16_gemm.gemm(x.to(torch.bfloat16), wq, linear.out_features, scale)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from compute.native import NativeExtension

__all__ = ["available", "chain", "pack", "pack_int8", "gemm"]

_EXT = NativeExtension("specstop_bf16_gemm", "bf16_gemm.cpp", "native bf16 GEMM")


def available() -> bool:
    """This CPU runs the kernel (AVX512-BF16) and it is built (builds it on the first call)."""
    mod = _EXT.module()
    return mod is not None and bool(mod.available())


def chain() -> str:
    """The instructions bfloat16 packs run on in this process: ``amx`` (AMX-BF16 tiles), ``avx512-bf16``
    (vdpbf16ps), or ``none`` (the kernel is unavailable). Decided once per process."""
    mod = _EXT.module()
    if mod is None or not mod.available():
        return "none"
    return str(mod.chain())


def pack(weight: Tensor) -> Tensor:
    """[N, K] weight (any float dtype, K even) -> the kernel's layout, [ceil(N / 16), K / 2, 16, 2] bfloat16 (the
    weights rounded to bfloat16 once, zero columns past N)."""
    return _module("pack", weight).pack(weight.detach())


def pack_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """[N, K] weight -> (int8 [ceil(N / 16), K / 2, 16, 2], float32 scales [ceil(N / 16) * 16]): each output row
    rounded to integers in [-127, 127] times its own scale ``max|w| / 127`` (symmetric, per output channel). Half the
    bytes of :func:`pack`; the kernel widens the integers to bfloat16 exactly and scales the fp32 sums, so a row's
    result is still the same whatever the number of rows."""
    return _module("pack_int8", weight).pack_int8(weight.detach())


def _module(what: str, weight: Tensor) -> Any:
    """The built kernel for packing ``weight``: RuntimeError when unavailable, ValueError for an odd in_features."""
    mod = _EXT.module()
    if mod is None:
        raise RuntimeError(f"bf16_gemm.{what}: the native kernel is unavailable ({_EXT.failed})")
    if weight.shape[-1] % 2:
        raise ValueError(f"bf16_gemm.{what}: in_features={weight.shape[-1]} must be even")
    return mod


def gemm(x: Tensor, packed: Tensor, out_features: int, scale: Tensor | None = None, fp32_out: bool = False) -> Tensor:
    """[M, K] bfloat16 contiguous rows times the packed weight (of :func:`pack`, or of :func:`pack_int8` with its
    ``scale``) -> [M, out_features] bfloat16 (fp32 sums, scaled for int8, rounded to nearest even), or with
    ``fp32_out`` float32: the same sums unrounded (an LM head's logits keep fp32 resolution)."""
    mod = _EXT.module()
    if mod is None:
        raise RuntimeError(f"bf16_gemm.gemm: the native kernel is unavailable ({_EXT.failed})")
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        x = x.to(torch.bfloat16).contiguous()
    return mod.gemm(x, packed, int(out_features), scale, bool(fp32_out))
