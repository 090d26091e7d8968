"""The native draft statistics (``compute.draft_stats``): entropy, q(token) and top-k probabilities against a float64
reference, rows with NaN or inf, and token_features with and without the native call."""
from __future__ import annotations

import shutil

import pytest
import torch

import compute.draft_stats as ds
from data_gen.features import token_features

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler: the torch fallback is what runs (tested elsewhere)")


def _reference(logits: torch.Tensor, tokens: torch.Tensor, k: int, temperature: float):
    z = logits.double() / (temperature if temperature > 0 else 1.0)
    p = torch.softmax(z, -1)
    k = min(k, logits.shape[-1])
    return torch.special.entr(p).sum(-1), p.gather(-1, tokens[..., None])[..., 0], p.topk(k, -1).values


def test_native_statistics_are_built():
    assert ds.native_available(), ds._EXT.failed


@pytest.mark.parametrize("shape", [(1, 151936), (3, 5000), (2, 37), (2, 3, 4096)])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_native_statistics_equal_a_float64_reference(shape, temperature):
    """Peaked and flat rows, a vocabulary smaller than k (zeros past V), leading batch dimensions."""
    torch.manual_seed(0)
    logits = torch.randn(*shape) * 3
    logits[..., 7] += 25.0 * (torch.arange(shape[-2]) % 2).view(*([1] * (len(shape) - 2)), -1)  # every other row
    tokens = torch.randint(0, shape[-1], shape[:-1])
    k = 10
    out = ds.draft_stats(logits, tokens, k, temperature)
    ent, q, topk = _reference(logits, tokens, k, temperature)
    assert out.shape == (*shape[:-1], 2 + k)
    torch.testing.assert_close(out[..., 0].double(), ent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[..., 1].double(), q, rtol=1e-5, atol=1e-12)
    kk = topk.shape[-1]
    torch.testing.assert_close(out[..., 2: 2 + kk].double(), topk, rtol=1e-5, atol=1e-12)
    assert torch.all(out[..., 2 + kk:] == 0)


def test_native_statistics_take_bf16_and_strided_logits():
    torch.manual_seed(1)
    base = torch.randn(4, 3000) * 2
    strided = base[:, ::2]  # non-contiguous
    tokens = torch.tensor([0, 5, 9, 11])
    torch.testing.assert_close(ds.draft_stats(strided, tokens, 5), ds.draft_stats(strided.contiguous(), tokens, 5))
    bf = base.bfloat16()
    torch.testing.assert_close(ds.draft_stats(bf, tokens, 5), ds.draft_stats(bf.float(), tokens, 5))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_native_statistics_mark_rows_with_non_finite_logits(bad):
    logits = torch.randn(3, 2000)
    logits[1, 17] = bad
    out = ds.draft_stats(logits, torch.tensor([0, 1, 2]), 4)
    assert torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()


