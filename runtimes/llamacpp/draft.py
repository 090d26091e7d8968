"""A specstop stop policy inside llama.cpp: a draft-model hook for llama-cpp-python's speculative decoding.

``Llama.generate`` of a target built with ``draft_model=hook`` calls ``hook(input_ids)`` before each of its forward
passes and verifies the returned tokens itself (greedy match, llama.cpp's own exact verification, untouched). The hook
(:class:`SpecstopDraftModel`) keeps a draft ``Llama`` with its own KV cache: on each call it keeps the common prefix
of its cached tokens and ``input_ids`` (rolling ``n_tokens`` back) and reads the rest, then drafts greedily token by
token (:func:`draft_greedily`), each step's features computed from the draft's logits by
``data_gen.features.token_features`` (the one feature function of data generation and the engine, plus
``position``) and the round stopped as the policy's round rule says (``policy.round_rule``, ``predictors.round_rules``):

- ``threshold`` (DISCO, SVIP, AdaEDL, max confidence, static...): the token is drafted, then drafting stops when
  ``keep_drafting`` says no (the token is kept) or at ``round_cap``; every drafted token is sent;
- ``goodput`` (``goodput:<spec>``): drafting goes on while ``predictors.goodput.keep_drafting`` says the expected
  tokens/s still improves, priced by llama.cpp's own curve (``python -m pipelines.measure_costs --runtime llamacpp``),
  and the best prefix is sent (``best_prefix``);
- ``prefix`` (llama.cpp's draft-simple rule, ``predictors.runtime_rules``): a candidate whose score is below the
  threshold (``p_min``) stops the round and is not taken, at most ``round_cap`` (``n_max``) are taken, and a round of
  fewer than the rule's minimum (``n_min``) sends nothing (``predictors.round_rules.PrefixRule``), as
  ``common/speculative.cpp`` does.

Online policies hear each round's outcome (``policy.update``) at the next call, the accepted count read from how many
of the sent tokens begin the new input; a call whose input does not extend the previous one starts a new sequence
(``policy.reset``). Each call is recorded (:class:`DraftCall`, a ``predictors.counts.RoundCounts`` of one round:
tokens drafted, sent and accepted; draft and stop-decision seconds), and :meth:`SpecstopDraftModel.decode_stats` sums
one generation's calls into ``decoding.stats.DecodeStats``.

Limits: greedy decoding only (the draft's argmax is drafted; llama-cpp-python's target samples by its own sampler);
policies that read the draft's hidden state, a companion or the target are refused; the drafting loop runs in Python,
one ``Llama.eval`` per drafted token.

Usage::

    draft, target = runtimes.llamacpp.llama.load_pair(draft_gguf, target_gguf, n_threads=2, n_ctx=1024)
    target.draft_model = hook = SpecstopDraftModel(draft, build_policy("adaedl:0.6"))
    hook.begin(end=len(prompt) + 128)
    out = runtimes.llamacpp.llama.generate_greedy(target, prompt, 128, stop_ids)
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from compute.timing import CostModel
from decoding.draft_steps import RequestRound, draft_step, sent_count, step_features
from decoding.draft_steps import check_policy as check_runtime_policy
from decoding.stats import DecodeStats
from predictors import goodput
from predictors.base import RoundFeedback, StopPolicy
from predictors.counts import RoundCounts
from runtimes.llamacpp.llama import llama_cpp_module

try:  # optional dependency (the llamacpp extra): the hook's base class; the drafting loop runs without it
    from llama_cpp.llama_speculative import LlamaDraftModel
except ImportError:
    LlamaDraftModel = object  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

__all__ = ["DraftCall", "RequestRound", "SpecstopDraftModel", "check_policy", "draft_greedily", "step_features"]

Feed = Callable[[int], Tensor]
"""Reads one drafted token into the draft and returns the [1, V] logits of the next position."""


@dataclass
class DraftCall(RoundCounts):
    """One call of the hook: one round of llama.cpp's speculative loop (``drafted``, ``sent``, ``accepted``; its
    ``tokens`` are llama.cpp's to count)."""

    rounds: int = 1
    started: float = 0.0
    """``time.perf_counter()`` when the call began."""
    heard: bool = False
    """``accepted`` is known: read at the next call, or by :meth:`SpecstopDraftModel.finish`."""
    steps: int = 0
    sync_tokens: int = 0
    """Tokens of the input the draft read to catch up (the prompt on a sequence's first call)."""
    sync_s: float = 0.0
    draft_s: float = 0.0
    """Seconds of the draft's forwards of drafted tokens (the catch-up apart: ``sync_s``)."""
    draft_evals: int = 0
    stop_s: float = 0.0


