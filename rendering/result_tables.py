"""Markdown tables rendered from stored run summaries (:mod:`rendering.result_store`), and the blocks of the README
and docs/results.md they fill.

A block sits between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` in a Markdown file; rendering replaces
what is between the markers and leaves the rest of the file alone. Runs of another model pair, compute path or CPU
kind are never averaged with others: each such group gets its own tables.

Usage::

    from rendering.result_tables import render_blocks
    blocks = render_blocks(load_summaries("results"))   # {"readme": "...", "docs": "..."}
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from predictors.baselines import ENTROPY_KINDS
from predictors.round_rules import rule_named
from rendering.device_results import gpu_block
from rendering.result_runtimes import RUNTIME_CONFIGS, replay_part, runtime_block, runtime_section
from rendering.result_store import (
    ESTIMATED_NOTE,
    Summary,
    cpu_label,
    dated,
    estimated,
    interval_text,
    tokens_cell,
)

LEARNED_KINDS = ("disco", "sprinter", "sv")
HEADLINE_BENCHMARKS = ("benchmark-full", "benchmark-full-t1", "benchmark")
FREE_NAMES = {"max-prob": "top-1 probability", "draft-prob": "q(x)", "neg-entropy": "-entropy"}
ROW_NAMES = {"target-only": "target-only", "hf:default": "transformers assisted generation (its defaults)"}


def _f(x: Any, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _is_learned(row: dict[str, Any]) -> bool:
    """A learned stopper's row, priced by goodput or not (goodput over an entropy bound is not learned)."""
    return (row.get("kind") or "").removeprefix("goodput-") in LEARNED_KINDS


def _approximate(row: dict[str, Any]) -> bool:
    """A row that does not decode the target's distribution: approximate by design (SPRINTER's sequential
    verification: the target checks only the last drafted token), or one whose greedy output differed."""
    return row.get("exact") is False or rule_named(row.get("verification")).sequential


def caption(s: Summary) -> str:
    """Where and when a run was made, on which commit, and the command that reproduces it."""
    d = s.data
    m = d["machine"]
    threads = f", {m['threads']} threads" if m.get("threads") else ""
    torch = f", torch {m['torch']}" if m.get("torch") else ""
    return (f"{cpu_label(m)}{threads}{torch}, compute path `{d['compute_path']}`; {dated(d)}; "
            f"`{d['command']}`")


def predictor_table(s: Summary) -> str:
    """Each learned predictor's test AUC on its own label beside the best training-free score's, and the
    cross-validated difference with its 95% paired-bootstrap interval."""
    lines = ["| predictor | label | test AUC | best training-free score (test AUC) | cross-validated AUC difference "
             "[95% CI] | replayed speedup |", "|---|---|---|---|---|---|"]
    for p in s.data["predictors"]:
        if p.get("test_auc") is None:
            continue
        free = FREE_NAMES.get(p.get("best_free", ""), p.get("best_free", ""))
        cv = interval_text(p.get("cv_diff"), p.get("cv_diff_lo"), p.get("cv_diff_hi"), "+.4f", "")
        speed = _f(p.get("test_speedup"), ".2f") + ("x" if p.get("test_speedup") is not None else "")
        lines.append(f"| {p['predictor']} | {p.get('label', '')} | {_f(p['test_auc'], '.4f')} | "
                     f"{free} {_f(p.get('test_auc_best_free'), '.4f')} | {cv} | {speed} |")
    return "\n".join(lines)


def recommendation_table(s: Summary) -> str:
    """Each runtime's tuned setting (what to paste) and its replayed speedup over target-only on the test split,
    beside the runtime's defaults, the best learned policy and the oracle, under the curve the job had ("" when the
    job made no recommendation)."""
    recs = s.data.get("recommendations") or []
    if not recs:
        return ""
    lines = ["| runtime | set | replayed speedup | its defaults | best learned policy | oracle |",
             "|---|---|---|---|---|---|"]
    for r in recs:
        what = f"`{r['paste']}`" if r["speculate"] else "do not speculate (target alone)"
        curve = " (priced with another runtime's curve)" if r.get("warnings") else ""
        learned = f"{r['best_learned_speedup']:.2f}x ({r['best_learned']})" if r.get("best_learned") else ""
        lines.append(f"| {r['runtime']}{curve} | {what} | {r['speedup']:.2f}x | {r['default_speedup']:.2f}x "
                     f"(`{r['default_spec']}`) | {learned} | {_f(r.get('oracle_speedup'), '.2f')}x |")
    return "\n".join(lines)


