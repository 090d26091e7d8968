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
ignored): the loop is vLLM's, for the whole batch. So with vLLM's curve (``python -m pipelines.measure_costs
--runtime vllm``, at the batch size nearest above the running one) and a calibrated acceptance per drafted token,
the stopper decides for the batch (``predictors.batch_goodput``): after each position another draft forward runs
only while the requests still drafting promise more tokens/s than stopping now, a thresholded policy's own stop
choosing which requests those are and a goodput policy's calibrated acceptance both which and what each sends; the
draft's first forward, which vLLM runs whatever is drafted, is priced as paid, and the curve's draft forwards and
verifications at the factors the engine's own steps meet (``runtimes.vllm.met_costs``), each draft position's
calibrated acceptance corrected by vLLM's verdicts there so far. Without a curve or a
calibration (a static length, a policy with no map) each request stops by its own rule alone. With a
:class:`runtimes.vllm.traces.TraceWriter`, every sent token's features and whether vLLM accepted it are logged.

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
from decoding.draft_steps import (
    RequestRound,
    check_policy,
    draft_step,
    keep_token,
    sent_count,
    step_features,
    take_candidate,
)
from predictors import goodput
from predictors.base import RoundFeedback, StopPolicy
from predictors.batch_goodput import BatchCost, RecentShare, after_position, batch_keep_drafting, send_lengths
from predictors.calibration import Calibrator
from predictors.counts import RoundCounts
from runtimes.vllm.met_costs import MetCosts
from runtimes.vllm.traces import TraceWriter

__all__ = ["RequestStopper", "StopperCounts", "curve_for_batch", "PSEUDO_TOKENS"]

PSEUDO_TOKENS = 20.0
"""Judged tokens a position's correction starts from, as if vLLM had accepted them just as calibrated: the correction
moves as vLLM's verdicts outnumber them."""


def curve_for_batch(curves: dict[int, CostModel], batch: int) -> CostModel:
    """The curve measured at the smallest batch size >= ``batch`` (the largest measured one beyond them)."""
    sizes = sorted(curves)
    return curves[next((b for b in sizes if b >= batch), sizes[-1])]


@dataclass
class StopperCounts(RoundCounts):
    """What the stopper decided over its life, summed over requests and rounds (``predictors.counts.RoundCounts``):
    ``rounds`` are proposals (one per request per target step with drafting), ``drafted`` the policies' choice,
    ``sent`` went to verification, ``accepted`` as far as heard back; ``tokens`` stays 0 (vLLM counts them)."""

    draft_steps: int = 0
    """Draft positions computed for the batch (one draft forward each after the first)."""
    idle_rows: int = 0
    """Rows of those steps that belonged to a request that had already stopped (the batch's cost of a stop)."""
    decide_s: float = 0.0
    """Seconds computing features and decisions."""
    per_request: dict[str, list[int]] = field(default_factory=dict)
    """Request id -> the number of tokens sent in each of its rounds."""
    steps: list[tuple[int, int, float]] = field(default_factory=list)
    """Per proposal of the batch: (requests, draft forwards run: 0 where the step skipped the draft, at least 1
    otherwise, mean tokens a request verifies next: sent + 1), what a curve prices (``runtimes.vllm.check``)."""
    batch_stops: int = 0
    """Proposals whose draft loop the batch rule ended while some request's own rule would have drafted on."""
    skipped_steps: int = 0
    """Proposals the batch rule decided not to draft at all, before the draft's first forward (``skip_idle``)."""
    by_position: dict[int, list[float]] = field(default_factory=dict)
    """Draft position j (1-based) -> [tokens judged, their predicted acceptance summed, accepted]: a sent token is
    judged when every token before it was accepted, so the mean prediction of a position is the calibration's and the
    accepted share vLLM's acceptance there (batch-rule and goodput policies, whose acceptance is calibrated)."""


