"""What this CPU is: its model name, the SIMD flags that decide the compute path, and the ISA specstop's native kernels
run on (``avx512`` or ``avx2``; ``SPECSTOP_ISA`` forces one the CPU has).

Usage::

    cpu_model()["simd_flags"]     # ['avx', 'avx2', 'avx512_bf16', ...]
    requested_isa()               # 'avx2' under SPECSTOP_ISA=avx2, None when unset
"""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["ISA_FLAGS", "ISA_NAMES", "avx512_allowed", "cpu_model", "cpuinfo_fields", "is_x86", "isas_of",
           "requested_isa"]

ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    "avx2": ("avx2", "fma"),
}
"""Kernel ISA -> the /proc/cpuinfo flags it needs, best first."""
ISA_NAMES = {"avx512": "AVX512-BF16", "avx2": "AVX2 with FMA"}


@functools.lru_cache(maxsize=1)
def cpuinfo_fields() -> dict[str, str]:
    """The first CPU's fields of /proc/cpuinfo (``model name``, ``flags``, ...); empty where the file does not exist."""
    fields: dict[str, str] = {}
    path = Path("/proc/cpuinfo")
    if path.is_file():
        for line in path.read_text().splitlines():
            key, _, val = line.partition(":")
            fields.setdefault(key.strip(), val.strip())
    return fields


@functools.lru_cache(maxsize=1)
def cpu_model() -> dict[str, Any]:
    """Model name and the SIMD flags that decide the compute path (no flags without /proc/cpuinfo)."""
    info = cpuinfo_fields()
    model, flags = info.get("model name", ""), set(info.get("flags", "").split())
    simd = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
    return {
        "model_name": model,
        "simd_flags": simd,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


def is_x86() -> bool:
    """This is an x86-64 CPU (the only one specstop's kernels have code for)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def isas_of(flags: set[str] | list[str]) -> list[str]:
    """The kernel ISAs these CPU flags allow, best first."""
    have = set(flags)
    return [isa for isa, need in ISA_FLAGS.items() if set(need) <= have]


def requested_isa() -> str | None:
    """The kernel ISA ``SPECSTOP_ISA`` asks for, None when unset or ``auto``; ValueError for another value or an ISA
    this CPU lacks."""
    return _checked_isa(os.environ.get("SPECSTOP_ISA", "").strip().lower(), tuple(cpu_model()["simd_flags"]),
                        cpu_model()["model_name"], is_x86())


@functools.lru_cache(maxsize=8)
def _checked_isa(value: str, flags: tuple[str, ...], model: str, x86: bool) -> str | None:
    if value in ("", "auto"):
        return None
    if value not in ISA_FLAGS:
        raise ValueError(f"SPECSTOP_ISA={value!r}: use {' or '.join(ISA_FLAGS)} (or leave it unset for the best this "
                         f"CPU has)")
    if not x86:
        raise ValueError(f"SPECSTOP_ISA={value} needs an x86-64 CPU; this one is {platform.machine() or 'unknown'} "
                         f"and runs no specstop kernel: leave it unset")
    if flags and value not in isas_of(flags):
        missing = [f for f in ISA_FLAGS[value] if f not in flags]
        has = isas_of(flags)
        fix = f"use SPECSTOP_ISA={has[0]} or leave it unset" if has else "leave it unset (no specstop kernel runs here)"
        raise ValueError(f"SPECSTOP_ISA={value} needs {ISA_NAMES[value]} ({', '.join(ISA_FLAGS[value])}); this CPU "
                         f"({model or 'unknown'}) lacks {', '.join(missing)} and has "
                         f"{', '.join(ISA_NAMES[i] for i in has) or 'neither kernel ISA'}: {fix}")
    return value


def avx512_allowed() -> bool:
    """AVX-512 code outside the bf16 GEMM may run: the CPU has it and ``SPECSTOP_ISA`` is not ``avx2``."""
    return requested_isa() != "avx2"
