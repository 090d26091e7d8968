"""The replay's round loop: ``replay_policy`` runs ``_replay_sequence`` per stored sequence, which runs rounds
(``_replay_round``: ``_round_rows`` gives the rows the round drafts from, ``_round_lengths`` decides the drafted and
sent counts (the schedule, the oracle's acceptable run, else ``policy.round_rule.replay_round``), then
``_accepted`` and the cost model count acceptance and time into a ``ReplayResult``).

What one policy's replay adds up to (:class:`ReplayResult`): the shared round counts of ``predictors.counts`` plus the
replayed seconds, what target-only decoding would take for the same tokens, and the goodput rule's expectations. The
hindsight bounds: the schedule oracle (:class:`OracleSchedule`, a dynamic programme over each greedy sequence for the
fastest rounds under the cost model) and the sampling oracle's expected round (draft until the first rejection)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from compute.timing import CostModel
from evaluation.replay.scores import missing_columns, overrides, scores_for, window_features
from evaluation.replay.sequences import REPLAY_MODES, ReplayData
from predictors import goodput
from predictors.base import RoundFeedback, StopPolicy
from predictors.counts import RoundCounts
from predictors.round_rules import HINDSIGHT, RoundRule

__all__ = ["ReplayResult", "OracleSchedule", "replay_policy", "speedup_of", "pooled_speedup"]


@dataclass
class ReplayResult(RoundCounts):
    """Totals of one policy replayed over all sequences.

    The round counts are those of ``predictors.counts.RoundCounts``, held as floats (expected counts in sampling
    mode); ``tokens`` is clipped at the end of each stored sequence. ``as_row`` keeps its table columns' names."""

    n_seqs: int = 0
    time_s: float = 0.0
    """Replayed seconds under the cost model."""
    target_only_s: float = 0.0
    """Seconds target-only decoding would take for the same tokens."""
    draft_len_hist: dict[int, int] = field(default_factory=dict)
    """Rounds by number of drafted tokens."""
    round_tokens: list[tuple[float, float]] = field(default_factory=list)
    """Goodput policies: (expected, replayed) tokens of every round."""
    round_lengths: list[tuple[int, int]] = field(default_factory=list)
    """Goodput policies: (drafted, sent) tokens of every round (to compare with the engine's)."""
    expected_tokens: float = 0.0
    """Goodput policies: tokens the rounds expected to emit (calibrated acceptance of the verified prefixes)."""
    first_verify_s: float = 0.0
    """Seconds of each sequence's first verification pass under the cost model (in ``time_s``): the engine runs it
    inside the target's pass over the prompt, so a comparison with its measured prefill leaves it out."""
    seq_tokens: list[float] = field(default_factory=list)
    """Tokens emitted on each stored sequence, in replay order (a stored main job's per-sequence records)."""
    seq_time_s: list[float] = field(default_factory=list)
    """Replayed seconds of each stored sequence, in replay order."""
    target_s_per_token: float = float("nan")
    """The cost model's target-only seconds per token the rounds were priced with."""

    def start_sequence(self) -> None:
        """Open the per-sequence totals of the next stored sequence."""
        self.seq_tokens.append(0.0)
        self.seq_time_s.append(0.0)

    def add_round(self, emitted: float, accepted: float, drafted: float, sent: float, seconds: float,
                  target_s_per_token: float, hist_key: int) -> None:
        """Count one verification round."""
        self.rounds += 1
        self.tokens += float(emitted)
        self.accepted += float(accepted)
        self.drafted += float(drafted)
        self.sent += float(sent)
        self.time_s += seconds
        self.target_only_s += emitted * target_s_per_token
        self.target_s_per_token = target_s_per_token
        self.draft_len_hist[hist_key] = self.draft_len_hist.get(hist_key, 0) + 1
        if self.seq_tokens:
            self.seq_tokens[-1] += float(emitted)
            self.seq_time_s[-1] += seconds

    @property
    def tokens_per_call(self) -> float:
        """Tokens emitted per target call (mean accepted length + 1)."""
        return self.tokens / self.rounds if self.rounds else float("nan")

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else float("nan")

    @property
    def drafted_per_round(self) -> float:
        return self.drafted / self.rounds if self.rounds else float("nan")

    @property
    def wasted_per_round(self) -> float:
        """Draft tokens not accepted, per round (rejected, after the first rejection, or drafted but not verified)."""
        return (self.drafted - self.accepted) / self.rounds if self.rounds else float("nan")

    @property
    def expected_per_round(self) -> float:
        """Goodput policies: expected tokens per round (NaN for the others)."""
        return self.expected_tokens / self.rounds if self.round_tokens else float("nan")

    @property
    def speedup(self) -> float:
        """Predicted speedup over target-only decoding."""
        return speedup_of(self.target_only_s, self.time_s)

    def as_row(self) -> dict[str, float]:
        return {
            "n_seqs": self.n_seqs,
            "n_rounds": self.rounds,
            "tokens": self.tokens,
            "tokens_per_call": self.tokens_per_call,
            "mean_accepted": self.mean_accepted,
            "drafted_per_round": self.drafted_per_round,
            "wasted_per_round": self.wasted_per_round,
            "time_s": self.time_s,
            "speedup": self.speedup,
            "expected_per_round": self.expected_per_round,
        }


