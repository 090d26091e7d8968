"""The replay's round loop: ``replay_policy`` runs ``_replay_sequence`` per stored sequence, which runs rounds
(``_replay_round``: ``_round_rows`` gives the rows the round drafts from, ``_draft_round`` decides the drafted and
verified counts by the policy's round rule (schedule, oracle, the goodput rule, or its stop decisions), then
``_accepted`` and the cost model count acceptance and time into a ``ReplayResult``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compute.timing import CostModel
from evaluation.replay_data import REPLAY_MODES, ReplayData
from evaluation.replay_oracle import OracleSchedule, oracle_schedule, sampling_oracle
from evaluation.replay_result import ReplayResult
from evaluation.replay_scores import missing_columns, overrides, scores_for, window_features
from predictors import goodput
from predictors.base import GOODPUT, HINDSIGHT, PREFIX, SEQUENTIAL, RoundFeedback, StopPolicy, drafted_length

__all__ = ["replay_policy"]


@dataclass
class _Replay:
    """One policy's replay over ``data``: what every round reads, and the running totals."""

    policy: StopPolicy
    data: ReplayData
    cm: CostModel
    mode: str
    goodput: goodput.RoundCost | None
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
    goodput: bool | None = None,
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
        goodput: follow the goodput rule (``predictors.goodput``) with ``policy.score`` as calibrated acceptance
            (default: when ``policy.verification == GOODPUT``); the policy is set to ``mode`` (``use_mode``).
        max_draft_len: extra cap on drafted tokens per round.
        scores: precomputed ``policy.score`` over ``data`` rows (skips recomputing across a threshold sweep).
        decision_cost_model: the curve the goodput rule decides with, when it is not the one that prices the rounds
            (the benchmark's policies decided with the curve measured before its rows; its replay check prices with
            the one probed while they ran).
        verify_all: replay an approximate policy's rounds (``SEQUENTIAL``) as if every drafted token were verified
            (its threshold is tuned so: taking the drafts unverified, the fastest threshold would never stop).
    """
    if mode not in REPLAY_MODES:
        raise ValueError(f"mode={mode!r}: use one of {REPLAY_MODES}")
    miss = missing_columns(policy, data.features)
    if miss:
        raise KeyError(
            f"{getattr(policy, 'kind', type(policy).__name__)} needs the columns {miss}; missing from the data"
        )
    companion = policy.needs_companion
    cm = cost_model
    policy.use_mode(mode)
    if goodput is None:
        goodput = policy.verification == GOODPUT
    cost = _goodput_cost(decision_cost_model or cm, companion) if goodput else None
    rp = _Replay(
        policy=policy, data=data, cm=cm, mode=mode, goodput=cost, max_draft_len=max_draft_len,
        scores=scores if scores is not None else scores_for(policy, data, max_draft_len),
        per_draft=cm.draft_s_per_token + (cm.companion_s_per_token if companion else 0.0),
        companion=companion, online=overrides(policy, "update"), res=ReplayResult(n_seqs=data.n_seqs),
        sequential=policy.verification == SEQUENTIAL and not verify_all,
    )
    for a0, b0 in zip(data.starts.tolist(), data.ends.tolist()):
        _replay_sequence(rp, a0, b0)
    return rp.res


def _replay_sequence(rp: _Replay, a0: int, b0: int) -> None:
    """Rounds over rows [a0, b0) of one stored sequence, each starting where the previous one's emitted tokens end."""
    rp.policy.reset()
    rp.pending = 1
    plan = None
    if isinstance(rp.policy, OracleSchedule) and rp.mode == "greedy":
        top = rp.policy.round_cap(rp.max_draft_len)
        plan = oracle_schedule(rp.data.match_run, a0, b0, top, rp.per_draft, rp.cm)
    s = a0
    while s < b0:
        if rp.policy.verification == HINDSIGHT and rp.mode == "sampling":
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
    n, nv = _draft_round(rp, s, rows, rem, plan)  # drafted, verified
    v = rows[:nv]
    acc, a_int = _accepted(rp, v)
    t = n * rp.per_draft + rp.cm.target_time(nv + 1) + (rp.cm.catchup_time(rp.pending) if n else 0.0)
    rp.pending = _pending_after(n, a_int, rp.pending)
    if s == a0:
        rp.res.first_verify_s += rp.cm.target_time(nv + 1)
    # tokens past the stored end are not counted
    rp.res.add_round(min(acc + 1, rem), acc, n, nv, t, rp.cm.target_only_s_per_token, n)
    if rp.goodput is not None:
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
    approximate sequential verification (``SEQUENTIAL``, SPRINTER) the tokens before the last are taken unverified, as
    the engine takes them, and only the last one is checked."""
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


def _draft_round(rp: _Replay, s: int, rows: np.ndarray, rem: int, plan: dict[int, int] | None) -> tuple[int, int]:
    """(drafted, verified) tokens of the round starting at row s whose candidate rows are ``rows``: the schedule's,
    the oracle's, SV's goodput rule, or the policy's stop decisions over those rows (the token that triggers the stop
    is drafted and verified)."""
    if plan is not None:
        return plan[s], plan[s]
    cap = len(rows)
    if rp.policy.verification == HINDSIGHT:  # the acceptable run, and the failing token when run as the engine does
        run = int(rp.data.match_run[s])
        extra = int(getattr(rp.policy, "drafts_failing_token", False) and rp.mode == "greedy")
        n = min(run + extra, cap, rem - 1)
        return n, n
    if cap == 0:
        return 0, 0
    w = _window_scores(rp, rows)  # [cap] or None
    if rp.goodput is not None:
        return goodput.draft_round(_round_acceptance(rp, rows, w), rp.goodput, cap, rp.policy.acceptance_ceiling)
    if rp.policy.verification == PREFIX:  # llama.cpp's rule: steps paid and tokens sent differ
        sc = w if w is not None else rp.policy.score(window_features(rp.data.features, rows)).numpy()
        return rp.policy.prefix_round(np.asarray(sc, dtype=np.float64).tolist())
    if w is None:
        keep = rp.policy.keep_drafting(window_features(rp.data.features, rows)).cpu().numpy().astype(bool)
    else:
        keep = w >= rp.policy.threshold
    n = drafted_length(keep)
    return n, n


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
