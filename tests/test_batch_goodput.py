"""The cost-aware rule for a batch sharing draft forwards and one verification pass (``predictors.batch_goodput``),
and the vLLM stopper deciding for its batch with it, on hand-made acceptances, curves and logits whose answer is known;
serving traces written whole and labelled by vLLM's verdicts."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from compute.timing import CostModel
from decoding.policies import build_policy
from predictors.batch_goodput import BatchCost, RecentShare, batch_keep_drafting, send_lengths, worth_drafting
from predictors.calibration import Calibrator
from runtimes.vllm.stopper import RequestStopper
from runtimes.vllm.traces import TraceWriter


def cost(draft: float, per_token: float, base: float = 0.1, batch: int = 4) -> BatchCost:
    cm = CostModel(draft_s_per_token=draft, target_s={L: base + per_token * (L - 1) for L in range(1, 10)})
    return BatchCost.from_cost_model(cm, batch)


def test_a_cheap_forward_is_run_for_confident_requests_and_a_dear_one_is_not() -> None:
    acc = [[0.9], [0.9], [0.9], [0.9]]
    assert batch_keep_drafting(acc, [True] * 4, cost(draft=0.005, per_token=0.002), cap=8)
    # one more forward costs as much as the whole step: four requests' 0.81 expected tokens do not pay it
    assert not batch_keep_drafting(acc, [True] * 4, cost(draft=0.2, per_token=0.002), cap=8)


def test_one_drafting_request_does_not_carry_a_forward_the_others_ride() -> None:
    c = cost(draft=0.03, per_token=0.004)
    assert batch_keep_drafting([[0.9]] * 4, [True] * 4, c, cap=8)
    assert not batch_keep_drafting([[0.9], [0.2], [0.2], [0.2]], [True, False, False, False], c, cap=8)


def test_the_first_forward_vllm_runs_anyway_makes_the_first_token_cost_its_verification_only() -> None:
    paid, skipped = cost(0.05, 0.001), cost(0.05, 0.001)
    skipped.first_forward_paid = False
    acc = [[0.5], [0.5], [0.5], [0.5]]
    assert send_lengths(acc, paid, forwards=1) == [1, 1, 1, 1]  # the forward is paid either way
    assert paid.step_s(0, 0) == paid.step_s(1, 0) and skipped.step_s(0, 0) < skipped.step_s(1, 0)


def test_a_request_drafts_on_only_where_its_next_token_pays_its_verification() -> None:
    c = cost(draft=0.01, per_token=0.02)
    assert worth_drafting([[0.95, 0.95], [0.3, 0.2]], c, forwards=2) == [True, False]


def test_the_stopper_ends_the_batchs_loop_where_the_batch_rule_says_so() -> None:
    logits = torch.zeros(4, 32)
    logits[:, 3] = 6.0  # every request confident: top-1 about 0.93
    dear = {4: CostModel(draft_s_per_token=0.5, target_s={L: 0.1 + 0.002 * (L - 1) for L in range(1, 10)})}
    cheap = {4: CostModel(draft_s_per_token=0.001, target_s={L: 0.1 + 0.002 * (L - 1) for L in range(1, 10)})}
    ident = _identity_map()
    for curves, steps in ((dear, 1), (cheap, 5)):
        stopper = RequestStopper(build_policy("max_confidence_fixed:0.5"), curves, acceptance=ident)
        stopper.begin_round(list("abcd"), None, num_speculative_tokens=5)
        done, n = False, 0
        while not done:
            done = stopper.step(logits)[1]
            n += 1
        assert n == steps
        assert all(len(p) == steps for p in stopper.proposals())


def test_without_a_calibration_each_request_stops_by_its_own_rule() -> None:
    curves = {4: CostModel(draft_s_per_token=0.5, target_s={1: 0.1, 2: 0.11})}
    assert not RequestStopper(build_policy("max_confidence_fixed:0.5"), curves).batch_rule
    assert RequestStopper(build_policy("max_confidence_fixed:0.5"), curves, acceptance=_identity_map()).batch_rule


def test_traces_label_sent_tokens_by_vllms_verdict_and_are_written_whole(tmp_path) -> None:
    w = TraceWriter(tmp_path / "t", {"runtime": "vllm", "precision": "bfloat16", "fingerprints": {"draft": "d"}},
                    shard_rows=3)
    w.sent("r1", [{"q": 0.9}, {"q": 0.8}, {"q": 0.7}, {"q": 0.6}], batch=2)
    w.verdicts("r1", accepted=1, batch=2)  # first accepted, second rejected, the rest never judged
    assert w.written == 0 and not list((tmp_path / "t").glob("*.parquet"))
    w.sent("r2", [{"q": 0.5}], batch=2)
    w.verdicts("r2", accepted=1, batch=2)
    rows = pq.read_table(tmp_path / "t" / "shard-00000.parquet").to_pylist()
    assert [(r["sample_id"], r["position"], r["greedy_match"]) for r in rows] == [
        ("r1", 0, 1.0), ("r1", 1, 0.0), ("r2", 0, 1.0)]
    with pytest.raises(ValueError, match="another precision"):
        TraceWriter(tmp_path / "t", {"runtime": "vllm", "precision": "float32", "fingerprints": {"draft": "d"}})


def _identity_map() -> Calibrator:
    """A map that reads the raw score as the acceptance."""
    return Calibrator.from_dict({"method": "isotonic", "x": [0.0, 1.0], "y": [0.0, 1.0]})


def test_calibrate_refits_a_score_on_vllm_traces_and_refuses_an_empty_folder(tmp_path, capsys) -> None:
    from pipelines.calibrate import main as calibrate

    traces = tmp_path / "traces"
    w = TraceWriter(traces, {"runtime": "vllm", "precision": "bfloat16", "fingerprints": {"draft": None}})
    for i in range(200):  # low entropy accepted, high entropy rejected: a map that rises as entropy falls
        rid = f"req-{i}"
        w.sent(rid, [{"draft_entropy": 0.1 + 0.01 * (i % 20), "q": 0.9},
                     {"draft_entropy": 2.0 + 0.01 * (i % 20), "q": 0.3}], batch=1)
        w.verdicts(rid, accepted=1, batch=1)
    w.close()
    out = calibrate(["--data_dir", str(traces), "--predictor", "svip", "--out_dir", str(tmp_path / "svip-vllm")])
    greedy = out["maps"]["greedy"]
    assert set(out["maps"]) == {"greedy"}  # traces of greedy decoding fit the greedy map only
    svip = build_policy("svip")
    sure, unsure = (svip.score_list({"draft_entropy": torch.tensor([h])})[0] for h in (0.15, 2.05))
    assert greedy.apply_one(sure) > 0.9 > 0.1 > greedy.apply_one(unsure)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        calibrate(["--data_dir", str(tmp_path / "empty"), "--predictor", "svip", "--out_dir", str(tmp_path / "x")])
    assert "no labelled draft tokens" in capsys.readouterr().err


def test_a_skipped_step_is_read_by_the_next_forward_in_front_of_each_requests_tokens() -> None:
    from runtimes.vllm.catch_up import CatchUp

    catch = CatchUp(max_tokens=64)
    # a step with no drafts: a's query is one token at 10, b's three (two drafts, one rejected) at 20..22
    catch.skipped(["a", "b"], torch.tensor([1, 2, 3, 4]), torch.tensor([10, 20, 21, 22]), [0, 1, 4], rejected=[0, 1])
    assert catch.pending("a") == 1 and catch.pending("b") == 2  # b's rejected draft is not read
    catch.skipped(["a", "b"], torch.tensor([5, 6]), torch.tensor([11, 22]), [0, 1, 2], rejected=None)
    ids, pos, starts = catch.extend(["a", "b"], torch.tensor([7, 8, 9]), torch.tensor([12, 23, 24]), [0, 1, 3])
    assert ids.tolist() == [1, 5, 7, 2, 3, 6, 8, 9] and pos.tolist() == [10, 11, 12, 20, 21, 22, 23, 24]
    assert starts == [0, 3, 8] and catch.pending("a") == 0 and catch.extend(["a"], ids[:1], pos[:1], [0, 1]) is None


def test_a_catch_up_that_does_not_follow_on_or_overflows_is_dropped() -> None:
    from runtimes.vllm.catch_up import CatchUp

    catch = CatchUp(max_tokens=4)
    catch.skipped(["a"], torch.tensor([1]), torch.tensor([10]), [0, 1], rejected=None)
    assert catch.extend(["a"], torch.tensor([2]), torch.tensor([30]), [0, 1])[0].tolist() == [2]  # preempted: gap
    catch.skipped(["a"], torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3, 4]), [0, 4], rejected=None)
    assert catch.extend(["a"], torch.tensor([5]), torch.tensor([5]), [0, 1]) is None  # 5 tokens > 4: dropped
    assert catch.dropped_tokens == 5


def test_where_a_step_can_skip_the_draft_the_batch_drafts_only_when_drafting_pays() -> None:
    logits = torch.zeros(4, 32)
    logits[:, 3] = 6.0
    target = {L: 0.1 + 0.002 * (L - 1) for L in range(1, 10)}
    for draft_s, drafts in ((0.5, False), (0.001, True)):
        stopper = RequestStopper(build_policy("max_confidence_fixed:0.5"),
                                 {4: CostModel(draft_s_per_token=draft_s, target_s=target)},
                                 acceptance=_identity_map(), skip_idle=True, prior=0.9)
        stopper.begin_round(list("abcd"), None, num_speculative_tokens=5)
        assert stopper.all_stopped() is not drafts
        assert stopper.counts.skipped_steps == (0 if drafts else 1)


def test_the_proposers_inputs_take_the_caught_up_tokens_and_query_boundaries() -> None:
    import dataclasses

    from runtimes.vllm.catch_up import CatchUp
    from runtimes.vllm.proposer import caught_up

    @dataclasses.dataclass
    class Meta:  # the fields of vLLM's CommonAttentionMetadata that a catch-up moves
        query_start_loc: torch.Tensor
        query_start_loc_cpu: torch.Tensor
        num_actual_tokens: int
        max_query_len: int
        positions: object = None
        _num_computed_tokens_cache: object = None
        _token_to_req_indices_cache: object = None

        def replace(self, **kw: object) -> Meta:
            return dataclasses.replace(self, **kw)

    catch = CatchUp(64)
    catch.skipped(["a", "b"], torch.tensor([1, 2]), torch.tensor([10, 20]), [0, 1, 2], rejected=None)
    loc = torch.tensor([0, 1, 3], dtype=torch.int32)
    kw = {"target_token_ids": torch.tensor([5, 6, 7]), "target_positions": torch.tensor([11, 21, 22]),
          "target_hidden_states": torch.zeros(3, 4), "token_indices_to_sample": torch.tensor([0, 2]),
          "common_attn_metadata": Meta(loc, loc, 3, 2)}
    out = caught_up(catch, ["a", "b"], [0, 1, 3], kw)
    assert out["target_token_ids"].tolist() == [1, 5, 2, 6, 7]
    assert out["common_attn_metadata"].query_start_loc.tolist() == [0, 2, 5]
    assert out["common_attn_metadata"].max_query_len == 3 and out["common_attn_metadata"].num_actual_tokens == 5
    assert out["token_indices_to_sample"].tolist() == [1, 4] and out["target_hidden_states"].shape == (5, 4)
    assert caught_up(catch, ["a", "b"], [0, 1, 3], kw) is kw  # nothing remembered: the inputs stand


def test_a_step_that_drafts_nothing_is_priced_at_the_speculative_engines_skipped_step() -> None:
    """``target_s[1]`` is the target alone's own engine; a skipped step in the speculative engine carries its
    per-step work too (the curve's ``skip_s``), so "draft nothing" is dearer than ``target(1)`` there."""
    cm = CostModel(draft_s_per_token=0.03, target_s={1: 0.06, 2: 0.085, 3: 0.095})
    plain = BatchCost.from_cost_model(cm, 4, first_forward_paid=False)
    cm.extra["skip_s"] = 0.07
    skip = BatchCost.from_cost_model(cm, 4, first_forward_paid=False)
    assert plain.step_s(0, 0) == pytest.approx(0.06) and skip.step_s(0, 0) == pytest.approx(0.07)
    assert skip.step_s(1, 4) == pytest.approx(plain.step_s(1, 4))  # a drafted step as before
    assert skip.scaled(1.0, 2.0).step_s(0, 0) == pytest.approx(0.14)
    assert BatchCost.from_cost_model(cm, 4).skip_s is None  # the first forward runs anyway: no skipped step
    forecast = [0.88] * 4  # 7.52 tokens in 0.115 s against 4 in 0.06 s (no draft) or in 0.07 s (the skipped step)
    assert not batch_keep_drafting([[]] * 4, [True] * 4, plain, cap=1, forecast=forecast)
    assert batch_keep_drafting([[]] * 4, [True] * 4, skip, cap=1, forecast=forecast)


def test_after_position_keeps_the_requests_whose_next_token_pays_and_stops_the_batch_when_none_pay() -> None:
    from predictors.batch_goodput import after_position

    c = cost(draft=0.001, per_token=0.001)
    drafting, go = after_position([[0.99], [0.99], [0.05], []], [True, True, True, False], c, cap=8, cost_aware=True)
    assert drafting == [True, True, False, False] and go  # the unlikely request stops; a cheap forward runs on
    assert after_position([[0.99], []], [False, False], c, cap=8, cost_aware=True) == ([False, False], False)
    dear = cost(draft=5.0, per_token=0.001)
    assert after_position([[0.99], [0.99], [0.99], [0.99]], [True] * 4, dear, cap=8, cost_aware=False) == (
        [True] * 4, False)  # a thresholded policy's own stop decides who; no forward is worth 5 s


def test_a_request_s_forecast_starts_at_the_prior_and_follows_its_recent_rounds() -> None:
    recent = RecentShare()
    assert recent.forecast(0.6) == 0.6
    for _ in range(20):
        recent.seen(accepted=4, sent=4)  # every token accepted: tried 4 a round
    assert 0.95 < recent.forecast(0.6) < 1.0
    for _ in range(40):
        recent.seen(accepted=0, sent=3)  # the first token rejected: tried 1 a round
    assert recent.forecast(0.6) < 0.2
    recent.seen(accepted=0, sent=0)  # a round that sent nothing counts nothing new, the old rounds fade
    assert recent.tried < 10