class RequestStopper:
    """Per-request stop decisions over a batched draft loop (see the module docstring).

    Args:
        policy: the stop policy; each request drafts with its own deep copy.
        curves: batch size -> the runtime's verification curve (goodput policies and the batch rule need it).
        max_draft_len: cap on one round's drafts (vLLM's ``num_speculative_tokens`` caps it too).
        top_k: top-k draft probabilities in the features (the predictors' training data's).
        acceptance: a thresholded policy's calibration map (raw score -> acceptance) for the batch rule.
        batch_rule: decide for the batch (``predictors.batch_goodput``) where curve and acceptance allow; a draft
            forward is priced at the curve's plus what scoring a position has cost here at that batch size (measured
            as it runs: the curve times vLLM's own proposer, which scores nothing).
        traces: where sent tokens' features and vLLM's verdicts are logged (None: not logged).
        draft_to_cap: every request drafts to its cap and sends it all (tracing: every position gets judged).
        skip_idle: a step in which no request drafts (every cap 0, ``static:0`` included) skips the draft's first
            forward (``runtimes.vllm.catch_up``); the batch rule then decides before it whether the step drafts at
            all, forecasting each request's acceptance by its recent rounds around ``prior``.
        prior: the acceptance a request's forecast starts from (vLLM's measured first-position acceptance, where the
            curve file holds it).
        follow: the batch rule prices the curve's draft forwards and verifications at the factors this engine's
            steps meet (:attr:`met`, measured as it runs), and corrects each draft position's calibrated acceptance
            by vLLM's verdicts there so far (:attr:`tally`); False: the curve and the calibration as measured.
    """

    def __init__(self, policy: StopPolicy, curves: dict[int, CostModel] | None = None, *, max_draft_len: int = 16,
                 top_k: int = 10, acceptance: Calibrator | None = None, batch_rule: bool = True,
                 traces: TraceWriter | None = None, draft_to_cap: bool = False, skip_idle: bool = False,
                 prior: float = 0.5, follow: bool = False) -> None:
        check_policy(policy, "vLLM")
        self.rule = policy.round_rule
        if self.rule.needs_cost_model and not curves:
            raise ValueError(f"policy {policy.kind} prices rounds with a verification curve: measure vLLM's with "
                             "python -m pipelines.measure_costs --runtime vllm --data_dir DIR")
        policy.use_mode("greedy")
        self.policy, self.curves = policy, dict(curves or {})
        self.max_draft_len, self.top_k = int(max_draft_len), int(top_k)
        self.counts = StopperCounts()
        self.acceptance, self.traces, self.draft_to_cap = acceptance, traces, draft_to_cap
        self.batch_rule = bool(batch_rule and not draft_to_cap and self.curves and not policy.fixed_length
                               and (self.rule.cost_aware or acceptance is not None))
        self.skip_idle, self.prior = bool(skip_idle), min(max(float(prior), 0.0), 1.0)
        self.follow, self.met = bool(follow and self.batch_rule), MetCosts()
        self.tally: dict[int, list[float]] = {}
        """Draft position -> [tokens judged, calibrated acceptance summed, accepted] over the tokens vLLM judged there,
        before the correction (what :meth:`_corrected` follows)."""
        self._calibrated: list[list[float]] = []
        self._t_begun, self._scoring = 0.0, 0.0
        self._last: tuple[int, float, frozenset[str], float] | None = None
        """The last proposal's (requests, mean tokens a request verifies, request ids, when it was sent)."""
        self._recent: dict[str, RecentShare] = {}
        self._batch_costs: dict[int, BatchCost] = {}
        self._batch: BatchCost | None = None
        self._own_s: dict[int, float] = {}
        self._acceptance: list[list[float]] = []
        self._feats: list[list[dict[str, float]]] = []
        self._costs: dict[int, goodput.RoundCost] = {}
        self._policies: dict[str, StopPolicy] = {}
        self._sent: dict[str, tuple[int, list[float], list[float], list[float]]] = {}
        """Request id -> its last proposal: (tokens sent, their draft probabilities, acceptances used, calibrated)."""
        self._ids: list[str] = []
        self._rounds: list[RequestRound] = []
        self._caps: list[int] = []
        self._cost: goodput.RoundCost | None = None
        self._positions, self._skipped = 0, False

    def _round_cost(self, batch: int) -> goodput.RoundCost | None:
        if not self.rule.needs_cost_model:
            return None
        if batch not in self._costs:
            self._costs[batch] = goodput.RoundCost.from_cost_model(curve_for_batch(self.curves, batch))
        return self._costs[batch]

    def begin_round(self, req_ids: Sequence[str], rejected: Sequence[int] | None, num_speculative_tokens: int) -> None:
        """A proposal for ``req_ids`` (the batch's rows, in order): feedback of the previous proposal
        (``rejected[i]``: how many of request i's verified drafts the target rejected; None when the last target
        step verified no drafts), fresh policies for new requests, each request's cap for this round."""
        ids = list(req_ids)
        self._met_verification(ids, time.perf_counter())
        for gone in set(self._policies) - set(ids):
            del self._policies[gone]
            self._sent.pop(gone, None)
            self._recent.pop(gone, None)
        self._cost = self._round_cost(len(ids))
        self._batch = self._batch_cost(len(ids))
        if self._batch is not None:  # at the factors met; a draft forward costs our scoring of it too
            levels = self.met.levels(len(ids)) if self.follow else (1.0, 1.0)
            self._batch = self._batch.scaled(*levels, self._own_s.get(len(ids), 0.0))
        self._ids, self._rounds, self._caps, self._positions, self._skipped = ids, [], [], 0, False
        self._acceptance, self._calibrated, self._feats = [[] for _ in ids], [[] for _ in ids], [[] for _ in ids]
        for i, rid in enumerate(ids):
            pol = self._policies.get(rid)
            if pol is None:
                pol = self._policies[rid] = copy.deepcopy(self.policy)
                pol.reset()
            elif rid in self._sent:
                n, qs, predicted, calibrated = self._sent.pop(rid)
                acc = max(0, n - int(rejected[i])) if rejected is not None and n else 0
                self.counts.accepted += acc
                self._judge(self.counts.by_position, predicted, acc)
                self._judge(self.tally, calibrated, acc)  # before the correction: what it follows
                self._recent.setdefault(rid, RecentShare()).seen(acc, n)
                pol.update(RoundFeedback.leading(n, acc, qs))
                if self.traces is not None:
                    self.traces.verdicts(rid, acc, len(ids))
            cap = pol.round_cap(self.max_draft_len, int(num_speculative_tokens))
            if self._batch is None:  # one request's round priced alone; the batch rule prices the first forward as paid
                cap = self.rule.affordable(pol, cap, self._cost)
            self._caps.append(cap)
            self._rounds.append(RequestRound(done=cap == 0))
        if self.skip_idle and self._batch is not None and not self.all_stopped() and not batch_keep_drafting(
                self._acceptance, [not r.done for r in self._rounds], self._batch, max(self._caps),
                forecast=[self._recent.get(rid, RecentShare()).forecast(self.prior) for rid in ids]):
            self.counts.skipped_steps += 1
            for r in self._rounds:
                r.done = True
        self._skipped = self.skip_idle and self.all_stopped()  # no request drafts: the proposer skips the forward
        self._t_begun, self._scoring = time.perf_counter(), 0.0

    def step(self, logits: Tensor) -> tuple[Tensor, bool]:
        """One drafted position: [B, V] draft ``logits`` -> ([B] greedy tokens, whether every request has stopped).
        The token of a stopped request is its argmax too (computed, never sent)."""
        t0 = time.perf_counter()
        tokens = logits.argmax(dim=-1)
        t1 = time.perf_counter()  # vLLM's own proposer takes the argmax too: the curve's draft forward holds it
        self.counts.draft_steps += 1
        self._positions += 1
        for i, (rnd, cap) in enumerate(zip(self._rounds, self._caps)):
            if rnd.done:
                self.counts.idle_rows += 1
                continue
            if self._batch is None and self.traces is None:
                more = draft_step(logits[i:i + 1], self._policies[self._ids[i]], rnd, self.top_k, cap, self._cost,
                                  token=int(tokens[i]))
            else:
                more = self._scored_step(i, logits[i:i + 1], rnd, cap)
            rnd.steps += 1
            rnd.done = not more or len(rnd.tokens) >= cap
        if self._batch is not None:
            self._decide_for_batch()
        end = time.perf_counter()
        self.counts.decide_s += end - t0
        b, took = len(self._ids), end - t1  # what scoring a position costs beyond vLLM's draft forward, per batch size
        self._scoring += took
        self._own_s[b] = 0.9 * self._own_s.get(b, took) + 0.1 * took
        return tokens, all(r.done for r in self._rounds)

    def _met_verification(self, ids: list[str], now: float) -> None:
        """The last proposal's verification step, timed from its sending to this round's start, against the curve; a
        step that also took a new request in (its prefill) is left out."""
        if self._last is None or not self.curves:
            return
        batch, length, before, sent = self._last
        self._last = None
        if ids and set(ids) <= before:
            self.met.verify(batch, (now - sent) / curve_for_batch(self.curves, batch).target_time(length))

    def _met_draft(self, forwards: int, now: float) -> None:
        """This round's draft forwards, timed from its start to its proposals less the scoring, against the curve."""
        if forwards and self.curves:
            per_forward = (now - self._t_begun - self._scoring) / forwards
            batch = len(self._ids)
            self.met.draft(batch, per_forward / curve_for_batch(self.curves, batch).draft_s_per_token)

    @staticmethod
    def _judge(cells: dict[int, list[float]], predicted: list[float], accepted: int) -> None:
        """Count in ``cells`` each judged token's predicted acceptance and vLLM's verdict by draft position:
        position -> [tokens judged, predictions summed, accepted]."""
        for j, a in enumerate(predicted[: accepted + 1], 1):
            cell = cells.setdefault(j, [0.0, 0.0, 0.0])
            cell[0] += 1
            cell[1] += a
            cell[2] += float(j <= accepted)

    def _corrected(self, position: int, calibrated: float) -> float:
        """``calibrated`` scaled by vLLM's accepted tokens over the calibration's predicted sum at ``position`` so far,
        ``PSEUDO_TOKENS`` added to both (the map as fitted until vLLM has judged more), at most 1."""
        if not self.follow:
            return calibrated
        _, predicted, accepted = self.tally.get(position, (0.0, 0.0, 0.0))
        return min(1.0, calibrated * (accepted + PSEUDO_TOKENS) / (predicted + PSEUDO_TOKENS))

    def _batch_cost(self, batch: int) -> BatchCost | None:
        if not self.batch_rule:
            return None
        if batch not in self._batch_costs:
            self._batch_costs[batch] = BatchCost.from_cost_model(curve_for_batch(self.curves, batch), batch,
                                                                 first_forward_paid=not self.skip_idle)
        return self._batch_costs[batch]

    def _scored_step(self, i: int, logits: Tensor, rnd: RequestRound, cap: int) -> bool:
        """One request's drafted position with its calibrated acceptance kept (the batch rule's input) and its
        features kept for the trace; returns its own rule's answer (a goodput policy's is the batch rule's)."""
        pol = self._policies[self._ids[i]]
        if pol.fixed_length:
            return draft_step(logits, pol, rnd, self.top_k, cap, self._cost)
        tok, feats = step_features(logits.float(), pol, self.top_k, len(rnd.tokens))
        raw = pol.score_list(feats)[0]
        calibrated = raw if self.rule.cost_aware or self.acceptance is None else self.acceptance.apply_one(raw)
        self._calibrated[i].append(calibrated)
        self._acceptance[i].append(self._corrected(len(self._calibrated[i]), calibrated))
        if self.traces is not None:
            self._feats[i].append({k: (v.reshape(-1).tolist() if v.numel() > 1 else float(v.reshape(-1)[0]))
                                   for k, v in feats.items()})
        if self.draft_to_cap or (self._batch is not None and self.rule.cost_aware):  # the cap or the batch decides
            keep_token(rnd, tok, feats, raw if self.rule.cost_aware else None)
            return True
        return take_candidate(pol, tok, feats, rnd, cap, self._cost, score=raw)

    def _decide_for_batch(self) -> None:
        """After a position: a goodput policy's requests draft on only where their next token pays its verification;
        the batch runs another draft forward only where the requests still drafting pay for it."""
        assert self._batch is not None
        live = [i for i, r in enumerate(self._rounds) if not r.done]
        if not live:
            return
        drafting, go = after_position(self._acceptance, [not r.done for r in self._rounds], self._batch,
                                      max(self._caps[i] for i in live), self.rule.cost_aware)
        if any(drafting) and not go:
            self.counts.batch_stops += 1
        for r, d in zip(self._rounds, drafting):
            r.done = not (d and go)

    def all_stopped(self) -> bool:
        """Whether no request drafts in this round (before any step: every cap was 0)."""
        return all(r.done for r in self._rounds)

    def proposals(self) -> list[list[int]]:
        """Per request, the drafted tokens to verify (a prefix of its round, as its policy says)."""
        now = time.perf_counter()
        out: list[list[int]] = []
        batch_sends = (send_lengths(self._acceptance, self._batch, self._positions)
                       if self._batch is not None and self.rule.cost_aware else None)
        for i, (rid, rnd) in enumerate(zip(self._ids, self._rounds)):
            if batch_sends is not None:
                n = min(batch_sends[i], len(rnd.tokens))
            else:
                n = sent_count(rnd, self._policies[rid], self._cost) if rnd.tokens else 0
            judged = len(self._acceptance[i]) >= n  # a fixed-length policy keeps no acceptance
            self._sent[rid] = (n, rnd.q[:n], self._acceptance[i][:n] if judged else [],
                               self._calibrated[i][:n] if judged else [])
            if self.traces is not None and n:
                self.traces.sent(rid, self._feats[i][:n], len(self._ids))
            self.counts.rounds += 1
            self.counts.drafted += len(rnd.tokens)
            self.counts.sent += n
            self.counts.per_request.setdefault(rid, []).append(n)
            out.append(rnd.tokens[:n])
        if out:
            forwards = 0 if self._skipped else max(1, self._positions)
            length = sum(len(o) + 1 for o in out) / len(out)
            self.counts.steps.append((len(out), forwards, length))
            self._met_draft(forwards, now)
            self._last = (len(out), length, frozenset(self._ids), time.perf_counter())
        return out
