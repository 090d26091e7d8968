"""``benchmarks/simulate_batch_rule.py``: traced outputs walked by the batch rule and by fixed K, priced by a curve."""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from simulate_batch_rule import emitted, main, oracle_step, simulate, traced_texts, window  # noqa: E402

from compute.timing import CostModel  # noqa: E402
from predictors.batch_goodput import BatchCost  # noqa: E402


def curve(draft: float) -> CostModel:
    return CostModel(draft_s_per_token=draft, target_s={L: 0.1 + 0.001 * (L - 1) for L in range(1, 10)})


def test_a_request_s_rounds_lay_end_to_end_with_the_bonus_position_after_a_round_all_accepted() -> None:
    scores, positions = np.array([0.9, 0.8, 0.3, 0.7, 0.6, 0.5, 0.4]), np.array([0, 1, 2, 0, 1, 0, 0])
    accepted = np.array([1, 1, 0, 1, 1, 0, 1])
    requests = ["a", "a", "a", "a", "a", "b", "a"]
    texts = traced_texts(scores, positions, accepted, requests, np.random.default_rng(0))
    (a_scores, a_ok), (b_scores, b_ok) = texts
    # a: round 1 ends at its rejection; round 2 accepted both, so the bonus position follows before round 3
    assert a_ok == [True, True, False, True, True, True, True] and a_scores[:5] == [0.9, 0.8, 0.3, 0.7, 0.6]
    assert a_scores[5] in (0.9, 0.8, 0.7, 0.6, 0.4) and a_scores[6] == 0.4
    assert (b_scores, b_ok) == ([0.5], [False])
    acc, ok = window((a_scores, a_ok), 5, cap=4, pool=np.array([0.1]), rng=np.random.default_rng(0))
    assert ok == [True, True, False, False] and acc[2:] == [0.1, 0.1]  # past the output's end: never accepted
    assert (emitted([True, True, False], 3), emitted([True, True], 1), emitted([False], 0)) == (3, 2, 1)


def text(p: float, ok: bool, n: int = 64) -> tuple[list[float], list[bool]]:
    return [p] * n, [ok] * n


def test_the_rule_drafts_far_where_tokens_are_sure_and_drafting_is_cheap_and_not_at_all_where_they_fail() -> None:
    got = simulate([text(0.99, True)] * 3, curve(0.001), batch=2, cap=8, prior=0.9, ks=[0, 1, 5], cycles=2)
    rule = got["batch rule"]
    assert rule.forwards == 8 * rule.steps and rule.rate > got["K = 5"].rate
    k5 = got["K = 5"]  # two requests, each its 5 drafts and the target's own, but where an output ends
    assert 11 * k5.steps < k5.tokens <= 12 * k5.steps
    got = simulate([text(0.01, False)] * 3, curve(0.05), batch=2, cap=8, prior=0.01, ks=[0, 1], cycles=2)
    assert got["batch rule"].forwards == 0 and got["batch rule"].rate >= got["K = 1"].rate


def test_every_setting_walks_the_same_outputs_with_the_batch_in_flight() -> None:
    texts = [text(0.9, True, 40), text(0.5, False, 20), text(0.7, True, 30)]
    got = simulate(texts, curve(0.01), batch=2, cap=4, prior=0.5, ks=[0, 3], cycles=3)
    assert got["K = 0"].steps and got["K = 0"].tokens == 2 * got["K = 0"].steps  # one token a request a step
    assert got["oracle"].rate >= max(t.rate for name, t in got.items() if name != "oracle")


def test_the_oracle_sends_each_accepted_run_under_the_fastest_common_cap() -> None:
    cost = BatchCost.from_cost_model(curve(0.01), batch=2, first_forward_paid=False)
    runs = [([0.5] * 4, [True, True, False, False]), ([0.5] * 4, [True, True, True, True])]
    assert oracle_step(cost, cap=4)(runs, [0.5, 0.5]) == ([2, 4], 4)  # cheap forwards: each request's whole run
    dear = BatchCost.from_cost_model(curve(1.0), batch=2, first_forward_paid=False)
    assert oracle_step(dear, cap=4)(runs, [0.5, 0.5]) == ([0, 0], 0)  # a forward dearer than what it buys


def test_bad_input_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "costs.json").write_text(json.dumps(curve(0.01).to_dict()))
    assert main([str(tmp_path), str(tmp_path / "costs.json"), "--policy", "goodput:svip"]) == 1
    assert "not a folder of vLLM serving traces" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"kind": "vllm_traces"}))
    assert main([str(tmp_path), str(tmp_path / "costs.json"), "--policy", "static:3"]) == 1
    assert "decides for goodput policies" in capsys.readouterr().err
    assert main([str(tmp_path), str(tmp_path / "costs.json"), "--policy", "goodput:svip", "--prior", "1.5"]) == 1
    assert "--prior 1.5: an acceptance, between 0 and 1" in capsys.readouterr().err


def test_a_forecast_started_too_low_never_drafts_where_a_skipped_step_is_cheap() -> None:
    """A request's forecast learns only from rounds it drafts: started below what drafting needs (a skipped step
    cheaper than a drafting one, as on a host whose draft forward is cheap), it never drafts; started at the
    acceptance vLLM was measured or traced at, it drafts and beats drafting nothing."""
    from compute.timing import SKIP_STEP

    cm = CostModel(draft_s_per_token=0.024, target_s={L: 0.065 for L in range(1, 10)})
    cm.extra[SKIP_STEP] = 0.057
    texts = [text(0.85, True, 80)] * 3
    low = simulate(texts, cm, batch=1, cap=6, prior=0.5, ks=[0, 2], cycles=2)
    measured = simulate(texts, cm, batch=1, cap=6, prior=0.85, ks=[0, 2], cycles=2)
    assert low["batch rule"].forwards == 0 and low["batch rule"].rate == low["K = 0"].rate
    assert measured["batch rule"].forwards > 0 and measured["batch rule"].rate > 1.3 * measured["K = 0"].rate
