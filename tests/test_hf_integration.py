"""A stop policy inside transformers' assisted generation: exact greedy output, and the policy drives draft lengths."""
from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import Tensor

from decoding.policies import build_policy
from predictors.base import StopPolicy
from predictors.round_rules import GOODPUT
from runtimes.transformers.assisted import generate_with_policy
from tests.tiny_pairs import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


PROMPT = torch.tensor([[67, 68, 69, 220, 69, 78, 78, 7, 87, 8, 25]])


@pytest.fixture(scope="module")
def pair():
    """Untied tiny Qwen2 draft and a perturbed copy as target (tests/tiny_pairs.py)."""
    return make_pair()


@pytest.mark.parametrize("spec", ["static:3", "svip:0.3", "heuristic", "max_confidence", "disco"])
def test_greedy_output_equals_target_only(pair, spec):
    draft, target = pair
    if spec == "disco":
        from predictors.disco import DiscoNet, DiscoPolicy
        from predictors.inputs import FeatureSpec

        fs = FeatureSpec.for_disco(top_k=10)
        policy = DiscoPolicy(DiscoNet(fs.width, 16), fs, threshold=0.5, max_draft_len=8)
    else:
        policy = build_policy(spec)
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=256)
    out, stats = generate_with_policy(target, draft, PROMPT, policy, do_sample=False, max_new_tokens=24,
                                      pad_token_id=256)
    assert out.tolist() == ref.tolist()
    assert sum(stats.drafted_lengths) > 0
    assert not hasattr(target, "_get_candidate_generator") or "_get_candidate_generator" not in vars(target)


def test_policy_changes_draft_lengths(pair):
    draft, target = pair
    _, st3 = generate_with_policy(target, draft, PROMPT, build_policy("static:3"), do_sample=False, max_new_tokens=24,
                                  pad_token_id=256)
    _, st1 = generate_with_policy(target, draft, PROMPT, build_policy("static:1"), do_sample=False, max_new_tokens=24,
                                  pad_token_id=256)
    assert max(st3.drafted_lengths) == 3 and max(st1.drafted_lengths) == 1

    class StopAtSecond(StopPolicy):
        """Stops after the token at window position 1: exactly two draft tokens per round."""

        kind = "stop_at_second"

        def score(self, features: Mapping[str, Tensor]) -> Tensor:
            return (features["position"] < 1).float()

    _, st = generate_with_policy(target, draft, PROMPT, StopAtSecond(threshold=0.5, max_draft_len=10),
                                 do_sample=False, max_new_tokens=24, pad_token_id=256)
    assert set(st.drafted_lengths[:-1]) <= {2} and st.drafted_lengths[0] == 2


def test_refuses_policies_it_cannot_run(pair):
    draft, target = pair

    class NeedsCompanion(StopPolicy):
        kind = "sv"
        round_rule = GOODPUT
        required_columns = ("companion_accept",)

    with pytest.raises(ValueError, match="SpeculativeDecoder"):
        generate_with_policy(target, draft, PROMPT, NeedsCompanion(), max_new_tokens=4)
    with pytest.raises(ValueError, match="SpeculativeDecoder"):
        generate_with_policy(target, draft, PROMPT, build_policy("oracle"), max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size 1"):
        generate_with_policy(target, draft, PROMPT.repeat(2, 1), build_policy("static:2"), max_new_tokens=4)


def test_goodput_policy_in_assisted_generation(pair):
    """A cost-aware policy drives transformers' drafting through the goodput rule and verifies its best prefix only;
    the output stays the target's greedy one; without a cost model it is refused."""
    from compute.timing import CostModel
    from predictors.baselines import MaxConfidence
    from predictors.calibration import Calibrator
    from predictors.goodput import GoodputPolicy

    draft, target = pair
    cal = {"greedy": Calibrator("isotonic", [0.0, 0.05, 0.2, 1.0], [0.05, 0.5, 0.9, 0.99])}
    policy = GoodputPolicy(MaxConfidence(0.4, max_draft_len=8), cal, "test")
    with pytest.raises(ValueError, match="cost_model"):
        generate_with_policy(target, draft, PROMPT, policy, max_new_tokens=4)
    ref = target.generate(PROMPT, do_sample=False, max_new_tokens=24, pad_token_id=256)
    for curve in ({1: 1.0, 4: 1.0, 5: 2.0, 9: 4.0}, {1: 1.0, 2: 5.0, 3: 9.0}):  # the second: verify nothing
        cm = CostModel(draft_s_per_token=0.05, target_s=curve)
        out, stats = generate_with_policy(target, draft, PROMPT, policy, cost_model=cm, do_sample=False,
                                          max_new_tokens=24, pad_token_id=256)
        assert out.tolist() == ref.tolist()
        assert max(stats.drafted_lengths) <= 8