def speedup_of(target_only_s: float, time_s: float) -> float:
    """Replayed speedup over target-only decoding: the seconds target-only decoding takes for the emitted tokens over
    the replayed seconds (NaN without replayed time)."""
    return target_only_s / time_s if time_s > 0 else float("nan")


def pooled_speedup(seq_tokens: list[float], seq_time_s: list[float], target_s_per_token: float) -> float:
    """:func:`speedup_of` over every sequence of a replay from its per-sequence tokens and seconds
    (``ReplayResult.seq_tokens``, ``seq_time_s``): how a stored main job's speedups are recomputed."""
    return speedup_of(math.fsum(seq_tokens) * target_s_per_token, math.fsum(seq_time_s))


class OracleSchedule(StopPolicy):
    """Cost-optimal hindsight schedule (greedy replay): the fastest way to emit each stored sequence under the cost
    model."""

    kind = "oracle_schedule"
    required_columns = ("greedy_match",)
    round_rule = HINDSIGHT
    has_threshold = False

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["greedy_match"].float()


def oracle_schedule(run: np.ndarray, a0: int, b0: int, cap: int, per_draft: float, cm: CostModel) -> dict[int, int]:
    """round start -> tokens to draft, minimising the time to emit rows [a0, b0) (greedy; draft only acceptable
    tokens)."""
    T = np.array([cm.target_time(k + 1) for k in range(cap + 1)])  # verification of k drafts + 1
    best = np.zeros(b0 - a0 + 1)
    choice = np.zeros(b0 - a0, dtype=np.int64)
    for s in range(b0 - 1, a0 - 1, -1):
        i = s - a0
        m = min(int(run[s]), cap, b0 - s)
        ns = np.arange(m + 1)
        nxt = np.minimum(i + ns + 1, b0 - a0)
        cost = ns * per_draft + T[ns] + best[nxt]
        j = int(np.argmin(cost))
        best[i], choice[i] = cost[j], j
    out, s = {}, a0
    while s < b0:
        out[s] = int(choice[s - a0])
        s += out[s] + 1
    return out


def sampling_oracle(acc: np.ndarray, cm: CostModel, companion: bool) -> tuple[float, float, float]:
    """Expected (accepted, drafted, seconds) of drafting exactly until the first rejection (capped at len(acc))."""
    surv = np.cumprod(acc)  # P(A >= k), k = 1..n
    n = len(acc)
    p_eq = np.append(1.0 - acc[0], surv[:-1] * (1.0 - acc[1:])) if n else np.zeros(0)  # P(A = k), k = 0..n-1
    probs = np.append(p_eq, surv[-1]) if n else np.array([1.0])  # k = 0..n
    ks = np.arange(n + 1)
    times = np.array([cm.round_time(int(k), companion=companion) for k in ks])
    return float(surv.sum()), float((probs * ks).sum()), float((probs * times).sum())




