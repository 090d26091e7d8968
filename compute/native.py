"""Build and load the project's native kernels (``compute/csrc/*.cpp``) on first use.

``torch.utils.cpp_extension.load`` compiles a source with g++ and ninja (a few seconds, cached under
``~/.cache/torch_extensions``) and imports it. OpenMP is on, so ``at::parallel_for`` inside a kernel runs on torch's
threads (without ``-fopenmp`` it runs on one). A kernel that cannot be built (no compiler, no ninja, no headers) or is
turned off with ``SPECSTOP_NATIVE=0`` loads as None, with the reason logged once: every caller has a torch fallback.

Usage::

    from compute.native import NativeExtension
    ext = NativeExtension("specstop_draft_stats", "draft_stats.cpp", "native draft statistics")
    mod = ext.module()        # the extension, or None (ext.failed says why)
    avx2 = NativeExtension("specstop_bf16_gemm_avx2", "bf16_gemm_avx2.cpp", "AVX2 bf16 GEMM", AVX2_CFLAGS)
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["NativeExtension", "CFLAGS", "AVX2_CFLAGS"]

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-std=c++17"]
LDFLAGS = ["-fopenmp"]
AVX2_CFLAGS = ["-mavx2", "-mfma", "-mf16c"]
"""Added for the AVX2 builds (``*_avx2`` extensions): the whole source compiled for AVX2 + FMA, no AVX-512."""


class NativeExtension:
    """One native source built and imported once per process."""

    def __init__(self, name: str, source: str, what: str, cflags: tuple[str, ...] = ()) -> None:
        self.name, self.source, self.what, self.cflags = name, CSRC / source, what, list(cflags)
        self._module: Any = None
        self.failed: str | None = None

    def module(self) -> Any:
        """The built extension, or None (the reason is logged once and kept in ``failed``)."""
        if self._module is not None or self.failed is not None:
            return self._module
        if os.environ.get("SPECSTOP_NATIVE", "1") == "0":
            self.failed = "SPECSTOP_NATIVE=0"
            return None
        try:
            from torch.utils.cpp_extension import load  # heavy, and only where a kernel is built

            self._module = load(name=self.name, sources=[str(self.source)], extra_cflags=CFLAGS + self.cflags,
                                extra_ldflags=LDFLAGS, extra_include_paths=[str(CSRC)], verbose=False)
        except Exception as e:  # no compiler, no ninja, no headers: the caller's torch path gives the same results
            msg = str(e).strip()
            self.failed = f"{type(e).__name__}: {msg.splitlines()[-1] if msg else ''}"
            log.warning("%s unavailable (%s); torch ops are used instead (slower)", self.what, self.failed)
        return self._module
