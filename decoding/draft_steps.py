"""One drafted token at a time, stopped by a specstop policy: the steps that the runtimes' draft hooks share.

A runtime that drafts token by token itself (llama.cpp's draft-model hook, ``runtimes.llamacpp.draft``; vLLM's draft
proposer, ``runtimes.vllm.proposer``) hands each step's draft logits here: :func:`step_features` picks the greedy token
and computes its features with ``data_gen.features.token_features`` (the one feature function of data generation and
the engine, plus ``position``), :func:`take_candidate` takes it or not into the round (:class:`RequestRound`) and says
whether to draft another, as the policy's round rule says (``policy.round_rule``, ``predictors.round_rules``):

- ``threshold`` (DISCO, SVIP, AdaEDL, max confidence, static...): the token is drafted, then drafting stops when
  ``keep_drafting`` says no (the token is kept) or at the round's cap; every drafted token is sent;
- ``goodput`` (``goodput:<spec>``): drafting goes on while ``predictors.goodput.keep_drafting`` says the expected
  tokens/s still improves, priced by the runtime's own curve, and the best prefix is sent;
- ``prefix`` (llama.cpp's draft-simple rule): a candidate whose score is below the threshold stops the round and is
  not taken; the rule (``predictors.round_rules.PrefixRule``) says how many are sent.

:func:`sent_count` is how many of a finished round's tokens go to the target (``sent``, the word of
``predictors.counts``).

Usage::

    rnd = RequestRound()
    tok, feats = step_features(logits, policy, top_k=10, position=len(rnd.tokens))
    more = take_candidate(policy, tok, feats, rnd, cap, cost)
    ...
    rnd.sent = sent_count(rnd, policy, cost)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from compute.draft_stats import greedy_draft_stats
from data_gen.features import token_features
from predictors import goodput
from predictors.base import StopPolicy

__all__ = ["RequestRound", "check_policy", "draft_step", "keep_token", "step_features", "take_candidate", "sent_count"]


@dataclass
class RequestRound:
    """One request's round of drafting in a runtime's hook (the engine's round of a batch is
    ``decoding.state.BatchRound``)."""

    tokens: list[int] = field(default_factory=list)
    """Tokens drafted (taken), in order."""
    sent: int = 0
    """How many of them go to the target (a prefix)."""
    scores: list[float] = field(default_factory=list)
    """Per stop decision, the policy's score (goodput and prefix rules; the dropped candidate's too)."""
    q: list[float] = field(default_factory=list)
    """q(x) of each drafted token."""
    steps: int = 0
    """Stop decisions taken (candidates scored)."""
    draft_s: float = 0.0
    """Seconds in the draft's forwards of drafted tokens."""
    draft_evals: int = 0
    """Those forwards."""
    stop_s: float = 0.0
    """Seconds computing features and decisions (the drafted token's argmax included)."""
    done: bool = False
    """The policy (or the cap) ended the round."""


def check_policy(policy: StopPolicy, runtime: str) -> None:
    """ValueError when ``policy`` cannot run inside ``runtime``'s drafting loop: a round rule other than threshold /
    goodput / prefix (the runtime verifies every sent token exactly), or inputs a hook does not compute."""
    if not policy.round_rule.runs_in_hook:
        raise ValueError(f"policy {policy.kind}: its verification ({policy.verification}) cannot run inside {runtime}, "
                         "which verifies every sent token exactly (threshold, goodput and prefix policies can)")
    if "draft_hidden" in policy.required_columns or policy.needs_companion or policy.needs_target:
        raise ValueError(f"policy {policy.kind} reads {list(policy.required_columns)}: inside {runtime} the hook "
                         "computes the draft's own columns only (top-k, entropy, probabilities, position)")


def step_features(logits: Tensor, policy: StopPolicy, top_k: int, position: int) -> tuple[int, dict[str, Tensor]]:
    """The greedy token of [1, V] draft ``logits`` and its features (``token_features`` with the policy's columns,
    plus ``position``), as the engine's greedy draft step computes them."""
    fused = greedy_draft_stats(logits, max(1, top_k))
    tok, stats = fused if fused is not None else (logits.argmax(-1), None)
    feats = token_features(logits, tok, top_k=top_k, temperature=0.0, columns=policy.required_columns, stats=stats)
    feats["position"] = torch.tensor([position], dtype=torch.long)
    return int(tok[0]), feats


def draft_step(logits: Tensor, policy: StopPolicy, rnd: RequestRound, top_k: int, cap: int,
               cost: goodput.RoundCost | None, token: int | None = None) -> bool:
    """One drafted position of one request from its [1, V] draft ``logits``: the greedy token goes into ``rnd`` (or,
    for a prefix rule, not) and the answer says whether to draft another. A length rule (``policy.fixed_length``:
    ``static:K``, a runtime's own K) is decided by ``cap`` alone, so no feature is computed for it; its token is
    ``token`` when the caller already took the argmax (vLLM's proposer does, for the whole batch), else computed
    here."""
    if policy.fixed_length:
        rnd.tokens.append(int(logits.argmax(-1)[0]) if token is None else token)
        rnd.q.append(1.0)
        return True
    tok, feats = step_features(logits.float(), policy, top_k, len(rnd.tokens))
    return take_candidate(policy, tok, feats, rnd, cap, cost)


def take_candidate(policy: StopPolicy, tok: int, feats: dict[str, Tensor], rnd: RequestRound, cap: int,
                   cost: goodput.RoundCost | None, score: float | None = None) -> bool:
    """Take the candidate or not (into ``rnd``) and say whether to draft another, by the policy's round rule (the
    engine's decision for one row; a prefix rule's candidate below its threshold ends the round untaken).
    ``score``: the candidate's score when the caller computed it already."""
    rule = policy.round_rule
    (keep,), scores = rule.decide(policy, feats, [rnd.scores], [cap], [True], cost,
                                  None if score is None else [score])
    if scores is not None:
        rnd.scores.append(scores[0])
    if rule.takes(keep):
        keep_token(rnd, tok, feats)
    return bool(keep)


def keep_token(rnd: RequestRound, tok: int, feats: dict[str, Tensor], score: float | None = None) -> None:
    """Append a drafted token, its draft probability and (when given) its score to the round."""
    rnd.tokens.append(tok)
    rnd.q.append(float(feats["q"][0]))
    if score is not None:
        rnd.scores.append(score)


def sent_count(rnd: RequestRound, policy: StopPolicy, cost: goodput.RoundCost | None) -> int:
    """How many of the round's drafted tokens go to the target, as the policy's round rule says."""
    return policy.round_rule.sent(policy, rnd.scores, len(rnd.tokens), cost)
