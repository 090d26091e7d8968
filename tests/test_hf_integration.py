"""A stop policy inside transformers' assisted generation: exact greedy output, and the policy drives draft lengths."""
from __future__ import annotations

import copy
from collections.abc import Mapping

import pytest
import torch
from torch import Tensor
from transformers import Qwen2Config, Qwen2ForCausalLM

from decoding.hf_integration import generate_with_policy
from decoding.policies import build_policy
from predictors.base import StopPolicy


pytestmark = pytest.mark.usefixtures("one_thread")


PROMPT = torch.tensor([[67, 68, 69, 220, 69, 78, 78, 7, 87, 8, 25]])


@pytest.fixture(scope="module")
def pair():
    """Untied tiny Qwen2 draft and a perturbed copy as target (as in test_engine.py)."""
    cfg = Qwen2Config(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
                      eos_token_id=257, pad_token_id=256)
    torch.manual_seed(0)
    draft = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        draft.lm_head.weight.mul_(8.0)
    target = copy.deepcopy(draft)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.5 * p.std() * torch.randn_like(p))
    return draft, target


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
    assert sum(stats["draft_lengths"]) > 0
    assert not hasattr(target, "_get_candidate_generator") or "_get_candidate_generator" not in vars(target)


def test_policy_changes_draft_lengths(pair):
    draft, target = pair
    _, st3 = generate_with_policy(target, draft, PROMPT, build_policy("static:3"), do_sample=False, max_new_tokens=24,
                                  pad_token_id=256)
    _, st1 = generate_with_policy(target, draft, PROMPT, build_policy("static:1"), do_sample=False, max_new_tokens=24,
                                  pad_token_id=256)
    assert max(st3["draft_lengths"]) == 3 and max(st1["draft_lengths"]) == 1

    class StopAtSecond(StopPolicy):
        """Stops after the token at window position 1: exactly two draft tokens per round."""

        kind = "stop_at_second"

        def score(self, features: Mapping[str, Tensor]) -> Tensor:
            return (features["position"] < 1).float()

    _, st = generate_with_policy(target, draft, PROMPT, StopAtSecond(threshold=0.5, max_draft_len=10),
                                 do_sample=False, max_new_tokens=24, pad_token_id=256)
    assert set(st["draft_lengths"][:-1]) <= {2} and st["draft_lengths"][0] == 2


def test_refuses_policies_it_cannot_run(pair):
    draft, target = pair

    class NeedsCompanion(StopPolicy):
        kind = "sv"
        required_columns = ("companion_accept",)

    with pytest.raises(ValueError, match="SpeculativeDecoder"):
        generate_with_policy(target, draft, PROMPT, NeedsCompanion(), max_new_tokens=4)
    with pytest.raises(ValueError, match="SpeculativeDecoder"):
        generate_with_policy(target, draft, PROMPT, build_policy("oracle"), max_new_tokens=4)
    with pytest.raises(ValueError, match="batch size 1"):
        generate_with_policy(target, draft, PROMPT.repeat(2, 1), build_policy("static:2"), max_new_tokens=4)
