"""Which compute path a device and CPU run (``--models.compute``), and the machine facts a timing or benchmark records.

``auto`` picks the fastest exact path this CPU runs; an explicit path the device or CPU lacks is refused with the value
that works (the paths: docs/compute-path.md).

Usage::

    resolve_compute_path("auto", "cpu")     # e.g. "packed-bf16"
    cpu_info()["bf16_chain"]                # amx, avx512-bf16, avx2 or none
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from compute import bf16_gemm, cpu

log = logging.getLogger(__name__)

__all__ = ["COMPUTE_PATHS", "auto_cpu_path", "cpu_info", "native_bf16", "resolve_compute_path"]

COMPUTE_PATHS = ("auto", "packed", "packed-bf16", "eager")


def cpu_info() -> dict[str, Any]:
    """:func:`compute.cpu.cpu_model`, the torch threads in use now and the instructions specstop's bf16 GEMM runs on
    here (``bf16_chain``)."""
    model = cpu.cpu_model()
    # a CPU with neither kernel ISA runs no chain: no build of a kernel just to say so (where the flags are unknown, no
    # /proc/cpuinfo, bf16_gemm.isa asks the kernels)
    chain = "none" if bf16_gemm.isa() == "none" else bf16_gemm.chain()
    return {**model, "threads": torch.get_num_threads(), "bf16_chain": chain}


def native_bf16() -> bool:
    """True when this CPU computes bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16) and oneDNN uses it."""
    flags = set(cpu.cpu_model()["simd_flags"])
    has_isa = bool(flags & {"avx512_bf16", "amx_bf16"})
    return has_isa and torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_compute_path(path: str, device: torch.device | str) -> str:
    """The concrete path for ``path`` on ``device``: ``auto`` picks, an explicit path is checked (ValueError naming
    ``--models.compute`` and the value that works)."""
    if path not in COMPUTE_PATHS:
        raise ValueError(f"models.compute={path!r}: use one of {', '.join(COMPUTE_PATHS)}")
    dev = torch.device(device)
    if path == "auto":
        return auto_cpu_path() if dev.type == "cpu" else "eager"
    if path == "eager":
        return path
    if dev.type != "cpu":
        raise ValueError(f"models.compute={path!r} is a CPU path but models.device={dev}; use --models.compute eager "
                         f"(or auto) on {dev.type}")
    if not torch.backends.mkldnn.is_available():
        raise ValueError(f"models.compute={path!r} needs oneDNN (mkldnn), which this torch build lacks; use "
                         f"--models.compute eager")
    if path == "packed-bf16" and not (bf16_gemm.available() or native_bf16()):
        raise ValueError(f"models.compute=packed-bf16 needs specstop's bf16 kernel (a CPU with AVX512-BF16, or AVX2 "
                         f"with FMA, and a C++ compiler: {bf16_gemm.unavailable_reason()}) or oneDNN's bf16 "
                         f"(AVX512-BF16 or AMX-BF16); this CPU ({cpu.cpu_model()['model_name'] or 'unknown'}) has "
                         f"neither: use --models.compute packed (or eager)")
    return path


def auto_cpu_path() -> str:
    """The fastest exact path this CPU runs: ``packed-bf16`` on specstop's kernel or oneDNN's bf16, else ``packed``,
    else ``eager``; anything but specstop's kernel is logged with its reason."""
    if not torch.backends.mkldnn.is_available():
        path, why = "eager", "this torch build has no oneDNN"
    elif bf16_gemm.available():
        return "packed-bf16"
    elif native_bf16():
        path, why = "packed-bf16", f"oneDNN's bf16; specstop's kernel is unavailable: {bf16_gemm.unavailable_reason()}"
    else:
        path, why = "packed", f"oneDNN fp32: {bf16_gemm.unavailable_reason()}"
    _say_once(f"compute path auto: {path} ({why})")
    return path


@functools.lru_cache(maxsize=8)
def _say_once(message: str) -> None:
    log.info(message)
