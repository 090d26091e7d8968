"""Exact speculative sampling: the engine's output distribution is the target's (chi-square on the first two tokens)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from data_gen.features import probs_from_logits
from decoding.engine import SpeculativeDecoder
from decoding.policies import build_policy
from tests.tiny_pairs import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


PROMPT = torch.tensor([[67, 68, 69, 220, 69, 78, 78, 7]])
N_PER_BATCH, N_BATCHES = 500, 4


def exact_marginals(target, temperature: float, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Target's exact distributions of the first generated token and (marginally) of the second."""
    with torch.no_grad():
        p1 = probs_from_logits(target(PROMPT).logits[0, -1], temperature, top_p)
        v = p1.shape[0]
        ext = torch.cat([PROMPT.repeat(v, 1), torch.arange(v).view(v, 1)], 1)
        p2_given = probs_from_logits(target(ext).logits[:, -1], temperature, top_p)  # [V, V]
    return p1.double().numpy(), (p1.double() @ p2_given.double()).numpy()


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit, pooling categories with small expected counts into one bin."""
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 1e-9:
        assert obs[-1] == 0, "tokens sampled that have (near) zero target probability"
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)


def sample_first_two(draft, target, spec: str, temperature: float, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    dec = SpeculativeDecoder(draft, target, build_policy(spec), temperature=temperature, top_p=top_p)
    v = target.config.vocab_size
    c1, c2 = np.zeros(v), np.zeros(v)
    for seed in range(N_BATCHES):
        out, stats = dec.generate(PROMPT.repeat(N_PER_BATCH, 1), None, 3, None, seed)
        new = out[:, PROMPT.shape[1]:]
        c1 += np.bincount(new[:, 0].numpy(), minlength=v)
        c2 += np.bincount(new[:, 1].numpy(), minlength=v)
        assert 0 < stats.accepted < stats.drafted  # both accept and reject paths ran
    return c1, c2


@pytest.fixture(scope="module")
def pair():
    return make_pair(noise=0.5)


@pytest.mark.parametrize("spec,temperature,top_p", [("static:2", 1.0, 1.0), ("svip:0.3", 0.7, 0.9)])
def test_output_distribution_is_target(pair, spec, temperature, top_p):
    draft, target = pair
    p1, p2 = exact_marginals(target, temperature, top_p)
    c1, c2 = sample_first_two(draft, target, spec, temperature, top_p)
    assert chi2_pvalue(c1, p1) > 1e-3
    assert chi2_pvalue(c2, p2) > 1e-3
    # The test has power: the draft's own distribution is rejected where it differs from the target's.
    with torch.no_grad():
        q1 = probs_from_logits(draft(PROMPT).logits[0, -1], temperature, top_p).double().numpy()
    if 0.5 * np.abs(q1 - p1).sum() > 0.15:
        assert chi2_pvalue(c1, q1) < 1e-3


def test_draws_from_probabilities_follow_them_and_never_pick_a_zero(monkeypatch):
    """decoding.sampling.draw (the residual's and top-p's draws): the native inversion sampler on a CPU, and
    torch.multinomial where it is unavailable, both match the probabilities and never draw a zero-probability token."""
    import decoding.sampling as sampling

    probs = torch.zeros(4, 3000)
    probs[:, [7, 1500, 2999]] = torch.tensor([0.2, 0.5, 0.3])
    probs[:, 100:200] = 1e-4  # a tail
    probs = probs / probs.sum(-1, keepdim=True)
    want = probs[0].double().numpy()
    for native in (True, False):
        if not native:
            monkeypatch.setattr(sampling, "sample_tokens", lambda *a, **k: None)
        gen = torch.Generator().manual_seed(0)
        draws = torch.cat([sampling.draw(probs, gen) for _ in range(2000)]).numpy()
        counts = np.bincount(draws, minlength=probs.shape[1])
        assert counts[want == 0].sum() == 0, native
        assert chi2_pvalue(counts, want) > 1e-3, native