@dataclass
class _Replay:
    """One policy's replay over ``data``: what every round reads, and the running totals."""

    policy: StopPolicy
    data: ReplayData
    cm: CostModel
    mode: str
    rule: RoundRule
    """The policy's round rule."""
    cost: goodput.RoundCost | None
    """The goodput rule's round cost (cost-aware policies), else None."""
    max_draft_len: int | None
    scores: np.ndarray | None
    """[N] per-token scores, [N, width] per in-round position, or None (ask the policy on each round's window)."""
    per_draft: float
    """Seconds of one draft step (plus the companion's when the policy reads it)."""
    companion: bool
    online: bool
    res: ReplayResult
    sequential: bool = False
    """Take a round's drafts before its last unverified, as the engine runs an approximate policy."""
    pending: int = 1
    """Tokens the draft reads at the next round's first forward (:func:`_pending_after`; priced by
    ``CostModel.catchup_time``)."""


def replay_policy(
    policy: StopPolicy,
    data: ReplayData,
    cost_model: CostModel,
    mode: str = "greedy",
    *,
    max_draft_len: int | None = None,
    scores: np.ndarray | None = None,
    decision_cost_model: CostModel | None = None,
    verify_all: bool = False,
) -> ReplayResult:
    """Replay one policy (mutated: reset / update are called on it) over every sequence of ``data``.

    Args:
        policy: the stop policy; its threshold and online state are used as they are.
        data: from :func:`prepare_replay_data`.
        cost_model: round latency model (prices the rounds).
        mode: 'greedy' or 'sampling' verification.
        max_draft_len: extra cap on drafted tokens per round.
        scores: precomputed ``policy.score`` over ``data`` rows (skips recomputing across a threshold sweep).
        decision_cost_model: the curve the goodput rule decides with, when it is not the one that prices the rounds
            (the benchmark's policies decided with the curve measured before its rows; its replay check prices with
            the one probed while they ran).
        verify_all: replay an approximate policy's rounds (the ``sequential`` rule) as if every drafted token were
            verified (its threshold is tuned so: taking the drafts unverified, the fastest threshold would never stop).
    """
    if mode not in REPLAY_MODES:
        raise ValueError(f"mode={mode!r}: use one of {REPLAY_MODES}")
    miss = missing_columns(policy, data.features)
    if miss:
        raise KeyError(
            f"{policy.kind} needs the columns {miss}; missing from the data"
        )
    companion = policy.needs_companion
    cm = cost_model
    policy.use_mode(mode)  # a cost-aware policy picks its calibration map
    rule = policy.round_rule
    cost = _goodput_cost(decision_cost_model or cm, companion) if rule.needs_cost_model else None
    rp = _Replay(
        policy=policy, data=data, cm=cm, mode=mode, rule=rule, cost=cost, max_draft_len=max_draft_len,
        scores=scores if scores is not None else scores_for(policy, data, max_draft_len),
        per_draft=cm.draft_s_per_token + (cm.companion_s_per_token if companion else 0.0),
        companion=companion, online=overrides(policy, "update"), res=ReplayResult(n_seqs=data.n_seqs),
        sequential=rule.sequential and not verify_all,
    )
    for a0, b0 in zip(data.starts.tolist(), data.ends.tolist()):
        _replay_sequence(rp, a0, b0)
    return rp.res


def _replay_sequence(rp: _Replay, a0: int, b0: int) -> None:
    """Rounds over rows [a0, b0) of one stored sequence, each starting where the previous one's emitted tokens end."""
    rp.policy.reset()
    rp.res.start_sequence()
    rp.pending = 1
    plan = None
    if isinstance(rp.policy, OracleSchedule) and rp.mode == "greedy":
        top = rp.policy.round_cap(rp.max_draft_len)
        plan = oracle_schedule(rp.data.match_run, a0, b0, top, rp.per_draft, rp.cm)
    s = a0
    while s < b0:
        if rp.rule.hindsight and rp.mode == "sampling":
            s = _sampling_oracle_round(rp, s, b0)
        else:
            s = _replay_round(rp, a0, s, b0, plan)