def row_name(row: dict[str, Any]) -> str:
    """A readable row name: the engine's policy label, or the transformers / target-only reference."""
    return ROW_NAMES.get(row["row"], row["row"])


def benchmark_table(s: Summary) -> str:
    """Tokens/s of every row with its speedup over target-only and its ratio to the best entropy bound, each with
    the 95% paired-bootstrap interval over prompts; greedy: the prompts whose output equals target-only's; sampling
    (where equal outputs mean nothing): accepted tokens a round, the share of HumanEval prompts whose answer passes
    the problem's tests, and ROUGE-L to target-only's sample."""
    sampled = s.data.get("temperature", 0) > 0
    tail = "accepted a round | HumanEval tests passed | ROUGE-L to target-only" if sampled else "output = target-only"
    lines = [f"| row | tokens/s | vs target-only [95% CI] | vs best entropy bound [95% CI] | {tail} |",
             "|---|---|---|---|---|" + ("---|---|" if sampled else "")]
    n = s.data["n_prompts"]
    for r in s.data["rows"]:
        speed = interval_text(r.get("speedup"), r.get("speedup_lo"), r.get("speedup_hi"))
        vs = interval_text(r.get("vs_best_entropy"), r.get("vs_best_entropy_lo"), r.get("vs_best_entropy_hi"))
        if sampled:
            cells = [_f(r.get("mean_accepted"), ".2f"), _f(r.get("humaneval_pass"), ".0%"), _f(r.get("rouge_l"), ".3f")]
        else:
            cells = ["" if r.get("identical_prompts") is None else f"{r['identical_prompts']}/{n}"]
        lines.append(f"| {row_name(r)} | {tokens_cell(r)} | {speed} | {vs} | {' | '.join(cells)} |")
    return "\n".join(lines)


def verdict(s: Summary) -> str:
    """One sentence on what the benchmark decides: the best exact learned row against the best entropy bound."""
    rows = s.data["rows"]
    learned = [r for r in rows if _is_learned(r) and not _approximate(r) and r.get("vs_best_entropy")]
    entropy = [r for r in rows if (r.get("kind") or "") in ENTROPY_KINDS and r.get("tokens_per_s")]
    if not learned or not entropy:
        return "This run has no exact learned row and entropy bound to compare."
    best = max(learned, key=lambda r: r["vs_best_entropy"])
    bound = max(entropy, key=lambda r: r["tokens_per_s"])  # the ratios' reference: two bounds can both round to 1.00
    mid, lo, hi = best["vs_best_entropy"], best.get("vs_best_entropy_lo"), best.get("vs_best_entropy_hi")
    head = (f"The best exact learned stopper ({row_name(best)}) ran {interval_text(mid, lo, hi)} the best entropy "
            f"bound ({row_name(bound)}) over {s.data['n_prompts']} prompts")
    if lo is not None and hi is not None:
        head += f" (an interval {100 * (hi - lo) / 2:.0f}% wide each way: smaller differences are not decided by it)"
    if lo is not None and lo > 1.0:
        return head + ": a learned stopper is measurably faster on this pair and machine."
    if hi is not None and hi < 1.0:
        return head + ": the entropy bound is measurably faster; it also needs no training."
    return (head + ": the interval holds 1, so on this pair and machine a learned stopper is not measurably faster "
            "than the training-free bound, which needs no training.")