@pytest.mark.parametrize("shape", [(1, 151936), (3, 5000), (2, 37)])
def test_greedy_stats_pick_the_first_argmax_and_its_statistics(shape):
    """Greedy decoding's one call: the token torch.argmax picks (the first of tied maxima, in any block) and the
    statistics draft_stats gives for it."""
    torch.manual_seed(3)
    logits = torch.randn(*shape) * 3
    logits[0, 3] = logits[0, -1] = logits.max() + 1.0  # a tie across blocks: the first wins
    if shape[0] > 1:
        logits[1, 200 % shape[1]] += 30.0
    tokens, stats = ds.greedy_draft_stats(logits, 10)
    assert torch.equal(tokens, logits.argmax(-1))
    assert tokens[0] == 3
    torch.testing.assert_close(stats, ds.draft_stats(logits, tokens, 10), rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_greedy_stats_name_the_model_of_non_finite_logits(bad):
    logits = torch.randn(2, 3000)
    logits[1, 5] = bad
    with pytest.raises(FloatingPointError, match="draft logits contain NaN or inf"):
        ds.greedy_draft_stats(logits, 4)


def test_token_features_native_and_torch_paths_agree(monkeypatch):
    """The native statistics and the torch ops give the same features (to float32 rounding of the torch softmax's
    sum); the nucleus path always takes the torch ops."""
    torch.manual_seed(2)
    logits = torch.randn(4, 6000) * 3
    logits[0, 5] += 20
    target, companion = torch.randn(4, 6000) * 3, torch.randn(4, 6000)
    tokens = torch.tensor([5, 1, 2, 3])
    for temperature in (0.0, 0.8):
        native = token_features(logits, tokens, target_logits=target, companion_logits=companion,
                                temperature=temperature)
        with monkeypatch.context() as m:
            m.setattr(ds, "draft_stats", lambda *a, **k: None)
            m.setattr("data_gen.features.draft_stats", lambda *a, **k: None)
            torch_ops = token_features(logits, tokens, target_logits=target, companion_logits=companion,
                                       temperature=temperature)
        assert native.keys() == torch_ops.keys()
        for name, v in native.items():
            if v.is_floating_point():
                torch.testing.assert_close(v, torch_ops[name], rtol=2e-5, atol=2e-6, msg=name)
            else:
                assert torch.equal(v, torch_ops[name]), name


@pytest.mark.parametrize("shape", [(2, 151936), (3, 5000), (2, 3, 37)])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_pair_statistics_equal_a_float64_reference(shape, temperature):
    """The other model's probability of the token, its entropy, TV and overlap with the draft, its first argmax
    (ties included: a row equal to the draft's, a tied maximum)."""
    torch.manual_seed(3)
    q, o = torch.randn(*shape) * 3, torch.randn(*shape) * 3
    o[..., 0, :] = q[..., 0, :]  # identical distributions: TV 0, overlap 1
    o[..., -1, 4] = o[..., -1, 9] = o[..., -1, :].amax(-1) + 5  # a tied maximum: the first index wins
    tokens = torch.randint(0, shape[-1], shape[:-1])
    out, amax = ds.pair_stats(q, o, tokens, temperature)
    t = temperature if temperature > 0 else 1.0
    pq, po = torch.softmax(q.double() / t, -1), torch.softmax(o.double() / t, -1)
    torch.testing.assert_close(out[..., 0].double(), po.gather(-1, tokens[..., None])[..., 0], rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(out[..., 1].double(), torch.special.entr(po).sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[..., 2].double(), 0.5 * (po - pq).abs().sum(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[..., 3].double(), torch.minimum(po, pq).sum(-1), rtol=1e-5, atol=1e-6)
    assert torch.equal(amax, o.argmax(-1)) and torch.all(amax[..., -1] == 4)
    assert torch.all(out[..., 0, 2] < 1e-6) and torch.all((out[..., 0, 3] - 1).abs() < 1e-6)
    bad = o.clone()
    bad[..., 1, 2] = float("nan")
    out, amax = ds.pair_stats(q, bad, tokens, temperature)
    assert torch.isnan(out[..., 1, :]).all() and torch.all(amax[..., 1] == -1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_decode_steps_pair_row_shared_among_threads_has_the_bits_of_one_thread(temperature):
    """A single wide row (a decode step's draft against the companion) runs its blocks on every thread: the same bits
    as the row computed on one thread and as that row inside a batch; a tied maximum in a later block is found."""
    torch.manual_seed(5)
    q, o = torch.randn(3, 151936) * 3, torch.randn(3, 151936) * 3
    o[1, 90000] = o[1, 120000] = o[1].amax() + 4
    tokens = torch.tensor([7, 90000, 151935])
    batch, batch_amax = ds.pair_stats(q, o, tokens, temperature)
    n = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for r in range(3):
                one, amax = ds.pair_stats(q[r : r + 1], o[r : r + 1], tokens[r : r + 1], temperature)
                assert torch.equal(one[0], batch[r]) and int(amax[0]) == int(batch_amax[r]), (threads, r)
    finally:
        torch.set_num_threads(n)
    assert int(batch_amax[1]) == 90000


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_native_sampling_draws_from_the_softmax(temperature):
    """Inversion sampling over block sums: frequencies of 60,000 draws over a 300-token vocabulary (three blocks, the
    last partial) pass a chi-square test against softmax(z / T); -inf logits are never drawn; a seeded generator
    repeats its draws."""
    torch.manual_seed(4)
    logits = torch.randn(300) * 2
    logits[[5, 150, 299]] = float("-inf")
    n = 60_000
    rows = logits.expand(n, 300)
    draws = ds.sample_tokens(rows, temperature, torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=300).double()
    p = torch.softmax(logits.double() / temperature, -1)
    assert counts[[5, 150, 299]].sum() == 0
    keep = p * n >= 5
    chi2 = float((((counts - n * p) ** 2) / (n * p))[keep].sum())
    df = int(keep.sum()) - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5, (chi2, df)
    again = ds.sample_tokens(rows, temperature, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)


@pytest.mark.parametrize("role", ["target", "companion"])
@pytest.mark.parametrize("native", [True, False])
def test_token_features_name_the_model_with_non_finite_logits(monkeypatch, role, native):
    """A NaN or inf in the target's or companion's logits raises FloatingPointError naming that model, on the native
    path (its statistics are NaN for the row) and on the torch one (a reduction over the logits)."""
    torch.manual_seed(5)
    logits = {name: torch.randn(3, 4000) for name in ("draft", "target", "companion")}
    logits[role][2, 7] = float("inf")
    if not native:
        monkeypatch.setattr("data_gen.features.draft_stats", lambda *a, **k: None)
    with pytest.raises(FloatingPointError, match=f"{role} logits contain NaN or inf"):
        token_features(logits["draft"], torch.tensor([1, 2, 3]), target_logits=logits["target"],
                       companion_logits=logits["companion"], temperature=0.0)
