"""How much of each vLLM benchmark row's decoding is its group's tail? Read from a run folder's stored engine steps.

At B concurrent requests the vLLM benchmark decodes each group of B prompts together until the last one finishes; as
requests finish, the last steps carry fewer than B. A server at B concurrent requests admits the next request as one
finishes and has no such tail, and a setting whose requests progress unevenly has a longer one. For each row and
batch size above 1 this prints its decode steps, those with fewer than the group in flight, their share of the
decode seconds, and, where the steps counted their tokens, tokens/s over the steps with the whole group in flight
beside tokens/s over all decode steps (``RowRun.in_flight``).

Usage:
    python benchmarks/vllm_group_tail.py outputs/benchmark-vllm
    python benchmarks/vllm_group_tail.py outputs/benchmark-vllm --batch 8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtimes.vllm.bench import row_from_dict  # noqa: E402


def tail_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Per stored row at a batch size above 1: decode steps, tail steps, the tail's share of the decode seconds and
    tokens/s with the whole group in flight and over all decode steps (None where tokens were not counted)."""
    out = []
    for part in sorted((run_dir / "engines").glob("*.json")):
        for d in json.loads(part.read_text())["rows"]:
            row = row_from_dict(d)
            if row.batch == 1:
                continue
            decode = [(row.full_batch(unit), s) for unit, steps in zip(row.outputs, row.steps) for s in steps
                      if s.decode]
            seconds = sum(s.wall_s for _, s in decode)
            tail = [s for n, s in decode if s.batch < n]
            flight = row.in_flight()
            counted = all(s.tokens for _, s in decode)
            out.append({"batch": row.batch, "row": row.name, "steps": len(decode), "tail_steps": len(tail),
                        "tail_share": sum(s.wall_s for s in tail) / seconds if seconds else 0.0,
                        "in_flight": sum(t for t, _ in flight) / sum(s for _, s in flight) if flight else None,
                        "decode": sum(s.tokens for _, s in decode) / seconds if counted and seconds else None})
    return sorted(out, key=lambda r: (r["batch"], r["row"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="a pipelines.vllm_bench output folder (its engines/ parts)")
    ap.add_argument("--batch", type=int, default=None, help="only this batch size")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    if not (run_dir / "engines").is_dir():
        print(f"{run_dir}: no engines/ folder: give the out_dir of a pipelines.vllm_bench run", file=sys.stderr)
        return 1
    rows = [r for r in tail_rows(run_dir) if args.batch is None or r["batch"] == args.batch]
    print("| batch | row | decode steps | with fewer in flight | their share of decode seconds | tokens/s, group in "
          "flight | tokens/s, all decode steps |\n|---|---|---|---|---|---|---|")
    for r in rows:
        rates = ["" if r[k] is None else f"{r[k]:.2f}" for k in ("in_flight", "decode")]
        print(f"| {r['batch']} | {r['row']} | {r['steps']} | {r['tail_steps']} | {r['tail_share']:.0%} | "
              f"{rates[0]} | {rates[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
