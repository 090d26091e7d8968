"""llama.cpp benchmark: target-only, llama.cpp's speculative decoding at its defaults and at given settings, and
specstop's stop policies inside llama.cpp's speculative loop, side by side on the same prompts, greedy, each output
checked against target-only's (``runtimes.llamacpp.measure``). Needs llama-cpp-python
(``bash scripts/setup.sh --llamacpp``); before any row its build decodes a GGUF of the target's widths in a child
process (``runtimes.llamacpp.llama.check_llama_build``), so a build that dies on this CPU stops the run with one line
naming its flags and the rebuild command.

With ``recommend_data`` (the main job's data folder) llama.cpp's settings are tuned under this run's curve and the
recommendation runs as a row (target-only when it is not to speculate); with ``replay_check`` the prompts are then
labelled with llama.cpp's logits and every row's replayed tokens/s is set beside the measured one.

Writes ``benchmark.md``, ``benchmark.json`` (rows, the comparisons with their intervals, the recommendation, the
replay check, the prompts' token ids), ``cost_model.llamacpp.json`` (the curve the goodput policies priced rounds
with and the recommendation was tuned under), ``llamacpp_replay_records.npz`` and ``config.yaml`` to ``out_dir``.

Usage:
    python -m pipelines.llamacpp_bench --config configs/benchmark-llamacpp.yaml
    python -m pipelines.llamacpp_bench --config configs/benchmark-llamacpp.yaml --n_prompts 3 --max_new_tokens 64
"""
from __future__ import annotations

import sys
import textwrap
import time
from typing import Any

from benchmark.check import summary_line
from benchmark.report import console_table
from compute.code_version import record_end
from pipelines.cli import parse_config, setup_logging, start_run, user_errors
from runtimes.llamacpp.measure import LlamaCppBenchConfig, comparison_lines, run_llamacpp_benchmark

PROG = "python -m pipelines.llamacpp_bench"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, run the rows, print the table and the comparisons; returns {"rows", "comparisons",
    "out_dir"}."""
    setup_logging()
    with user_errors(PROG):
        cfg = parse_config(LlamaCppBenchConfig, argv, __doc__)
        out_dir = start_run(cfg, PROG, argv)
        t0 = time.perf_counter()
        rep = run_llamacpp_benchmark(cfg)
        record_end(out_dir, time.perf_counter() - t0)  # the run's end and duration beside its start's code and host
    print(console_table(rep.table, len(rep.table[0]["prompt_tokens"])))
    check = [summary_line(rep.replay_check["summary"])] if rep.replay_check else []
    for line in [*comparison_lines(rep.comparisons), *rep.recommendation, *check,
                 f"full table: {out_dir / 'benchmark.md'}"]:
        print(textwrap.fill(line, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False))
    return {"rows": rep.table, "comparisons": rep.comparisons, "replay_check": rep.replay_check,
            "out_dir": str(out_dir)}


if __name__ == "__main__":
    main(sys.argv[1:])
