"""Per-request stopping for a batched draft loop: what vLLM's draft proposer asks after each drafted token.

vLLM drafts for every running request at once, one draft forward per position ([B, V] logits a step), and verifies
each request's proposal in the next target step. :class:`RequestStopper` keeps, per request id, its own copy of a
specstop stop policy and its round in progress (``decoding.draft_steps``), so that each request's drafting stops when
*its* policy says so:

- :meth:`RequestStopper.begin_round` at the start of a proposal: requests new to the batch get a fresh policy copy,
  finished ones are dropped, and the others hear how many of their last proposal the target accepted
  (``RoundFeedback``); each request's cap is the step's ``num_speculative_tokens`` within the policy's own cap, 0
  where a cost-aware (goodput) policy's round cannot pay at the batch's verification curve;
- :meth:`RequestStopper.step` with the draft's [B, V] logits of one position: the greedy tokens, and whether every
  request has stopped (the proposer then ends the draft loop: no draft forward runs for nobody);
- :meth:`RequestStopper.proposals`: per request, the tokens to verify (lists of different lengths).

A request that has stopped still rides the batch's draft forwards while another drafts (its rows are computed and
ignored): the loop is vLLM's, for the whole batch. A cost-aware policy prices rounds with the curve measured at the
batch size nearest above the running one (``python -m pipelines.measure_costs --runtime vllm``).

This module needs no vLLM (its tests run on plain tensors); ``runtimes.vllm.proposer`` plugs it into vLLM.

Usage::

    stopper = RequestStopper(build_policy("adaedl:0.6"), curves=None)
    stopper.begin_round(["req-0", "req-1"], rejected=None, num_speculative_tokens=5)
    tokens, all_stopped = stopper.step(logits)      # logits: [2, V]
    stopper.proposals()                              # e.g. [[17, 4], [9]]
"""
from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from compute.timing import CostModel
from decoding.draft_steps import DraftedRound, check_policy, draft_step, verified_count
from predictors import goodput
from predictors.base import GOODPUT, RoundFeedback, StopPolicy

__all__ = ["RequestStopper", "StopperCounts", "curve_for_batch"]


def curve_for_batch(curves: dict[int, CostModel], batch: int) -> CostModel:
    """The curve measured at the smallest batch size >= ``batch`` (the largest measured one beyond them)."""
    sizes = sorted(curves)
    return curves[next((b for b in sizes if b >= batch), sizes[-1])]