def check_policy(policy: StopPolicy) -> None:
    """ValueError when ``policy`` cannot run in the hook (``decoding.draft_steps.check_policy``)."""
    check_runtime_policy(policy, "llama.cpp")


def draft_greedily(logits: Tensor, feed: Feed, policy: StopPolicy, cap: int, cost: goodput.RoundCost | None = None,
                top_k: int = 10) -> RequestRound:
    """Draft greedily from the [1, V] ``logits`` of the first position, ``feed`` reading each drafted token that is
    followed by another, at most ``cap`` tokens, stopped and cut by the policy (see the module docstring)."""
    rnd = RequestRound()
    while len(rnd.tokens) < cap:
        t0 = time.perf_counter()
        more = draft_step(logits, policy, rnd, top_k, cap, cost)
        rnd.stop_s += time.perf_counter() - t0
        rnd.steps += 1
        if not more or len(rnd.tokens) >= cap:
            break
        t0 = time.perf_counter()
        logits = feed(rnd.tokens[-1])  # the token just taken (a step that takes none ends the round)
        rnd.draft_s += time.perf_counter() - t0
        rnd.draft_evals += 1
    rnd.sent = sent_count(rnd, policy, cost)
    return rnd


def _accepted(new: np.ndarray, sent: Sequence[int]) -> int:
    """How many of ``sent`` begin ``new`` (the tokens past the previous input: accepted drafts, then the target's
    correction or bonus token, which is never counted)."""
    k = 0
    while k < min(len(sent), len(new) - 1) and int(new[k]) == sent[k]:
        k += 1
    return k


