"""The replay check in the benchmark's report: ``replay_check.md`` beside ``benchmark.md``, the ``replay_check`` entry
of ``benchmark.json``, ``replay_check.png`` (predicted against measured tokens/s), and a console table within 100
columns; a rerun rewrites all three."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmark.check import summary_line
from benchmark.check_inputs import read_json
from benchmark.plots import plot_check

SECTION = "## Replay check"
"""The heading of the check's report."""

REPORT = "replay_check.md"
PLOT = "replay_check.png"


def _fmt(v: Any, digits: int = 3) -> str:
    return "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def markdown_section(result: dict[str, Any]) -> str:
    """The check's report: what was replayed, one table row per engine row, the summary line."""
    s = result["summary"]
    lines = [
        SECTION, "",
        f"Every engine row's policy replayed offline ({result['mode']}) on the benchmark's prompts, labelled along "
        f"target-only's output (an approximate row along its own) with the draft's rollouts ({result['rollouts']} "
        f"rollouts of {result['rollout_len']} "
        f"tokens, {result['records']} records; {result['data']}), under this run's curve ({result['cost_model']}). "
        "predicted tokens/s = tokens / (tokens x the replay's seconds per token under the curve + the row's measured "
        "prefill); accepted / drafted = draft tokens "
        "per round, measured / predicted; curve tok/s = the replay's own tokens/s under the curve (no prefill or "
        "overhead); vs entropy (curve) = curve tok/s over the best entropy bound's, the same rounds priced alike "
        "(greedy rounds do not change from run to run; measured ratios also carry the host's speed when each row "
        "ran); unpriced ms/token = the engine's decoding time outside its draft and target forwards (stop decisions, "
        "bookkeeping), per output token, which the prediction leaves out. Where the replay follows the engine's "
        "rounds, a miss is the forwards' cost against the curve's (the two step columns) or that time. "
        f"Goal: predicted / measured within 1 +- {s['band']:.2f}.", "",
        "| row | measured tok/s | predicted tok/s | predicted / measured | accepted | drafted | rounds | "
        "curve tok/s | vs entropy (curve) | draft step ms, engine / curve | verification ms, engine / curve | "
        "unpriced ms/token | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        pair = [f"{_fmt(r[f'measured_{k}'])} / {_fmt(r[f'predicted_{k}'])}"
                for k in ("mean_accepted", "mean_drafted", "rounds")]
        steps = [f"{_fmt(r.get(f'measured_{k}_ms'), 1)} / {_fmt(r.get(f'curve_{k}_ms'), 1)}"
                 if r.get(f"measured_{k}_ms") else "" for k in ("draft", "verify")]
        lines.append(f"| {r['row']} | {_fmt(r['measured_tokens_per_s'])} | {_fmt(r['predicted_tokens_per_s'])} | "
                     f"{_fmt(r['ratio'])} | {' | '.join(pair)} | {_fmt(r['curve_tokens_per_s'])} | "
                     f"{_fmt(r.get('curve_vs_best_entropy'))} | {' | '.join(steps)} | "
                     f"{_fmt(r.get('unpriced_ms_per_token'), 2)} | {r['note']} |")
    return "\n".join([*lines, "", summary_line(s) + ".", "", f"![predicted against measured]({PLOT})", ""])


def console_table(result: dict[str, Any], width: int = 100) -> str:
    """The check in aligned columns within ``width`` characters (row names cut with ``~``); notes are in
    benchmark.md."""
    head = ["row", "measured", "predicted", "ratio", "accepted m/p", "drafted m/p"]
    cells = [head] + [[r["row"], _fmt(r["measured_tokens_per_s"]), _fmt(r["predicted_tokens_per_s"]),
                       _fmt(r["ratio"]) + ("*" if r["note"] else ""),
                       f"{_fmt(r['measured_mean_accepted'], 2)}/{_fmt(r['predicted_mean_accepted'], 2)}",
                       f"{_fmt(r['measured_mean_drafted'], 2)}/{_fmt(r['predicted_mean_drafted'], 2)}"]
                      for r in result["rows"]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    widths[0] = max(12, min(widths[0], width - sum(w + 2 for w in widths[1:])))

    def cell(v: str, i: int) -> str:
        v = v if len(v) <= widths[i] else v[: widths[i] - 1] + "~"
        return v.ljust(widths[i]) if i == 0 else v.rjust(widths[i])

    lines = ["  ".join(cell(v, i) for i, v in enumerate(c)).rstrip()[:width] for c in cells]
    lines.insert(1, "-" * max(len(x) for x in lines))
    return "\n".join([*lines, "(* the replay cannot follow the engine for this row: see the note in benchmark.md)"])


def write_check(result: dict[str, Any], bench_dir: str | Path) -> None:
    """Add the check to benchmark.json (``replay_check``) and write replay_check.md and replay_check.png."""
    bench_dir = Path(bench_dir)
    report = read_json(bench_dir / "benchmark.json")
    report["replay_check"] = result
    (bench_dir / "benchmark.json").write_text(json.dumps(report, indent=2))
    (bench_dir / REPORT).write_text(markdown_section(result) + "\n")
    plot_check(result, bench_dir / PLOT)
