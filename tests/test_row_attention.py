"""The native decoding attention (csrc/row_attention.cpp behind compute.compute_path.row_invariant_attention):
values of SDPA, and each row's bits whatever the number of rows computed with it, with and without its AVX-512 path."""
from __future__ import annotations

import types

import pytest
import torch

from compute import compute_path as cp
from compute.row_attention import ATTENTION
from tests.kernel_isas import KERNEL_ISAS, use_isa

pytestmark = pytest.mark.skipif(ATTENTION.module() is None, reason="native build unavailable")


@pytest.fixture(params=KERNEL_ISAS, autouse=True)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test of this module runs as each kernel ISA's process does (SPECSTOP_ISA=avx2: no AVX-512 attention)."""
    use_isa(monkeypatch, request.param)
    return request.param


def _qkv(b: int, h: int, hkv: int, q: int, t: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, q, d, generator=g), torch.randn(b, hkv, t, d, generator=g),
            torch.randn(b, hkv, t, d, generator=g))


def _sdpa_rows(query, key, value, mask):
    """Reference: one SDPA call per row over its causal keys (with the mask row), grouped heads expanded."""
    b, h, q, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    k, v = key.repeat_interleave(h // hkv, 1), value.repeat_interleave(h // hkv, 1)
    out = torch.empty(b, q, h, d)
    for i in range(q):
        n = t - q + i + 1
        m = None if mask is None else mask[:, :, i : i + 1, :n]
        out[:, i] = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, i : i + 1].double(), k[:, :, :n].double(), v[:, :, :n].double(),
            attn_mask=m).float()[:, :, 0]
    return out


MODULE = types.SimpleNamespace(training=False)


@pytest.mark.parametrize("b,h,hkv,q,t,d", [(1, 12, 2, 8, 40, 128), (2, 4, 2, 3, 9, 16), (1, 14, 2, 1, 300, 64)])
def test_values_equal_sdpa_in_float64(b: int, h: int, hkv: int, q: int, t: int, d: int) -> None:
    query, key, value = _qkv(b, h, hkv, q, t, d)
    out, _ = cp.row_invariant_attention(MODULE, query, key, value, None, scaling=d**-0.5)
    assert out.shape == (b, q, h, d)
    torch.testing.assert_close(out, _sdpa_rows(query, key, value, None), rtol=1e-5, atol=1e-5)


def test_left_padding_masks_keys_and_fully_masked_rows_give_zeros() -> None:
    query, key, value = _qkv(2, 4, 2, 6, 6, 16, seed=1)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[0, :, :, :2] = False  # the first sequence is left-padded by two tokens
    out, _ = cp.row_invariant_attention(MODULE, query, key, value, mask, scaling=0.25)
    ref = _sdpa_rows(query * 1.0, key, value, mask)  # SDPA's default scale is 1/sqrt(16) = 0.25 too
    torch.testing.assert_close(out[0, 2:], ref[0, 2:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2]))  # padding rows see no key


def test_a_row_has_the_same_bits_alone_and_among_others() -> None:
    """Rows of one verification forward over a cache equal one-row calls over the growing cache, bit for bit."""
    query, key, value = _qkv(1, 12, 2, 8, 50, 64, seed=2)
    whole, _ = cp.row_invariant_attention(MODULE, query, key, value, None, scaling=0.125)
    for i in range(8):
        n = 50 - 8 + i + 1
        alone, _ = cp.row_invariant_attention(MODULE, query[:, :, i : i + 1].contiguous(), key[:, :, :n],
                                              value[:, :, :n], None, scaling=0.125)
        assert torch.equal(alone[:, 0], whole[:, i]), i
