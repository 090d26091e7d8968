"""End-to-end decoding benchmark: target-only, transformers assisted generation, and the engine with every stop policy.

On the same held-out prompts (HumanEval and MT-Bench test split, half each, by default) and in one run, all rows on
the same model objects (so every row runs on the same compute path, ``--models.compute``):
- ``target-only``: ``target.generate`` (with ``interleave``, the target's forward a token at a time: the same tokens),
  the exact reference output and the speed baseline; ``target-only (eager)`` also
  times the target on ``reference_compute`` (default eager fp32: the speed of a plain transformers load);
- transformers assisted generation (``assistant_model=draft``): ``hf:static:K`` (K tokens, constant schedule),
  ``hf:heuristic`` (+2 / -1 from 5) and ``hf:default`` (20 tokens, confidence 0.4: transformers' defaults);
- ``decoding.engine.SpeculativeDecoder`` with every policy in ``policies`` and every predictor in ``predictors`` (export
  folders or ``models:/<name>@champion``); ``hfp:<policy>`` runs a policy inside transformers' generate. Tuned specs
  read the validation split of ``tune_data_dir`` and replay it under this run's measured curve: ``static:best`` (the
  static length of highest replayed speedup), ``<baseline>:tuned`` (``svip:tuned``, ``adaedl:tuned``,
  ``max_confidence:tuned``, ``draft_prob:tuned``: threshold of highest replayed speedup; under sampling
  ``draft_prob``, q(x) of the drafted token, is what transformers' confidence criterion compares, not the top-1
  probability). Thresholded learned exports are tuned again the same way (``tune_predictors``).

Rows run side by side (``order: prompt``, the default): every row decodes prompt 1, then every row prompt 2, and so on,
so a machine that slows down or speeds up during the run (a shared VM does) moves every row alike and the paired
ratios stay fair; with ``interleave: true`` target-only and the engine's rows decode each prompt together a step at a
time, each step timed alone, so that even a slow phase of seconds falls on every row alike (``benchmark.interleave``);
``order: row`` runs each row over all prompts in turn. The reference row
(``reference_compute``) decodes ``reference_max_new_tokens`` per prompt (its tokens/s is what it is compared on).
In greedy decoding the oracle reads target-only's output as its look-ahead (exact decoding emits it token for token),
so its rounds verify like any policy's and its time is measured; in sampling it runs the target one step per drafted
token and its time is estimated from the curve.

The verification curve (``compute.timing.CostModel``, L = 1..16 new tokens, read from ``cost_file`` or measured at the
start) prices SV's rounds, the sampling oracle's estimate and the tuning, and is printed in the report.

Per row: tokens/s, speedup over target-only with a paired bootstrap interval over prompts, the ratio to the best
entropy policy (SVIP, AdaEDL) with its interval, for cost-aware rows (``verification == goodput``) the ratio to the best
thresholded engine policy (learned or training-free, ``verification == threshold`` with a threshold: not static, not
the oracle) with its interval, mean accepted length, target calls per token, draft tokens wasted per token,
stop-decision cost as a fraction of one draft forward, exactness (greedy: outputs equal to target-only's) and ROUGE-L
against target-only's output. Writes ``benchmark.md``, ``benchmark.json`` (with each engine row's policy spec, the
prompts' token ids and target-only's output ids), ``speedup.png``, ``cost_model.json`` (``cost_model_rows.json``: the
curve probed between the prompts) and the resolved ``config.yaml``
to ``out_dir``; logs them to MLflow. The console shows a table within 100 columns; the full one is in ``benchmark.md``.

Under sampling, ``samples_per_prompt`` decodes every prompt several times per row, sample s of prompt i with seed
``seed + i + s * 1000000`` in every row (sample 0 keeps ``seed + i``); the records keep every sample, and the
intervals resample prompts with all their samples, so they narrow as the samples average out the sampled texts.

A stopped run continues: with ``order: prompt`` every finished prompt's rows (every finished sample's) are kept in
``<out_dir>/prompts`` and the report is rewritten after each prompt (marked partial); the same command on the same
machine reads them back and goes on at the first unfinished prompt (or sample), on the curve the run began with
(``benchmark.resume``; another ``samples_per_prompt``, seed or temperature is refused; ``--resume false`` starts
over).

With ``replay_check`` the run ends with the replay check (``benchmark.check``; on a finished run:
``python -m pipelines.replay_check``): the benchmark's prompts labelled along target-only's output, every engine row's
policy replayed offline under this run's curve, predicted against measured tokens/s (``replay_check`` in
benchmark.json, ``replay_check.md``, ``replay_check.png``).

Usage:
    python -m pipelines.benchmark --config configs/benchmark.yaml
    python -m pipelines.benchmark --config configs/benchmark-smoke.yaml --n_prompts 2
"""
from __future__ import annotations

import logging
import sys
import textwrap
from typing import Any

from benchmark.check import summary_line
from benchmark.config import BenchmarkConfig
from benchmark.report import best_thresholded, console_table, cost_aware_line
from benchmark.run import run_benchmark
from benchmark.tracking import log_to_mlflow
from compute.code_version import record_end
from pipelines.cli import parse_config, setup_logging, start_run, user_errors
from rendering.result_store import invocation, summarize_benchmark, write_summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, run the benchmark, log to MLflow; returns {"rows", "stats", "out_dir"}."""
    setup_logging()
    logging.getLogger("absl").setLevel(logging.WARNING)  # rouge-score logs once per scorer
    with user_errors("python -m pipelines.benchmark"):
        cfg = parse_config(BenchmarkConfig, argv, __doc__)
        out_dir = start_run(cfg, "python -m pipelines.benchmark", argv)
        rows, stats = run_benchmark(cfg)
        record_end(out_dir, stats["seconds"])  # the run's end and duration beside its start's code and host
    if cfg.tracking:
        log_to_mlflow(cfg, rows, out_dir, stats["replay_check"])
    print(console_table(rows, len(rows[0]["prompt_tokens"])))
    lines = [cost_aware_line(rows, best_thresholded(rows))]
    if stats["replay_check"] is not None:
        lines.append(summary_line(stats["replay_check"]["summary"]))
    for x in [x for x in lines if x] + [f"full table: {out_dir / 'benchmark.md'}"]:
        print(textwrap.fill(x, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False))
    if cfg.results_dir:
        command, name = invocation("pipelines.benchmark", argv)
        with user_errors("python -m pipelines.benchmark"):
            summary = summarize_benchmark(out_dir, command, name, stats["seconds"])
            print(f"results summary: {write_summary(summary, cfg.results_dir)}")
    return {"rows": rows, "stats": stats, "out_dir": str(out_dir)}


if __name__ == "__main__":
    main(sys.argv[1:])
