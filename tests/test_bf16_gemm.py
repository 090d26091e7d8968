"""specstop's bf16 GEMM (compute.bf16_gemm), every test once per kernel ISA this CPU runs (AVX512-BF16, AVX2):
values against float64 of the same bf16 operands, and the same bits for a row whatever the number of rows in the call
(the batch invariance the packed-bf16 path relies on)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from compute import bf16_gemm
from compute.compute_path import PackedLinear, native_bf16
from tests.kernel_isas import KERNEL_ISAS, use_isa


@pytest.fixture(params=KERNEL_ISAS, autouse=True)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test of this module runs on each kernel ISA (SPECSTOP_ISA)."""
    use_isa(monkeypatch, request.param)
    return request.param


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.to(torch.bfloat16).double().T


@pytest.mark.parametrize("n,k", [(16, 2), (40, 64), (33, 96), (1000, 448), (96, 1200)])
def test_gemm_equals_float64_of_the_bf16_operands_to_output_rounding(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(37, k, generator=g).to(torch.bfloat16)
    y = bf16_gemm.gemm(x, bf16_gemm.pack(w), n)
    assert y.shape == (37, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
    ref = _ref(x, w)
    # bf16 output: half an ulp of 2^-8 relative, plus fp32 summation error
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-4 * k**0.5).all()


@pytest.mark.parametrize("n,k", [(48, 64), (200, 320), (17, 2 * 700), (300, 2 * 600)])
def test_a_row_has_the_same_bits_alone_in_a_few_rows_and_in_many(n: int, k: int) -> None:
    """Calls of 1..40 rows (the one-to-16-row path and the tiled many-row path with its spilled input blocks, one
    column block a pass and, from 32 rows, groups of blocks) give every row the bits of its one-row call."""
    g = torch.Generator().manual_seed(k)
    wp = bf16_gemm.pack(torch.randn(n, k, generator=g))
    x = torch.randn(40, k, generator=g).to(torch.bfloat16)
    alone = torch.cat([bf16_gemm.gemm(x[i : i + 1].contiguous(), wp, n) for i in range(40)])
    for m in (2, 3, 5, 8, 9, 16, 17, 24, 40):
        for start in (0, 40 - m):
            assert torch.equal(bf16_gemm.gemm(x[start : start + m].contiguous(), wp, n), alone[start : start + m]), m


def test_packed_linear_on_the_kernel_matches_onednn_to_bf16_rounding() -> None:
    if not native_bf16():
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(256, 96, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 256, generator=g) / 16)
    native, onednn = PackedLinear(lin, torch.bfloat16, native=True), PackedLinear(lin, torch.bfloat16)
    assert native.kernel == "specstop" and onednn.kernel == "onednn"
    x = torch.randn(2, 5, 256, generator=g)
    with torch.no_grad():
        a, b = native(x), onednn(x)
    assert a.dtype == torch.float32 and a.shape == (2, 5, 96)
    torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3)  # both bf16-rounded outputs of other summation orders


def test_bad_shapes_name_the_problem() -> None:
    with pytest.raises(ValueError, match="in_features=3 must be even"):
        bf16_gemm.pack(torch.randn(4, 3))
    wp = bf16_gemm.pack(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="packed weight"):
        bf16_gemm.gemm(torch.randn(2, 10).to(torch.bfloat16), wp, 32)


def _dequantized(w: torch.Tensor) -> torch.Tensor:
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(w / scale).clamp(-127, 127) * scale


