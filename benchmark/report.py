"""The benchmark's report: the rows' entries (exactness and ROUGE-L against target-only, ratios to the best entropy and
the best thresholded row with their intervals: :func:`finish_rows`), ``benchmark.md``, ``benchmark.json`` and
``speedup.png`` (:func:`write_report`), and the console table within 100 columns (:func:`console_table`)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmark.bench import SAMPLE_SEED_STRIDE, Bench, RunOrder, decode_units
from benchmark.humaneval_check import humaneval_passes, pass_rate
from benchmark.plots import plot_speedups
from benchmark.records import bootstrap_indices, n_prompts, prompt_means
from benchmark.resume import PROMPTS_DIR
from benchmark.rows import Row, ratio_ci
from compute.compute_path import compute_path_of, cpu_info
from data_gen.config import ModelsConfig
from predictors.baselines import ENTROPY_KINDS

log = logging.getLogger("pipelines.benchmark")


COLUMNS = ("row", "tokens_per_s", "speedup", "vs_best_entropy", "vs_best_thresholded", "mean_accepted",
           "mean_drafted", "target_calls_per_token", "wasted_per_token", "stop_overhead", "identical_prompts",
           "rouge_l", "humaneval_pass", "runs", "note")


RATIO_COLUMNS = ("speedup", "vs_best_entropy", "vs_best_thresholded")
"""Columns holding a ratio with its interval (``<c>_lo``, ``<c>_hi``)."""


def _cell(r: dict[str, Any], c: str) -> str:
    v = r.get(c)
    if c in RATIO_COLUMNS and v is not None and r.get(f"{c}_lo") is not None:
        return f"{v:.3f} [{r[f'{c}_lo']:.2f}, {r[f'{c}_hi']:.2f}]"
    return "" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


CONSOLE = (("row", "row"), ("tok/s", "tokens_per_s"), ("vs target-only", "speedup"), ("vs entropy", "vs_best_entropy"),
           ("vs thresholded", "vs_best_thresholded"), ("accepted", "mean_accepted"), ("same", "identical_prompts"))
"""The console table's (header, column): the rest is in benchmark.md."""


def _short(r: dict[str, Any], c: str, n_prompts: int) -> str:
    v = r.get(c)
    if v is None:
        return ""
    if c in RATIO_COLUMNS:
        lo, hi = r.get(f"{c}_lo"), r.get(f"{c}_hi")
        return f"{v:.2f}" if lo is None else f"{v:.2f} [{lo:.2f},{hi:.2f}]"
    if c == "identical_prompts":
        return f"{v}/{n_prompts}"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def console_table(rows: list[dict[str, Any]], n_prompts: int, width: int = 100) -> str:
    """The rows in aligned columns within ``width`` characters (row names cut with ``~`` when needed; columns no row
    fills dropped); every column is in benchmark.md."""
    cells = [[h for h, _ in CONSOLE]] + [[_short(r, c, n_prompts) for _, c in CONSOLE] for r in rows]
    used = [i for i in range(len(CONSOLE)) if i == 0 or any(c[i] for c in cells[1:])]
    widths = {i: max(len(c[i]) for c in cells) for i in used}
    widths[0] = max(12, min(widths[0], width - sum(widths[i] + 2 for i in used[1:])))

    def cell(v: str, i: int) -> str:
        v = v if len(v) <= widths[i] else v[: widths[i] - 1] + "~"
        return v.ljust(widths[i]) if i == 0 else v.rjust(widths[i])

    lines = ["  ".join(cell(c[i], i) for i in used).rstrip()[:width] for c in cells]
    lines.insert(1, "-" * max(len(x) for x in lines))
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def rouge_l(outputs: list[list[int]], refs: list[list[int]], tokenizer) -> list[float]:
    """ROUGE-L F1 of each decoded output against its decoded reference."""
    from rouge_score import rouge_scorer  # slow to import (nltk): only when outputs are compared

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    vals = []
    for o, r in zip(outputs, refs):
        a, b = tokenizer.decode(r, skip_special_tokens=True), tokenizer.decode(o, skip_special_tokens=True)
        if not a.strip() and not b.strip():
            vals.append(1.0)
            continue
        vals.append(scorer.score(a, b)["rougeL"].fmeasure)
    return vals


def mean_or_zero(values: list[float]) -> float:
    """The mean of per-prompt scores (0.0 for none): a row's ROUGE-L from its prompts'."""
    return sum(values) / len(values) if values else 0.0


