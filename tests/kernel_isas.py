"""The ISAs of specstop's bf16 GEMM (``compute.bf16_gemm.ISAS``) for tests that run once per ISA: every kernel test
runs under each ISA this CPU allows (``SPECSTOP_ISA=avx2`` on an AVX-512 host runs the AVX2 kernels too).

Usage::

    @pytest.mark.parametrize("isa", KERNEL_ISAS)
    def test_x(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
        use_isa(monkeypatch, isa)   # the process's kernels (packing, GEMM, native layers, attention) are isa's
"""
from __future__ import annotations

import pytest

from compute import bf16_gemm
from compute.cpu import cpu_model, isas_of

__all__ = ["KERNEL_ISAS", "any_kernel", "use_isa"]


def _runs(isa: str) -> bool:
    """This CPU has the ISA (or its flags are unknown) and the kernel builds and says so."""
    flags = cpu_model()["simd_flags"]
    return (not flags or isa in isas_of(flags)) and bf16_gemm.available(isa)


KERNEL_ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not _runs(isa), reason=f"no {isa} kernel on this host"))
               for isa in bf16_gemm.ISAS]
"""One parameter per kernel ISA, skipped where this CPU (or the build) lacks it."""


def any_kernel() -> bool:
    """Some kernel ISA runs here."""
    return any(_runs(isa) for isa in bf16_gemm.ISAS)


def use_isa(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """Run this test's kernels on ``isa`` (``SPECSTOP_ISA``, undone after the test)."""
    monkeypatch.setenv("SPECSTOP_ISA", isa)
    assert bf16_gemm.isa() == isa
