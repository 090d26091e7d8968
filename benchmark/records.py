"""Per-prompt records of a benchmark row and the paired bootstrap every benchmark computes its intervals with, so a
stored summary's figures can be recomputed from what it holds (``benchmark.verify``).

A row's records are columns of lists, one entry a prompt (or a unit of prompts decoded together): tokens, seconds
(full precision: the figures were computed from these very values), rounds, drafted and accepted draft tokens, and a
short hash of each output's token ids (outputs equal iff hashes equal, without storing the tokens).

Usage::

    rec = row_records(outputs, seconds, rounds, drafted, accepted)
    boot = bootstrap_indices(seed=0, n_boot=1000, n=len(seconds))
    mid, lo, hi = paired_ratio(tok, sec, ref_tok, ref_sec, boot)
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

COUNTS = ("rounds", "drafted", "accepted")
"""The per-prompt round counters of a record (None per prompt where a row cannot split them by prompt)."""


def output_hash(tokens: Sequence[int]) -> str:
    """A short sha1 of an output's token ids (12 hex digits: equal outputs, equal hashes)."""
    return hashlib.sha1(json.dumps([int(t) for t in tokens]).encode()).hexdigest()[:12]


def row_records(outputs: Sequence[Sequence[int]], seconds: Sequence[float], rounds: Sequence[int | None],
                drafted: Sequence[int | None], accepted: Sequence[int | None]) -> dict[str, list[Any]]:
    """A row's per-prompt records as columns of lists; counters shorter than the prompts (a row read back from an
    older stored prompt) are stored as None per prompt."""
    n = len(outputs)

    def column(values: Sequence[int | None]) -> list[int | None]:
        return [None if v is None else int(v) for v in values] if len(values) == n else [None] * n

    return {"tokens": [len(o) for o in outputs], "seconds": [float(s) for s in seconds],
            "rounds": column(rounds), "drafted": column(drafted), "accepted": column(accepted),
            "output_sha1": [output_hash(o) for o in outputs]}


def bootstrap_indices(seed: int, n_boot: int, n: int) -> np.ndarray:
    """[n_boot, n] prompt indices resampled with replacement, seeded: the same draw for every row of a run."""
    return np.random.default_rng(seed).integers(0, n, (n_boot, n))


def paired_ratio(tok: Sequence[float], sec: Sequence[float], ref_tok: Sequence[float], ref_sec: Sequence[float],
                 boot: np.ndarray) -> tuple[float, float, float]:
    """tokens/s over the reference's, and its 95% paired bootstrap interval over the prompts (``boot``: resampled
    prompt indices, the same for both rows)."""
    point = (sum(tok) / sum(sec)) / (sum(ref_tok) / sum(ref_sec))
    t, s, rt, rs = (np.asarray(x, float) for x in (tok, sec, ref_tok, ref_sec))
    ratios = (t[boot].sum(1) / s[boot].sum(1)) / (rt[boot].sum(1) / rs[boot].sum(1))
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(point), float(lo), float(hi)