def finish_rows(rows: list[Row], bench: Bench, n_boot: int = 1000, quiet: bool = False,
                names: list[str] | None = None) -> list[dict[str, Any]]:
    """Exactness and ROUGE-L against target-only, HumanEval's tests on each row's answers (where ``names``, the
    prompts' ids, hold HumanEval prompts), the bootstrap intervals (``n_boot`` resamples of the prompts, each with its
    samples), the best entropy row: the report rows (``quiet``: without logging the cost-aware line)."""
    greedy = bench.decoding.temperature == 0
    units = decode_units(len(bench.prompts), bench.decoding.samples_per_prompt)
    prompts = None if units is None else [p for p, _ in units]
    if greedy:
        mark_identical(rows)
    for r in compared_rows(rows):
        r.prompt_rouge_l = rouge_l(r.outputs, rows[0].outputs, bench.tokenizer)
    if names and any(n.startswith("humaneval:") for n in names):
        unit_names = names if prompts is None else [names[p] for p in prompts]
        for r in rows:
            if r.outputs:
                replies = [bench.tokenizer.decode(o, skip_special_tokens=True) for o in r.outputs]
                r.prompt_humaneval = humaneval_passes(unit_names[:len(replies)], replies)
    for r in rows:
        score_means(r, prompts)
    best_entropy, best_thr = reference_rows(rows)
    boot = bootstrap_indices(bench.decoding.seed, n_boot, n_prompts(prompts, len(bench.prompts)))
    table = [r.metrics(rows[0], best_entropy, boot, best_thr, units) for r in rows]
    # target-only's tokens, and in greedy decoding those of every row whose output differs (an approximate policy's):
    # what pipelines.replay_check labels
    for t, r in zip(table, rows):
        if r is rows[0] or (greedy and r.exact is False and r.method == "engine"):
            t["output_ids"] = r.outputs
    line = cost_aware_line(table, best_thr.name if best_thr else None)
    if line and not quiet:
        log.info(line)
    against_defaults(rows, table, boot, quiet, prompts)
    return table


def score_means(row: Row, prompts: list[int] | None) -> None:
    """The row's ROUGE-L and HumanEval pass share from its per-entry scores (where scored): each prompt's samples
    averaged, then the prompts (``prompts``: each entry's prompt index; None: one entry a prompt)."""
    if row.prompt_rouge_l:
        row.rouge_l = mean_or_zero([float(v) for v in prompt_means(row.prompt_rouge_l, prompts) if v is not None])
    if row.prompt_humaneval:
        row.humaneval_pass = pass_rate(prompt_means(row.prompt_humaneval, prompts))


def compared_rows(rows: list[Row]) -> list[Row]:
    """The rows compared with target-only's outputs (the first row): not the reference compute path's."""
    return [r for r in rows[1:] if r.outputs and not r.reference]


def mark_identical(rows: list[Row]) -> None:
    """Greedy decoding: each compared row's exactness and its prompts whose output equals target-only's."""
    ref = rows[0].outputs
    for r in compared_rows(rows):
        r.exact = r.outputs == ref
        r.identical_prompts = sum(a == b for a, b in zip(r.outputs, ref))


def reference_rows(rows: list[Row]) -> tuple[Row | None, Row | None]:
    """The fastest entropy-bound engine row and the fastest thresholded engine row (the rows the ratios
    ``vs_best_entropy`` and ``vs_best_thresholded`` divide by), None where no such row ran."""
    entropy = [r for r in rows if r.kind in ENTROPY_KINDS and r.method == "engine" and r.outputs]
    thresholded = [r for r in rows if r.thresholded and r.method == "engine" and r.outputs]
    return (max(entropy, key=lambda r: r.tokens_per_s) if entropy else None,
            max(thresholded, key=lambda r: r.tokens_per_s) if thresholded else None)


def against_defaults(rows: list[Row], table: list[dict[str, Any]], boot: np.ndarray, quiet: bool,
                     prompts: list[int] | None = None) -> None:
    """The ``hf:recommended`` row against ``hf:default`` (tokens/s ratio and its paired interval, in its report entry
    as ``vs_defaults``; ``prompts``: each entry's prompt index when a prompt has several samples), logged in one
    line."""
    by_name = {r.name: (r, t) for r, t in zip(rows, table)}
    if "hf:recommended" not in by_name or "hf:default" not in by_name:
        return
    (rec, entry), (default, _) = by_name["hf:recommended"], by_name["hf:default"]
    mid, lo, hi = ratio_ci(rec, default, boot, prompts)
    if mid is None:
        return
    entry.update(vs_defaults=round(mid, 3), vs_defaults_lo=round(lo, 3), vs_defaults_hi=round(hi, 3))
    if not quiet:
        log.info("transformers at the recommended settings (%s) against its defaults: %.3fx [%.3f, %.3f] (95%% paired "
                 "bootstrap over prompts)", rec.note, mid, lo, hi)


def best_thresholded(table: list[dict[str, Any]]) -> str | None:
    """The fastest thresholded engine row of a report (learned or training-free; not static, the oracle, goodput)."""
    rows = [r for r in table if r.get("thresholded")]
    return max(rows, key=lambda r: r["tokens_per_s"])["row"] if rows else None


