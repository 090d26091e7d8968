"""Offline replay of stop policies over stored labelled sequences: no model runs, only the per-token records.

Records are grouped by labelled segment (``seq_id`` and the segment start ``prefix_len - offset``, see
:func:`segment_keys`) and ordered by ``offset``. A round starts at offset ``s``: the policy drafts tokens ``s, s+1,
...``, and after each drafted token ``keep_drafting`` says whether to draft another (the token that triggers the stop is
still drafted and verified), up to ``policy.draft_cap()`` tokens and the end of the sequence. Verification:

- ``greedy``: accepted count ``a`` = leading ``greedy_match`` among the drafted tokens (first mismatch);
- ``sampling``: the expectation ``E[a] = sum_k prod_{j<=k} accept_prob_j`` over the drafted prefix (exact speculative
  sampling accepts token j with ``min(1, p/q)``), and the next round starts at ``s + round(E[a]) + 1``.

The round emits ``a + 1`` tokens (the correction, or the bonus token when all were accepted) and costs
``CostModel.round_time(n_drafted)``; ``policy.update(RoundFeedback(...))`` follows each round and ``policy.reset()``
starts each sequence. Predicted speedup = (tokens / replayed seconds) * target-only seconds per token (``target_s[1]``).

Why this is exact for greedy on ``origin == "target"`` teacher-forced sequences: greedy speculative decoding outputs
exactly the target's greedy continuation, and along that continuation the draft's prefix at offset ``s + j`` is
identical to the stored one while every earlier drafted token matched. So the accepted counts, the round boundaries and
the emitted tokens of every round are those of a real run. Two caveats: (1) the draft tokens *after* the first mismatch
of a round were drafted in a real run from the draft's own (wrong) token, while the stored features there come from the
target's token, so the number of *wasted* drafts of a threshold policy is approximate (accepted counts are not); (2) it
holds when the stored target continuation is the target's greedy output (temperature 0). Elsewhere (draft rollouts,
dataset text, sampling) the sequence after a mismatch is not what speculative decoding would have produced, and the
replay is an approximation that uses the stored prefixes as a sample of contexts. :class:`ReplayConfig` replays the
exact case by default and falls back, with a note in ``ReplayData.note``, when the data holds no such sequences.

Caveat (1) goes with ``ReplayConfig.branch_rollouts`` on data that holds the draft's own rollout from every prefix where
a drafted token fails greedy match, and from the end of the sequence (``data_gen.generate.label_continuation``): past a
round's first mismatch the round reads that rollout's rows, as the engine's draft does, so the drafted lengths (and the
goodput rule's verified lengths) are those of a real run too. ``ReplayConfig.max_new_tokens`` caps each round as the
engine caps it (``max_new_tokens - emitted - 1``) and lets a round draft past the stored end (an end of sequence) into
the rollout from there. ``pipelines.replay_check`` replays the benchmark's prompts this way.

Tokens are counted up to the end of the stored sequence (a round that would emit its bonus token past the end is
clipped), so in greedy mode every policy emits the same tokens and the speedup is a pure time ratio.

Special policies: the oracle (``verification == HINDSIGHT``, DISCO's definition) drafts exactly the acceptable run
(greedy: leading matches; sampling: until the first rejection, in expectation), never the last stored token (its bonus
would lie past the end); it is the upper bound when a verification pass costs more than a draft step and verification
time is subadditive in length. The schedule oracle (:class:`OracleSchedule`) is the exact bound under any non-decreasing
cost model in greedy mode: a dynamic programme over each sequence picks, at every round start, how many of the
acceptable tokens to draft so that the total replayed time is minimal (in sampling mode it falls back to the expectation
oracle). Cost-aware policies (``verification == GOODPUT``: SV, ``goodput:`` wrappers) follow the one goodput rule of
``predictors.goodput`` (the engine calls the same functions): draft while the expected tokens/s of the lengths still
reachable improves, verify the best prefix, paying companion steps per drafted token when the policy reads them. Each of
their rounds also records the tokens it expected to emit beside the ones it did (``ReplayResult.round_tokens``).

Approximate policies (``verification == SEQUENTIAL``, SPRINTER) are replayed as the engine runs them: the tokens a round
drafts before its last are taken unverified and only the last is checked (greedy match, or min(1, p/q) in expectation),
so a round of n drafted tokens emits n + 1 tokens or n. Once a round takes a mismatch unverified the engine's output
leaves the stored sequence while the replay goes on along it: the rounds' lengths and checks are a sample of the
policy's, not its trajectory.

Phases: :func:`replay_policy` runs :func:`_replay_sequence` per stored sequence, which runs rounds
(:func:`_replay_round`: :func:`_round_rows` gives the rows the round drafts from, :func:`_draft_round` decides drafted
and verified counts, then acceptance and cost are counted).

Usage::

    from evaluation.replay import replay_table, ReplayConfig
    table = replay_table(columns, {"disco": policy}, cost_model, ReplayConfig(mode="greedy"))
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from compute.timing import CostModel
from predictors import goodput
from predictors.base import (
    GOODPUT,
    HINDSIGHT,
    SEQUENTIAL,
    RoundFeedback,
    StopPolicy,
    as_tensor_dict,
    drafted_length,
)
from predictors.counts import RoundCounts

__all__ = [
    "ReplayConfig",
    "ReplayData",
    "ReplayResult",
    "prepare_replay_data",
    "replay_policy",
    "replay_table",
    "threshold_sweep",
    "tune_threshold",
    "default_grid",
    "default_replay_policies",
    "policy_scores",
    "position_score_matrix",
    "missing_columns",
    "OracleSchedule",
    "segment_keys",
    "with_threshold",
]

REPLAY_MODES = ("greedy", "sampling")


@dataclass
class ReplayConfig:
    """Which sequences to replay and how verification is modelled."""

    mode: str = "greedy"
    """'greedy' (accept while greedy_match) or 'sampling' (expected acceptance from accept_prob)."""
    origins: tuple[str, ...] | None = ("target",)
    """Prefix origins whose sequences are replayed (None: all). 'target' is the exact case for greedy."""
    teacher_forced_only: bool = True
    """Keep only sequences that are teacher-forced along the stored continuation (``rollout == False``), when that
    column
    exists; a draft rollout after a target prefix is not the speculative-decoding path."""
    split: str | None = None
    """Only rows of this ``split`` (None: all rows given)."""
    fallback_to_all: bool = True
    """When the selection above is empty, replay every sequence instead (the result is then marked approximate)."""
    max_draft_len: int | None = None
    """Extra cap on draft tokens per round for every policy (None: each policy's own ``draft_cap()``)."""
    online_roc_baseline: bool = False
    """Also replay transformers' max-confidence with online ROC re-tuning (one sklearn call per round: slow)."""
    branch_rollouts: bool = False
    """Greedy mode: past a round's first mismatch, and past the stored end, follow the draft's own rollout from that
    prefix when the data holds one (a rollout segment of the same ``seq_id`` starting at a stored position of the
    sequence or at its end, as ``data_gen.generate.label_continuation`` writes them), so that the drafted lengths, not
    only the accepted counts, are those of a real run. Where the data holds no such rollout the round goes on along
    the stored rows, as without this option."""
    max_new_tokens: int | None = None
    """The decoder's limit of new tokens per sequence: a round drafts at most ``max_new_tokens - emitted - 1`` tokens,
    as the engine caps it (None: up to the stored end)."""

    def __post_init__(self) -> None:
        if self.mode not in REPLAY_MODES:
            raise ValueError(f"ReplayConfig.mode={self.mode!r}: use one of {REPLAY_MODES}")
        if self.max_draft_len is not None and self.max_draft_len < 1:
            raise ValueError(f"ReplayConfig.max_draft_len must be >= 1 or None, got {self.max_draft_len}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"ReplayConfig.max_new_tokens must be >= 1 or None, got {self.max_new_tokens}")


@dataclass
class ReplayData:
    """Rows sorted by (seq_id, offset) with per-sequence boundaries, ready for replay."""

    features: dict[str, Tensor]
    """Column -> tensor, rows sorted by sequence then offset (what policies score)."""
    starts: np.ndarray
    """[S] first row of each sequence."""
    ends: np.ndarray
    """[S] one past the last row of each sequence."""
    greedy: np.ndarray
    """[N] bool greedy_match."""
    accept: np.ndarray
    """[N] float accept_prob = min(1, p/q)."""
    q: np.ndarray
    """[N] float q(x) of the drafted token."""
    match_run: np.ndarray
    """[N] consecutive greedy matches starting at each row, within its sequence."""
    exact: bool
    """True when greedy replay on these sequences reproduces real accepted counts (teacher-forced target sequences)."""
    note: str
    """Which sequences were selected and why."""
    branches: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    """(first row of a sequence, offset in it) -> rows [a, b) of the draft's own rollout from that prefix
    (``ReplayConfig.branch_rollouts``; offset = the sequence's length for the rollout past its end). These rows follow
    every sequence's rows in the arrays above."""
    max_new_tokens: int | None = None
    """The decoder's new-token limit (``ReplayConfig.max_new_tokens``)."""

    @property
    def n_rows(self) -> int:
        """Rows of the replayed sequences (branch rollouts not counted)."""
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def n_seqs(self) -> int:
        return int(self.starts.shape[0])


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
    """Goodput policies: (drafted, verified) tokens of every round (to compare with the engine's)."""
    expected_tokens: float = 0.0
    """Goodput policies: tokens the rounds expected to emit (calibrated acceptance of the verified prefixes)."""
    first_verify_s: float = 0.0
    """Seconds of each sequence's first verification pass under the cost model (in ``time_s``): the engine runs it
    inside the target's pass over the prompt, so a comparison with its measured prefill leaves it out."""

    def add_round(self, emitted: float, accepted: float, drafted: float, verified: float, seconds: float,
                  target_s_per_token: float, hist_key: int) -> None:
        """Count one verification round."""
        self.rounds += 1
        self.tokens += float(emitted)
        self.accepted += float(accepted)
        self.drafted += float(drafted)
        self.verified += float(verified)
        self.time_s += seconds
        self.target_only_s += emitted * target_s_per_token
        self.draft_len_hist[hist_key] = self.draft_len_hist.get(hist_key, 0) + 1

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
        return self.target_only_s / self.time_s if self.time_s > 0 else float("nan")

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


# ----------------------------------------------------------------------------------------------------------- data


def segment_keys(columns: Mapping[str, object]) -> np.ndarray:
    """[N] id of the labelled segment of each row: ``seq_id`` plus the segment start (``prefix_len - offset``).

    One ``seq_id`` can hold two segments whose offsets both start at 0 (the teacher-forced continuation, then the draft
    rollout); without ``prefix_len`` the ``rollout`` flag separates them.
    """
    seq = np.asarray(columns["seq_id"]).astype(str)
    if "prefix_len" in columns:
        start = np.asarray(columns["prefix_len"], dtype=np.int64) - np.asarray(columns["offset"], dtype=np.int64)
        return np.char.add(np.char.add(seq, "|"), start.astype(str))
    if "rollout" in columns:
        return np.char.add(np.char.add(seq, "|r"), np.asarray(columns["rollout"], dtype=bool).astype(int).astype(str))
    return seq


def _sort_order(columns: Mapping[str, object], keys: np.ndarray) -> np.ndarray:
    _, codes = np.unique(keys, return_inverse=True)
    offset = np.asarray(columns["offset"], dtype=np.int64)
    return np.lexsort((offset, codes))


def _match_run(greedy: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    run = np.zeros(greedy.shape[0], dtype=np.int64)
    for a, b in zip(starts, ends):
        r = 0
        for i in range(b - 1, a - 1, -1):
            r = r + 1 if greedy[i] else 0
            run[i] = r
    return run


def _select(columns: Mapping[str, object], cfg: ReplayConfig) -> tuple[np.ndarray, bool, str]:
    n = len(np.asarray(columns["seq_id"]))
    base = np.ones(n, dtype=bool)
    if cfg.split is not None and "split" in columns:
        base &= np.asarray(columns["split"]).astype(str) == cfg.split
        if not base.any():
            raise ValueError(f"no rows in split {cfg.split!r} to replay")
    origin = np.asarray(columns["origin"]).astype(str) if "origin" in columns else None
    rollout = np.asarray(columns["rollout"], dtype=bool) if "rollout" in columns else None
    attempts: list[tuple[np.ndarray, bool, str]] = []
    if cfg.origins is not None and origin is not None:
        m = base & np.isin(origin, list(cfg.origins))
        exact = set(cfg.origins) <= {"target"}
        if cfg.teacher_forced_only and rollout is not None:
            attempts.append((m & ~rollout, exact, f"origins {list(cfg.origins)}, teacher-forced (rollout == False)"))
        attempts.append((m, exact and rollout is None, f"origins {list(cfg.origins)}"))
    elif cfg.origins is not None:
        attempts.append((base, False, "no origin column: all sequences"))
    if cfg.origins is None or cfg.fallback_to_all:
        attempts.append((base, False, "all sequences"))
    for i, (mask, exact, desc) in enumerate(attempts):
        if mask.any():
            note = desc if i == 0 else f"{desc} (FALLBACK: nothing matched {attempts[0][2]})"
            return mask, exact, note
    raise ValueError(f"no sequences to replay: nothing matched {attempts[0][2]}")


def prepare_replay_data(columns: Mapping[str, object], cfg: ReplayConfig | None = None) -> ReplayData:
    """Select, sort and index the sequences to replay.

    Args:
        columns: record columns (``data_gen.schema``) as numpy arrays / lists; needs seq_id, offset, greedy_match,
            accept_prob, q.
        cfg: selection and mode (default :class:`ReplayConfig`).
    """
    cfg = cfg or ReplayConfig()
    need = [c for c in ("seq_id", "offset", "greedy_match", "accept_prob", "q") if c not in columns]
    if need:
        raise KeyError(f"replay needs the columns {need}; they are missing from the data")
    mask, exact, note = _select(columns, cfg)
    sub, starts, ends = _sorted_segments(columns, mask)
    note = f"{note}; {len(starts)} sequences, {len(sub['offset'])} tokens"
    branches: dict[tuple[int, int], tuple[int, int]] = {}
    if cfg.branch_rollouts and cfg.mode == "greedy":
        extra, branches = _branch_rollouts(columns, _branch_candidates(columns, mask, cfg), sub, starts, ends)
        if branches:
            sub = {k: np.concatenate([v, extra[k]]) for k, v in sub.items()}
        note += f"; {len(branches)} draft rollouts followed past a mismatch or the end"
    greedy = sub["greedy_match"].astype(bool)
    exact = exact and cfg.mode == "greedy"
    return ReplayData(
        features=as_tensor_dict(sub),
        starts=starts,
        ends=ends,
        greedy=greedy,
        accept=sub["accept_prob"].astype(np.float64),
        q=sub["q"].astype(np.float64),
        match_run=_match_run(greedy, starts, ends),
        exact=exact,
        note=note,
        branches=branches,
        max_new_tokens=cfg.max_new_tokens,
    )


def _sorted_segments(columns: Mapping[str, object], mask: np.ndarray
                     ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """The rows of ``mask`` sorted by segment then offset, and each segment's [start, end) rows."""
    idx = np.flatnonzero(mask)
    sub = {k: np.asarray(v)[idx] for k, v in columns.items()}
    keys = segment_keys(sub)
    order = _sort_order(sub, keys)
    sub = {k: v[order] for k, v in sub.items()}
    seq = keys[order]
    change = np.flatnonzero(seq[1:] != seq[:-1]) + 1
    starts = np.concatenate([[0], change]).astype(np.int64)
    ends = np.concatenate([change, [len(seq)]]).astype(np.int64)
    return sub, starts, ends


def _branch_candidates(columns: Mapping[str, object], mask: np.ndarray, cfg: ReplayConfig) -> np.ndarray:
    """[N] rollout rows outside the replayed sequences, of the same origins and split (``branch_rollouts``)."""
    if "rollout" not in columns or "prefix_len" not in columns:
        return np.zeros_like(mask)
    cand = np.asarray(columns["rollout"], dtype=bool) & ~mask
    if cfg.origins is not None and "origin" in columns:
        cand &= np.isin(np.asarray(columns["origin"]).astype(str), list(cfg.origins))
    if cfg.split is not None and "split" in columns:
        cand &= np.asarray(columns["split"]).astype(str) == cfg.split
    return cand


def _branch_rollouts(columns: Mapping[str, object], cand: np.ndarray, sub: dict[str, np.ndarray], starts: np.ndarray,
                     ends: np.ndarray) -> tuple[dict[str, np.ndarray], dict[tuple[int, int], tuple[int, int]]]:
    """The rollout segments among ``cand`` that start at a stored position of a replayed sequence (same ``seq_id``,
    same ``prefix_len``) or just past its end: their rows (to follow the sequences' rows) and ``ReplayData.branches``.
    """
    if not cand.any():
        return {}, {}
    at: dict[tuple[str, int], tuple[int, int]] = {}  # (seq_id, prefix_len) -> (sequence start row, offset)
    seq_ids, prefix = sub["seq_id"].astype(str), sub["prefix_len"].astype(np.int64)
    for a0, b0 in zip(starts.tolist(), ends.tolist()):
        for r in range(a0, b0):
            at[(seq_ids[r], int(prefix[r]))] = (a0, r - a0)
        at[(seq_ids[b0 - 1], int(prefix[b0 - 1]) + 1)] = (a0, b0 - a0)
    rows, r_starts, r_ends = _sorted_segments(columns, cand)
    first = rows["prefix_len"].astype(np.int64)[r_starts]
    keep: list[np.ndarray] = []
    branches: dict[tuple[int, int], tuple[int, int]] = {}
    n = int(ends[-1])
    for a, b, p in zip(r_starts.tolist(), r_ends.tolist(), first.tolist()):
        where = at.get((str(rows["seq_id"][a]), int(p)))
        if where is None or where in branches:
            continue
        branches[where] = (n, n + b - a)
        keep.append(np.arange(a, b))
        n += b - a
    idx = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
    return {k: v[idx] for k, v in rows.items()}, branches


# ------------------------------------------------------------------------------------------------------ policies


def missing_columns(policy: StopPolicy, available: Iterable[str]) -> list[str]:
    """Columns the policy needs that the data lacks."""
    have = set(available)
    return [c for c in getattr(policy, "required_columns", ()) if c not in have]


def _overrides(policy: StopPolicy, name: str) -> bool:
    return getattr(type(policy), name) is not getattr(StopPolicy, name)


def _needs_round_features(policy: StopPolicy) -> bool:
    """Scores depend on the in-round position or on earlier tokens of the round: score per round, not once."""
    return "position" in getattr(policy, "required_columns", ()) or _overrides(policy, "keep_drafting")


def _position_dependent(policy: StopPolicy) -> bool:
    """The score reads the in-round ``position`` but is otherwise per token: precompute one column per position."""
    return "position" in getattr(policy, "required_columns", ()) and not _overrides(policy, "keep_drafting")


def position_score_matrix(policy: StopPolicy, features: Mapping[str, Tensor], width: int) -> np.ndarray:
    """[N, width] ``policy.score`` of every row as if it were drafted at in-round position j = 0..width-1."""
    n = next(iter(features.values())).shape[0]
    out = np.empty((n, width), dtype=np.float64)
    for j in range(width):
        feats = dict(features)
        feats["position"] = torch.full((n,), j, dtype=torch.long)
        out[:, j] = policy_scores(policy, feats)
    return out


def _scores_for(policy: StopPolicy, data: ReplayData, max_draft_len: int | None) -> np.ndarray | None:
    """Precomputed scores: [N] for per-token policies, [N, cap] for position-dependent ones, None for the rest."""
    if policy.verification == HINDSIGHT:
        return None
    if _position_dependent(policy):
        width = int(policy.max_draft_len) if max_draft_len is None else min(int(policy.max_draft_len), max_draft_len)
        return position_score_matrix(policy, data.features, max(width, 1))
    if _needs_round_features(policy):
        return None
    return policy_scores(policy, data.features)


def policy_scores(policy: StopPolicy, features: Mapping[str, Tensor], chunk: int = 16384) -> np.ndarray:
    """[N] ``policy.score`` over all rows, in chunks, as float64 numpy."""
    n = next(iter(features.values())).shape[0]
    out = []
    with torch.no_grad():
        for a in range(0, n, chunk):
            part = {k: v[a : a + chunk] for k, v in features.items()}
            out.append(policy.score(part).detach().float().reshape(-1).cpu().numpy())
    return np.concatenate(out).astype(np.float64) if out else np.zeros(0)


def _window(features: Mapping[str, Tensor], rows: np.ndarray) -> dict[str, Tensor]:
    """The features of a round's rows (increasing), with ``position`` the in-round draft position."""
    if len(rows) and int(rows[-1]) - int(rows[0]) + 1 == len(rows):  # contiguous: views
        a, b = int(rows[0]), int(rows[-1]) + 1
        w = {k: v[a:b] for k, v in features.items()}
    else:
        idx = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        w = {k: v[idx] for k, v in features.items()}
    w["position"] = torch.arange(len(rows))  # the in-round draft position, as the decoder sees it
    return w


class OracleSchedule(StopPolicy):
    """Cost-optimal hindsight schedule (greedy replay): the fastest way to emit each stored sequence under the cost
    model."""

    kind = "oracle_schedule"
    required_columns = ("greedy_match",)
    verification = HINDSIGHT
    has_threshold = False

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["greedy_match"].float()


def _schedule(run: np.ndarray, a0: int, b0: int, cap: int, per_draft: float, cm: CostModel) -> dict[int, int]:
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


def with_threshold(policy: StopPolicy, threshold: float) -> StopPolicy:
    """A copy of ``policy`` starting at ``threshold`` (online policies restart from it on every reset)."""
    p = copy.deepcopy(policy)
    old = p.threshold
    p.threshold = float(threshold)
    init = getattr(p, "initial", None)
    if isinstance(init, float) and math.isclose(init, old):
        p.initial = float(threshold)
    return p


# -------------------------------------------------------------------------------------------------------- replay


def _sampling_oracle(acc: np.ndarray, cm: CostModel, companion: bool) -> tuple[float, float, float]:
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
        scores=scores if scores is not None else _scores_for(policy, data, max_draft_len),
        per_draft=cm.draft_s_per_token + (cm.companion_s_per_token if companion else 0.0),
        companion=companion, online=_overrides(policy, "update"), res=ReplayResult(n_seqs=data.n_seqs),
        sequential=policy.verification == SEQUENTIAL and not verify_all,
    )
    for a0, b0 in zip(data.starts.tolist(), data.ends.tolist()):
        _replay_sequence(rp, a0, b0)
    return rp.res


def _replay_sequence(rp: _Replay, a0: int, b0: int) -> None:
    """Rounds over rows [a0, b0) of one stored sequence, each starting where the previous one's emitted tokens end."""
    rp.policy.reset()
    plan = None
    if isinstance(rp.policy, OracleSchedule) and rp.mode == "greedy":
        top = rp.policy.round_cap(rp.max_draft_len)
        plan = _schedule(rp.data.match_run, a0, b0, top, rp.per_draft, rp.cm)
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
    acc_exp, n_exp, t = _sampling_oracle(rp.data.accept[s : s + min(cap, rem - 1)], rp.cm, rp.companion)
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
    t = n * rp.per_draft + rp.cm.target_time(nv + 1)
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
        return goodput.draft_round(_round_acceptance(rp, rows, w), rp.goodput, cap)
    if w is None:
        keep = rp.policy.keep_drafting(_window(rp.data.features, rows)).cpu().numpy().astype(bool)
    else:
        keep = w >= rp.policy.threshold
    n = drafted_length(keep)
    return n, n


def _goodput_cost(cm: CostModel, companion: bool) -> goodput.RoundCost:
    return goodput.RoundCost.from_cost_model(cm, companion=companion)


def _round_acceptance(rp: _Replay, rows: np.ndarray, w: np.ndarray | None) -> np.ndarray:
    """[len(rows)] calibrated acceptance of a round's rows at in-round positions 0, 1, ... (a goodput policy's
    scores)."""
    est = w if w is not None else rp.policy.score(_window(rp.data.features, rows)).numpy()
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


# ---------------------------------------------------------------------------------------------------------- tables


def default_replay_policies(
    static_lengths: Iterable[int] = range(1, 11), max_draft_len: int = 40, online_roc: bool = False
) -> dict[str, StopPolicy]:
    """The training-free baselines replayed next to the learned policies."""
    from predictors.baselines import SVIP, AdaEDL, HFHeuristic, MaxConfidence, Oracle, StaticLength

    pols: dict[str, StopPolicy] = {
        f"static-{k}": StaticLength(k, max_draft_len=max(max_draft_len, k)) for k in static_lengths
    }
    pols["hf-heuristic"] = HFHeuristic(initial=5, max_draft_len=max_draft_len)
    pols["svip"] = SVIP(h=0.3, gamma=0.15, max_draft_len=max_draft_len)
    pols["adaedl"] = AdaEDL(lam=0.6, gamma=0.2, max_draft_len=max_draft_len, online=True)
    pols["max-confidence"] = MaxConfidence(threshold=0.4, max_draft_len=max_draft_len)
    if online_roc:
        # transformers' online ROC re-tuning: one sklearn roc_curve per round, slow on large data, so opt-in.
        pols["hf-confidence-roc"] = MaxConfidence(threshold=0.4, max_draft_len=max_draft_len, online_roc=True)
    pols["oracle"] = Oracle(threshold=0.5, max_draft_len=max_draft_len)
    pols["oracle-schedule"] = OracleSchedule(threshold=0.5, max_draft_len=max_draft_len)
    return pols


def default_grid(policy: StopPolicy, data: ReplayData, n: int = 15, scores: np.ndarray | None = None) -> list[float]:
    """Thresholds to sweep: quantiles of the policy's scores on the data, plus its own threshold."""
    if scores is None:
        scores = _scores_for(policy, data, None)
    if scores is None or scores.size == 0:
        base = np.linspace(0.05, 0.95, n)
    else:
        flat = (scores[:, 0] if scores.ndim == 2 else scores).ravel()  # first drafted position for position scores
        base = np.quantile(flat[np.isfinite(flat)], np.linspace(0.02, 0.98, n))
    grid = sorted(set(np.round(np.append(base, policy.threshold), 6).tolist()))
    return [float(g) for g in grid]


def threshold_sweep(
    policy: StopPolicy,
    data: ReplayData,
    cost_model: CostModel,
    grid: Sequence[float] | None = None,
    mode: str = "greedy",
    max_draft_len: int | None = None,
    verify_all: bool = False,
) -> pd.DataFrame:
    """Replay ``policy`` at each threshold of ``grid`` (default :func:`default_grid`); one row per threshold
    (``verify_all``: see :func:`replay_policy`)."""
    scores = _scores_for(policy, data, max_draft_len)
    grid = list(grid) if grid is not None else default_grid(policy, data, scores=scores)
    rows = []
    for thr in grid:
        p = with_threshold(policy, thr)
        r = replay_policy(p, data, cost_model, mode, max_draft_len=max_draft_len, scores=scores, verify_all=verify_all)
        rows.append({"threshold": float(thr), **r.as_row()})
    return pd.DataFrame(rows)


def tune_threshold(
    policy: StopPolicy,
    columns: Mapping[str, object],
    cost_model: CostModel,
    grid: Sequence[float] | None = None,
    *,
    split: str | None = "val",
    mode: str = "greedy",
    origins: tuple[str, ...] | None = ("target",),
) -> tuple[float, float]:
    """Threshold maximising predicted speedup on the ``split`` rows (DISCO tunes for latency, not F1).

    Args:
        policy: the policy to tune (not modified).
        columns: record columns; rows of ``split`` are used when a ``split`` column exists (pass split=None to use all).
        cost_model: round latency model.
        grid: thresholds to try (default: quantiles of the policy's scores).
        split: rows to tune on ('val'); mode: greedy or sampling verification; origins: sequences replayed (see
            :class:`ReplayConfig`; falls back to every sequence when none match).
    Returns:
        (best threshold, its predicted speedup). The policy is replayed with its threshold rule (SV's goodput length
        has no threshold to tune); an approximate policy (SPRINTER) as if every drafted token were verified, so the
        speed it is tuned for rewards stopping at the tokens the target would reject (taking its drafts unverified,
        the fastest threshold would never stop; its output's quality has no place in the objective).

    Example (what the main job does after training)::

        thr, sp = tune_threshold(policy, val_columns, CostModel.from_json(data_dir / "cost_model.json"))
        update_metadata(export_folder, threshold=thr, tuning={"split": "val", "speedup": sp})
    """
    if split is not None and "split" in columns and not np.any(np.asarray(columns["split"]).astype(str) == split):
        raise ValueError(f"tune_threshold: no rows in split {split!r}")
    cfg = ReplayConfig(mode=mode, origins=origins, split=split if "split" in columns else None)
    data = prepare_replay_data(columns, cfg)
    sweep = threshold_sweep(policy, data, cost_model, grid, mode, verify_all=True)
    best = sweep.loc[sweep["speedup"].idxmax()]
    return float(best["threshold"]), float(best["speedup"])


def replay_table(
    columns: Mapping[str, object],
    policies: Mapping[str, StopPolicy | None],
    cost_model: CostModel,
    cfg: ReplayConfig | None = None,
    *,
    static_lengths: Iterable[int] = range(1, 11),
    include_baselines: bool = True,
    sweep: bool = True,
    grid_size: int = 15,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Replay every policy (the given ones plus the baselines) at its own threshold, and sweep thresholds.

    Args:
        columns: record columns (numpy arrays / lists).
        policies: name -> policy (None: listed with the reason 'not loaded').
        cost_model: round latency model.
        cfg: sequence selection and verification mode.
        static_lengths: static draft lengths added as baselines (the best one is added as 'static-best').
        include_baselines: add :func:`default_replay_policies`.
        sweep: also replay each thresholded policy over a grid (the second frame).
    Returns:
        (table, sweep): one row per policy (policy, kind, threshold, ..., speedup, reason), and one row per
        (policy, threshold) of the sweep; ``table.attrs["round_tokens"]``: per goodput policy, the (expected, replayed)
        tokens of each round.
    """
    cfg = cfg or ReplayConfig()
    data = prepare_replay_data(columns, cfg)
    all_pols: dict[str, StopPolicy | None] = {}
    if include_baselines:
        all_pols.update(default_replay_policies(static_lengths, online_roc=cfg.online_roc_baseline))
    all_pols.update(policies)
    common = {
        "mode": cfg.mode,
        "sequences": data.note,
        "exact_accepts": data.exact,
        "cost_model": "assumed" if cost_model.assumed else "measured",
    }
    rows, sweeps = [], []
    results: dict[str, ReplayResult] = {}
    for name, pol in all_pols.items():
        base = {"policy": name, "kind": getattr(pol, "kind", ""), "threshold": getattr(pol, "threshold", float("nan"))}
        if pol is None:
            rows.append({**base, **common, "reason": "policy not loaded"})
            continue
        miss = missing_columns(pol, data.features)
        if miss:
            rows.append({**base, **common, "reason": f"missing columns {miss}"})
            continue
        p = copy.deepcopy(pol)
        try:
            r = replay_policy(p, data, cost_model, cfg.mode, max_draft_len=cfg.max_draft_len)
        except ValueError as e:  # a goodput policy without a map for this mode, a curve of one length
            rows.append({**base, **common, "reason": str(e)})
            continue
        results[name] = r
        # SV's rounds follow its goodput rule, SPRINTER's its approximate sequential verification
        rows.append({**base, **common, **r.as_row(), "verification": pol.verification, "reason": ""})
        if sweep and pol.tunable:
            sw = threshold_sweep(pol, data, cost_model, None, cfg.mode, cfg.max_draft_len)
            sw.insert(0, "policy", name)
            sweeps.append(sw)
    table = pd.DataFrame(rows)
    static = table[table["policy"].str.startswith("static-") & table.get("speedup", pd.Series(dtype=float)).notna()]
    if len(static):
        best = static.loc[static["speedup"].idxmax()].to_dict()
        best["policy"] = f"static-best (k={best['policy'].removeprefix('static-')})"
        table = pd.concat([table, pd.DataFrame([best])], ignore_index=True)
    if sweeps:
        sweep_df = pd.concat(sweeps, ignore_index=True)
    else:
        sweep_df = pd.DataFrame(columns=["policy", "threshold", "speedup"])
    table.attrs["round_tokens"] = {name: r.round_tokens for name, r in results.items() if r.round_tokens}
    return table, sweep_df
