"""A tiny draft and a perturbed copy as target, for engine tests: they agree often, not always."""
from __future__ import annotations

import copy

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


def make_pair(noise: float = 0.5, seed: int = 0, vocab: int = 260, hidden: int = 32):
    """Untied tiny Qwen2 draft and a perturbed copy as target: they agree often, not always (mixed accept / reject)."""
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=257, pad_token_id=256)
    torch.manual_seed(seed)
    draft = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        draft.lm_head.weight.mul_(8.0)
    target = copy.deepcopy(draft)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))
    return draft, target
