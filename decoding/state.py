"""The state of one ``SpeculativeDecoder.generate`` call: what outlives a round (``Decoding``: caches, pending
tokens, outputs, limits, statistics) and what one round drafted (``BatchRound``); ``Decoding.settle`` books a
verified round into both (statistics, cache holes, limits)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from decoding.stats import DecodeStats
from decoding.streams import Stream

__all__ = ["Decoding", "BatchRound"]


@dataclass
class Decoding:
    """The state of one ``generate`` call that outlives a round (B sequences)."""

    tgt: Stream
    drf: Stream
    cmp: Stream | None
    t_pending: list[list[int]]
    """[B][n] tokens the target has not processed yet (the last emitted ones)."""
    d_pending: list[list[int]]
    """[B][n] the same for the draft (and companion)."""
    outputs: list[list[int]]
    """[B][emitted] new tokens per sequence."""
    done: list[bool]
    """[B] finished (eos or max_new_tokens)."""
    eos: set[int]
    max_new_tokens: int
    gen: torch.Generator | None
    stats: DecodeStats
    device: torch.device
    reference: list[list[int]] | None = None
    """[B][N] target-only greedy output (the oracle's look-ahead without target steps), or None."""
    peek: bool = False
    """The oracle runs the target one step per drafted token (no reference given)."""
    prompt_pending: list[bool] = field(default_factory=list)
    """[B] the target has not read sequence b's prompt yet: its first verification pass reads it."""

    @property
    def batch(self) -> int:
        return len(self.done)

    def streams(self) -> list[Stream]:
        return [s for s in (self.tgt, self.drf, self.cmp) if s is not None]

    def reference_match(self, rnd: BatchRound, tok: Tensor) -> Tensor:
        """[B] the drafted token equals the target-only output at its position (False past its end)."""
        assert self.reference is not None
        match = []
        for b, t in enumerate(tok.tolist()):
            pos = len(self.outputs[b]) + len(rnd.drafted[b])
            match.append(pos < len(self.reference[b]) and self.reference[b][pos] == t)
        return torch.tensor(match, device=tok.device)

    def settle(self, rnd: BatchRound, b: int, emitted: list[int], n_acc: int) -> None:
        """Sequence b after verification: statistics, caches keep pending + accepted tokens, limits."""
        n_drafted = len(rnd.drafted[b])
        stats = self.stats
        stats.target_calls += 1  # one verification per sequence-round
        stats.rounds += 1
        stats.drafted += n_drafted
        stats.accepted += n_acc
        stats.wasted += n_drafted - n_acc
        stats.accepted_lengths.append(n_acc)
        stats.drafted_lengths.append(n_drafted)
        self.tgt.discard(b, rnd.t_idx[b][len(self.t_pending[b]) + n_acc :])  # pending (the prompt at first) + accepted
        self.t_pending[b] = emitted[n_acc:]
        self.prompt_pending[b] = False
        if n_drafted:
            fed = n_drafted - 1  # the draft never fed its last drafted token
            keep_n = min(n_acc, fed)
            n_old = len(rnd.d_idx[b]) - fed
            for s in (self.drf, self.cmp):
                if s is not None:
                    s.discard(b, rnd.d_idx[b][n_old + keep_n :])
            self.d_pending[b] = emitted[keep_n:]
        else:
            self.d_pending[b] = self.d_pending[b] + emitted
        self._emit(b, emitted)

    def _emit(self, b: int, emitted: list[int]) -> None:
        """Append sequence b's emitted tokens up to its first eos and its token limit; mark it done there."""
        for j, t in enumerate(emitted):
            if t in self.eos:
                emitted = emitted[: j + 1]
                self.done[b] = True
                break
        emitted = emitted[: self.max_new_tokens - len(self.outputs[b])]
        self.outputs[b] += emitted
        if len(self.outputs[b]) >= self.max_new_tokens:
            self.done[b] = True


@dataclass
class BatchRound:
    """What one round of the engine drafted, per sequence b of the batch (a runtime hook's round of one request is
    ``decoding.draft_steps.RequestRound``) (lists of length B; n_b drafted tokens for sequence b)."""

    caps: list[int]
    """[B] most tokens sequence b may draft this round."""
    active: list[bool]
    """[B] sequence b is still drafting."""
    drafted: list[list[int]]
    """[B][n_b] drafted token ids."""
    q_rows: list[list[Tensor]]
    """[B][n_b] of [V]: sampling distribution of each drafted token (sampling only)."""
    q_x: list[list[float]]
    """[B][n_b] q(x) of each drafted token (policy feedback)."""
    scores: list[list[float]]
    """[B][n_b] the scores the round rule keeps (``RoundRule.decide``): a goodput policy's calibrated acceptance, a
    prefix rule's scores; empty for the other rules."""
    peek_logits: list[list[Tensor]]
    """[B][n_b] of [V]: analysis only, the target's logits at each drafted token."""
    t_idx: list[list[int]]
    """[B] target cache index of the pending + drafted tokens fed this round."""
    d_idx: list[list[int]]
    """[B] draft (and companion) cache index of the tokens fed this round."""

    @classmethod
    def start(cls, caps: list[int]) -> BatchRound:
        def empty() -> list:
            return [[] for _ in caps]

        return cls(caps, [c > 0 for c in caps], empty(), empty(), empty(), empty(), empty(), empty(), empty())

    def feed(self, pending: list[list[int]], step: int) -> list[list[int]]:
        """[B] tokens each active sequence feeds at this draft step: its pending tokens first, then its last draft."""
        return [(pending[b] if step == 0 else [self.drafted[b][-1]]) if self.active[b] else []
                for b in range(len(self.caps))]