def cost_aware_line(table: list[dict[str, Any]], best_thresholded: str | None) -> str:
    """One line: the best cost-aware row against the best thresholded one, the ratio and its interval ('' when either
    is missing)."""
    cost_aware = [r for r in table if r.get("vs_best_thresholded") is not None]
    if not cost_aware or best_thresholded is None:
        return ""
    best = max(cost_aware, key=lambda r: r["tokens_per_s"])
    thr = next(r for r in table if r["row"] == best_thresholded)
    return (f"cost-aware against thresholded: best cost-aware {best['row']} {best['tokens_per_s']:.3f} tokens/s, "
            f"best thresholded {thr['row']} {thr['tokens_per_s']:.3f} tokens/s: {best['vs_best_thresholded']:.3f}x "
            f"[{best['vs_best_thresholded_lo']:.3f}, {best['vs_best_thresholded_hi']:.3f}] (95% paired bootstrap "
            f"over prompts)")


def write_report(table: list[dict[str, Any]], bench: Bench, names: list[str], out_dir: Path, models: ModelsConfig,
                 how: RunOrder, of: int | None = None) -> None:
    """``benchmark.md``, ``benchmark.json`` and ``speedup.png`` of the rows in ``table`` (``models``: the models the
    run loaded; ``how``: the order the rows ran in; ``of``: the run's number of prompts when the table covers only the
    first ones, a report of a run still going or stopped)."""
    d, cm = bench.decoding, bench.cost_model
    info = cpu_info()
    entropy = [r for r in table if r["kind"] in ENTROPY_KINDS and r["method"] == "engine"]
    best_e = max(entropy, key=lambda r: r["tokens_per_s"])["row"] if entropy else "none"
    best_t = best_thresholded(table)
    k = d.samples_per_prompt
    samples = (f" x {k} samples each (sample s of prompt i seeded seed + i + s x {SAMPLE_SEED_STRIDE}, the same in "
               f"every row; intervals resample the prompts with their samples)") if k > 1 else ""
    partial = (f"**Partial: the first {len(names)} of {of} prompts.** The run goes on, or was stopped: the same "
               f"command continues it (`{PROMPTS_DIR}/` keeps every finished prompt{' and sample' if k > 1 else ''})."
               "\n") if of else ""
    md = [
        "# Decoding benchmark\n",
        *([partial] if partial else []),
        f"draft `{models.draft}`, target `{models.target}`, companion `{models.companion}`; "
        f"{len(names)} prompts ({', '.join(names)}){samples}, {d.max_new_tokens} new tokens, temperature "
        f"{d.temperature}, "
        f"device {models.device}, compute path {compute_path_of(bench.target)} (fp32 activations), batch size "
        f"{d.batch_size}; CPU {info['model_name']} ({info['torch_cpu_capability']}, {torch.get_num_threads()} "
        f"threads), torch {info['torch']}.\n",
        "speedup = tokens/s over target-only on the same path; vs_best_entropy = tokens/s over the best entropy "
        f"policy ({best_e}); vs_best_thresholded (cost-aware rows) = tokens/s over the best thresholded engine policy, "
        f"learned or training-free ({best_t or 'none'}); [95% paired bootstrap interval over prompts]; mean_accepted / "
        "mean_drafted = draft tokens accepted / drafted per round; stop_overhead = one stop decision / one draft "
        "forward; identical_prompts = prompts whose output equals target-only's (greedy); rouge_l against "
        "target-only's output; runs = the row's timed runs over the prompts; with several a prompt, its seconds are "
        "the runs' median, each pass's slow phase (the rows' median) taken out"
        f"{_runs_rule(how)}.\n",
        markdown_table(table),
    ]
    line = cost_aware_line(table, best_t)
    if line:
        md += ["", line[0].upper() + line[1:] + "."]
    if cm is not None:
        md += ["\n```", cm.curve_table(), "```"]
    (out_dir / "benchmark.md").write_text("\n".join(md) + "\n")
    report = {"rows": table, "prompts": names, "prompt_ids": bench.prompts[::k], "samples_per_prompt": k,
              "cpu": info, "prompts_of_run": of or len(names)}
    (out_dir / "benchmark.json").write_text(json.dumps(report, indent=2))
    plot_speedups(table, out_dir / "speedup.png")


def _runs_rule(how: RunOrder) -> str:
    steps = ("; target-only and the engine's rows decode each prompt together, a step of the row with the fewest "
             "tokens at a time, each step timed alone") if how.order == "prompt" and how.interleave else ""
    if how.order != "prompt" or how.repeats == 1:
        return f" (one run per prompt{steps})"
    return f" ({how.repeats} per prompt{steps})"
