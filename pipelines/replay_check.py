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
curve + the row's measured prefill; older reports without prefill times: the replay's own tokens/s);
measured tokens/s; predicted / measured; predicted and measured mean accepted and mean drafted tokens per round and
rounds (a miss in acceptance or in drafting is the trajectory's, the rest is the curve's); ``curve_tokens_per_s``, the
replay's own tokens/s under the curve. Written to ``benchmark.json`` (``replay_check``), a section of
``benchmark.md`` and ``replay_check.png`` (predicted against measured, identity line and +-10% band); logged to
MLflow. The labelling logs one line per prompt with an ETA, the check one summary line (worst |predicted / measured -
1| and its row).

Usage:
    python -m pipelines.replay_check --bench_dir outputs/benchmark     # on a finished benchmark's folder
    python -m pipelines.benchmark --config configs/benchmark.yaml      # runs it at the end (replay_check: true)
"""
from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.timing import STATISTICS
from data_gen.config import GenerateConfig, ModelsConfig
from data_gen.generate import load_models
from pipelines.benchmark.check import run_check, summary_line
from pipelines.benchmark.check_inputs import BenchFolder, read_bench_config, read_bench_folder
from pipelines.benchmark.check_report import PLOT, console_table, write_check
from pipelines.benchmark.tracking import check_metrics
from pipelines.cli import parse_config, setup_logging, user_errors
from pipelines.tracking import TrackingSwitch, TrackingURI, mlflow_run


@dataclass
class ReplayCheckConfig(TrackingURI, TrackingSwitch):
    """Everything ``python -m pipelines.replay_check`` does; ``tracking`` logs the check in one run of the benchmark's
    experiment, at ``tracking_uri`` (default: the benchmark's)."""

    bench_dir: str = "outputs/benchmark"
    """A finished benchmark's out_dir: benchmark.json, config.yaml and cost_model.json."""
    gen_batch_size: int = 8
    """Draft rollouts generated per batch."""
    label_batch_tokens: int = 4096
    """Memory budget of one labelling pass: padded tokens (batch x longest) per forward."""
    statistic: str | None = None
    """min, median or mean: summarise the benchmark's curve from its raw timings by this statistic (None: as written;
    min is the uncontended cost, median what a step typically costs on a shared machine, mean what it costs on average,
    the expectation of a row's total time; the curve probed during the rows is pooled by the mean)."""

    def __post_init__(self) -> None:
        if self.statistic is not None and self.statistic not in STATISTICS:
            raise ValueError(f"--statistic {self.statistic!r}: use {', '.join(STATISTICS)} (or leave it unset)")
        if self.gen_batch_size < 1 or self.label_batch_tokens < 1:
            raise ValueError(f"gen_batch_size={self.gen_batch_size} and label_batch_tokens={self.label_batch_tokens} "
                             "must be >= 1")


def load_pair(models: ModelsConfig) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedTokenizerBase]:
    """The benchmark's draft and target, on its compute path (the companion loads only when a row reads it)."""
    loaded, tok = load_models(GenerateConfig(models=replace(models, companion=None)))
    return loaded.draft, loaded.target, tok


def log_check(result: dict[str, Any], folder: BenchFolder, tracking_uri: str | None) -> None:
    """One MLflow run in the benchmark's experiment (its config's, as its tracking URI unless ``tracking_uri`` is
    given): the check's metrics, benchmark.json / .md and the plot."""
    bench_cfg = read_bench_config(folder.path)
    with mlflow_run(tracking_uri or bench_cfg.tracking_uri, bench_cfg.experiment, "replay-check") as mlflow:
        mlflow.log_params({"bench_dir": str(folder.path), "mode": result["mode"], "rollout_len": result["rollout_len"]})
        mlflow.log_metrics(check_metrics(result))
        for name in ("benchmark.json", "benchmark.md", PLOT):
            mlflow.log_artifact(str(folder.path / name))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, check the folder, write and log the check; returns the ``replay_check`` section."""
    setup_logging()
    with user_errors("python -m pipelines.replay_check"):
        cc = parse_config(ReplayCheckConfig, argv, __doc__)
        folder = read_bench_folder(cc.bench_dir)
        if cc.statistic:
            folder.cost_model = folder.cost_model.with_statistic(cc.statistic)
        torch.manual_seed(folder.decoding.seed)
        draft, target, tok = load_pair(folder.models)
        result = run_check(folder, draft, target, tok, gen_batch_size=cc.gen_batch_size,
                           label_batch_tokens=cc.label_batch_tokens)
        write_check(result, folder.path)
    if cc.tracking:
        log_check(result, folder, cc.tracking_uri)
    print(console_table(result))
    print(textwrap.fill(summary_line(result["summary"]), 100, subsequent_indent="  ", break_long_words=False,
                        break_on_hyphens=False))
    print(f"full table: {folder.path / 'benchmark.md'}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
