"""This host's native kernels built ahead: the first model load starts their builds in two background threads, so
that they compile while the weights convert and load (on a fresh machine each takes 10-25 s of one core, which one
after another sat in front of the first forward).

Usage::

    prebuild()                       # in the background, once per process
    python -m compute.kernels        # now, waiting for them (scripts/setup.sh --real)
"""
from __future__ import annotations

import logging
import os
import threading

from compute import bf16_gemm, draft_stats, native_layers, row_attention, timing
from compute.native import NativeExtension

__all__ = ["host_extensions", "prebuild"]

_STARTED: list[threading.Thread] = []


def host_extensions() -> list[NativeExtension]:
    """The kernels this process runs: its ISA's GEMM and decoder layers, and the ISA-free ones (none off x86)."""
    isa = bf16_gemm.isa()
    if isa == "none":
        return []
    return [bf16_gemm._EXTS[isa], native_layers._EXTS[isa], row_attention.ATTENTION, draft_stats._EXT, timing._PROBE]


def prebuild(wait: bool = False, workers: int = 2) -> None:
    """Build :func:`host_extensions` in ``workers`` daemon threads (once per process; a built kernel only loads);
    ``wait`` joins them."""
    if not _STARTED and os.environ.get("SPECSTOP_NATIVE", "1") != "0":
        todo, n = host_extensions(), max(1, workers)
        for i in range(n):
            share = todo[i::n]
            thread = threading.Thread(target=lambda s=share: [ext.module() for ext in s], daemon=True,
                                      name=f"specstop native build {i}")
            thread.start()
            _STARTED.append(thread)
    if wait:
        for thread in _STARTED:
            thread.join()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prebuild(wait=True)
    print("native kernels: " + ", ".join(f"{e.name} {'failed' if e.failed else 'ready'}" for e in host_extensions()))
