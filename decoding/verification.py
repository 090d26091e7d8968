"""The target's side of a round: one forward pass over every live sequence's window, then exact verification per
sequence (greedy match, or min(1, p/q) with a correction drawn from norm(max(0, p - q)) and a bonus token), or the
approximate sequential verification of a ``SEQUENTIAL`` policy (SPRINTER: the drafts before the last are taken
unverified, only the last one is checked). The policy hears each outcome (``policy.update``) and the decoding state
books it (``Decoding.settle``)."""
from __future__ import annotations

import torch
from torch import Tensor

from compute.timing import clock
from decoding.sampling import TokenSampler
from decoding.state import BatchRound, Decoding
from predictors.base import RoundFeedback, StopPolicy

__all__ = ["Verifier"]


class Verifier:
    """Verifies drafted windows for one decoder (its sampler, its policy, exact or sequential verification)."""

    def __init__(self, sampler: TokenSampler, policy: StopPolicy, sequential: bool) -> None:
        self.sampler, self.policy, self.sequential = sampler, policy, sequential

    def verify_round(self, st: Decoding, rnd: BatchRound, n_sent: list[int]) -> None:
        """One target forward pass over every live sequence's window, then per-sequence verification and bookkeeping."""
        live = [b for b in range(st.batch) if not st.done[b]]
        if st.peek:  # the target has seen every drafted token but the last
            t_feed = [[d[-1]] if d else list(p) for d, p in zip(rnd.drafted, st.t_pending)]
        else:
            t_feed = [st.t_pending[b] + rnd.drafted[b][: n_sent[b]] for b in range(st.batch)]
        t_feed = [t_feed[b] if not st.done[b] else [] for b in range(st.batch)]
        keep = 1 if st.peek else max(n_sent[b] + 1 for b in live)  # the positions that score drafts or the bonus
        prompt = [b for b in live if st.prompt_pending[b] and not st.peek]
        t0 = clock(st.device)
        tl, _, tidx = st.tgt.forward(t_feed, left_pad=True, keep_logits=keep)  # [B, keep, V], windows right-aligned
        if prompt:  # the prompts' pass: the target's prefill, which verified the first drafts too
            st.stats.prefill_time += clock(st.device) - t0
        else:
            st.stats.target_time += clock(st.device) - t0
        for b in range(st.batch):
            rnd.t_idx[b] += tidx[b]
        for b in live:
            k = n_sent[b]
            if st.peek:
                logit_rows = rnd.peek_logits[b][:k] + [tl[b, -1]]
            else:
                logit_rows = [tl[b, keep - k - 1 + j] for j in range(k + 1)]
            emitted, n_acc, flags = self.verify(rnd.drafted[b][:k], rnd.q_rows[b][:k], logit_rows, st.gen)
            st.stats.sent += k
            st.stats.sent_lengths.append(k)
            if b in prompt:
                st.stats.prompt_passes += 1
                st.stats.prompt_pass_lengths.append(k)
            self.policy.update(RoundFeedback(n_drafted=k, n_accepted=n_acc, draft_probs=rnd.q_x[b][:k], accepted=flags))
            st.settle(rnd, b, emitted, n_acc)

    def verify(
        self, drafted: list[int], q_rows: list[Tensor], logit_rows: list[Tensor], gen: torch.Generator | None
    ) -> tuple[list[int], int, list[bool]]:
        """Verify one sequence's window. logit_rows[j] scores drafted[j]; logit_rows[k] scores the bonus position.

        Returns (emitted tokens, accepted draft tokens, per-token accepted flags).
        """
        k = len(drafted)
        flags: list[bool] = []
        if self.sequential and k > 0:
            # SPRINTER: tokens before the last are taken unverified; only the last is checked.
            flags = [True] * (k - 1)
            last_ok, corr = self.check(drafted[-1], q_rows[-1] if q_rows else None, logit_rows[k - 1], gen)
            if last_ok:
                return drafted + [self.sampler.pick_row(logit_rows[k], gen)], k, flags + [True]
            return drafted[:-1] + [corr], k - 1, flags + [False]
        for j in range(k):
            ok, corr = self.check(drafted[j], q_rows[j] if q_rows else None, logit_rows[j], gen)
            flags.append(ok)
            if not ok:
                return drafted[:j] + [corr], j, flags + [False] * (k - j - 1)
        return drafted + [self.sampler.pick_row(logit_rows[k], gen)], k, flags

    def check(self, x: int, q: Tensor | None, logits: Tensor, gen: torch.Generator | None) -> tuple[bool, int]:
        """Exact check of one draft token: (accepted, correction token if rejected)."""
        if self.sampler.temperature == 0:
            a = int(logits.argmax())
            return a == x, a
        p = self.sampler.probs(logits)
        u = float(torch.rand((), generator=gen, device=p.device))
        if u < float(p[x]) / max(float(q[x]), 1e-30):
            return True, -1
        resid = (p - q).clamp_min(0.0)
        if float(resid.sum()) <= 0:
            resid = p
        return False, self.sampler.sample(resid / resid.sum(), gen)