def _sampling_oracle_round(rp: _Replay, s: int, b0: int) -> int:
    """The oracle in sampling mode: draft until the first rejection, in expectation; returns the next round's start."""
    rem = b0 - s
    cap = rp.policy.round_cap(rem, rp.max_draft_len)
    # never draft the last stored token: its bonus would lie past the end
    acc_exp, n_exp, t = sampling_oracle(rp.data.accept[s : s + min(cap, rem - 1)], rp.cm, rp.companion)
    a_int = int(round(acc_exp))
    rp.res.add_round(min(acc_exp + 1, rem), acc_exp, n_exp, n_exp, t, rp.cm.target_only_s_per_token, a_int)
    return s + a_int + 1


def _replay_round(rp: _Replay, a0: int, s: int, b0: int, plan: dict[int, int] | None) -> int:
    """One round from row s of the sequence starting at row a0: draft, verify (greedy match or expected acceptance),
    count; returns the next start."""
    rem = b0 - s
    cap = rp.policy.round_cap(_room(rp, a0, s, b0), rp.max_draft_len)
    rows = _round_rows(rp, a0, s, b0, cap)  # the rows the round drafts from, in draft order
    n, nv = _round_lengths(rp, s, rows, rem, plan)  # drafted, sent
    v = rows[:nv]
    acc, a_int = _accepted(rp, v)
    t = n * rp.per_draft + rp.cm.target_time(nv + 1) + (rp.cm.catchup_time(rp.pending) if n else 0.0)
    rp.pending = _pending_after(n, a_int, rp.pending)
    if s == a0:
        rp.res.first_verify_s += rp.cm.target_time(nv + 1)
    # tokens past the stored end are not counted
    rp.res.add_round(min(acc + 1, rem), acc, n, nv, t, rp.cm.target_only_s_per_token, n)
    if rp.rule.cost_aware:
        _count_expected(rp, v, min(acc + 1, rem))
        rp.res.round_lengths.append((n, nv))
    if rp.online:
        q = rp.data.q[v].tolist()
        rp.policy.update(RoundFeedback.leading(n_drafted=nv, n_accepted=a_int, draft_probs=q))
    return s + a_int + 1


def _pending_after(drafted: int, accepted: int, pending: int) -> int:
    """Tokens the draft reads at the next round's first forward, after a round that drafted ``drafted`` tokens (it
    read each but the last) of which the target accepted ``accepted``: the target's token, and the round's last draft
    too when every draft was accepted (the draft's cache keeps the accepted ones it read); a round that drafted
    nothing leaves the draft behind by the tokens it emitted."""
    if drafted == 0:
        return pending + accepted + 1
    return 2 if accepted >= drafted else 1


def _accepted(rp: _Replay, verified: np.ndarray) -> tuple[float, int]:
    """(accepted tokens, as a float in expectation, and as the count the next round starts after) of a round whose
    target checks ``verified`` rows: the leading greedy matches, or the expected run of min(1, p/q) acceptances; under
    approximate sequential verification (the ``sequential`` rule, SPRINTER) the tokens before the last are taken
    unverified, as the engine takes them, and only the last one is checked."""
    n = len(verified)
    if rp.sequential and n:
        last = float(rp.data.greedy[verified[-1]]) if rp.mode == "greedy" else float(rp.data.accept[verified[-1]])
        return n - 1 + last, n - 1 + int(round(last))
    if rp.mode == "greedy":
        g = rp.data.greedy[verified]
        a = len(g) if g.all() else int(np.argmin(g))  # leading greedy matches
        return float(a), a
    acc = float(np.cumprod(rp.data.accept[verified]).sum()) if n else 0.0
    return acc, int(round(acc))


