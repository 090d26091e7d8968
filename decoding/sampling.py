"""Token choice at one temperature and nucleus mass: the sampling distribution, the argmax or a draw per row, on the
draft's side (drafted tokens) and the target's (corrections, bonus tokens) alike."""
from __future__ import annotations

import torch
from torch import Tensor

from compute.draft_stats import sample_tokens
from data_gen.features import probs_from_logits

__all__ = ["TokenSampler", "draw"]


def draw(probs: Tensor, gen: torch.Generator | None) -> Tensor:
    """[B, V] probabilities -> [B] one draw per row. On a CPU by the native inversion sampler on their logs
    (``compute.draft_stats.sample_tokens``: one uniform per row against block sums accumulated in double, zero
    probabilities never drawn), much faster than ``torch.multinomial`` over a large vocabulary. Elsewhere, or without
    the native build, ``torch.multinomial``."""
    tok = sample_tokens(probs.log(), 1.0, gen) if probs.device.type == "cpu" else None
    return tok if tok is not None else torch.multinomial(probs, 1, generator=gen).squeeze(-1)


class TokenSampler:
    """Greedy (``temperature == 0``) or sampling choice of tokens from logits."""

    def __init__(self, temperature: float, top_p: float) -> None:
        self.temperature, self.top_p = temperature, top_p

    def probs(self, logits: Tensor) -> Tensor:
        """The sampling distribution (temperature, then top-p) of [..., V] logits."""
        return probs_from_logits(logits, self.temperature, self.top_p)

    def pick(self, logits: Tensor, gen: torch.Generator | None) -> Tensor:
        """[B, V] logits -> [B] token: argmax (greedy) or a draw from the sampling distribution (without top-p, straight
        from the logits by the native inversion sampler, whose softmax equals ``probs``' to float rounding)."""
        if self.temperature == 0:
            return logits.argmax(-1)
        if self.top_p >= 1.0:
            tok = sample_tokens(logits, self.temperature, gen)
            if tok is not None:
                return tok
        return draw(self.probs(logits), gen)

    def pick_row(self, logits: Tensor, gen: torch.Generator | None) -> int:
        """[V] logits -> one token (``pick`` on a batch of one)."""
        return int(self.pick(logits.unsqueeze(0), gen)[0])

    @staticmethod
    def sample(probs: Tensor, gen: torch.Generator | None) -> int:
        """[V] probabilities -> one sampled token id."""
        return int(draw(probs.unsqueeze(0), gen)[0])
