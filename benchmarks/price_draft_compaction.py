"""What would running vLLM's later draft forwards over the still-drafting requests only save? Priced from a stored run.

vLLM's draft loop runs every request of the batch through each draft forward; a request whose policy stopped rides
along (its rows are the stored ``idle_rows``). Dropping those rows from the forwards after the first (the first must
run for every request: it writes the draft's cache of the verified tokens) would save, per idle row, the draft
forward's marginal cost of one row at that batch size, which vLLM's curve in the same file measured
(``draft_ms`` at batch sizes 1, 2, 4, 8). For each drafting row and batch size above 1 this prints the idle
rows, that marginal cost, the seconds it prices them at and their share of the row's measured seconds: the most
compaction could buy there (its own bookkeeping not counted).

Usage:
    python benchmarks/price_draft_compaction.py results/vllm_benchmark-benchmark-vllm-zen-5-avx-512-bf16-2026-11-28.json
    python benchmarks/price_draft_compaction.py results/vllm_benchmark-*.json --min_share 0.01   # the newest
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def row_ms(curves: dict[str, Any], batch: int) -> float:
    """The draft forward's cost of one more row at ``batch`` (ms): the curve's slope from the next smaller batch size
    it measured (0 at its smallest, and where the curve falls)."""
    draft = {int(b): float(c["draft_ms"]) for b, c in curves.items()}
    below = [b for b in draft if b < batch]
    if batch not in draft or not below:
        return 0.0
    lo = max(below)
    return max(0.0, (draft[batch] - draft[lo]) / (batch - lo))  # a host whose curve dips there: no row saves time


def priced_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Per drafting row of the summary: batch, row, idle rows, their share of the draft rows, the marginal row cost,
    the seconds saved at that cost and their share of the row's measured seconds."""
    out = []
    for r in summary["rows"]:
        rec = r.get("records") or {}
        rows, idle = sum(rec.get("draft_rows") or []), sum(rec.get("idle_rows") or [])
        if not rows or r["batch"] == 1:  # a request alone never rides a forward it stopped drafting in
            continue
        ms = row_ms(summary["curves"], r["batch"])
        saved = idle * ms / 1000
        out.append({"batch": r["batch"], "row": r["row"], "idle_rows": idle, "idle_share": idle / rows,
                    "row_ms": ms, "saved_s": saved, "share": saved / sum(rec["seconds"])})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("summary", help="a stored vLLM benchmark summary (results/vllm_benchmark-*.json)")
    ap.add_argument("--min_share", type=float, default=0.0, help="print only rows whose saving is at least this share")
    args = ap.parse_args(argv)
    path = Path(args.summary)
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"{path}: not a readable JSON summary ({e})", file=sys.stderr)
        return 2
    if summary.get("kind") != "vllm_benchmark" or "curves" not in summary:
        print(f"{path}: not a stored vLLM benchmark (python -m pipelines.results --benchmark DIR "
              "--config_name benchmark-vllm writes one)", file=sys.stderr)
        return 2
    print(f"{path.name}: {summary['host']['model_name']}, commit {summary['commit'][:7]}")
    print(f"{'batch':>5}  {'row':<58} {'idle rows':>9} {'share':>6} {'ms/row':>6} {'saved s':>7} {'of time':>7}")
    for p in priced_rows(summary):
        if p["share"] >= args.min_share:
            print(f"{p['batch']:>5}  {p['row'][:58]:<58} {p['idle_rows']:>9} {p['idle_share']:>6.1%} "
                  f"{p['row_ms']:>6.2f} {p['saved_s']:>7.2f} {p['share']:>7.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