@pytest.mark.parametrize("n,k", [(16, 2), (40, 64), (33, 96), (1000, 448), (96, 1200)])
def test_int8_gemm_equals_float64_of_the_dequantized_weights_to_output_rounding(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    w, x = torch.randn(n, k, generator=g), torch.randn(37, k, generator=g).to(torch.bfloat16)
    w[3] = 0  # a zero row: scale 1, outputs 0
    q, scale = bf16_gemm.pack_int8(w)
    assert q.dtype == torch.int8 and q.shape == (-(-n // 16), k // 2, 16, 2) and scale.shape == (q.shape[0] * 16,)
    y = bf16_gemm.gemm(x, q, n, scale)
    ref = x.double() @ _dequantized(w).double().T
    assert y.shape == (37, n) and y.dtype == torch.bfloat16
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-4 * k**0.5).all()
    assert (y[:, 3] == 0).all() and scale[3] == 1


@pytest.mark.parametrize("n,k", [(48, 64), (200, 320), (17, 2 * 700), (300, 2 * 600)])
def test_an_int8_row_has_the_same_bits_alone_in_a_few_rows_and_in_many(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(k + 1)
    q, scale = bf16_gemm.pack_int8(torch.randn(n, k, generator=g))
    x = torch.randn(40, k, generator=g).to(torch.bfloat16)
    alone = torch.cat([bf16_gemm.gemm(x[i : i + 1].contiguous(), q, n, scale) for i in range(40)])
    for m in (2, 3, 5, 8, 9, 16, 17, 24, 40):
        for start in (0, 40 - m):
            assert torch.equal(bf16_gemm.gemm(x[start : start + m].contiguous(), q, n, scale), alone[start : start + m])


def test_int8_weights_without_their_scales_are_refused() -> None:
    w = torch.randn(32, 8)
    q, scale = bf16_gemm.pack_int8(w)
    x = torch.randn(2, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="int8 weight needs its scales"):
        bf16_gemm.gemm(x, q, 32)
    with pytest.raises(RuntimeError, match="int8 weight needs its scales"):
        bf16_gemm.gemm(x, bf16_gemm.pack(w), 32, scale)
    with pytest.raises(RuntimeError, match="scales of pack_int8"):
        bf16_gemm.gemm(x, q, 32, scale[:16].contiguous())
    with pytest.raises(ValueError, match="in_features=3 must be even"):
        bf16_gemm.pack_int8(torch.randn(4, 3))


@pytest.mark.parametrize("int8", [False, True])
def test_fp32_out_returns_the_sums_the_bf16_output_rounds(int8: bool) -> None:
    """``fp32_out`` (the LM heads' logits): float32 sums within fp32 summation error of float64, rounding to the bits
    of the bf16 output, and a row's bits the same in calls of 1..40 rows (both row paths)."""
    n, k = 200, 320
    g = torch.Generator().manual_seed(11 + int8)
    w, x = torch.randn(n, k, generator=g), torch.randn(40, k, generator=g).to(torch.bfloat16)
    wp, scale = bf16_gemm.pack_int8(w) if int8 else (bf16_gemm.pack(w), None)
    y = bf16_gemm.gemm(x, wp, n, scale, fp32_out=True)
    assert y.dtype == torch.float32 and y.shape == (40, n)
    ref = x.double() @ (_dequantized(w) if int8 else w.to(torch.bfloat16)).double().T
    assert ((y.double() - ref).abs() <= ref.abs() * 2.0**-20 + 1e-5 * k**0.5).all()
    assert torch.equal(y.to(torch.bfloat16), bf16_gemm.gemm(x, wp, n, scale))
    alone = torch.cat([bf16_gemm.gemm(x[i : i + 1].contiguous(), wp, n, scale, fp32_out=True) for i in range(40)])
    for m in (3, 8, 16, 17, 40):
        assert torch.equal(bf16_gemm.gemm(x[:m].contiguous(), wp, n, scale, fp32_out=True), alone[:m]), m


def test_a_bf16_head_on_the_kernel_returns_fp32_logits() -> None:
    """The LM head on specstop's kernel keeps fp32 resolution (``bfloat16-fp32-logits``); the target asks for it and
    gets a bf16 head only there (``fp32_logits``)."""
    from compute import compute_path as cp
    from compute.models import ModelSpec, load_model, model_fingerprint

    model, tok = load_model(ModelSpec("tiny:3:64:2", compute="eager"))
    ref, _ = load_model(ModelSpec("tiny:3:64:2", compute="eager"))
    cp.apply_compute_path(model, "packed-bf16", bf16_head=True, min_elements=0, fp32_logits=True)
    cp.apply_compute_path(ref, "packed-bf16", bf16_head=False, min_elements=0)
    head = model.get_output_embeddings()
    assert head.fp32_out and head.pack_dtype == torch.bfloat16
    assert model_fingerprint(model, tok)["head_dtype"] == "bfloat16-fp32-logits"
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 44, 18]])
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert a.dtype == torch.float32
    assert not torch.equal(a, a.to(torch.bfloat16).float())  # not rounded to bf16
    assert (a - b).abs().max() < 2**-6 * b.abs().max()  # the weights' bf16 rounding only
    if not native_bf16():
        return  # oneDNN has no bf16 kernels on this CPU
    onednn, _ = load_model(ModelSpec("tiny:3:64:2", compute="eager"))
    cp.apply_compute_path(onednn, "packed-bf16", bf16_head=True, min_elements=0, fp32_logits=True, native_gemm=False)
    assert model_fingerprint(onednn, tok)["head_dtype"] == "float32"  # oneDNN would round the logits: head kept fp32