@dataclass
class StopperCounts:
    """What the stopper decided over its life (summed over requests and rounds); ``rounds``, ``drafted``, ``verified``
    and ``accepted`` are the words of ``predictors.counts.RoundCounts`` (not a subclass: vLLM, not the stopper, knows
    the tokens emitted)."""

    rounds: int = 0
    """Proposals made (one per request per target step with drafting)."""
    drafted: int = 0
    """Tokens drafted by the policies' choice."""
    verified: int = 0
    """Tokens sent to verification."""
    accepted: int = 0
    """Sent tokens the target accepted (as far as heard back)."""
    draft_steps: int = 0
    """Draft positions computed for the batch (one draft forward each after the first)."""
    idle_rows: int = 0
    """Rows of those steps that belonged to a request that had already stopped (the batch's cost of a stop)."""
    decide_s: float = 0.0
    """Seconds computing features and decisions."""
    per_request: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> the number of tokens sent in each of its rounds."""
    steps: list[tuple[int, int, float]] = field(default_factory=list)
    """Per proposal of the batch: (requests, draft positions computed, mean tokens a request verifies next: verified +
    1), what a curve prices (``runtimes.vllm.check``)."""


class RequestStopper:
    """Per-request stop decisions over a batched draft loop (see the module docstring).

    Args:
        policy: the stop policy; each request drafts with its own deep copy.
        curves: batch size -> the runtime's verification curve (goodput policies need it; others ignore it).
        max_draft_len: cap on one round's drafts (vLLM's ``num_speculative_tokens`` caps it too).
        top_k: top-k draft probabilities in the features (the predictors' training data's).
    """

    def __init__(self, policy: StopPolicy, curves: dict[int, CostModel] | None = None, *, max_draft_len: int = 16,
                 top_k: int = 10) -> None:
        check_policy(policy, "vLLM")
        if policy.verification == GOODPUT and not curves:
            raise ValueError(f"policy {policy.kind} prices rounds with a verification curve: measure vLLM's with "
                             "python -m pipelines.measure_costs --runtime vllm --data_dir DIR")
        policy.use_mode("greedy")
        self.policy, self.curves = policy, dict(curves or {})
        self.max_draft_len, self.top_k = int(max_draft_len), int(top_k)
        self.counts = StopperCounts()
        self._costs: dict[int, goodput.RoundCost] = {}
        self._policies: dict[str, StopPolicy] = {}
        self._sent: dict[str, tuple[int, list[float]]] = {}
        self._ids: list[str] = []
        self._rounds: list[DraftedRound] = []
        self._caps: list[int] = []
        self._cost: goodput.RoundCost | None = None
        self._positions = 0

    def _round_cost(self, batch: int) -> goodput.RoundCost | None:
        if self.policy.verification != GOODPUT:
            return None
        if batch not in self._costs:
            self._costs[batch] = goodput.RoundCost.from_cost_model(curve_for_batch(self.curves, batch))
        return self._costs[batch]

    def begin_round(self, req_ids: Sequence[str], rejected: Sequence[int] | None, num_speculative_tokens: int) -> None:
        """A proposal for ``req_ids`` (the batch's rows, in order): feedback of the previous proposal
        (``rejected[i]``: how many of request i's verified drafts the target rejected; None when the last target
        step verified no drafts), fresh policies for new requests, each request's cap for this round."""
        ids = list(req_ids)
        for gone in set(self._policies) - set(ids):
            del self._policies[gone]
            self._sent.pop(gone, None)
        self._cost = self._round_cost(len(ids))
        self._ids, self._rounds, self._caps, self._positions = ids, [], [], 0
        for i, rid in enumerate(ids):
            pol = self._policies.get(rid)
            if pol is None:
                pol = self._policies[rid] = copy.deepcopy(self.policy)
                pol.reset()
            elif rid in self._sent:
                n, qs = self._sent.pop(rid)
                acc = max(0, n - int(rejected[i])) if rejected is not None and n else 0
                self.counts.accepted += acc
                pol.update(RoundFeedback.leading(n, acc, qs))
            cap = pol.round_cap(self.max_draft_len, int(num_speculative_tokens))
            if self._cost is not None and not goodput.can_pay(self._cost, cap, pol.acceptance_ceiling):
                cap = 0
            self._caps.append(cap)
            self._rounds.append(DraftedRound(done=cap == 0))

    def step(self, logits: Tensor) -> tuple[Tensor, bool]:
        """One drafted position: [B, V] draft ``logits`` -> ([B] greedy tokens, whether every request has stopped).
        The token of a stopped request is its argmax too (computed, never sent)."""
        t0 = time.perf_counter()
        tokens = logits.argmax(dim=-1)
        self.counts.draft_steps += 1
        self._positions += 1
        for i, (rnd, cap) in enumerate(zip(self._rounds, self._caps)):
            if rnd.done:
                self.counts.idle_rows += 1
                continue
            more = draft_step(logits[i:i + 1], self._policies[self._ids[i]], rnd, self.top_k, cap, self._cost,
                              token=int(tokens[i]))
            rnd.steps += 1
            rnd.done = not more or len(rnd.tokens) >= cap
        self.counts.decide_s += time.perf_counter() - t0
        return tokens, all(r.done for r in self._rounds)

    def all_stopped(self) -> bool:
        """Whether no request drafts in this round (before any step: every cap was 0)."""
        return all(r.done for r in self._rounds)

    def proposals(self) -> list[list[int]]:
        """Per request, the drafted tokens to verify (a prefix of its round, as its policy says)."""
        out: list[list[int]] = []
        for rid, rnd in zip(self._ids, self._rounds):
            n = verified_count(rnd, self._policies[rid], self._cost) if rnd.tokens else 0
            self._sent[rid] = (n, rnd.q[:n])
            self.counts.rounds += 1
            self.counts.drafted += len(rnd.tokens)
            self.counts.verified += n
            self.counts.per_request.setdefault(rid, []).append(n)
            out.append(rnd.tokens[:n])
        if out:
            self.counts.steps.append((len(out), self._positions, sum(len(o) + 1 for o in out) / len(out)))
        return out
