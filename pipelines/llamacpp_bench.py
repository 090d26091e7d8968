"""llama.cpp benchmark: target-only, llama.cpp's speculative decoding at its defaults and at given settings, and
specstop's stop policies inside llama.cpp's speculative loop, side by side on the same prompts, greedy, each output
checked against target-only's (``pipelines.benchmark.llamacpp``). Needs llama-cpp-python
(``bash scripts/setup.sh --llamacpp``).

Writes ``benchmark.md``, ``benchmark.json`` (rows, the comparisons with their intervals, the prompts' token ids),
``cost_model.llamacpp.json`` (the curve the goodput policies priced rounds with) and ``config.yaml`` to ``out_dir``.

Usage:
    python -m pipelines.llamacpp_bench --config configs/benchmark-llamacpp.yaml
    python -m pipelines.llamacpp_bench --config configs/benchmark-llamacpp.yaml --n_prompts 3 --max_new_tokens 64
"""
from __future__ import annotations

import sys
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from pipelines.benchmark.llamacpp import LlamaCppBenchConfig, comparison_lines, run_llamacpp_benchmark
from pipelines.benchmark.report import console_table
from pipelines.cli import parse_config, setup_logging, user_errors

PROG = "python -m pipelines.llamacpp_bench"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, run the rows, print the table and the comparisons; returns {"rows", "comparisons",
    "out_dir"}."""
    setup_logging()
    with user_errors(PROG):
        cfg = parse_config(LlamaCppBenchConfig, argv, __doc__)
        out_dir = Path(cfg.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yaml").write_text(f"# {PROG} --config {out_dir / 'config.yaml'}\n"
                                             + yaml.safe_dump(asdict(cfg)))
        rows, comps = run_llamacpp_benchmark(cfg)
    print(console_table(rows, len(rows[0]["prompt_tokens"])))
    for line in [*comparison_lines(comps), f"full table: {out_dir / 'benchmark.md'}"]:
        print(textwrap.fill(line, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False))
    return {"rows": rows, "comparisons": comps, "out_dir": str(out_dir)}


if __name__ == "__main__":
    main(sys.argv[1:])
