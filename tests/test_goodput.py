"""The cost-aware rule (predictors.goodput) on hand-computed cases, calibration maps and their error, goodput:
policies in the engine (exact in greedy mode), replay / engine agreement, and the errors users meet."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import numpy as np
import pytest
import torch
from torch import Tensor

from compute.timing import CostModel
from decoding.engine import SpeculativeDecoder
from decoding.policies import build_policy
from evaluation.replay import ReplayConfig, prepare_replay_data, replay_policy
from predictors import goodput
from predictors.baselines import MaxConfidence
from predictors.calibration import (
    Calibrator,
    ece_interval,
    ece_noise_floor,
    expected_calibration_error,
    fit_calibrator,
    reliability_bins,
)
from predictors.export import export_predictor, load_predictor, update_metadata
from predictors.goodput import GoodputPolicy, MissingCalibration, RoundCost
from predictors.sv import SVPolicy, SVTable
from tests.tiny_pairs import make_pair

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 61, 7]])


def cost(target_s: dict[int, float], draft: float = 0.01) -> RoundCost:
    return RoundCost.from_cost_model(CostModel(draft_s_per_token=draft, target_s=target_s))


STEP4 = {1: 1.0, 4: 1.0, 5: 2.0, 8: 2.0, 9: 4.0, 12: 4.0}
"""t(1..4) = 1, t(5..8) = 2, t(9..12) = 4: a step every four new tokens."""


# ------------------------------------------------------------------------------------------------------- the rule


def test_expected_tokens_and_best_prefix_hand_computed():
    assert np.allclose(goodput.expected_tokens([0.5, 0.5]), [1.0, 1.5, 1.75])
    c = cost({1: 1.0, 2: 2.0}, draft=0.0)  # t(L) = L
    # E = 1, 1.9, 2.71 over t(n + 1) = 1, 2, 3 -> 1, 0.95, 0.903: verify nothing
    assert goodput.best_prefix([0.9, 0.9], c)[0] == 0
    flat = cost({1: 1.0, 2: 1.0}, draft=0.0)
    n, rate = goodput.best_prefix([0.9, 0.9, 0.1], flat)
    assert n == 3 and rate == pytest.approx(1 + 0.9 + 0.81 + 0.081)


def test_confident_drafts_to_the_end_of_a_step_and_stops_before_the_jump():
    c = cost(STEP4)
    # 3 drafts + 1 fill the first step: E_3 / (0.03 + 1) = 3.83 beats every length past the jump (4.90 / 2.04, ...,
    # 7.73 / 2.07 at the end of the second step)
    assert goodput.window_round([0.99] * 12, c, 12) == (3, 3)
    # a cheaper second step (t = 1.5): confident tokens cross it to its end, unconfident ones stop before the jump
    c2 = cost({1: 1.0, 4: 1.0, 5: 1.5, 8: 1.5, 9: 4.0, 12: 4.0})
    assert goodput.window_round([0.99] * 12, c2, 12) == (7, 7)
    assert goodput.window_round([0.5] * 12, c2, 12) == (3, 3)
    # an unconfident token right before a jump (t(1) = 1, t(2) = 2): drafted, found not worth verifying
    assert goodput.window_round([0.3] * 6, cost({1: 1.0, 2: 2.0, 3: 2.0}), 6) == (1, 0)


def test_keep_drafting_respects_the_cap_and_a_dropping_acceptance():
    c = cost(STEP4)
    assert goodput.keep_drafting([], c, 4) and not goodput.keep_drafting([0.99] * 4, c, 4)
    # a confident start, then a token unlikely to be accepted: its forecast kills every longer length
    assert goodput.window_round([0.99, 0.99, 0.99, 0.01, 0.99, 0.99, 0.99, 0.99], cost({1: 1.0, 8: 1.0, 9: 2.0}), 8) \
        == (4, 4)
    assert goodput.window_round([0.99, 0.99, 0.99, 0.01] + [0.99] * 4, cost({1: 1.0, 4: 1.0, 5: 2.0, 9: 2.1}), 8) \
        == (4, 3)


def test_batch_lengths_pick_the_confident_sequence():
    cm = CostModel(draft_s_per_token=0.0, target_s={1: 1.0, 11: 2.0})
    lat = lambda n: cm.round_time(n)  # noqa: E731
    assert goodput.batch_lengths([[0.99, 0.99, 0.99], [0.01, 0.9]], lat) == [3, 0]
    assert goodput.batch_lengths([[], []], lat) == [0, 0]


def test_batch_lengths_send_more_where_a_longer_pass_costs_less():
    """A pass over 4 tokens a sequence that costs less than one over 2 (vLLM's CPU GEMM): one more token alone does
    not pay, three do, and the scan over every prefix finds them."""
    cm = CostModel(draft_s_per_token=0.0, target_s={1: 1.0, 2: 1.3, 3: 1.3, 4: 1.0, 5: 1.6})
    lat = lambda n: cm.round_time(n)  # noqa: E731
    assert goodput.batch_lengths([[0.9, 0.9, 0.9]], lat) == [3]
    assert goodput.batch_lengths([[0.9, 0.9, 0.9, 0.9]], lat) == [3]  # the fourth's pass costs more than it brings


def test_keep_drafting_and_best_prefix_equal_their_array_forms():
    """The rule's Python-float loops give the decisions and rates of the array formulas (expected_tokens / the
    forecast by the last acceptance) on random rounds, curves and caps."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        d = float(rng.choice([0.01, 0.03, 0.06]))
        slope = float(rng.uniform(0.0, 0.01))
        cost = RoundCost(d, lambda n, s=slope: 0.09 + s * max(0, n - 4))
        k, cap = int(rng.integers(0, 12)), int(rng.integers(1, 16))
        acc = [float(v) for v in rng.choice([0.0, 0.5, 0.999, 1.0, rng.random()], size=k)]
        if k:
            rate = goodput.expected_tokens(acc) / (k * d + cost.verify_times(k))
            n, r = goodput.best_prefix(acc, cost)
            assert n == int(np.argmax(rate)) and r == float(rate[n])
        if 0 < k < cap:
            a = np.clip(np.asarray(acc), 0, 1)
            ns = np.arange(k + 1, cap + 1)
            ahead = goodput.expected_tokens(acc)[-1] + np.prod(a) * np.cumsum(a[-1] ** (ns - k))
            want = bool((ahead / (ns * d + cost.verify_times(cap)[k + 1:])).max() > goodput.best_prefix(acc, cost)[1])
            assert goodput.keep_drafting(acc, cost, cap) == want


