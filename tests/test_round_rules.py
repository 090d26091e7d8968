"""The round rules (``predictors.round_rules``) as the policies supply them, and the one registry of policy names."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding.policies import build_policy
from predictors.policy_names import POLICIES, policy_kinds
from predictors.round_rules import GOODPUT, HINDSIGHT, PREFIX, SEQUENTIAL, THRESHOLD, PrefixRule, rule_named
from predictors.sprinter import SprinterPolicy


def test_each_policy_supplies_its_rule_and_the_rule_answers_the_callers_questions() -> None:
    assert build_policy("svip:0.3").round_rule is THRESHOLD and THRESHOLD.exact and THRESHOLD.sends_all
    assert build_policy("oracle").round_rule.hindsight and not HINDSIGHT.runs_in_hook
    assert build_policy("llamacpp:4,2,0.5").round_rule == PrefixRule(minimum=2) and PREFIX.drops_candidate
    assert SprinterPolicy.round_rule is SEQUENTIAL and SEQUENTIAL.sequential and not SEQUENTIAL.runs_in_hook
    assert GOODPUT.needs_cost_model and GOODPUT.cost_aware and not GOODPUT.sends_all
    assert [r.name for r in (THRESHOLD, SEQUENTIAL, GOODPUT, PREFIX, HINDSIGHT)] == \
        ["threshold", "sequential", "goodput", "prefix", "hindsight"]


def test_a_stored_rows_verification_names_its_rule() -> None:
    assert rule_named("sequential") is SEQUENTIAL and rule_named(None) is THRESHOLD and rule_named("") is THRESHOLD
    with pytest.raises(ValueError, match="threshold, sequential, goodput, hindsight, prefix"):
        rule_named("exactish")


def test_threshold_and_prefix_rules_decide_as_the_engine_does() -> None:
    pol = build_policy("llamacpp:4,0,0.5")
    top = torch.tensor([[0.9] + [0.01] * 9, [0.3] + [0.07] * 9])
    keep, scores = pol.round_rule.decide(pol, {"draft_topk": top}, [[], []], [4, 4], [True, True], None)
    assert keep == [True, False] and scores == pytest.approx([0.9 / 0.99, 0.3 / 0.93])
    assert pol.round_rule.sent(pol, [0.9, 0.8, 0.2], 3, None) == 2
    svip = build_policy("svip:0.3")
    assert svip.round_rule.replay_round(svip, np.array([0.9, 0.8, 0.6, 0.9]), dict, None) == (3, 3)


def test_one_registry_builds_every_named_policy_and_names_them_on_a_miss() -> None:
    for name, entry in POLICIES.items():
        assert isinstance(build_policy(name), entry.cls)
    assert set(policy_kinds()) == {"static", "heuristic", "max_confidence", "draft_prob", "svip", "adaedl", "oracle"}
    with pytest.raises(ValueError) as err:
        build_policy("nope")
    assert "\n" not in str(err.value) and "svip[:value]" in str(err.value) and "llamacpp[:values]" in str(err.value)
