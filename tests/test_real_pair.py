"""The generator on the real Qwen2.5-Coder pair (opt in: pytest --real -m real; needs scripts/setup.sh --real)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def real_pair():
    from compute.models import ModelSpec, load_model

    draft, tok = load_model(ModelSpec("packaged:qwen2.5-coder-0.5b-instruct"))
    target, _ = load_model(ModelSpec("packaged:qwen2.5-coder-1.5b-instruct"))
    return draft, target, tok


def test_real_labels_match_step_by_step_verification(real_pair):
    from data_gen.continuations import continue_batch
    from data_gen.labelling import LabelModels, LabelOptions, Segment, SequenceSpec, label_sequences
    from data_gen.prompts import PromptSourceConfig, load_prompts, render_prompt

    draft, target, tok = real_pair
    prompts, _ = load_prompts([PromptSourceConfig("humaneval", limit=3)])
    rendered = [render_prompt(p, tok, True, 200)[0] for p in prompts]
    conts, _ = continue_batch(draft, rendered, [16] * 3, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    seqs = [SequenceSpec(p.id, p.source, p.domain, "test", p.id, r + c,
                         [Segment(len(r), len(r) + len(c), "prompt", True)])
            for p, r, c in zip(prompts, rendered, conts)]
    recs, _ = label_sequences(LabelModels(draft, target), seqs, LabelOptions(pad_token_id=tok.pad_token_id))
    rate = float(np.mean(recs["accept_prob"]))
    assert 0.2 < rate < 0.99, rate
    # Step-by-step greedy verification of the first sequence: target argmax at every prefix.
    s = seqs[0]
    n = s.segments[0].end - s.segments[0].start
    with torch.no_grad():
        for i, j in enumerate(range(s.segments[0].start, s.segments[0].end)):
            arg = int(target(torch.tensor([s.tokens[:j]])).logits[0, -1].argmax())
            assert recs["greedy_match"][i] == (arg == s.tokens[j])
            assert recs["target_argmax"][i] == arg
    assert n > 0
