"""vLLM benchmark: vLLM's target alone, its own static K, the recommended per-batch setting and specstop's policies
inside vLLM's draft proposer, side by side on the same prompts at each batch size, greedy, each output checked
against the target alone's (``runtimes.vllm.run``). Needs vLLM: ``bash scripts/setup.sh --vllm``, then run it with
``.venv-vllm/bin/python``.

Writes ``benchmark.md``, ``benchmark.json`` (rows, intervals, the recommendation, the replay check, the checks) and
``cost_model.vllm.json`` to ``out_dir``; ``python -m pipelines.results --benchmark OUT_DIR --config_name
benchmark-vllm`` stores its summary in ``results/``.

Usage:
    .venv-vllm/bin/python -m pipelines.vllm_bench --config configs/benchmark-vllm.yaml
    .venv-vllm/bin/python -m pipelines.vllm_bench --config configs/benchmark-vllm.yaml --n_prompts 4 --max_new_tokens 32
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict
from typing import Any

from compute.code_version import PartClock, check_resume, new_run, record_end
from pipelines.cli import parse_config, setup_logging, start_run, user_errors
from runtimes.vllm.bench import VllmBenchConfig
from runtimes.vllm.engine import reexec_with_iomp

PROG = "python -m pipelines.vllm_bench"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, run the engines, print the tables and the checks; returns the report as a dict."""
    setup_logging()
    with user_errors(PROG):
        cfg = parse_config(VllmBenchConfig, argv, __doc__)
        reexec_with_iomp(["-m", "pipelines.vllm_bench", *(sys.argv[1:] if argv is None else argv)])
        from runtimes.vllm.bench_report import markdown
        from runtimes.vllm.run import run_vllm_benchmark, stored_parts

        out_dir = start_run(cfg, PROG, argv)
        if stored_parts(cfg):
            check_resume(out_dir)  # what is read back ran on the first start's code and host kind
        else:
            new_run(out_dir)  # nothing of an earlier run is read back: the run's code is this start's
        t0, clock = time.time(), PartClock(out_dir)
        rep = run_vllm_benchmark(cfg, clock)
        # the run's end and duration: this start's seconds and those of the parts read back from a stopped start
        # (None when one of them has no seconds recorded)
        record_end(out_dir, clock.duration(time.time() - t0))
    print(markdown(rep))
    print(f"full report: {out_dir / 'benchmark.md'}")
    return asdict(rep)


if __name__ == "__main__":
    main(sys.argv[1:])