def test_both_chains_compute_the_same_products_and_amx_can_be_turned_off(isa: str) -> None:
    """Where AMX runs the bf16 packs, a process with SPECSTOP_AMX=0 runs vdpbf16ps instead: it says so, and its
    fp32 sums equal this process's to rounding (the two chains add the same products in another order)."""
    if bf16_gemm.chain() != "amx":
        pytest.skip(f"this process runs the {bf16_gemm.chain()} chain, not AMX")
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(70, 1400, generator=g), torch.randn(9, 1400, generator=g).to(torch.bfloat16)
    here = bf16_gemm.gemm(x, bf16_gemm.pack(w), 70, fp32_out=True)
    code = ("import sys, torch; from compute import bf16_gemm; w, x = torch.load(sys.argv[1]); "
            "torch.save((bf16_gemm.chain(), bf16_gemm.gemm(x, bf16_gemm.pack(w), 70, fp32_out=True)), sys.argv[1])")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "io.pt")
        torch.save((w, x), path)
        subprocess.run([sys.executable, "-c", code, path], check=True, env={**os.environ, "SPECSTOP_AMX": "0"})
        chain, there = torch.load(path)
    assert chain == "avx512-bf16"
    torch.testing.assert_close(here, there, rtol=1e-5, atol=1e-4)


def test_the_two_isas_compute_the_same_products(isa: str) -> None:
    """The AVX2 kernel and the AVX512-BF16 one add the same bf16 products in other orders: fp32 sums equal to rounding,
    int8 packs of each kernel's byte order alike."""
    if isa != "avx2" or not bf16_gemm.available("avx512"):
        pytest.skip("needs both kernels (runs in the avx2 round)")
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(70, 1400, generator=g), torch.randn(9, 1400, generator=g).to(torch.bfloat16)
    for which in (None, "avx512"):
        assert bf16_gemm.gemm_name(which) == ("specstop-avx2" if which is None else "specstop")
    ys = [bf16_gemm.gemm(x, bf16_gemm.pack(w, which), 70, fp32_out=True, which=which) for which in ("avx2", "avx512")]
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-5, atol=1e-4)
    qs = [bf16_gemm.pack_int8(w, which) for which in ("avx2", "avx512")]
    assert torch.equal(qs[0][1], qs[1][1]) and not torch.equal(qs[0][0], qs[1][0])  # same scales, other byte order
    ys = [bf16_gemm.gemm(x, q, 70, scale, fp32_out=True, which=which) for (q, scale), which in zip(qs, ("avx2",
                                                                                                      "avx512"))]
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-5, atol=1e-4)


def test_the_avx2_build_holds_no_avx512_instruction(isa: str) -> None:
    """The AVX2 kernel is compiled for AVX2 + FMA only: no zmm register or AVX-512 mask in its machine code, so it runs
    on AVX2-only CPUs as timed here."""
    objdump = shutil.which("objdump")
    if isa != "avx2" or objdump is None:
        pytest.skip("the avx2 round, with objdump")
    so = Path(bf16_gemm.library("avx2"))
    code = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True,
                          check=True).stdout
    assert "vfmadd" in code and "%zmm" not in code and "{%k" not in code