def test_calibration_of_one_score_equals_the_array_map():
    """Calibrator.apply_one (the engine's per-token path) equals apply (np.interp, the replay's) on isotonic maps with
    repeated breakpoints, at and outside the breakpoints, and on Platt maps; GoodputPolicy.score_list equals score."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 20))
        x = np.sort(np.round(rng.random(n), 1))
        cal = Calibrator("isotonic", x.tolist(), np.sort(rng.random(n)).tolist())
        s = np.concatenate([rng.random(30) * 1.4 - 0.2, x])
        assert np.array_equal(cal.apply(s), [cal.apply_one(float(v)) for v in s])
    platt = Calibrator("platt", a=2.0, b=-1.0)
    s = rng.normal(size=50)
    np.testing.assert_allclose(platt.apply(s), [platt.apply_one(float(v)) for v in s], rtol=0, atol=1e-15)
    pol = GoodputPolicy(MaxConfidence(threshold=0.5), {"greedy": cal})
    feats = {"draft_max_prob": torch.rand(7), "q": torch.rand(7)}
    np.testing.assert_allclose(pol.score_list(feats), pol.score(feats).tolist(), rtol=0, atol=1e-7)


def test_curve_of_one_length_is_refused_and_a_foreign_curve_warned(caplog):
    with pytest.raises(ValueError, match="at least two lengths"):
        RoundCost.from_cost_model(CostModel(draft_s_per_token=0.01, target_s={1: 1.0}))
    cm = CostModel(draft_s_per_token=0.01, target_s={1: 1.0, 2: 1.1}, draft_name="a", target_name="b")
    with caplog.at_level(logging.WARNING):
        diffs = goodput.check_cost_model(cm, "a", "other-target")
    assert diffs == ["target: measured b, run other-target"] and "other-target" in caplog.text


def test_a_curve_measured_on_the_other_bf16_chain_is_named():
    """AMX and vdpbf16ps give a CPU two verification curves (one flat to 16 rows, one not): a cost file measured with
    the other chain is reported like another CPU."""
    cm = CostModel(draft_s_per_token=0.01, target_s={1: 1.0, 2: 1.1}, machine={"model_name": "x", "bf16_chain": "amx"})
    diffs = cm.mismatch("", "", None, {"model_name": "x", "bf16_chain": "avx512-bf16"})
    assert diffs == ["CPU bf16_chain: measured on 'amx', run on 'avx512-bf16'"]
    assert cm.mismatch("", "", None, {"model_name": "x"}) == []  # a run that does not say is not accused


# ------------------------------------------------------------------------------------------------- calibration


def test_calibration_ece_on_synthetic_data():
    rng = np.random.default_rng(0)
    s = rng.normal(size=40_000)
    p_true = 1 / (1 + np.exp(-(2.0 * s - 0.5)))
    y = (rng.random(s.size) < p_true).astype(float)
    raw = 1 / (1 + np.exp(-s))  # a probability, but miscalibrated
    assert expected_calibration_error(raw[20_000:], y[20_000:]) > 0.05
    for method in ("isotonic", "platt"):
        cal = fit_calibrator(raw[:20_000], y[:20_000], method)
        assert expected_calibration_error(cal(raw[20_000:]), y[20_000:]) < 0.02
        back = Calibrator.from_dict(json.loads(json.dumps(cal.to_dict())))
        assert np.allclose(back(raw[:100]), cal(raw[:100]))
    # soft labels (min(1, p/q)): a map fitted on them predicts their mean
    soft = np.clip(p_true + 0.1 * rng.normal(size=s.size), 0, 1)
    cal = fit_calibrator(raw[:20_000], soft[:20_000], "platt")
    assert expected_calibration_error(cal(raw[20_000:]), soft[20_000:]) < 0.03
    b = reliability_bins(cal(raw), soft, 10)
    assert b["count"].sum() == s.size
    t = cal(torch.tensor([0.1, 0.9]))
    assert isinstance(t, Tensor) and t[0] < t[1]


def test_auto_calibration_picks_by_cross_validation_and_the_noise_floor_is_reported():
    rng = np.random.default_rng(1)
    s = rng.normal(size=600)
    y = (rng.random(s.size) < 1 / (1 + np.exp(-(2.0 * s - 0.5)))).astype(float)
    # a logistic truth and few tokens: Platt's two parameters beat isotonic's steps held out
    assert fit_calibrator(s, y, "auto").method == "platt"
    # a step truth with plenty of tokens: isotonic follows it, a sigmoid cannot
    s2 = rng.uniform(size=20_000)
    y2 = (rng.random(s2.size) < np.where(s2 < 0.5, 0.1, 0.9)).astype(float)
    assert fit_calibrator(s2, y2, "auto").method == "isotonic"
    # a perfectly calibrated predictor scores about the floor by chance; the floor shrinks with more tokens
    p = rng.uniform(size=684)
    floor = ece_noise_floor(p)
    assert 0.01 < floor < 0.06
    assert ece_noise_floor(rng.uniform(size=20_000)) < floor / 3


def test_ece_interval_over_prompts_widens_when_prompts_differ():
    """Prompts with their own acceptance level (a calibrated map on average, off per prompt) move the ECE of a split
    of 16 prompts far more than the independent-token floor says; the interval over resampled prompts shows it."""
    rng = np.random.default_rng(2)
    groups = np.repeat(np.arange(16), 80)
    p = rng.uniform(0.3, 1.0, size=groups.size)
    shift = rng.normal(0, 0.15, size=16)[groups]  # each prompt's acceptance off the map by its own amount
    y = (rng.random(p.size) < np.clip(p + shift, 0, 1)).astype(float)
    lo, hi = ece_interval(p, y, groups)
    assert lo < expected_calibration_error(p, y) < hi and hi - lo > 0.03
    y_iid = (rng.random(p.size) < p).astype(float)  # no prompt effect: a narrower interval near the floor
    lo2, hi2 = ece_interval(p, y_iid, groups)
    assert hi2 - lo2 < hi - lo and lo2 < ece_noise_floor(p) < hi2 + 0.01
    assert np.isnan(ece_interval(p[:80], y[:80], groups[:80])).all()  # one prompt: no interval


# ------------------------------------------------------------------------------------------------ policies


def calibrated_max_confidence(tmp_path, modes=("greedy", "sampling")) -> str:
    """An exported max-confidence score with identity-like maps (acceptance = top-1 probability)."""
    folder = export_predictor(MaxConfidence(0.4), tmp_path / "maxconf", {})
    ident = Calibrator("isotonic", [0.0, 1.0], [0.0, 1.0], label="greedy match").to_dict()
    update_metadata(folder, calibration={m: ident for m in modes})
    return str(folder)


def test_goodput_spec_without_a_map_names_the_export_and_the_command(tmp_path):
    folder = export_predictor(MaxConfidence(0.4), tmp_path / "plain", {})
    with pytest.raises(MissingCalibration, match=r"(?s)plain.*python -m pipelines.calibrate"):
        build_policy(f"goodput:{folder}")
    with pytest.raises(MissingCalibration, match="pipelines.calibrate"):
        build_policy("goodput:svip")
    only_sampling = calibrated_max_confidence(tmp_path / "s", modes=("sampling",))
    pol = build_policy(f"goodput:{only_sampling}")
    with pytest.raises(MissingCalibration, match="greedy decoding"):
        pol.use_mode("greedy")
    pol = build_policy(f"goodput:{calibrated_max_confidence(tmp_path)}")
    assert isinstance(pol, GoodputPolicy) and pol.kind == "goodput-max_confidence"


def test_named_score_under_goodput_reads_the_calibration_dir(tmp_path):
    calibrated_max_confidence(tmp_path)
    (tmp_path / "maxconf").rename(tmp_path / "max_confidence")
    pol = build_policy("goodput:max_confidence", calibration_dir=tmp_path)
    feats = {"draft_max_prob": torch.tensor([0.2, 0.8])}
    assert torch.allclose(pol.score(feats), feats["draft_max_prob"])


@pytest.fixture(scope="module")
def pair():
    return make_pair(noise=0.5, seed=0)


class Recorder(GoodputPolicy):
    """A goodput policy that records, per round, the raw scores the engine computed and how many it verified."""

    def __init__(self, inner, calibrations) -> None:
        super().__init__(inner, calibrations, "recorder")
        self.rounds: list[list[float]] = [[]]
        self.verified: list[int] = []

    def score_list(self, features: Mapping[str, Tensor]) -> list[float]:  # the engine's per-token call
        self.rounds[-1].extend(self.inner.score(features).tolist())
        return super().score_list(features)

    def update(self, feedback) -> None:
        self.verified.append(feedback.n_drafted)
        self.rounds.append([])


def test_goodput_policy_is_exact_in_greedy_mode_and_replay_agrees_with_the_engine(pair):
    draft, target = pair
    cm = CostModel(draft_s_per_token=0.05, target_s={1: 1.0, 3: 1.0, 4: 1.6, 6: 1.6, 7: 3.0})
    # the tiny draft's top-1 probabilities lie around 0.02-0.1: a map spreading them over [0.1, 0.97]
    cal = {"greedy": Calibrator("isotonic", [0.02, 0.04, 0.06, 0.1], [0.1, 0.6, 0.9, 0.97])}
    pol = Recorder(MaxConfidence(0.4, max_draft_len=8), cal)
    dec = SpeculativeDecoder(draft, target, pol, cost_model=cm, max_draft_len=8)
    out, stats = dec.generate(PROMPT, None, 30, None, 0)
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=30, pad_token_id=256)
    assert out.tolist() == ref.tolist()
    assert len(set(stats.drafted_lengths)) > 1 and len(stats.expected_tokens) == stats.rounds
    assert stats.sent_lengths == pol.verified
    # the offline replay of each engine round (its raw scores stored as draft_max_prob, every token a match, the
    # sequence long enough for the engine's cap) drafts and verifies what the engine did
    produced, compared = 0, 0
    for i, (raw, drafted, verified) in enumerate(zip(pol.rounds, stats.drafted_lengths, pol.verified)):
        acc = stats.accepted_lengths[i]
        cap = min(8, 30 - produced - 1)
        produced += acc + 1
        if cap < 8:
            continue
        cols = _round_as_sequence(raw + [raw[-1]] * (9 - len(raw)))
        data = prepare_replay_data(cols, ReplayConfig(origins=None))
        res = replay_policy(GoodputPolicy(MaxConfidence(0.4, max_draft_len=8), cal, "replayed"), data, cm, "greedy",
                            max_draft_len=8)
        assert res.round_lengths[0] == (drafted, verified)
        assert res.round_tokens[0][0] == pytest.approx(stats.expected_tokens[i], rel=1e-6)
        compared += 1
    assert compared >= 3


def _round_as_sequence(raw: list[float]) -> dict[str, np.ndarray]:
    """One stored sequence whose tokens all match, with the given raw top-1 probabilities."""
    n = len(raw)
    return {"seq_id": np.array(["r"] * n), "offset": np.arange(n), "greedy_match": np.ones(n, dtype=bool),
            "accept_prob": np.ones(n), "q": np.full(n, 0.5), "draft_max_prob": np.asarray(raw)}


def test_goodput_sampling_mode_runs_and_keeps_the_length(pair, tmp_path):
    draft, target = pair
    pol = build_policy(f"goodput:{calibrated_max_confidence(tmp_path)}")
    cm = CostModel(draft_s_per_token=0.05, target_s={1: 1.0, 4: 1.0, 5: 2.0})
    out, stats = SpeculativeDecoder(draft, target, pol, cost_model=cm, temperature=1.0,
                                    max_draft_len=6).generate(PROMPT, None, 12, None, 3)
    assert out.shape[1] == PROMPT.shape[1] + 12 and pol.mode == "sampling" and stats.rounds > 0


def test_sv_export_loads_as_goodput_with_its_maps(tmp_path):
    table = SVTable(s_bins=3, a_bins=3)
    g = torch.Generator().manual_seed(0)
    s, a = torch.rand(100, generator=g), torch.rand(100, generator=g)
    table.fit(s, a, (s + a) / 2)
    folder = export_predictor(SVPolicy(table), tmp_path / "sv", {})
    with pytest.raises(MissingCalibration):
        build_policy(f"goodput:{folder}")
    calibrator = fit_calibrator(np.linspace(0, 1, 20), np.linspace(0, 1, 20))
    update_metadata(folder, calibration={"sampling": calibrator.to_dict()})
    pol = build_policy(f"goodput:{folder}")
    pol.use_mode("sampling")
    assert pol.needs_companion and load_predictor(folder).verification == pol.verification


STEEP = {1: 1.0, 2: 1.8, 4: 3.4, 8: 6.6}
"""Verifying n tokens costs nearly n one-token steps (llama.cpp's curve on a CPU): no round can pay."""


def test_no_round_is_drafted_where_no_round_could_pay(pair):
    assert goodput.can_pay(cost(STEP4), 8) and not goodput.can_pay(cost(STEEP, draft=0.3), 8)
    assert goodput.window_round([1.0] * 8, cost(STEEP, draft=0.3), 8) == (0, 0)  # not even the first draft step
    assert goodput.window_round([1.0] * 8, cost(STEP4), 8)[0] > 0
    draft, target = pair
    cm = CostModel(draft_s_per_token=0.3, target_s=STEEP)
    cal = {"greedy": Calibrator("isotonic", [0.0, 1.0], [0.99, 0.99])}
    out, stats = SpeculativeDecoder(draft, target, GoodputPolicy(MaxConfidence(0.4, max_draft_len=8), cal),
                                    cost_model=cm, max_draft_len=8).generate(PROMPT, None, 12, None, 0)
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=12, pad_token_id=256)
    assert out.tolist() == ref.tolist() and stats.drafted == 0 and stats.rounds == 12


