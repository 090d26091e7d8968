"""Does the offline replay predict the engine? The benchmark's prompts labelled with the data generator's code, every
engine row's policy replayed under the benchmark's measured curve, predicted against measured tokens/s.

Labelling (``data_gen.continuation_labels.label_continuation``, the generator's labelling passes and rollouts): along
the target-only output the benchmark produced for each prompt (no extra target decoding), records of origin ``target``
teacher-forced, plus, in greedy mode, the draft's own rollout from every prefix where the drafted token fails greedy
match and from the end of the output, as long as the longest draft a benchmarked policy can make. An approximate row
(SPRINTER, greedy) is labelled along its own output, which the benchmark keeps (:func:`own_output_rows`).

Replay (``evaluation.replay``): every engine row's policy (static, tuned baselines, learned exports, ``goodput:`` rows;
not target-only, the transformers rows or the eager reference), rebuilt from the spec and threshold the benchmark
recorded, is replayed on those records under the benchmark's curve (``cost_model_rows.json``, pooled from probes
between its prompts, else ``cost_model.json``, measured before its rows), in its decoding mode, with its
``max_draft_len`` and ``max_new_tokens`` (``ReplayConfig.branch_rollouts``: past a round's first mismatch the round
reads the draft's rollout, as the engine's draft does). In greedy mode on an exact compute path the replay follows the
engine's own trajectory (same rounds, drafted and accepted tokens), so what remains between predicted and measured
tokens/s is the cost curve and what it leaves out (stop decisions, the decoder's own overhead).

Per engine row: predicted tokens/s = the row's tokens over (those tokens at the replay's seconds per token under the
curve + the row's measured prefill; rows that time no prefill apart, transformers': the replay's own tokens/s);
measured tokens/s; predicted / measured; predicted and measured mean accepted and mean drafted tokens per round and
rounds (a miss in acceptance or in drafting is the trajectory's, the rest is the curve's); ``curve_tokens_per_s``, the
replay's own tokens/s under the curve. Written to ``benchmark.json`` (``replay_check``), ``replay_check.md``
and ``replay_check.png`` (predicted against measured, identity line and +-10% band); logged to
MLflow. The labelling logs one line per prompt with an ETA, the check one summary line (worst |predicted / measured -
1| and its row).

Usage:
    python -m pipelines.replay_check --bench_dir outputs/benchmark     # on a finished benchmark's folder
    python -m pipelines.benchmark --config configs/benchmark.yaml      # runs it at the end (replay_check: true)
"""
from __future__ import annotations

import functools
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmark.check import run_check, summary_line
from benchmark.check_inputs import ReplayCheckConfig, read_bench_folder
from benchmark.check_report import console_table, write_check
from benchmark.config import BenchmarkConfig
from benchmark.tracking import log_check
from data_gen.generate import load_pair
from pipelines.cli import parse_config, setup_logging, user_errors


def read_bench_config(folder: Path) -> BenchmarkConfig:
    """The benchmark's resolved config, ``config.yaml`` in its folder (its cost_file is not needed: the folder holds
    the curve)."""
    path = folder / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (the benchmark writes its resolved config there)")
    return parse_config(BenchmarkConfig, ["--config", str(path), "--cost_file", "null"], "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, check the folder, write and log the check; returns the ``replay_check`` section."""
    setup_logging()
    with user_errors("python -m pipelines.replay_check"):
        cc = parse_config(ReplayCheckConfig, argv, __doc__)
        read_config = functools.cache(read_bench_config)  # read once, for the folder and for MLflow
        folder = read_bench_folder(cc.bench_dir, read_config)
        bench_cfg = read_config(folder.path)
        if cc.statistic:
            folder.cost_model = folder.cost_model.with_statistic(cc.statistic)
        torch.manual_seed(folder.decoding.seed)
        # the benchmark's draft and target on its compute path (the companion loads only when a row reads it)
        settings = {k: v for k, v in asdict(folder.models).items() if k not in ("draft", "target", "companion")}
        draft, target, tok = load_pair(folder.models.draft, folder.models.target, **settings)
        result = run_check(folder, draft, target, tok, gen_batch_size=cc.gen_batch_size,
                           label_batch_tokens=cc.label_batch_tokens)
        write_check(result, folder.path)
    if cc.tracking:
        log_check(result, folder, bench_cfg, cc.tracking_uri)
    print(console_table(result))
    print(textwrap.fill(summary_line(result["summary"]), 100, subsequent_indent="  ", break_long_words=False,
                        break_on_hyphens=False))
    print(f"full table: {folder.path / 'replay_check.md'}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
