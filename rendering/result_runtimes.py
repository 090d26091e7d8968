"""Markdown of the stored runtime benchmarks (:mod:`rendering.result_store` summaries of
``pipelines.llamacpp_bench`` and of ``pipelines.benchmark --config configs/benchmark-transformers.yaml``): each row's
tokens/s with its interval, the comparisons the goals read (the recommended settings against the runtime's defaults,
specstop's policies against the recommended settings), the recommendation the run tuned and the replay check. They
fill the ``<!-- results:llamacpp -->`` block of docs/llamacpp.md and ``<!-- results:transformers -->`` of
docs/runtimes.md (``python -m pipelines.results``), so the figures there come from stored runs.

Usage::

    from rendering.result_runtimes import runtime_block
    print(runtime_block(load_summaries("results"), "benchmark-llamacpp"))
"""
from __future__ import annotations

from rendering.result_store import (
    ESTIMATED_NOTE,
    Summary,
    cpu_label,
    dated,
    estimated,
    interval_text,
    tokens_cell,
)

RUNTIME_CONFIGS = {"llamacpp": "benchmark-llamacpp", "transformers": "benchmark-transformers"}
"""Block name -> the config name of the runs it renders (the newest one)."""


def runtime_caption(s: Summary) -> str:
    d = s.data
    m = d["machine"]
    threads = f", {m['threads']} threads" if m.get("threads") else ""
    return (f"{d['n_prompts']} test prompts x {d['max_new_tokens']} new tokens, greedy, each row twice a prompt; "
            f"{cpu_label(m)}{threads}; {dated(d)}; `{d['command']}`")


def rows_table(s: Summary) -> str:
    """Every row: tokens/s, speedup over target-only with its 95% paired-bootstrap interval over prompts, accepted
    tokens a round, outputs equal to target-only's."""
    n = s.data["n_prompts"]
    lines = ["| row | tokens/s | vs target-only [95% CI] | accepted / round | outputs = target-only |",
             "|---|---|---|---|---|"]
    for r in s.data["rows"]:
        name = r["row"] + (" (recommended)" if r["row"] == s.data.get("recommended") else "")
        same = "" if r.get("identical_prompts") is None else f"{r['identical_prompts']}/{n}"
        acc = "" if not r.get("mean_drafted") else f"{r['mean_accepted']:.2f} of {r['mean_drafted']:.2f}"
        if r.get("mean_drafted") == 0:
            acc = "drafts nothing"
        speed = interval_text(r.get("speedup"), r.get("speedup_lo"), r.get("speedup_hi"))
        lines.append(f"| `{name}` | {tokens_cell(r)} | {speed} | {acc} | {same} |")
    if any(estimated(r) for r in s.data["rows"]):
        lines += ["", ESTIMATED_NOTE]
    return "\n".join(lines)


def comparison_lines(s: Summary) -> list[str]:
    """The ratios between rows the run computed, each with its interval (the recommended settings against the
    defaults, each policy against the recommended row; transformers' tuned row against its defaults)."""
    out = [f"- `{c['row']}` against `{c['against']}`: {interval_text(c['ratio'], c.get('lo'), c.get('hi'))}"
           for c in s.data.get("comparisons") or [] if c.get("ratio") is not None]
    for r in s.data["rows"]:
        if r.get("vs_defaults") is not None:
            out.append(f"- `{r['row']}` ({r.get('note') or r.get('spec')}) against `hf:default`: "
                       f"{interval_text(r['vs_defaults'], r.get('vs_defaults_lo'), r.get('vs_defaults_hi'))}")
    return out


def replay_table(s: Summary) -> str:
    """Each row's tokens/s as the replay predicts it (its policy replayed on the prompts labelled along target-only's
    output, priced by the runtime's curve) beside the measured one ("" when the run made no check)."""
    rows = s.data.get("replay_rows") or []
    if not rows:
        return ""
    lines = ["| row | measured tokens/s | replayed tokens/s | replayed / measured |", "|---|---|---|---|"]
    for r in rows:
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.3f}"
        pred = "" if r.get("predicted_tokens_per_s") is None else f"{r['predicted_tokens_per_s']:.2f}"
        lines.append(f"| `{r['row']}` | {r['measured_tokens_per_s']:.2f} | {pred} | {ratio} |")
    summ = s.data.get("replay_check") or {}
    if summ.get("worst_row") is not None:
        lines += ["", f"Worst row {summ['worst_row']}: |replayed / measured - 1| = {summ['worst_error']:.3f}; "
                      f"{summ['within_band']} of {summ['rows_scored']} rows within {summ['band']:.0%}."]
    return "\n".join(lines)


def replay_part(s: Summary) -> list[str]:
    """The run's replay check under its heading, as lines of a document ([] when the run made no check)."""
    check = replay_table(s)
    return ["The replay against the measurement:", "", check, ""] if check else []


def curve_line(s: Summary) -> str:
    """The run's curve in one sentence ("" for a summary stored without it)."""
    c = s.data.get("curve")
    if not c:
        return ""
    catchup = (f"; a draft forward that reads a second token (the catch-up after a round whose drafts were all "
               f"accepted) {c['catchup_ms']:.1f} ms more") if c.get("catchup_ms") else ""
    return (f"The run's curve: a target forward of one new token {c['target_ms_L1']:.1f} ms, of two "
            f"{c['target_ms_L2']:.1f} ms; a draft step {c['draft_ms']:.1f} ms{catchup}.")


def runtime_section(s: Summary) -> str:
    """One stored runtime benchmark as markdown: caption, curve, rows, comparisons, recommendation, replay check."""
    curve = curve_line(s)
    parts = [f"Measured ({runtime_caption(s)}):", "", *([curve, ""] if curve else []), rows_table(s), ""]
    comps = comparison_lines(s)
    parts += [*comps, ""] if comps else []
    if s.data.get("recommendation"):
        parts += ["The recommendation this run tuned under its own curve:", "",
                  *[f"- {x}" for x in s.data["recommendation"]], ""]
    parts += replay_part(s)
    return "\n".join(parts).rstrip()


def runtime_block(summaries: list[Summary], config: str) -> str:
    """The newest stored run of ``config`` as a section, or how to store one."""
    runs = [s for s in summaries if s.kind == "benchmark" and s.data["config"] == config]
    if not runs:
        return (f"No stored run yet: run `configs/{config}.yaml`, then `python -m pipelines.results --benchmark "
                f"<its out_dir> --config_name {config}`.")
    return runtime_section(runs[-1])