def _room(rp: _Replay, a0: int, s: int, b0: int) -> int:
    """Most tokens a round from row s may draft: to the stored end, or, under the decoder's new-token limit, as many
    as the engine allows (``max_new_tokens - emitted - 1``; the draft's rollout past the end may supply them)."""
    if rp.data.max_new_tokens is None:
        return b0 - s
    return max(rp.data.max_new_tokens - (s - a0) - 1, 0)


def _round_rows(rp: _Replay, a0: int, s: int, b0: int, cap: int) -> np.ndarray:
    """[<= cap] rows a round from row s drafts from: the stored rows, and past the first mismatch (or past the stored
    end) the draft's own rollout from there when the data holds one (``ReplayData.branches``)."""
    if not rp.data.branches:
        return np.arange(s, min(s + cap, b0))
    stop = s + int(rp.data.match_run[s])  # first mismatching row, or b0
    if stop >= s + cap:
        return np.arange(s, s + cap)
    if stop < b0:  # the round drafts the mismatching token, then the draft's rollout from its prefix goes on
        head, branch, skip = np.arange(s, stop + 1), rp.data.branches.get((a0, stop - a0)), 1
    else:  # every stored row matched: the draft goes on past the stored end
        head, branch, skip = np.arange(s, b0), rp.data.branches.get((a0, b0 - a0)), 0
    if branch is None:
        return np.arange(s, min(s + cap, b0))
    first = branch[0] + skip
    tail = np.arange(first, min(branch[1], first + cap - len(head)))
    return np.concatenate([head, tail])[:cap]


def _round_lengths(rp: _Replay, s: int, rows: np.ndarray, rem: int, plan: dict[int, int] | None
                   ) -> tuple[int, int]:
    """(drafted, sent) tokens of the round starting at row s whose candidate rows are ``rows``: the schedule's,
    the oracle's, or the policy's round rule over those rows' scores (``RoundRule.replay_round``)."""
    if plan is not None:
        return plan[s], plan[s]
    cap = len(rows)
    if rp.rule.hindsight:  # the acceptable run, and the failing token when run as the engine does
        run = int(rp.data.match_run[s])
        extra = int(rp.policy.drafts_failing_token and rp.mode == "greedy")
        n = min(run + extra, cap, rem - 1)
        return n, n
    if cap == 0:
        return 0, 0
    return rp.rule.replay_round(rp.policy, _window_scores(rp, rows),
                                lambda: window_features(rp.data.features, rows), rp.cost)


def _goodput_cost(cm: CostModel, companion: bool) -> goodput.RoundCost:
    return goodput.RoundCost.from_cost_model(cm, companion=companion)


def _round_acceptance(rp: _Replay, rows: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    """[len(rows)] calibrated acceptance of a round's rows at in-round positions 0, 1, ... (a goodput policy's
    scores)."""
    est = w if w is not None else rp.policy.score(window_features(rp.data.features, rows)).numpy()
    return np.clip(np.asarray(est, dtype=np.float64), 0.0, 1.0)


def _count_expected(rp: _Replay, verified: np.ndarray, replayed: float) -> None:
    """Record the tokens a goodput round expected (from the calibrated acceptances of its ``verified`` rows) beside
    the replayed ones."""
    if len(verified):
        est = _round_acceptance(rp, verified, _window_scores(rp, verified))
    else:
        est = np.zeros(0)
    expected = float(goodput.expected_tokens(est)[-1])
    rp.res.expected_tokens += expected
    rp.res.round_tokens.append((expected, float(replayed)))


def _window_scores(rp: _Replay, rows: np.ndarray) -> np.ndarray | None:
    """[len(rows)] precomputed scores of a round's rows at in-round positions 0, 1, ...; None: ask the policy."""
    sc = rp.scores
    if sc is None or (sc.ndim == 2 and len(rows) > sc.shape[1]):
        return None  # keep_drafting overridden (or positions beyond the matrix): ask the policy on this window
    if sc.ndim == 2:
        return sc[rows, np.arange(len(rows))]
    return sc[rows]