def sampled_quality(s: Summary) -> str:
    """Under sampling (where equal outputs mean nothing), one sentence on the approximate rows' quality: their ROUGE-L
    to target-only's sample beside the exact rows' range (the similarity of two samples of the target's own
    distribution), and HumanEval's pass rates; "" for a greedy run or one without both kinds of row."""
    rows = [r for r in s.data["rows"] if r.get("rouge_l") is not None]
    exact = [r["rouge_l"] for r in rows if not _approximate(r)]
    approx = [r for r in rows if _approximate(r)]
    if s.data.get("temperature", 0) == 0 or not exact or not approx:
        return ""
    lo, hi = min(exact), max(exact)
    theirs = ", ".join(f"{r['rouge_l']:.3f} for {row_name(r)}" for r in approx)
    inside = all(lo <= r["rouge_l"] <= hi for r in approx)
    text = (f"Quality at this temperature: ROUGE-L to target-only's sample is {lo:.3f}-{hi:.3f} for the exact rows "
            f"(two samples of the target's own distribution) and {theirs}"
            + (", inside that range: this measure does not tell the approximate decoding from the target's."
               if inside else ", outside that range."))
    passes = [r["humaneval_pass"] for r in s.data["rows"][1:] if r.get("humaneval_pass") is not None]
    target = s.data["rows"][0].get("humaneval_pass")
    if passes and target is not None:
        text += (f" HumanEval's tests pass for {target:.0%} of target-only's answers and {min(passes):.0%}-"
                 f"{max(passes):.0%} of the other rows' ({s.data['max_new_tokens']} new tokens an answer).")
    return text


def _verdicts(s: Summary) -> str:
    """The speed verdict, under sampling the quality sentence, and the footnote of a table with an estimated row."""
    note = ESTIMATED_NOTE if any(estimated(r) for r in s.data["rows"]) else ""
    return " ".join(x for x in (verdict(s), sampled_quality(s), note) if x)


def _benchmark_heading(s: Summary) -> str:
    d = s.data
    mode = "greedy" if d["temperature"] == 0 else f"sampling at temperature {d['temperature']}"
    partial = ""
    if d.get("partial"):
        partial = f" (partial: the first {d['n_prompts']} of the run's {d.get('prompts_of_run')})"
    samples = d.get("samples_per_prompt", 1)
    each = f" x {samples} samples" if samples > 1 else ""
    return f"{d['n_prompts']} prompts{each} x {d['max_new_tokens']} new tokens, {mode}{partial}"


def headline(summaries: list[Summary]) -> tuple[Summary | None, Summary | None]:
    """The README's runs: the newest default main job and the newest greedy headline benchmark."""
    mains = [s for s in summaries if s.kind == "main_job" and s.data["config"] == "default"]
    benches = [s for s in summaries if s.kind == "benchmark" and s.data["temperature"] == 0]
    for name in HEADLINE_BENCHMARKS:
        picked = [s for s in benches if s.data["config"] == name]
        if picked:
            return (mains[-1] if mains else None), picked[-1]
    return (mains[-1] if mains else None), None


def sampled_headline(summaries: list[Summary]) -> Summary | None:
    """The newest headline benchmark run at a temperature above 0."""
    runs = [s for s in summaries if s.kind == "benchmark" and s.data["temperature"] > 0
            and s.data["config"] in HEADLINE_BENCHMARKS]
    return runs[-1] if runs else None


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def times_table(summaries: list[Summary]) -> str:
    """The newest main job's and headline benchmark's wall time per CPU kind and compute path."""
    latest: dict[tuple[str, str, str], Summary] = {}
    for s in summaries:
        if s.data.get("duration_s") and (s.kind == "main_job" and s.data["config"] == "default"
                                         or s.kind == "benchmark" and s.data["config"] in HEADLINE_BENCHMARKS):
            latest[(cpu_label(s.data["machine"]), s.data["compute_path"], s.kind + s.data["config"])] = s
    if not latest:
        return ""
    lines = ["| CPU | compute path | run | wall time | date, code |", "|---|---|---|---|---|"]
    for (cpu, path, _), s in sorted(latest.items()):
        what = "main job (`configs/default.yaml`)" if s.kind == "main_job" else f"benchmark `{s.data['config']}`"
        lines.append(f"| {cpu} | `{path}` | {what} | {_minutes(s.data['duration_s'])} | {dated(s.data)} |")
    return "\n".join(lines)


