"""Build and load the native kernels (``compute/csrc/*.cpp``) on first use with ``torch.utils.cpp_extension.load``.

Each build runs under an ``fcntl`` lock of its own, so a ``lock`` file a killed torch build left behind (on which
``load`` would wait forever) is known stale and removed. A kernel that cannot be built, or is off with
``SPECSTOP_NATIVE=0``, loads as None with the reason logged once; every caller has a torch fallback.

``compute.kernels.prebuild()`` builds this host's kernels ahead, in background threads.

Usage::

    ext = NativeExtension("specstop_draft_stats", "draft_stats.cpp", "native draft statistics")
    mod = ext.module()        # the extension, or None (ext.failed says why)
"""
from __future__ import annotations

import fcntl
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["NativeExtension", "CFLAGS", "AVX2_CFLAGS", "build_directory", "exclusive_build"]

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
        self._lock = threading.Lock()  # a caller meeting a background build waits for it instead of importing twice

    def module(self) -> Any:
        """The built extension, or None (the reason is logged once and kept in ``failed``)."""
        if self._module is not None or self.failed is not None:
            return self._module
        with self._lock:
            if self._module is None and self.failed is None:
                self._build()
        return self._module

    def _build(self) -> None:
        if os.environ.get("SPECSTOP_NATIVE", "1") == "0":
            self.failed = "SPECSTOP_NATIVE=0"
            return
        try:
            from torch.utils.cpp_extension import load  # heavy, and only where a kernel is built

            build_dir = build_directory(self.name)
            with exclusive_build(build_dir):
                self._module = load(name=self.name, sources=[str(self.source)], extra_cflags=CFLAGS + self.cflags,
                                    extra_ldflags=LDFLAGS, extra_include_paths=[str(CSRC)],
                                    build_directory=str(build_dir), verbose=False)
        except Exception as e:  # no compiler, no ninja, no headers: the caller's torch path gives the same results
            msg = str(e).strip()
            self.failed = f"{type(e).__name__}: {msg.splitlines()[-1] if msg else ''}"
            log.warning("%s unavailable (%s); torch ops are used instead (slower)", self.what, self.failed)


def build_directory(name: str) -> Path:
    """Where ``name`` is built: a folder per Python and torch version, so that two torch builds never share objects."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    folder = root / f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold the build folder's ``fcntl`` lock; a torch ``lock`` file found under it is a dead build's and is removed."""
    with open(build_dir / "specstop.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # waits only on a live build: the kernel releases a dead process's lock
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
