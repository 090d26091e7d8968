"""How much of "slower than vLLM's fastest fixed setting" is the choice of the bar? A vLLM run read from its records.

The fastest fixed setting of a run (the target alone, vLLM's static Ks) is the best of several rows, each measured with
the host's noise, on the very units (groups of B prompts) a policy is compared on: the noise that makes one of them
look fastest raises the bar (a winner's curse), so a policy that ties the truly fastest setting reads below 1. For each
policy row this prints its ratio to that bar and to the fair one, unit by unit the fixed setting fastest on the run's
other units (``runtimes.vllm.bench_report.against_fixed_chosen_elsewhere``), on whole groups and with every request of
a group in flight, recomputed from the stored per-unit records by the report's own routine.

Usage:
    python benchmarks/vllm_fixed_bar.py results/vllm_benchmark-benchmark-vllm-emerald-rapids-amx-bf16-2026-11-29.json
    python benchmarks/vllm_fixed_bar.py outputs/benchmark-vllm          # a run folder (its benchmark.json)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtimes.vllm.bench_report import ratio_text  # noqa: E402
from runtimes.vllm.results import recomputed_entries  # noqa: E402


def read_run(path: Path) -> tuple[list[dict[str, Any]], list[int], int, int]:
    """A stored summary's or a run folder's rows (with records), batch sizes, seed and bootstrap draws; ValueError
    in one line for anything else."""
    if path.is_dir():
        if not (path / "benchmark.json").is_file():
            raise ValueError(f"{path}: no benchmark.json (a finished python -m pipelines.vllm_bench run folder?)")
        data = json.loads((path / "benchmark.json").read_text())
        cfg = data["config"]
        rows, batches, seed, n_boot = data["table"], cfg["batch_sizes"], cfg["seed"], cfg["n_boot"]
    elif path.is_file():
        data = json.loads(path.read_text())
        if data.get("kind") != "vllm_benchmark":
            raise ValueError(f"{path}: not a stored vLLM benchmark (kind {data.get('kind')!r})")
        rows, batches, seed, n_boot = data["rows"], data["batch_sizes"], data["seed"], data["n_boot"]
    else:
        raise ValueError(f"{path}: no such file or folder")
    if not all(r.get("records") for r in rows):
        raise ValueError(f"{path}: stored without per-unit records; nothing to recompute")
    return rows, list(batches), int(seed), int(n_boot)


def bar_lines(entries: list[dict[str, Any]], batches: list[int], seed: int, n_boot: int) -> list[str]:
    """Per policy row and batch size, its ratio to the fastest-measured fixed setting and to the one fastest on the
    other groups, recomputed by the report's routine from the records."""
    table = recomputed_entries(entries, batches, seed, n_boot)
    lines = []
    for t in table:
        if t["role"]["what"] != "policy" or "vs_fastest_fixed" not in t:
            continue
        units = len(t["unit_seconds"])
        fair = ratio_text(t.get("vs_fixed_chosen_elsewhere")) or "(one group: no other to choose on)"
        lines += [f"{t['batch']} concurrent, {units} group{'s' if units > 1 else ''}: {t['row']}",
                  f"  whole groups:    {ratio_text(t['vs_fastest_fixed'])} the fastest fixed ({t['fastest_fixed']}); "
                  f"{fair} the fastest on the other groups ({', '.join(t.get('fixed_chosen_elsewhere') or [])})"]
        if t.get("vs_fastest_fixed_in_flight"):
            lines.append(f"  group in flight: {ratio_text(t['vs_fastest_fixed_in_flight'])} the fastest fixed "
                         f"({t['fastest_fixed_in_flight']}); {ratio_text(t.get('vs_fixed_chosen_elsewhere_in_flight'))}"
                         f" the fastest on the other groups "
                         f"({', '.join(t.get('fixed_chosen_elsewhere_in_flight') or [])})")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a stored vLLM summary (results/vllm_benchmark-*.json) or a run folder")
    args = ap.parse_args(argv)
    try:
        entries, batches, seed, n_boot = read_run(args.run)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    print("\n".join(bar_lines(entries, batches, seed, n_boot)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
