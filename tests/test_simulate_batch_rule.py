"""``benchmarks/simulate_batch_rule.py``: traced rounds decided by the batch rule and by fixed K, priced by a curve."""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from simulate_batch_rule import emitted, main, oracle_step, simulate, traced_rounds  # noqa: E402

from compute.timing import CostModel  # noqa: E402
from predictors.batch_goodput import BatchCost  # noqa: E402


def curve(draft: float) -> CostModel:
    return CostModel(draft_s_per_token=draft, target_s={L: 0.1 + 0.001 * (L - 1) for L in range(1, 10)})


def test_a_traced_round_is_filled_to_the_cap_with_scores_drawn_at_each_position_and_no_acceptance() -> None:
    scores, positions = np.array([0.9, 0.8, 0.3, 0.7, 0.6]), np.array([0, 1, 2, 0, 1])
    accepted = np.array([1, 1, 0, 1, 0])
    rounds = traced_rounds(scores, positions, accepted, cap=4, rng=np.random.default_rng(0))
    assert [r[1] for r in rounds] == [[True, True, False, False], [True, False, False, False]]
    assert rounds[0][0][:3] == [0.9, 0.8, 0.3] and rounds[1][0][2] == 0.3  # position 2's only traced score
    assert all(len(a) == 4 for a, _ in rounds)
    assert (emitted([True, True, False], 3), emitted([True, True], 1), emitted([False], 0)) == (3, 2, 1)


def test_the_rule_drafts_far_where_tokens_are_sure_and_drafting_is_cheap_and_not_at_all_where_they_fail() -> None:
    sure = [([0.99] * 8, [True] * 8)]
    got = simulate(sure, curve(0.001), batch=4, steps=20, cap=8, prior=0.9, ks=[0, 1, 5])
    assert got["batch rule"].forwards == 20 * 8 and got["batch rule"].rate > got["K = 5"].rate
    hopeless = [([0.01] * 8, [False] * 8)]
    got = simulate(hopeless, curve(0.05), batch=4, steps=20, cap=8, prior=0.01, ks=[0, 1])
    assert got["batch rule"].forwards == 0 and got["batch rule"].rate >= got["K = 1"].rate


def test_the_oracle_sends_each_accepted_run_under_the_fastest_common_cap() -> None:
    cost = BatchCost.from_cost_model(curve(0.01), batch=2, first_forward_paid=False)
    runs = [([0.5] * 4, [True, True, False, False]), ([0.5] * 4, [True, True, True, True])]
    tokens, seconds, forwards, sent = oracle_step(runs, cost, cap=4)
    assert (tokens, forwards, sent) == (2 + 1 + 4 + 1, 4, 6)  # cheap forwards: each request's whole run
    assert seconds == cost.step_s(4, 6)
    dear = BatchCost.from_cost_model(curve(1.0), batch=2, first_forward_paid=False)
    assert oracle_step(runs, dear, cap=4)[2:] == (0, 0)  # a forward dearer than the tokens it buys: no drafting
    got = simulate(runs, curve(0.01), batch=2, steps=50, cap=4, prior=0.5, ks=[1, 3])
    assert got["oracle"].rate >= max(got["K = 1"].rate, got["K = 3"].rate, got["batch rule"].rate)


def test_bad_input_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "costs.json").write_text(json.dumps(curve(0.01).to_dict()))
    assert main([str(tmp_path), str(tmp_path / "costs.json"), "--policy", "goodput:svip"]) == 1
    assert "not a folder of vLLM serving traces" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"kind": "vllm_traces"}))
    assert main([str(tmp_path), str(tmp_path / "costs.json"), "--policy", "static:3"]) == 1
    assert "decides for goodput policies" in capsys.readouterr().err