def test_a_round_that_pays_only_if_every_draft_is_accepted_is_not_drafted_below_certainty():
    """t(L) = L up to 8 tokens and t(9) = 8 (a kernel's tile: llama.cpp's curve has such flat steps), a draft step of
    0.1: only a round of 8 drafts all accepted pays (9 tokens in 8.8 steps). Priced with the calibration's ceiling c
    instead of certainty, 1 + c + ... + c^8 expected tokens, it no longer pays even at c = 0.99."""
    tile = {**{L: float(L) for L in range(1, 9)}, 9: 8.0}
    assert goodput.can_pay(cost(tile, draft=0.1), 8) and not goodput.can_pay(cost(tile, draft=0.1), 7)
    assert not goodput.can_pay(cost(tile, draft=0.1), 8, ceiling=0.99)
    assert goodput.window_round([0.99] * 8, cost(tile, draft=0.1), 8, ceiling=0.99) == (0, 0)
    assert goodput.can_pay(cost(STEP4), 8, ceiling=0.5)  # where rounds pay easily the ceiling changes nothing
    iso = Calibrator("isotonic", [0.0, 0.5, 1.0], [0.1, 0.5, 0.93])
    assert iso.ceiling == pytest.approx(0.93) and Calibrator("platt", a=2.0, b=0.0).ceiling == 1.0
    assert GoodputPolicy(MaxConfidence(0.4), {"greedy": iso}).calibrator.ceiling == pytest.approx(0.93)


