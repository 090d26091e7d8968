"""Recompute a stored benchmark summary's figures from its per-prompt records (``benchmark.records``), with the
benchmark's own routines: each prompt's seconds from its runs where a row ran several times a prompt, each row's
tokens/s, its ratios and their seeded bootstrap intervals (``Row.metrics``: over the prompts, each with its samples
where the records hold several), outputs equal to target-only's (the output hashes), accepted and drafted tokens a
round, ROUGE-L and HumanEval from their per-prompt scores (a prompt's samples averaged first), the ratios between rows
(llama.cpp's comparisons, transformers' tuned row against its defaults) and the verdict sentence. ``python -m
pipelines.results --verify`` runs it on every file in ``results/``.

Usage::

    first = verify_benchmark(summary.data)   # None when every figure agrees, else the first Disagreement
"""
from __future__ import annotations

import math
from typing import Any

from benchmark.records import bootstrap_indices, n_prompts, pass_adjusted
from benchmark.report import against_defaults, mark_identical, reference_rows, score_means
from benchmark.rows import Row, ratio_ci
from rendering.result_store import Disagreement

FIGURES = ("tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "vs_best_entropy", "vs_best_entropy_lo",
           "vs_best_entropy_hi", "vs_best_thresholded", "vs_best_thresholded_lo", "vs_best_thresholded_hi",
           "identical_prompts", "exact", "mean_accepted", "mean_drafted", "rouge_l", "humaneval_pass", "vs_defaults",
           "vs_defaults_lo", "vs_defaults_hi")
"""The fields of a stored row that are recomputed and compared."""


class MissingRecords(ValueError):
    """A summary stored without per-prompt records: nothing to recompute its figures from."""


def same(a: Any, b: Any) -> bool:
    """Equal figures (floats within a rounding step of their last stored digit)."""
    if isinstance(a, float) and isinstance(b, float | int) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return a == b


def stand_ins(rec: dict[str, Any]) -> list[list[int]]:
    """Each output as its hash (read as a number) repeated over its length: equal outputs, equal stand-ins."""
    return [[int(h, 16)] * n for h, n in zip(rec["output_sha1"], rec["tokens"])]


def row_from_records(entry: dict[str, Any]) -> Row:
    """A benchmark row rebuilt from a stored entry: its identity and per-prompt records; each output stands in as its
    hash repeated over its length (:func:`stand_ins`)."""
    rec = entry.get("records")
    if not rec:
        raise MissingRecords(f"row {entry.get('row')!r} has no per-prompt records")
    row = Row(name=entry["row"], method=entry.get("method") or "", kind=entry.get("kind") or "",
              verification=entry.get("verification") or "", thresholded=bool(entry.get("thresholded")),
              reference=bool(entry.get("reference")), estimated=bool(entry.get("estimated")))
    row.seconds = list(rec["seconds"])
    row.outputs = stand_ins(rec)
    for name, total in (("rounds", "rounds"), ("drafted", "draft_tokens"), ("accepted", "accepted")):
        if None not in rec[name]:
            setattr(row, total, sum(rec[name]))
    if rec.get("rouge_l"):
        row.prompt_rouge_l = list(rec["rouge_l"])
    if rec.get("humaneval_pass"):
        row.prompt_humaneval = list(rec["humaneval_pass"])
    score_means(row, rec.get("prompt"))
    return row


def record_units(data: dict[str, Any]) -> list[tuple[int, int]] | None:
    """Each entry's (prompt, sample) from the first row's records (a run sampling each prompt several times stores
    them), None with one entry a prompt."""
    rec = data["rows"][0]["records"]
    return None if rec.get("prompt") is None else list(zip(rec["prompt"], rec["sample"]))


def recompute_rows(data: dict[str, Any]) -> tuple[list[Row], list[dict[str, Any]]]:
    """The rows rebuilt from a summary's records and their report entries, computed as the benchmark computes them
    (``benchmark.report.finish_rows`` without the outputs' text: ROUGE-L and HumanEval from per-prompt scores)."""
    rows = [row_from_records(r) for r in data["rows"]]
    if data.get("temperature", 0) == 0:
        mark_identical(rows)
    best_entropy, best_thr = reference_rows(rows)
    units = record_units(data)
    prompts = None if units is None else [p for p, _ in units]
    boot = bootstrap_indices(int(data["seed"]), int(data["n_boot"]), n_prompts(prompts, len(rows[0].seconds)))
    table = [r.metrics(rows[0], best_entropy, boot, best_thr, units) for r in rows]
    against_defaults(rows, table, boot, quiet=True, prompts=prompts)
    return rows, table


def verify_benchmark(data: dict[str, Any]) -> Disagreement | None:
    """The first figure of a ``benchmark`` summary that its records do not give (None: all agree). MissingRecords
    when it holds none."""
    if data.get("seed") is None or data.get("n_boot") is None:
        raise MissingRecords("no seed and n_boot of its bootstrap")
    first = verify_pass_seconds(data)
    if first is not None:
        return first
    rows, table = recompute_rows(data)
    for stored, new in zip(data["rows"], table):
        shared = None in stored["records"]["rounds"]  # a batch's counters: no per-prompt split to recompute from
        for key in FIGURES:
            if shared and key in ("mean_accepted", "mean_drafted"):
                continue
            if key in stored and not same(stored[key], new.get(key)):
                return Disagreement(stored["row"], key, stored[key], new.get(key))
    units = record_units(data)
    prompts = None if units is None else [p for p, _ in units]
    boot = bootstrap_indices(int(data["seed"]), int(data["n_boot"]), n_prompts(prompts, len(rows[0].seconds)))
    by_name = {r.name: r for r in rows}
    for c in data.get("comparisons") or []:
        row, against = (by_name[n] for n in c["rows"])
        for key, value in zip(("ratio", "lo", "hi"), ratio_ci(row, against, boot, prompts)):
            if not same(c.get(key), value):
                return Disagreement(f"{c['row']} against {c['against']}", key, c.get(key), value)
    return None


def verify_pass_seconds(data: dict[str, Any]) -> Disagreement | None:
    """The first entry's seconds that its rows' runs (``pass_seconds``, where a row ran more than once a prompt) do not
    give by ``benchmark.records.pass_adjusted``; None when all agree or no row holds runs."""
    timed = [r for r in data["rows"] if (r.get("records") or {}).get("pass_seconds")]
    for e in range(len(timed[0]["records"]["seconds"]) if timed else 0):
        adjusted = pass_adjusted({r["row"]: r["records"]["pass_seconds"][e] for r in timed})
        for r in timed:
            if not same(r["records"]["seconds"][e], adjusted.get(r["row"])):
                return Disagreement(r["row"], f"seconds of entry {e}", r["records"]["seconds"][e],
                                    adjusted.get(r["row"]))
    return None


def recomputed_summary(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of the summary whose rows carry the recomputed figures (rendered beside the stored one to compare the
    verdicts)."""
    _, table = recompute_rows(data)
    rows = [{**stored, **{k: new.get(k) for k in FIGURES if k in stored}} for stored, new in zip(data["rows"], table)]
    return {**data, "rows": rows}