class SpecstopDraftModel(LlamaDraftModel):
    """llama-cpp-python's draft-model hook drafting with a GGUF draft and stopping by a specstop policy.

    Args:
        draft: a ``llama_cpp.Llama`` (its own context and KV cache; ``logits_all`` not needed).
        policy: a stop policy (``decoding.policies.build_policy``: a spec, an export, ``llamacpp:N_MAX,N_MIN,P_MIN``),
            checked by :func:`check_policy`.
        cost_model: llama.cpp's curve (goodput policies price rounds with it; ValueError without one).
        max_draft_len: cap on the tokens of one round (the policy's own ``draft_cap`` may be lower).
        top_k: top-k draft probabilities in the features (the predictors' training data's).
    """

    def __init__(self, draft: Any, policy: StopPolicy, *, cost_model: CostModel | None = None,
                 max_draft_len: int = 16, top_k: int = 10) -> None:
        check_policy(policy)
        if policy.round_rule.needs_cost_model and cost_model is None:
            raise ValueError(f"policy {policy.kind} prices rounds with a verification curve: measure llama.cpp's with "
                             "python -m pipelines.measure_costs --runtime llamacpp and pass it as the cost model")
        policy.use_mode("greedy")
        if cost_model is not None and (warn := cost_model.runtime_mismatch("llamacpp")):
            log.warning(warn)
        self.draft, self.policy, self.max_draft_len, self.top_k = draft, policy, int(max_draft_len), int(top_k)
        self.cost = goodput.RoundCost.from_cost_model(cost_model) if policy.round_rule.needs_cost_model else None
        self.end: int | None = None
        self.calls: list[DraftCall] = []
        self._prev: np.ndarray | None = None
        self._sent: list[int] = []
        self._sent_q: list[float] = []

    def begin(self, end: int | None = None) -> None:
        """A new sequence: the draft's cache, the policy and the call records reset; ``end``: the sequence's length
        (prompt + new tokens) at which decoding stops, so that no round drafts past it."""
        self.draft.reset()
        self.policy.reset()
        self.calls, self._prev, self._sent, self._sent_q, self.end = [], None, [], [], end

    def drafts_nothing(self, prompt_len: int) -> bool:
        """After :meth:`begin`: whether no round of the sequence can draft, decided at its start. A cost-aware policy
        whose first round could not pay at the sequence's widest cap and the acceptance it starts from drafts nothing
        for the whole sequence (its caps only shrink towards the end, its acceptance estimate never exceeds that start):
        the caller may then run the target alone, without the speculative path's per-token hook call."""
        return self.cost is not None and self._round_cap(prompt_len) == 0

    def _round_cap(self, length: int) -> int:
        """The drafts a round may make after ``length`` tokens: the policy's cap within the context and the sequence's
        end (the round's drafts and the target's token fit before it), 0 when a cost-aware policy's round cannot pay
        there."""
        limits = [self.max_draft_len, self.draft.n_ctx() - length - 1]
        if self.end is not None:
            limits.append(self.end - length - 1)
        return self.policy.round_rule.affordable(self.policy, self.policy.round_cap(*limits), self.cost)

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        call = DraftCall(started=time.perf_counter())
        ids = np.array(input_ids, dtype=np.intc)  # a copy: the target's buffer changes under us
        self._feedback(ids)
        cap = self._round_cap(len(ids))
        rnd = RequestRound()
        if cap > 0:
            t0 = time.perf_counter()
            call.sync_tokens = self._catch_up(ids)
            call.sync_s = time.perf_counter() - t0
            rnd = draft_greedily(self._logits(), self._feed, self.policy, cap, self.cost, self.top_k)
        call.drafted, call.sent, call.steps = len(rnd.tokens), rnd.sent, rnd.steps
        call.draft_s, call.draft_evals, call.stop_s = rnd.draft_s, rnd.draft_evals, rnd.stop_s
        self.calls.append(call)
        self._prev, self._sent, self._sent_q = ids, rnd.tokens[: rnd.sent], rnd.q[: rnd.sent]
        return np.asarray(self._sent, dtype=np.intc)

    def _feedback(self, ids: np.ndarray) -> None:
        """The previous round's outcome to the policy when ``ids`` extends the previous input, else a new sequence."""
        prev = self._prev
        if prev is not None and len(ids) > len(prev) and np.array_equal(ids[: len(prev)], prev):
            k = _accepted(ids[len(prev):], self._sent)
            self.calls[-1].accepted, self.calls[-1].heard = k, True
            self.policy.update(RoundFeedback.leading(len(self._sent), k, list(self._sent_q)))
        elif prev is not None:
            self.policy.reset()

    def finish(self, sequence: Sequence[int]) -> None:
        """Book the last round's accepted tokens from the final sequence (prompt + output; no call follows it)."""
        if self.calls and not self.calls[-1].heard and self._prev is not None:
            seq = np.asarray(sequence, dtype=np.intc)
            self.calls[-1].accepted, self.calls[-1].heard = _accepted(seq[len(self._prev):], self._sent), True

    def _catch_up(self, ids: np.ndarray) -> int:
        """Roll the draft's cache back to its common prefix with ``ids`` (leaving at least the last token to read, whose
        logits the first draft step needs) and read the rest; returns the tokens read."""
        llm = self.draft
        cached = llm.input_ids[: llm.n_tokens]
        n = min(len(cached), len(ids) - 1)
        diff = np.flatnonzero(cached[:n] != ids[:n])
        keep = int(diff[0]) if len(diff) else n
        llm.n_tokens = keep  # eval removes the cached positions from n_tokens on
        llm.eval(ids[keep:].tolist())
        return len(ids) - keep

    def _logits(self) -> Tensor:
        """[1, V] logits of the draft's last read position (a view of llama.cpp's buffer: read before the next eval)."""
        ptr = llama_cpp_module().llama_get_logits_ith(self.draft.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.draft.n_vocab(),))).view(1, -1)

    def _feed(self, token: int) -> Tensor:
        self.draft.eval([token])
        return self._logits()

    def decode_stats(self, t_start: float, wall_s: float, tokens: int) -> DecodeStats:
        """The calls since :meth:`begin` as the engine's counters: one round and one target pass per call, the first
        call's catch-up (the draft's prefill) and the target's pass over the prompt before it in ``prefill_time``, the
        target's passes the time left over."""
        st = DecodeStats(rounds=len(self.calls), tokens=tokens, wall_time=wall_s, target_calls=len(self.calls))
        for j, c in enumerate(self.calls):
            acc = int(c.accepted)
            st.drafted, st.sent, st.accepted = st.drafted + c.drafted, st.sent + c.sent, st.accepted + acc
            st.drafted_lengths.append(int(c.drafted))
            st.sent_lengths.append(int(c.sent))
            st.accepted_lengths.append(acc)
            st.wasted += c.drafted - acc
            st.draft_forwards += c.draft_evals + (1 if j and c.sync_tokens else 0)
            st.draft_time += c.draft_s + (c.sync_s if j else 0.0)
            st.stop_decisions += c.steps
            st.stop_time += c.stop_s
        if self.calls:
            st.prefill_time = self.calls[0].started - t_start + self.calls[0].sync_s
        st.target_time = max(0.0, wall_s - st.prefill_time - st.draft_time - st.stop_time)
        return st