def test_the_first_draft_is_priced_with_the_acceptance_seen_so_far():
    """A draft's acceptance before a round is what the sequence's recent rounds showed (tokens accepted over tokens
    tried up to the first rejection, earlier rounds weighed down, under a uniform prior: 1/2 before any round), capped
    by the calibration."""
    from predictors.base import RoundFeedback

    pol = GoodputPolicy(MaxConfidence(0.4), {"greedy": Calibrator("isotonic", [0.0, 1.0], [0.0, 0.97])})
    assert pol.acceptance_ceiling == pytest.approx(0.5)
    pol.update(RoundFeedback.leading(4, 1, [0.5] * 4))  # 1 accepted, the 2nd rejected: 2 tried
    pol.update(RoundFeedback.leading(3, 3, [0.5] * 3))  # 3 of 3
    f = goodput.FORGET
    assert pol.acceptance_ceiling == pytest.approx((f * 1 + 3 + 1) / (f * 2 + 3 + 2))
    for _ in range(50):  # rounds all accepted: the estimate nears 1 but the calibration caps it
        pol.update(RoundFeedback.leading(4, 4, [0.9] * 4))
    assert pol.acceptance_ceiling == pytest.approx(0.97)
    tile = {**{L: float(L) for L in range(1, 9)}, 9: 8.0}
    assert not goodput.can_pay(cost(tile, draft=0.1), 8, pol.acceptance_ceiling)
    pol.reset()
    assert pol.acceptance_ceiling == pytest.approx(0.5)


