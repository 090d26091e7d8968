"""The replay charges what the engine spends: with every model forward costing exactly what the curve says (a fake
clock advanced by the curve's price of each forward, nothing else taking time), the replay's seconds for a policy's
rounds equal the engine's decoding seconds, for the goodput rule (rounds that draft nothing, rounds that verify fewer
tokens than they drafted, the draft's catch-up after both) and for a thresholded policy. Whatever separates the
replay check's prediction from a measured row is then the realised cost of the forwards (the host's speed while the
row ran, the curve's shape at the run's contexts) or the time the curve does not price (stop decisions, bookkeeping),
never the replay's accounting of the rounds."""
from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch

from compute.timing import CostModel
from data_gen.continuation_labels import label_continuation
from data_gen.labelling import LabelModels, LabelOptions
from decoding.engine import SpeculativeDecoder
from evaluation.replay import ReplayConfig, prepare_replay_data, replay_policy
from predictors.baselines import MaxConfidence
from predictors.calibration import Calibrator
from predictors.goodput import GoodputPolicy
from tests.tiny_pairs import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")

NEW, CAP, PAD = 32, 8, 256
CURVE = CostModel(draft_s_per_token=0.02, draft_catchup_s=0.004,
                  target_s={1: 0.1, 2: 0.1, 3: 0.14, 5: 0.15, 6: 0.22, 16: 0.4})
"""Steps at L = 3 and 6 (a goodput round then verifies fewer than it drafted now and then); a draft forward of n
tokens costs a step plus (n - 1) catch-ups."""
# the tiny draft's top-1 probabilities lie around 0.02-0.1: a map spreading them over [0.1, 0.97]
MAP = {"greedy": Calibrator("isotonic", [0.02, 0.04, 0.06, 0.1], [0.1, 0.6, 0.9, 0.97])}


class CurveClock:
    """A clock that moves only when a model runs a forward, by the curve's price of it: the target's pass of L new
    tokens t(L), the draft's forward of n new tokens one step plus ``catchup_time(n)`` (its pass over the prompt,
    into an empty cache, is prefill: free)."""

    def __init__(self, draft: torch.nn.Module, target: torch.nn.Module, cm: CostModel) -> None:
        self.now, self.cm = 0.0, cm
        self.handles = [draft.register_forward_pre_hook(self._draft, with_kwargs=True),
                        target.register_forward_pre_hook(self._target, with_kwargs=True)]

    def __call__(self) -> float:
        return self.now

    def _draft(self, module, args, kwargs) -> None:
        n = int(kwargs["input_ids"].shape[-1])
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache.get_seq_length() > 0:
            self.now += self.cm.draft_s_per_token + self.cm.catchup_time(n)

    def _target(self, module, args, kwargs) -> None:
        self.now += self.cm.target_time(int(kwargs["input_ids"].shape[-1]))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def run():
    """The pair, four prompts and their records along target-only's output with the draft's rollouts."""
    draft, target = make_pair(noise=0.4, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (10,), generator=g).tolist() for _ in range(4)]
    opts = LabelOptions(top_k=10, store_hidden=False, pad_token_id=PAD)
    parts = []
    for i, p in enumerate(prompts):
        ref = target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, pad_token_id=PAD)
        recs, _ = label_continuation(LabelModels(draft, target), p, ref[0, len(p):].tolist(), opts, sample_id=str(i),
                                     rollout_len=CAP, generator=torch.Generator().manual_seed(0))
        parts.append(recs)
    columns = {k: np.asarray([v for part in parts for v in part[k]]) for k in parts[0]}
    data = prepare_replay_data(columns, ReplayConfig(branch_rollouts=True, max_new_tokens=NEW, fallback_to_all=False))
    return draft, target, prompts, data


@pytest.mark.parametrize("kind", ["goodput", "thresholded"])
def test_the_replay_charges_the_engines_forwards_at_the_curves_price(run, kind, monkeypatch):
    draft, target, prompts, data = run
    policy = (GoodputPolicy(MaxConfidence(0.4, max_draft_len=CAP), MAP, "max_confidence") if kind == "goodput"
              else MaxConfidence(0.05, max_draft_len=CAP))
    clock = CurveClock(draft, target, CURVE)
    monkeypatch.setattr(time, "perf_counter", clock)  # the engine's timer (compute.timing.clock reads it too)
    try:
        dec = SpeculativeDecoder(draft, target, copy.deepcopy(policy), cost_model=CURVE, max_draft_len=CAP)
        runs = [dec.generate(torch.tensor([p]), None, NEW, None, 0)[1] for p in prompts]
    finally:
        clock.close()
        monkeypatch.undo()
    engine_s = sum(st.wall_time - st.prefill_time for st in runs)  # decoding after each prompt's pass
    drafted = [k for st in runs for k in st.drafted_lengths]
    verified = [k for st in runs for k in st.sent_lengths]
    accepted = [k for st in runs for k in st.accepted_lengths]
    res = replay_policy(copy.deepcopy(policy), data, CURVE, "greedy", max_draft_len=CAP)
    assert (res.rounds, res.drafted, res.accepted) == (len(drafted), sum(drafted), sum(accepted))
    # the replay's seconds less each prompt's first verification (the engine runs it in the prompt's pass)
    assert res.time_s - res.first_verify_s == pytest.approx(engine_s, rel=1e-9)
    assert any(a == d > 0 for a, d in zip(accepted, drafted))  # fully accepted: the next round catches up
    if kind == "goodput":
        assert drafted.count(0) > len(prompts)  # rounds that draft nothing (the draft falls behind by what they emit)
        assert any(v < d for v, d in zip(verified, drafted))  # best prefix shorter than the round


def test_the_check_sets_the_engines_unpriced_time_beside_its_step_costs():
    """The engine's decoding time outside its draft and target forwards (what the curve does not price), per output
    token, goes from the row into the check's row."""
    from benchmark.check import compare_row
    from benchmark.rows import Row
    from decoding.stats import DecodeStats

    stats = DecodeStats(tokens=100, rounds=30, target_calls=31, prompt_passes=1, sent_lengths=[2] * 31,
                        prompt_pass_lengths=[2], draft_forwards=60, wall_time=10.0, prefill_time=1.0, draft_time=4.0,
                        target_time=4.5, stop_time=0.3)
    row = Row("disco", "engine", rounds=30, accepted=40, draft_tokens=60, decode=stats)
    costs = row.step_costs()
    assert costs["unpriced_ms_per_token"] == pytest.approx(5.0)  # (10 - 1 - 4 - 4.5) s over 100 tokens
    out = compare_row({"row": "disco", "rounds": 30, "accepted": 40, "draft_tokens": 60, "tokens_per_s": 10.0,
                       **costs}, None, "", CURVE)
    assert out["unpriced_ms_per_token"] == pytest.approx(5.0) and out["measured_draft_ms"] == pytest.approx(66.67)
    analysis = Row("oracle", "engine", decode=DecodeStats(tokens=10, target_calls=3, analysis_time=1.0, wall_time=2.0))
    assert analysis.step_costs()["unpriced_ms_per_token"] is None  # no verification pass of its own