def render_readme(summaries: list[Summary], runtime_lines: list[str] = ()) -> str:
    """The README's results block: the learned-vs-free AUC table, the end-to-end tables of the headline runs and the
    runtimes' own lines (``runtime_lines``: each a paragraph a runtime's folder renders)."""
    main, bench = headline(summaries)
    parts = []
    if main is not None:
        records = f", {main.data['records']:,} labelled records" if main.data.get("records") else ""
        parts += [f"Learned predictors against the best training-free score (main job{records}; {caption(main)}):",
                  "", predictor_table(main), ""]
        recs = recommendation_table(main)
        if recs:
            parts += ["What to set in each runtime, tuned on the validation split and replayed on the test split "
                      "(`python -m pipelines.recommend`, same run):", "", recs, ""]
    if bench is not None:
        parts += [f"End to end, {_benchmark_heading(bench)} ({caption(bench)}):", "", benchmark_table(bench), "",
                  _verdicts(bench)]
    sampled = sampled_headline(summaries)
    if sampled is not None:
        parts += ["", f"End to end, {_benchmark_heading(sampled)} ({caption(sampled)}):", "",
                  benchmark_table(sampled), "", _verdicts(sampled)]
    elif bench is not None:
        parts += ["", "At temperature 1 no headline run is stored yet: `python -m pipelines.benchmark --config "
                  "configs/benchmark-full-t1.yaml --results_dir results` measures it."]
    for line in runtime_lines:
        parts += ["", line]
    times = times_table(summaries)
    if times:
        parts += ["", "Wall time on 2 cores, from a run's start to its table (the main job's first model conversion "
                  "excluded; a run stopped and resumed: the seconds its starts ran, the pause between them left out):",
                  "", times]
    if not parts:
        parts = ["No stored run yet: `python -m pipelines.train --results_dir results` writes one."]
    return "\n".join(parts).rstrip()


def render_docs(summaries: list[Summary]) -> str:
    """docs/results.md's block: every stored run, grouped by model pair, compute path and CPU kind, newest first."""
    groups: dict[tuple[str, str, str], list[Summary]] = {}
    for s in summaries:
        if s.kind in ("main_job", "benchmark"):  # vLLM's and the GPU check's runs have documents of their own
            groups.setdefault(s.group, []).append(s)
    parts: list[str] = []
    for (pair, path, cpu), runs in sorted(groups.items()):
        parts += [f"### {pair}, `{path}`, {cpu}", ""]
        for s in reversed(runs):
            if s.kind == "main_job":
                parts += [f"**Main job, config `{s.data['config']}`** ({caption(s)}):", "", predictor_table(s), ""]
                recs = recommendation_table(s)
                parts += [recs, ""] if recs else []
            elif s.data["config"] in RUNTIME_CONFIGS.values():
                parts += [f"**Runtime benchmark `{s.data['config']}`**", "", runtime_section(s), ""]
            else:
                parts += [f"**Benchmark `{s.data['config']}`, {_benchmark_heading(s)}** ({caption(s)}):", "",
                          benchmark_table(s), "", _verdicts(s), "", *replay_part(s)]
    return "\n".join(parts).rstrip() if parts else "No stored run yet."


def render_blocks(summaries: list[Summary], runtime_blocks: dict[str, str] | None = None,
                  runtime_lines: list[str] = ()) -> dict[str, str]:
    """Every block the docs hold, by name; ``runtime_blocks`` and ``runtime_lines`` are what the runtimes' own folders
    render (``runtimes.vllm.results``), passed in so that rendering never imports a runtime."""
    runtimes = {name: runtime_block(summaries, config) for name, config in RUNTIME_CONFIGS.items()}
    return {"readme": render_readme(summaries, runtime_lines), "docs": render_docs(summaries), **runtimes,
            **(runtime_blocks or {}), "gpu": gpu_block(summaries)}


def block_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- results:{name} -->\n)(.*?)(^<!-- /results:{name} -->)", re.S | re.M)


def fill(text: str, name: str, body: str, path: Path) -> str:
    """``text`` with the block ``name`` replaced by ``body``; a file without the markers is an error naming it."""
    pat = block_pattern(name)
    if not pat.search(text):
        raise ValueError(f"{path}: no <!-- results:{name} --> ... <!-- /results:{name} --> markers")
    return pat.sub(lambda m: m.group(1) + (body.rstrip("\n") + "\n" if body else "") + m.group(3), text, count=1)