def test_a_run_of_rejections_does_not_stop_drafting_for_the_rest_of_the_sequence():
    """Rounds whose first draft is rejected bring the estimate below what a round needs to pay; the rounds that then
    draft nothing add no evidence, and the estimate returns towards the prior until rounds pay again (it never sticks
    where it fell)."""
    from predictors.base import RoundFeedback

    pol = GoodputPolicy(MaxConfidence(0.4), {"greedy": Calibrator("isotonic", [0.0, 1.0], [0.0, 0.97])})
    steep = cost({1: 1.0, 2: 1.2, 3: 1.4, 4: 1.6, 5: 1.8}, draft=0.2)  # a round pays above an acceptance of 0.4
    assert goodput.can_pay(steep, 4, pol.acceptance_ceiling)
    for _ in range(6):
        pol.update(RoundFeedback.leading(1, 0, [0.5]))  # one draft tried, rejected
    assert not goodput.can_pay(steep, 4, pol.acceptance_ceiling)
    waited = 0
    while not goodput.can_pay(steep, 4, pol.acceptance_ceiling):
        pol.update(RoundFeedback.leading(0, 0, []))  # a round that drafted nothing
        waited += 1
        assert waited < 30, pol.acceptance_ceiling
    assert pol.acceptance_ceiling < 0.5
