"""The replay's input: which stored sequences are replayed (``ReplayConfig``), sorted and indexed as ``ReplayData``
(rows by segment and offset, each sequence's bounds, its runs of greedy matches, and the draft's own rollouts to follow
past a mismatch when ``ReplayConfig.branch_rollouts`` asks for them)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from predictors.base import as_tensor_dict

__all__ = ["REPLAY_MODES", "ReplayConfig", "ReplayData", "prepare_replay_data", "segment_keys"]

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
