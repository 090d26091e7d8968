"""Offline replay: hand-made rollouts with hand-computed accepted counts and speedups, the oracle bound, SV goodput,
threshold tuning, and the cost model measured on tiny models."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from torch import Tensor

from compute.timing import CostModel, measure_cost_model
from evaluation.replay import (
    OracleSchedule,
    ReplayConfig,
    prepare_replay_data,
    replay_policy,
    replay_table,
    tune_threshold,
)
from predictors import goodput
from predictors.base import RoundFeedback, StopPolicy
from predictors.baselines import SVIP, HFHeuristic, MaxConfidence, Oracle, StaticLength
from predictors.round_rules import GOODPUT, SEQUENTIAL


class ColumnScore(StopPolicy):
    """Keep drafting while the column ``x`` is >= threshold; records the feedback it gets."""

    kind = "column"
    required_columns = ("x",)

    def __init__(self, threshold: float = 0.5, max_draft_len: int = 40) -> None:
        super().__init__(threshold, max_draft_len)
        self.feedback: list[RoundFeedback] = []
        self.resets = 0

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["x"].float()

    def update(self, feedback: RoundFeedback) -> None:
        self.feedback.append(feedback)

    def reset(self) -> None:
        self.resets += 1


class SVLike(StopPolicy):
    """Acceptance estimate from the companion column (replayed with SV's goodput length)."""

    kind = "sv"
    round_rule = GOODPUT
    required_columns = ("companion_sim", "companion_accept")

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["companion_accept"].float()


def hand_rollout() -> dict[str, np.ndarray]:
    """One teacher-forced target sequence of 6 tokens."""
    return {
        "seq_id": np.array(["a"] * 6),
        "sample_id": np.array(["p0"] * 6),
        "origin": np.array(["target"] * 6),
        "rollout": np.zeros(6, dtype=bool),
        "offset": np.array([3, 1, 0, 2, 5, 4]),  # stored out of order: replay sorts by offset
        # by offset 0..5: greedy [1,1,0,1,1,1], accept [.5,.5,1,.8,1,1], x [.9,.2,.9,.9,.1,.9]
        "greedy_match": np.array([1, 1, 1, 0, 1, 1], dtype=bool),
        "accept_prob": np.array([0.8, 0.5, 0.5, 1.0, 1.0, 1.0]),
        "q": np.full(6, 0.5),
        "x": np.array([0.9, 0.2, 0.9, 0.9, 0.9, 0.1]),
        "position": np.zeros(6, dtype=np.int64),
    }


CONST = CostModel(draft_s_per_token=1.0, target_s={1: 4.0, 40: 4.0})


def test_greedy_static_hand_computed():
    data = prepare_replay_data(hand_rollout())
    assert data.exact and data.greedy.tolist() == [True, True, False, True, True, True]
    # static-2: rounds at 0 (a=2, emits 3) and 3 (a=2, emits 3); each costs 2 * 1 + 4 = 6 s
    r = replay_policy(StaticLength(2), data, CONST, "greedy")
    assert (r.rounds, r.tokens, r.accepted, r.drafted, r.time_s) == (2, 6, 4, 4, 12)
    assert r.tokens_per_call == 3 and r.wasted_per_round == 0
    assert r.speedup == pytest.approx(6 * 4 / 12)
    # static-3: round 0 drafts 3 and accepts 2 (one wasted), round 3 accepts 3 (its bonus lies past the end: not
    # counted): 6 tokens in 14 s
    r = replay_policy(StaticLength(3), data, CONST, "greedy")
    assert (r.rounds, r.tokens, r.accepted, r.drafted, r.time_s) == (2, 6, 5, 6, 14)
    assert r.speedup == pytest.approx(6 * 4 / 14)


def test_oracle_hand_computed():
    data = prepare_replay_data(hand_rollout())
    r = replay_policy(Oracle(), data, CONST, "greedy")
    # drafts exactly the match runs but never the last stored token: 2 (emits 3), then 2 of the run of 3 (emits 3)
    assert (r.rounds, r.tokens, r.drafted, r.time_s) == (2, 6, 4, 12)
    assert r.speedup == pytest.approx(2.0)
    s = replay_policy(OracleSchedule(), data, CONST, "greedy")
    assert s.time_s == pytest.approx(12) and s.tokens == 6
    engine_like = Oracle()
    engine_like.drafts_failing_token = True  # as the engine runs it: the first mismatch drafted and verified too
    e = replay_policy(engine_like, data, CONST, "greedy")
    # round 0 drafts 3 (the run of 2 and the mismatch), emits 3; round 3 drafts 2 (never the last stored token)
    assert (e.rounds, e.tokens, e.accepted, e.drafted, e.time_s) == (2, 6, 4, 5, 13)


def test_sampling_expectation_hand_computed():
    data = prepare_replay_data(hand_rollout(), ReplayConfig(mode="sampling"))
    r = replay_policy(StaticLength(2), data, CONST, "sampling")
    # s=0: E[a] = .5 + .25 = .75 -> next at 0+1+1=2; s=2: E = 1 + .8 = 1.8 -> next at 2+2+1=5; s=5: 1 token, E = 1
    # (emits 2, clipped to the 1 stored token left)
    assert r.rounds == 3
    assert r.accepted == pytest.approx(0.75 + 1.8 + 1.0)
    assert r.tokens == pytest.approx(1.75 + 2.8 + 1)
    assert r.time_s == pytest.approx(6 + 6 + 5)
    assert r.speedup == pytest.approx(5.55 * 4 / 17)


def test_threshold_policy_and_feedback():
    data = prepare_replay_data(hand_rollout())
    pol = ColumnScore(0.5)
    r = replay_policy(pol, data, CONST, "greedy")
    # s=0: x=[.9,.2] -> drafts 2 (stops after the .2 token), a=2; s=3: x=[.9,.1] -> drafts 2, a=2
    assert (r.rounds, r.tokens, r.drafted) == (2, 6, 4)
    assert pol.resets == 1
    assert [(f.n_drafted, f.n_accepted) for f in pol.feedback] == [(2, 2), (2, 2)]
    assert pol.feedback[0].accepted == [True, True] and pol.feedback[0].draft_probs == [0.5, 0.5]


class SequentialColumn(ColumnScore):
    """SPRINTER-like: approximate sequential verification (only a round's last drafted token is checked)."""

    kind = "sprinter"
    round_rule = SEQUENTIAL


def test_sequential_verification_checks_only_the_last_token():
    cols = hand_rollout()
    order = np.argsort(cols["offset"])
    # by offset 0..5: greedy [1,0,1,1,0,1], accept [.5,.5,1,.8,1,1], x [.9,.9,.1,.9,.1,.9]
    cols["greedy_match"][order] = [True, False, True, True, False, True]
    cols["x"][order] = [0.9, 0.9, 0.1, 0.9, 0.1, 0.9]
    data = prepare_replay_data(cols)
    pol = SequentialColumn(0.5)
    r = replay_policy(pol, data, CONST, "greedy")
    # s=0: drafts offsets 0-2 (x = .1 stops), the mismatch at 1 taken unverified, the last (2) matches: 3 accepted,
    # emits 4 (3 + bonus), 3 + 4 s; s=4: drafts 1 (x = .1), it fails: emits the correction, 1 + 4 s; s=5: drafts
    # the last stored token, it matches: emits 2, clipped to the 1 left, 1 + 4 s
    assert (r.rounds, r.tokens, r.accepted, r.drafted, r.time_s) == (3, 6, 4, 5, 17)
    assert [(f.n_drafted, f.n_accepted) for f in pol.feedback] == [(3, 3), (1, 0), (1, 1)]
    # exact verification of the same drafts would stop at the mismatch: s=0 accepts 1 (emits 2), ...
    exact = replay_policy(ColumnScore(0.5), data, CONST, "greedy")
    assert exact.accepted < r.accepted and exact.rounds > r.rounds
    # sampling: only the last token's min(1, p/q) counts; s=0 drafts 0-2, accept[2] = 1: 3 accepted, next s=4
    # (1 + 1 drafted, accept 1: emits 2, the 2 left)
    s = replay_policy(SequentialColumn(0.5), prepare_replay_data(cols, ReplayConfig(mode="sampling")), CONST,
                      "sampling")
    assert (s.rounds, s.tokens, s.accepted, s.drafted) == (2, 6, 4, 4)


def test_heuristic_schedule():
    data = prepare_replay_data(hand_rollout())
    # k=1: s=0 a=1 (all accepted -> k=3); s=2: drafts 3, a=0 (k=2); s=3: drafts 2, a=2 (k=4); s=6 end
    r = replay_policy(HFHeuristic(initial=1), data, CONST, "greedy")
    assert (r.rounds, r.drafted, r.accepted, r.tokens) == (3, 6, 3, 6)


def _random_columns(n_seq: int = 12, length: int = 80, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = n_seq * length
    H = rng.gamma(1.0, 1.0, n)
    greedy = rng.random(n) < 1 / (1 + np.exp(2 * (H - 1)))
    return {
        "seq_id": np.repeat([f"s{i}" for i in range(n_seq)], length),
        "sample_id": np.repeat([f"p{i}" for i in range(n_seq)], length),
        "split": np.repeat(["val" if i % 2 else "test" for i in range(n_seq)], length),
        "origin": np.array(["target"] * n),
        "rollout": np.zeros(n, dtype=bool),
        "offset": np.tile(np.arange(length), n_seq),
        "position": np.zeros(n, dtype=np.int64),
        "greedy_match": greedy,
        "accept_prob": np.where(greedy, rng.uniform(0.6, 1, n), rng.uniform(0, 0.6, n)),
        "q": rng.uniform(0.1, 1, n),
        "draft_entropy": H,
        "draft_max_prob": np.exp(-H / 2),
        "x": greedy + rng.normal(0, 0.8, n),
    }


def test_oracle_never_loses():
    cols = _random_columns()
    cm = CostModel(draft_s_per_token=0.1, target_s={1: 0.3, 8: 0.34, 41: 0.5})
    pols = {"col": ColumnScore(0.5), "col-low": ColumnScore(-0.5), "col-high": ColumnScore(1.2)}
    table, sweep = replay_table(cols, pols, cm, ReplayConfig(mode="greedy"), static_lengths=range(1, 11))
    oracle = table.loc[table["policy"] == "oracle", "speedup"].item()
    schedule = table.loc[table["policy"] == "oracle-schedule", "speedup"].item()
    others = table.loc[~table["policy"].isin(["oracle", "oracle-schedule"]), "speedup"]
    assert others.notna().all() and len(others) >= 15
    assert oracle >= others.max() and schedule >= oracle - 1e-12
    assert oracle >= sweep["speedup"].max()
    assert any(table["policy"].str.startswith("static-best"))
    assert table["exact_accepts"].all()


def test_missing_columns_and_unloaded_policy_rows():
    cols = _random_columns(n_seq=2, length=20)
    table, _ = replay_table(cols, {"sv": SVLike(), "gone": None}, CONST, sweep=False, static_lengths=[1])
    sv = table.loc[table["policy"] == "sv", "reason"].item()
    assert "companion_sim" in sv and "companion_accept" in sv
    assert table.loc[table["policy"] == "gone", "reason"].item() == "policy not loaded"


def test_sv_goodput_round_hand_computed():
    est = [0.9, 0.9, 0.1, 0.9]
    # constant target cost 4, draft 1: stopping now vs the best reachable length (forecast: the last acceptance)
    # k=1: .38 < 2.71/6; k=2: .452 < 3.439/7; k=3 (a=.1): 2.791/7 = .399 > 2.799/8 -> 3 drafted, all 3 verified
    assert goodput.window_round(est, goodput.RoundCost(1.0, CONST.target_time), 4) == (3, 3)
    steep = CostModel(draft_s_per_token=1.0, target_s={1: 4.0, 5: 8.0})  # T(L) = 3 + L
    # k=3: E / (3 + T(m + 1)) = .143, .238, .301, .279 -> verify 2; drafting a 4th promises 2.799 / 12 = .233
    assert goodput.window_round(est, goodput.RoundCost(1.0, steep.target_time), 4) == (3, 2)


def test_sv_replay_with_companion_columns():
    cols = _random_columns(n_seq=4, length=40)
    cols["companion_accept"] = np.asarray(cols["accept_prob"])
    cols["companion_sim"] = np.ones(len(cols["q"]))
    table, _ = replay_table(cols, {"sv": SVLike()}, CONST, sweep=False, static_lengths=[1])
    row = table[table["policy"] == "sv"].iloc[0]
    assert row["verification"] == "goodput" and row["reason"] == ""
    assert row["tokens_per_call"] >= 1 and np.isfinite(row["speedup"])


def test_tune_threshold_on_val():
    cols = _random_columns()
    grid = [-1.0, 0.0, 0.5, 1.0, 2.0]
    thr, sp = tune_threshold(ColumnScore(0.5), cols, CONST, grid, split="val")
    assert thr in grid and sp > 0
    val = {k: v[cols["split"] == "val"] for k, v in cols.items()}
    data = prepare_replay_data(val)
    best = max(replay_policy(ColumnScore(g), data, CONST).speedup for g in grid)
    assert sp == pytest.approx(best)
    with pytest.raises(ValueError, match="no rows in split"):
        tune_threshold(ColumnScore(0.5), cols, CONST, grid, split="nosuch")
    # an approximate policy is tuned as if every drafted token were verified: taking them unverified, the fastest
    # threshold would be the one that never stops (-1 here)
    assert tune_threshold(SequentialColumn(0.5), cols, CONST, grid, split="val") == (thr, pytest.approx(sp))
    approx = {g: replay_policy(SequentialColumn(g), data, CONST).speedup for g in grid}
    assert max(approx, key=approx.get) == -1.0 and approx[-1.0] > sp


def test_fallback_when_no_target_sequences():
    cols = _random_columns(n_seq=2, length=10)
    cols["origin"] = np.array(["prompt"] * 20)
    data = prepare_replay_data(cols)
    assert not data.exact and "FALLBACK" in data.note and data.n_seqs == 2
    with pytest.raises(ValueError, match="no sequences"):
        prepare_replay_data(cols, ReplayConfig(fallback_to_all=False))


def test_builtin_policies_run():
    data = prepare_replay_data(_random_columns(n_seq=2, length=30))
    for p in (SVIP(), MaxConfidence(0.4, online_roc=True)):
        r = replay_policy(p, data, CONST)
        # greedy replay emits every stored token once, whatever the policy; the counts nest
        assert r.tokens == pytest.approx(data.n_rows)
        assert r.accepted <= r.sent <= r.drafted and r.tokens <= r.accepted + r.rounds  # the last bonus is cut
        assert r.speedup == pytest.approx(r.tokens * CONST.target_only_s_per_token / r.time_s)


def test_the_draft_catch_up_after_a_fully_accepted_round_is_priced():
    """After a round whose drafts were all accepted the draft reads its last draft and the bonus token in one forward:
    the next round pays ``draft_catchup_s`` once; after a round with a rejected draft it does not."""
    from dataclasses import replace

    cm = replace(CONST, draft_catchup_s=0.5)
    data = prepare_replay_data(hand_rollout())
    # static-2: round 0 accepts both drafts, so round 3 reads two tokens first (12 s + 0.5 s)
    assert replay_policy(StaticLength(2), data, cm, "greedy").time_s == pytest.approx(12.5)
    # static-3: round 0 accepts 2 of 3 (the draft read the two it accepted): round 3 reads one token (14 s)
    assert replay_policy(StaticLength(3), data, cm, "greedy").time_s == pytest.approx(14.0)
    assert replay_policy(StaticLength(2), data, CONST, "greedy").time_s == pytest.approx(12.0)  # not measured: 0
    assert (cm.catchup_time(1), cm.catchup_time(2), cm.catchup_time(4)) == (0.0, 0.5, 1.5)


def test_the_catch_up_is_read_from_the_raw_timings_of_one_and_two_token_draft_forwards(tmp_path):
    raw = {"draft_raw_s": [0.010, 0.012], "target_raw_s_L1": [0.1], "target_raw_s_L2": [0.12],
           "draft_raw_s_L1": [0.011, 0.013], "draft_raw_s_L2": [0.016, 0.015]}
    cm = CostModel(0.01, {1: 0.1, 2: 0.12}, extra=raw).with_statistic("min")
    assert cm.draft_catchup_s == pytest.approx(0.004) and "catch-up" in cm.curve_table()
    cm.to_json(tmp_path / "cm.json")
    assert CostModel.from_json(tmp_path / "cm.json").draft_catchup_s == pytest.approx(0.004)
    old = {k: v for k, v in cm.to_dict().items() if k != "draft_catchup_s"}  # a file written before the field
    assert CostModel.from_dict(old).draft_catchup_s == 0.0
    with pytest.raises(ValueError, match="catch-up"):
        CostModel(0.01, {1: 0.1}, draft_catchup_s=-1.0)


def test_cost_model_json_and_interpolation(tmp_path):
    cm = CostModel(draft_s_per_token=0.01, target_s={1: 0.1, 4: 0.13, 8: 0.2}, companion_s_per_token=0.005)
    assert cm.target_time(2) == pytest.approx(0.11)
    assert cm.target_time(16) == pytest.approx(0.2 + 8 * (0.07 / 4))  # linear beyond the last two points
    assert cm.round_time(3) == pytest.approx(0.03 + 0.13)
    assert cm.round_time(3, n_verify=1, companion=True) == pytest.approx(3 * 0.015 + 0.11)
    cm.to_json(tmp_path / "cm.json")
    back = CostModel.from_json(tmp_path / "cm.json")
    assert back.target_s == cm.target_s and back.round_time(5) == pytest.approx(cm.round_time(5))
    with pytest.raises(ValueError, match="target_s"):
        CostModel(0.01, {})


def test_measure_cost_model_tiny():
    from compute.models import tiny_model

    torch.manual_seed(0)
    draft, target = tiny_model(1).eval(), tiny_model(2, 48, 2).eval()
    cm = measure_cost_model(
        draft, target, companion=draft, lengths=(1, 2, 4, 8), prompt_len=16, repeats=2, decode_steps=3
    )
    assert cm.draft_s_per_token > 0 and cm.companion_s_per_token > 0
    assert sorted(cm.target_s) == [1, 2, 4, 8] and all(v > 0 for v in cm.target_s.values())
    ts = [cm.target_s[k] for k in sorted(cm.target_s)]
    assert all(a <= b for a, b in zip(ts, ts[1:]))  # made non-decreasing in L
    assert len(cm.extra["target_raw_s_L4"]) == 2
    assert len(cm.extra["draft_raw_s_L2"]) == 2 and cm.draft_catchup_s >= 0  # the draft's two-token forward, timed
    assert cm.round_time(4) > cm.round_time(0) > 0
    assert not cm.assumed and cm.prompt_len == 16


class FirstTwo(StopPolicy):
    """Score 1 at in-round positions 0 and 1, else 0: with threshold 0.5 it drafts exactly 3 tokens (like static-3)."""

    kind = "first_two"
    required_columns = ("position",)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return (features["position"] < 2).float()


class CumulativeProduct(StopPolicy):
    """SpecDec++-style rule: keep drafting while the product of the round's ``x`` values stays >= threshold."""

    kind = "cumprod"
    required_columns = ("x",)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["x"].float()

    def keep_drafting(self, features: Mapping[str, Tensor]) -> Tensor:
        return torch.cumprod(features["x"].float(), 0) >= self.threshold


def test_position_uses_in_round_index():
    data = prepare_replay_data(hand_rollout())  # stored positions are all 0: the replay must override them
    a = replay_policy(FirstTwo(0.5), data, CONST)
    b = replay_policy(StaticLength(3), data, CONST)
    assert (a.rounds, a.tokens, a.drafted, a.time_s) == (b.rounds, b.tokens, b.drafted, b.time_s)


def test_keep_drafting_override_sees_the_round():
    data = prepare_replay_data(hand_rollout())
    # x by offset [.9,.2,.9,.9,.1,.9]; threshold .5: s=0 cumprod [.9,.18] -> drafts 2, a=2, next 3;
    # s=3 cumprod [.9,.09] -> drafts 2, a=2, next 6
    r = replay_policy(CumulativeProduct(0.5), data, CONST)
    assert (r.rounds, r.drafted, r.accepted, r.tokens) == (2, 4, 4, 6)
    # threshold .05: s=0 cumprod [.9,.18,.162,.146,.0146] -> drafts 5, a=2 -> next 3; s=3 [.9,.09,.081] -> 3, a=3
    r = replay_policy(CumulativeProduct(0.05), data, CONST)
    assert (r.rounds, r.drafted, r.accepted, r.tokens) == (2, 8, 5, 6)


def test_two_segments_of_one_sequence_are_replayed_apart():
    one = hand_rollout()
    two = {k: np.concatenate([v, v]) for k, v in one.items()}
    # same seq_id, both offsets from 0: the teacher-forced continuation starts at 10, the rollout at 16
    two["prefix_len"] = np.concatenate([10 + one["offset"], 16 + one["offset"]])
    data = prepare_replay_data(two, ReplayConfig(teacher_forced_only=False))
    assert data.n_seqs == 2 and data.greedy.tolist() == [True, True, False, True, True, True] * 2
    r = replay_policy(StaticLength(2), data, CONST)
    assert (r.rounds, r.tokens, r.time_s) == (4, 12, 24)


def test_sampling_oracle_hand_computed():
    data = prepare_replay_data(hand_rollout(), ReplayConfig(mode="sampling"))
    r = replay_policy(Oracle(), data, CONST, "sampling")
    # never drafts the last stored token. s=0: accept [.5,.5,1,.8,1]: E[A] = .5+.25+.25+.2+.2 = 1.4, E[time] = 1.4 + 4,
    # next at 0+1+1 = 2; s=2: accept [1,.8,1]: E[A] = 2.6, E[time] = 2.6 + 4, emits 3.6, next at 2+3+1 = 6
    assert r.rounds == 2
    assert r.tokens == pytest.approx(2.4 + 3.6) and r.drafted == pytest.approx(4.0)
    assert r.time_s == pytest.approx(5.4 + 6.6) and r.speedup == pytest.approx(2.0)


def test_schedule_oracle_never_loses_even_under_a_lopsided_cost_model():
    cols = _random_columns(n_seq=6, length=60, seed=3)
    # verifying 2+ tokens costs far more than 1: drafting rarely pays, the match-run oracle loses, the schedule does not
    lopsided = CostModel(draft_s_per_token=0.05, target_s={1: 0.1, 2: 0.5, 41: 0.6})
    pols = {"col": ColumnScore(0.5)}
    for mode in ("greedy",):
        table, sweep = replay_table(cols, pols, lopsided, ReplayConfig(mode=mode), static_lengths=range(1, 6))
        sched = table.loc[table["policy"] == "oracle-schedule", "speedup"].item()
        assert sched >= table["speedup"].max() - 1e-12 and sched >= sweep["speedup"].max()
        assert sched >= 1.0 - 1e-12  # never slower than target-only decoding (drafting nothing is a schedule)


def branched_sequence() -> dict[str, np.ndarray]:
    """A teacher-forced sequence of 5 tokens (prefix_len 10..14, greedy [1,0,1,1,1], x all .9), the draft's rollout from
    its mismatch at offset 1 (greedy [0,1,1,0], x [.9,.9,.2,.9]) and from its end (greedy [1,1,0], x .9)."""
    parts = [  # (start prefix_len, rollout, greedy, x)
        (10, False, [1, 0, 1, 1, 1], [0.9] * 5),
        (11, True, [0, 1, 1, 0], [0.9, 0.9, 0.2, 0.9]),
        (15, True, [1, 1, 0], [0.9] * 3),
    ]
    cols: dict[str, list] = {k: [] for k in ("seq_id", "origin", "rollout", "offset", "prefix_len", "greedy_match",
                                             "accept_prob", "q", "x")}
    for start, rollout, greedy, x in reversed(parts):  # stored out of order: the replay sorts
        n = len(greedy)
        cols["seq_id"] += ["a"] * n
        cols["origin"] += ["target"] * n
        cols["rollout"] += [rollout] * n
        cols["offset"] += list(range(n))
        cols["prefix_len"] += list(range(start, start + n))
        cols["greedy_match"] += [bool(g) for g in greedy]
        cols["accept_prob"] += [1.0] * n
        cols["q"] += [0.5] * n
        cols["x"] += x
    return {k: np.asarray(v) for k, v in cols.items()}


def test_branch_rollouts_give_the_drafts_own_rows_past_a_mismatch_and_the_end():
    cols = branched_sequence()
    data = prepare_replay_data(cols, ReplayConfig(branch_rollouts=True, max_new_tokens=8))
    assert data.n_seqs == 1 and data.n_rows == 5 and sorted(data.branches) == [(0, 1), (0, 5)]
    r = replay_policy(ColumnScore(0.5), data, CONST)
    # s=0 (cap 8-0-1 = 7): rows 0, 1 (mismatch), then the rollout from offset 1: x [.9,.9,.9,.2] -> drafts 4, a = 1;
    # s=2 (cap 5): rows 2..4 match, then the rollout past the end: x all .9 -> drafts 5 (cap), a = 3 + 2 = 5,
    # emits the 3 stored tokens left
    assert (r.rounds, r.drafted, r.accepted, r.tokens) == (2, 9, 6, 5)
    assert r.time_s == pytest.approx(9 * 1.0 + 2 * 4.0)
    # cut by the limit (5 new tokens: the stored length): s=0 cap 4 -> drafts 4, a = 1; s=2 cap 2 -> drafts 2, a = 2
    capped = replay_policy(ColumnScore(0.5), prepare_replay_data(cols, ReplayConfig(branch_rollouts=True,
                                                                                    max_new_tokens=5)), CONST)
    assert (capped.rounds, capped.drafted, capped.accepted, capped.tokens) == (2, 6, 3, 5)
    # without the rollouts the rounds read the stored rows (x .9 throughout) and stop at the stored end
    plain = replay_policy(ColumnScore(0.5), prepare_replay_data(cols), CONST)
    assert (plain.rounds, plain.drafted, plain.accepted, plain.tokens) == (2, 8, 4, 5)
    sampled = prepare_replay_data(cols, ReplayConfig(branch_rollouts=True, mode="sampling"))
    assert sampled.branches == {}  # greedy mode only: a sampled round has no first mismatch to branch at
    with pytest.raises(ValueError, match="max_new_tokens"):
        ReplayConfig(max_new_tokens=0)
