"""Per-prompt records of a benchmark row and the paired bootstrap every benchmark computes its intervals with, so a
stored summary's figures can be recomputed from what it holds (``benchmark.verify``).

A row's records are columns of lists, one entry a prompt (or a unit of prompts decoded together): tokens, seconds
(full precision: the figures were computed from these very values), rounds, drafted and accepted draft tokens, and a
short hash of each output's token ids (outputs equal iff hashes equal, without storing the tokens). A run that samples
each prompt several times has one entry per sample, and two more columns: ``prompt`` (the run's prompt index, what
the bootstrap resamples: a prompt's samples go with it) and ``sample``. A run that times every row several times a
prompt (``repeats``) stores each run's seconds too (``pass_seconds``), and ``seconds`` is :func:`pass_adjusted` of them.

Usage::

    rec = row_records(outputs, seconds, rounds, drafted, accepted, units=[(0, 0), (0, 1), (1, 0), (1, 1)])
    boot = bootstrap_indices(seed=0, n_boot=1000, n=n_prompts(rec.get("prompt"), len(seconds)))
    mid, lo, hi = paired_ratio(tok, sec, ref_tok, ref_sec, boot, rec.get("prompt"))
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

COUNTS = ("rounds", "drafted", "accepted")
"""The per-prompt round counters of a record (None per prompt where a row cannot split them by prompt)."""


def output_hash(tokens: Sequence[int]) -> str:
    """A short sha1 of an output's token ids (12 hex digits: equal outputs, equal hashes)."""
    return hashlib.sha1(json.dumps([int(t) for t in tokens]).encode()).hexdigest()[:12]


def row_records(outputs: Sequence[Sequence[int]], seconds: Sequence[float], rounds: Sequence[int | None],
                drafted: Sequence[int | None], accepted: Sequence[int | None],
                units: Sequence[tuple[int, int]] | None = None,
                pass_seconds: Sequence[Sequence[float | None]] = ()) -> dict[str, list[Any]]:
    """A row's per-prompt records as columns of lists; a counter the row does not count per prompt (a runtime's own
    generate, a batch sharing its counters) is stored as None per prompt. ``units``: each entry's (prompt, sample),
    when a prompt has several samples (the ``prompt`` and ``sample`` columns); ``pass_seconds``: each entry's runs'
    seconds, pass by pass, when it ran more than once (the ``pass_seconds`` column)."""
    n = len(outputs)

    def column(values: Sequence[int | None]) -> list[int | None]:
        return [None if v is None else int(v) for v in values] if len(values) == n else [None] * n

    rec: dict[str, list[Any]] = {"tokens": [len(o) for o in outputs], "seconds": [float(s) for s in seconds],
                                 "rounds": column(rounds), "drafted": column(drafted), "accepted": column(accepted),
                                 "output_sha1": [output_hash(o) for o in outputs]}
    if units is not None:
        rec["prompt"] = [int(p) for p, _ in units[:n]]
        rec["sample"] = [int(s) for _, s in units[:n]]
    if len(pass_seconds) == n:
        rec["pass_seconds"] = [[None if s is None else float(s) for s in runs] for runs in pass_seconds]
    return rec


def pass_adjusted(runs: dict[str, Sequence[float | None]]) -> dict[str, float]:
    """One decode's seconds for each row from every row's runs of it, pass by pass (None: a pass a row did not run,
    or whose output differed from its first run's). A pass's slowdown is the median over rows (those run more than
    once) of how much slower each ran in it than in its own median pass, 0 at the fastest pass; a row's seconds is the
    median over its runs, each divided by its pass's slowdown. A slow phase of the host that a pass's rows share
    (they run seconds apart) so cancels in every ratio between rows, and one row's spike is outvoted by the others;
    in one pass, the seconds as they are."""
    logs = {k: [None if s is None else math.log(s) for s in v] for k, v in runs.items()}
    n_pass = max((len(v) for v in logs.values()), default=0)
    if n_pass <= 1:
        return {k: float(v[0]) for k, v in runs.items() if v and v[0] is not None}
    typical = {k: float(np.median([x for x in v if x is not None])) for k, v in logs.items()}
    repeated = {k: v for k, v in logs.items() if sum(x is not None for x in v) > 1}  # rows that show a pass's pace
    slow = []
    for r in range(n_pass):
        dev = [v[r] - typical[k] for k, v in repeated.items() if r < len(v) and v[r] is not None]
        slow.append(float(np.median(dev)) if dev else 0.0)
    floor = min(slow)
    return {k: math.exp(float(np.median([x - (slow[r] - floor) for r, x in enumerate(v) if x is not None])))
            for k, v in logs.items() if any(x is not None for x in v)}


def n_prompts(prompts: Sequence[int] | None, n_entries: int) -> int:
    """How many prompts the bootstrap resamples: one per entry without a prompt index, else the prompts indexed."""
    return n_entries if prompts is None else max(prompts, default=-1) + 1


def bootstrap_indices(seed: int, n_boot: int, n: int) -> np.ndarray:
    """[n_boot, n] prompt indices resampled with replacement, seeded: the same draw for every row of a run."""
    return np.random.default_rng(seed).integers(0, n, (n_boot, n))


def prompt_sums(values: Sequence[float], prompts: Sequence[int] | None) -> np.ndarray:
    """Per prompt, the sum of its entries' values (``prompts``: each entry's prompt index; None: one entry a prompt,
    the values as they are)."""
    v = np.asarray(values, float)
    if prompts is None:
        return v
    return np.bincount(np.asarray(prompts, int), weights=v, minlength=max(prompts, default=-1) + 1)


def prompt_means(values: Sequence[float | bool | None], prompts: Sequence[int] | None) -> list[float | bool | None]:
    """Per prompt, the mean of its entries' scores (a HumanEval pass share, a ROUGE-L), in prompt order; None where a
    prompt has no score (not a HumanEval prompt). One entry a prompt (``prompts`` None): the scores as they are."""
    if prompts is None:
        return list(values)
    by_prompt: dict[int, list[float]] = {}
    for p, v in zip(prompts, values):
        if v is not None:
            by_prompt.setdefault(int(p), []).append(float(v))
    return [sum(by_prompt[p]) / len(by_prompt[p]) if p in by_prompt else None for p in sorted(set(prompts))]


def paired_ratio(tok: Sequence[float], sec: Sequence[float], ref_tok: Sequence[float], ref_sec: Sequence[float],
                 boot: np.ndarray, prompts: Sequence[int] | None = None) -> tuple[float, float, float]:
    """tokens/s over the reference's, and its 95% paired bootstrap interval over the prompts (``boot``: resampled
    prompt indices, the same for both rows; ``prompts``: each entry's prompt index when a prompt has several samples,
    which are resampled together: a cluster bootstrap over the prompts' summed tokens and seconds)."""
    point = (sum(tok) / sum(sec)) / (sum(ref_tok) / sum(ref_sec))
    t, s, rt, rs = (prompt_sums(x, prompts) for x in (tok, sec, ref_tok, ref_sec))
    ratios = (t[boot].sum(1) / s[boot].sum(1)) / (rt[boot].sum(1) / rs[boot].sum(1))
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(point), float(lo), float(hi)


def seconds_ratio(seconds: Sequence[float], base: Sequence[float], boot: np.ndarray) -> tuple[float, float, float]:
    """Summed ``seconds`` over summed ``base`` seconds, unit by unit paired, with its 95% bootstrap interval:
    :func:`paired_ratio` of one token a unit (a ratio of rates is the inverse ratio of seconds)."""
    ones = np.ones(len(seconds))
    return paired_ratio(ones, base, ones, seconds, boot)
