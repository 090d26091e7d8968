"""The runtimes' own draft-length rules (llama.cpp, transformers, vLLM): their scores and rounds on hand-made data,
transformers' ROC re-tuning against its own formula, greedy exactness in the engine, the tuned recommendation and its
verdict, and bad input."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compute.timing import CostModel
from decoding.engine import SpeculativeDecoder
from decoding.policies import build_policy
from evaluation.replay import ReplayConfig, prepare_replay_data, replay_policy
from main_job.recommend import SPECULATE_MIN, RecommendConfig, coarse_rules, draft_name, recommend
from predictors.base import RoundFeedback
from predictors.round_rules import PrefixRule
from predictors.runtime_rules import LlamaCppRule, TransformersRule, VllmRule, roc_threshold, runtime_rule
from tests.synthetic import make_records
from tests.tiny_pairs import make_pair

CONST = CostModel(draft_s_per_token=1.0, target_s={1: 4.0, 40: 4.0})


def topk_rows(top1: list[float]) -> np.ndarray:
    """[n, 10] top-10 probabilities whose top-1 share of the top 10 is ``top1 / (top1 + 0.1)``."""
    rest = np.full((len(top1), 9), 0.1 / 9)
    return np.concatenate([np.asarray(top1)[:, None], rest], axis=1)


def rollout(greedy: list[int], top1: list[float]) -> dict[str, np.ndarray]:
    n = len(greedy)
    return {"seq_id": np.array(["a"] * n), "sample_id": np.array(["p0"] * n), "origin": np.array(["target"] * n),
            "rollout": np.zeros(n, dtype=bool), "offset": np.arange(n), "greedy_match": np.array(greedy, dtype=bool),
            "accept_prob": np.ones(n), "q": np.asarray(top1, dtype=np.float64), "draft_topk": topk_rows(top1)}


def test_llamacpp_score_is_top1_among_the_top_10():
    rule = LlamaCppRule(4, 0, 0.5)
    feats = {"draft_topk": torch.tensor(topk_rows([0.9, 0.1]), dtype=torch.float32)}
    assert rule.score(feats).tolist() == pytest.approx([0.9 / 1.0, 0.1 / 0.2])
    assert rule.round_rule == PrefixRule(minimum=0) and rule.verification == "prefix" and rule.draft_cap() == 4
    with pytest.raises(KeyError, match="top 10"):
        rule.score({"draft_topk": torch.ones(2, 5)})


def test_llamacpp_round_pays_the_step_that_scored_low_and_drops_its_token():
    rule = LlamaCppRule(4, 0, 0.5).round_rule
    assert rule.steps_and_sent(0.5, [0.9, 0.8, 0.3, 0.9]) == (3, 2)  # third step scored below p_min: paid, not sent
    assert rule.steps_and_sent(0.5, [0.9, 0.8, 0.7, 0.9]) == (4, 4)  # n_max reached: no extra step
    assert rule.steps_and_sent(0.5, [0.2]) == (1, 0)
    assert LlamaCppRule(4, 3, 0.5).round_rule.steps_and_sent(0.5, [0.9, 0.8, 0.3]) == (3, 0)  # under n_min: none


def test_llamacpp_replay_hand_computed():
    # top-1 shares: .9/(.9+.1)=.9 ... ; p_min .5 -> the round at 0 takes tokens 0, 1 and pays the step of token 2
    data = prepare_replay_data(rollout([1, 1, 1, 1, 1, 1], [0.9, 0.9, 0.05, 0.9, 0.9, 0.9]))
    r = replay_policy(LlamaCppRule(4, 0, 0.5), data, CONST, "greedy")
    # round 0: 3 steps, 2 sent, both match -> emits 3 (next at 3), 3 * 1 + 4 = 7 s; round 3: rows 3..5 (room 3),
    # 3 steps, 3 sent, all match -> emits 3 (clipped to the end): 3 + 4 = 7 s
    assert (r.rounds, r.tokens, r.drafted, r.sent, r.time_s) == (2, 6, 6, 5, 14)
    r2 = replay_policy(LlamaCppRule(4, 3, 0.5), data, CONST, "greedy")
    # round 0 now sends nothing (2 < n_min): emits 1 after 3 steps + a one-token target pass
    assert r2.sent < r.sent and r2.time_s > r.time_s


def test_transformers_roc_retuning_follows_its_formula():
    rule = TransformersRule(5, "constant", 0.4)
    # transformers keeps the matched tokens' probabilities and the first rejected one's
    rule.update(RoundFeedback.leading(4, 2, [0.9, 0.8, 0.3, 0.7]))
    assert rule._probs == [0.9, 0.8, 0.3] and rule._matches == [1, 1, 0]
    assert rule.threshold == 0.4  # not more than 5 pairs yet
    rule.update(RoundFeedback.leading(3, 3, [0.6, 0.5, 0.95]))
    assert rule.threshold == pytest.approx(roc_threshold([0.9, 0.8, 0.3, 0.6, 0.5, 0.95], [1, 1, 0, 1, 1, 1]))
    assert rule.threshold == pytest.approx(0.5)  # fpr + 3 fnr is least at the lowest matched probability
    rule.reset()
    assert rule.threshold == 0.4 and rule._probs == []


def test_transformers_schedule_and_no_threshold():
    rule = TransformersRule(3, "heuristic", 0.0)
    rule.update(RoundFeedback.leading(3, 3, [0.9] * 3))
    assert rule.draft_cap() == 5
    rule.update(RoundFeedback.leading(5, 1, [0.9] * 5))
    assert rule.draft_cap() == 4 and rule.threshold == 0.0 and rule._probs == []


def test_specs_parse_and_refuse_bad_values():
    assert build_policy("llamacpp:8,1,0.6").settings() == {"n_max": 8, "n_min": 1, "p_min": 0.6}
    assert build_policy("llamacpp").settings() == LlamaCppRule.DEFAULTS
    assert build_policy("transformers:6,heuristic,0.3").settings()["num_assistant_tokens_schedule"] == "heuristic"
    assert build_policy("vllm:7").draft_cap() == 7
    assert runtime_rule("llamacpp", "5,0,0.7").spec() == "llamacpp:5,0,0.7"
    for bad, match in [("llamacpp:1,2,3,4", "at most 3"), ("llamacpp:x", "not a number"),
                       ("llamacpp:3,0,1.5", "p_min"), ("transformers:5,sometimes", "schedule"), ("vllm:0", ">= 1")]:
        with pytest.raises(ValueError, match=match):
            build_policy(bad)
    assert "--spec-draft-p-min 0.60" in LlamaCppRule(8, 1, 0.6).paste("d.gguf")
    assert '"num_speculative_tokens": 4' in VllmRule(4).paste("d")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("spec", ["llamacpp:4,0,0.5", "llamacpp:3,2,0.3", "llamacpp", "transformers",
                                  "transformers:3,heuristic,0.3", "vllm:3"])
def test_greedy_equals_target_only_in_the_engine(spec):
    draft, target = make_pair()
    prompt = torch.tensor([[67, 68, 69, 220, 69, 78, 78, 7, 87, 8, 25]])
    ref = target.generate(prompt, do_sample=False, max_new_tokens=20, pad_token_id=256, eos_token_id=None)
    out, stats = SpeculativeDecoder(draft, target, build_policy(spec)).generate(prompt, None, 20, None, 0)
    assert out.tolist() == ref.tolist()
    assert stats.accepted + stats.rounds == stats.tokens
    assert stats.accepted <= stats.sent <= stats.drafted


def test_hf_integration_refuses_llamacpp_rule():
    from runtimes.transformers.assisted import check_hf_policy

    with pytest.raises(ValueError, match="llama.cpp's rule"):
        check_hf_policy(LlamaCppRule(), None)


def records() -> dict[str, np.ndarray]:
    return make_records(n_prompts=30, tokens_per_prompt=40, companion=False)


def test_recommend_tunes_on_val_and_beats_the_defaults_it_replays():
    cm = CostModel(draft_s_per_token=0.01, target_s={1: 0.1, 4: 0.12, 16: 0.3}, runtime="llamacpp")
    rec = recommend("llamacpp", records(), cm)
    assert rec.speculate and rec.val_speedup > SPECULATE_MIN
    assert rec.val_speedup >= max(r["speedup"] for r in rec.tried) - 1e-12
    assert {r["spec"] for r in rec.tried} >= {r.spec() for r in coarse_rules("llamacpp")}
    assert rec.warnings == [] and rec.oracle is not None and rec.oracle.speedup >= rec.test.speedup
    lines = rec.lines("d.gguf")
    assert lines[0].startswith("llamacpp: -md d.gguf --spec-type draft-simple")
    assert json.loads(json.dumps(rec.to_dict()))["spec"] == rec.rule.spec()


def test_recommend_says_do_not_speculate_when_nothing_pays():
    slow_draft = CostModel(draft_s_per_token=1.0, target_s={1: 0.1, 16: 0.2}, runtime="llamacpp")
    rec = recommend("vllm", records(), slow_draft)
    assert not rec.speculate and rec.speedup == 1.0
    assert "do not speculate" in rec.lines()[1]
    assert "'llamacpp', not 'vllm'" in rec.warnings[0]  # a curve of another runtime warns, naming both


def test_recommend_needs_val_and_test_rows():
    cols = records()
    cols["split"] = np.where(cols["split"] == "test", "train", cols["split"])
    with pytest.raises(ValueError, match="no test rows"):
        recommend("vllm", cols, CONST)


def test_a_specstop_curve_prices_transformers_without_warning():
    assert CONST.runtime_mismatch("transformers") is None
    assert "measure llamacpp's own" in CONST.runtime_mismatch("llamacpp")


def test_replay_config_is_unchanged_by_rules():
    data = prepare_replay_data(records(), ReplayConfig(split="val"))
    base = replay_policy(build_policy("static:3"), data, CONST)
    same = replay_policy(build_policy("vllm:3"), data, CONST)
    assert (base.tokens, base.time_s) == (same.tokens, same.time_s)  # vLLM's rule is a static length


@pytest.mark.usefixtures("one_thread")
def test_transformers_costs_time_generate_own_forwards_and_overheads():
    from compute.timing import measure_cost_model
    from runtimes.transformers.costs import measure_transformers_costs

    draft, target = make_pair()
    base = measure_cost_model(draft, target, lengths=(1, 2), prompt_len=16, repeats=1)
    cm = measure_transformers_costs(draft, target, lengths=(1, 4), new_tokens=12, prompt_len=16, repeats=1, base=base)
    assert cm.runtime == "transformers" and cm.runtime_mismatch("transformers") is None
    assert cm.target_name == base.target_name and cm.machine == base.machine
    assert {1, 2, 5} <= set(cm.target_s)  # target-only steps, and rounds of 1 and 4 drafts (+ the bonus token)
    times = [cm.target_s[L] for L in sorted(cm.target_s)]
    assert times == sorted(times) and cm.draft_s_per_token > 0
    a, b = cm.extra["transformers_per_round_s"], cm.extra["transformers_per_draft_s"]
    assert a >= 0 and b >= 0
    runs = {r["k"]: r for r in cm.extra["transformers_runs"]}
    assert set(runs) == {0, 1, 4} and runs[0]["drafted"] == 0 and runs[4]["drafted"] > runs[1]["drafted"] > 0
    with pytest.raises(ValueError, match="two draft lengths"):
        measure_transformers_costs(draft, target, lengths=(4,))


def test_each_runtime_names_a_packaged_draft_as_it_loads_it(tmp_path):
    """The printed settings name the draft a runtime can load: llama.cpp the joined GGUF file, vLLM the Hugging Face
    folder the model was converted to, transformers the packaged name; a draft given on the command line wins."""
    (tmp_path / "config.json").write_text(json.dumps({"resolved": {"models": {
        "draft": "packaged:qwen2.5-coder-0.5b-instruct", "cache_dir": "/models"}}}))
    cfg = RecommendConfig(data_dir=str(tmp_path))
    assert draft_name(cfg, "vllm") == "/models/qwen2.5-coder-0.5b-instruct"
    assert draft_name(cfg, "llamacpp").startswith("/models/") and draft_name(cfg, "llamacpp").endswith(".gguf")
    assert draft_name(cfg, "transformers") == "packaged:qwen2.5-coder-0.5b-instruct"
    assert draft_name(RecommendConfig(data_dir=str(tmp_path), draft="my/draft"), "vllm") == "my/draft"
