"""The main job's results table (``python -m pipelines.train``): every column in ``results.md``
(:func:`format_table`, :func:`results_markdown`), and a summary within 100 columns for the console
(:func:`format_summary`)."""
from __future__ import annotations

from typing import Any

__all__ = ["RESULTS_MD", "FULL_COLUMNS", "SUMMARY_NOTE", "fmt", "format_table", "summary_rows", "format_summary",
           "results_markdown"]


RESULTS_MD = "results.md"
"""The full table (every column) and the stage times, beside ``results.json`` in ``out_dir``."""

FULL_COLUMNS = ["predictor", "status", "label", "val_auc", "val_auc_best_free", "test_auc", "best_free",
                "test_auc_best_free", "cv_auc", "cv_best_free", "cv_auc_best_free", "cv_diff", "cv_diff_lo",
                "cv_diff_hi", "threshold", "val_speedup", "test_speedup", "decoding", "ece_greedy", "ece_sampling",
                "info_gain_bits", "info_gain_frac", "registry_name", "registry_version", "champion"]
"""Columns of the full table (``results.md``), in order; a column no row has is left out."""


def fmt(v: Any, spec: str = ".4f") -> str:
    """A float with ``spec``, anything else as text (None: empty)."""
    return format(v, spec) if isinstance(v, float) else ("" if v is None else str(v))


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the results, every column (:data:`FULL_COLUMNS`)."""
    cols = [c for c in FULL_COLUMNS if any(c in r for r in rows)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


SUMMARY_NOTE = (
    "test AUC: on the predictor's own label and draw, test split; best free: the best training-free score (top-1,\n"
    "q(x), -entropy) on the same tokens; cv diff: cross-validated AUC difference to it, "
    "95% paired bootstrap interval;\n"
    "speedup: replayed on the test split (thresholds tuned on validation; approx.: approximate decoding, SPRINTER's\n"
    "rounds take their drafts before the last unverified); reg.: MLflow registry version (* champion)."
)

FREE_SHORT = {"max-prob": "top-1", "draft-prob": "q(x)", "neg-entropy": "-entropy"}
"""The training-free scores as the console table names them (the README's names)."""


def summary_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The console table's cells: one list per result row (header first). A row that was not trained shows its status
    in place of the numbers. Add a row and it shows on the console; every field
    also goes to :func:`format_table`."""
    out = [["predictor", "label", "test AUC", "best free", "cv diff [95% CI]", "speedup", "reg."]]
    for r in rows:
        if r.get("status") not in (None, "trained"):
            out.append([str(r.get("predictor")), str(r["status"])])
            continue
        free = r.get("best_free")
        best = f"{fmt(r.get('test_auc_best_free'))} {FREE_SHORT.get(free, free or '')}".strip()
        cv = ""
        if r.get("cv_diff") is not None:
            cv = f"{r['cv_diff']:+.4f} [{r['cv_diff_lo']:+.4f},{r['cv_diff_hi']:+.4f}]"
        speed = f"{r['test_speedup']:.2f}x" if isinstance(r.get("test_speedup"), float) else ""
        if speed and r.get("decoding") == "approximate":
            speed += " approx."
        version = f"v{r['registry_version']}" if r.get("registry_version") is not None else ""
        version += "*" if r.get("champion") else ""
        label = str(r.get("label") or "")
        out.append([str(r.get("predictor")), label, fmt(r.get("test_auc")), best, cv, speed, version])
    return out


def format_summary(rows: list[dict[str, Any]], width: int = 100) -> str:
    """The console table: predictor, label, test AUC, best training-free score, cross-validated difference with its
    interval, replayed speedup, registered version; aligned in columns, at most ``width`` characters a line (when the
    cells are wider, the label and then the predictor column are cut, marked with ``~``)."""
    cells = summary_rows(rows)
    n = len(cells[0])
    full = [c for c in cells if len(c) == n]
    widths = [max(len(c[i]) for c in full) for i in range(n)]
    used = [i for i in range(n) if any(c[i] for c in full[1:])] or list(range(n))  # drop columns no row fills
    right = {2, 5}  # numbers, right-aligned after one space

    def total() -> int:
        return sum(widths[i] for i in used) + sum(1 if i in right else 2 for i in used[1:])

    for i, floor in ((1, 10), (0, 12)):
        widths[i] -= max(0, min(total() - width, widths[i] - floor))

    def cell(v: str, i: int) -> str:
        v = v if len(v) <= widths[i] else v[: widths[i] - 1] + "~"
        return v.rjust(widths[i]) if i in right else v.ljust(widths[i])

    lines = []
    for c in cells:
        if len(c) < n:  # predictor + status across the row
            line = cell(c[0], 0) + "  " + " ".join(c[1:])
        else:
            line = cell(c[used[0]], used[0]) + "".join((" " if i in right else "  ") + cell(c[i], i) for i in used[1:])
        lines.append(line.rstrip()[:width])
    lines.insert(1, "-" * min(width, max(len(x) for x in lines)))
    return "\n".join(lines)


def results_markdown(out_dir: str, result: dict[str, Any]) -> str:
    """results.md: the full table, the notes, the report's path and the time of each stage."""
    times = result["stage_seconds"]
    lines = [f"# Main job results ({out_dir})", "", format_table(result["results"]), "",
             SUMMARY_NOTE.replace("\n", " "), "",
             f"Report: {result['report']}" if result["report"] else "No evaluation report (--evaluate false).", "",
             "## Time by stage", "", "| stage | seconds |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in times.items()]
    return "\n".join(lines) + "\n"
