"""A step that drafts nothing skips the draft's forward; the draft reads the skipped tokens when drafting resumes.

vLLM's draft-model proposer runs the draft each step over the tokens the target verified in it (its first forward),
which keeps the draft's KV cache in step with the target's, even in a step that drafts nothing (vLLM's own K = 0 pays
it too). :class:`CatchUp` lets specstop's proposer skip that forward: it remembers, per request, the verified tokens of
the skipped steps (their positions run on without a gap) and, when the proposer next runs the draft, puts them in
front of each request's tokens of that step, so that one forward writes them all into the draft's cache, as
specstop's own engine catches its draft up. The draft's cache slots come from the positions (vLLM recomputes the
slot mapping from the block table), so only the query boundaries change. A request whose next tokens do not follow
its remembered ones (preempted and recomputed) drops them: its draft then reads what it has, which costs acceptance,
never exactness (the target verifies every token).

This module needs no vLLM (its tests run on plain tensors); ``runtimes.vllm.proposer`` plugs it in.

Usage::

    catch = CatchUp(max_tokens=8192)
    catch.skipped(["a", "b"], tokens, positions, query_starts=[0, 1, 2], rejected=None)   # a step without drafts
    ids, pos, starts = catch.extend(["a", "b"], tokens, positions, query_starts=[0, 1, 2])  # the next drafted step
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["CatchUp"]


class CatchUp:
    """Per request, the verified tokens of skipped steps, read by the draft in its next forward."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = int(max_tokens)
        """The most tokens one draft forward may hold (vLLM's input buffers): a longer catch-up is dropped."""
        self._pending: dict[str, tuple[Tensor, Tensor]] = {}
        self.skipped_steps = 0
        self.caught_up_tokens = 0
        self.dropped_tokens = 0

    def pending(self, request_id: str) -> int:
        """How many tokens ``request_id``'s draft has not read yet."""
        got = self._pending.get(request_id)
        return 0 if got is None else int(got[0].numel())

    def skipped(self, req_ids: Sequence[str], tokens: Tensor, positions: Tensor, query_starts: Sequence[int],
                rejected: Sequence[int] | None) -> None:
        """A step whose draft forward did not run: remember each request's verified tokens of it (its query less the
        drafts the target rejected) and forget the requests that left the batch."""
        self._forget(req_ids)
        self.skipped_steps += 1
        for i, rid in enumerate(req_ids):
            end = query_starts[i + 1] - (int(rejected[i]) if rejected is not None else 0)
            self._append(rid, tokens[query_starts[i]:end], positions[query_starts[i]:end])

    def extend(self, req_ids: Sequence[str], tokens: Tensor, positions: Tensor, query_starts: Sequence[int],
               ) -> tuple[Tensor, Tensor, list[int]] | None:
        """The step's draft inputs with each request's remembered tokens in front: (tokens, positions, query
        starts); None when no request has any (the inputs stand as they are)."""
        self._forget(req_ids)
        if not self._pending:
            return None
        parts_t, parts_p, starts = [], [], [0]
        for i, rid in enumerate(req_ids):
            seg = slice(query_starts[i], query_starts[i + 1])
            got = self._pending.pop(rid, None)
            if got is not None and got[1].numel() and int(got[1][-1]) + 1 == int(positions[seg][0]):
                parts_t.append(got[0])
                parts_p.append(got[1])
            elif got is not None:
                self.dropped_tokens += int(got[0].numel())
                got = None
            parts_t.append(tokens[seg])
            parts_p.append(positions[seg])
            starts.append(starts[-1] + (0 if got is None else int(got[0].numel())) + seg.stop - seg.start)
        if starts[-1] > self.max_tokens:
            self.dropped_tokens += starts[-1] - query_starts[len(req_ids)]
            return None
        self.caught_up_tokens += starts[-1] - query_starts[len(req_ids)]
        return torch.cat(parts_t), torch.cat(parts_p), starts

    def _append(self, rid: str, tokens: Tensor, positions: Tensor) -> None:
        old = self._pending.get(rid)
        if old is not None and old[1].numel() and positions.numel() and int(old[1][-1]) + 1 != int(positions[0]):
            self.dropped_tokens += int(old[0].numel())
            old = None
        self._pending[rid] = ((tokens.clone(), positions.clone()) if old is None
                              else (torch.cat([old[0], tokens]), torch.cat([old[1], positions])))

    def _forget(self, req_ids: Sequence[str]) -> None:
        for gone in set(self._pending) - set(req_ids):
            del self._pending[gone]
