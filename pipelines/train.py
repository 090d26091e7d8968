"""The main job: labelled draft tokens -> trained, evaluated, registered stop predictors, and a comparison table.

1. Generate the labelled-token shards if the data folder is missing or short of its budget (resumes otherwise).
2. Train the learned predictors with Lightning (DISCO FFN, SPRINTER verifier, SV bin table), each logged to MLflow
   through MLFlowLogger (params, per-epoch metrics, data fingerprint, model identities, resolved config).
3. Evaluate them on the test split against the training-free scores (ROC / F1 / replayed speedup) and tune each
   threshold for predicted speedup on the validation split (``evaluation.evaluate``); the report is logged to
   MLflow. With ``crossval_folds`` > 0, also cross-validate DISCO and SPRINTER over folds of prompts
   (``evaluation.crossval``).
4. Export each predictor (safetensors + JSON) with its tuned threshold, register it in the MLflow registry, move the
   ``champion`` alias when it beats the current champion on validation AUC, and print the table: a summary that fits
   100 columns on the console, every column in ``<out_dir>/results.md`` (and ``results.json``).

One progress view (``data_gen.progress``): a bar over the stages, records/s and an ETA while generating, one line per
stage with its time and a total. A stopped job resumes: finished shards are kept (``data_gen.shards``; a shard that no
longer reads is moved aside and generated again), a data folder that a generation run completed is not reopened, and a
predictor whose export matches its config and the data (``<out_dir>/<kind>/train_state.json``) is not trained or
registered again (``--retrain true`` trains every predictor anew).

Usage:
    python -m pipelines.train                                 # default config: the real Qwen2.5-Coder pair
    python -m pipelines.train --config configs/smoke.yaml     # tiny random-init models, under a minute
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from compute.code_version import record_end
from data_gen.config import GenerateConfig
from main_job.train import TrainJobConfig, train_all
from pipelines.cli import command_line, parse_config, setup_logging, user_errors
from rendering.result_store import invocation, main_job_records, summarize_main_job, write_summary
from rendering.train_results import RESULTS_MD, SUMMARY_NOTE, format_summary

PROG = "python -m pipelines.train"


def generate_config(path: str) -> GenerateConfig:
    """A generate config from its YAML file (an ``extra_data`` entry of the main job)."""
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"extra_data entry {path!r} is not a file (give generate-config YAML paths from {Path.cwd()})"
        )
    return parse_config(GenerateConfig, ["--config", path], "generate config")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, run the main job, print its table, recommendations and stage times; returns the job's
    result (``main_job.train.train_all``)."""
    setup_logging()
    with user_errors(PROG):
        cfg = parse_config(TrainJobConfig, argv, __doc__)
        result = train_all(cfg, [generate_config(p) for p in cfg.extra_data], command=command_line(PROG, argv))
    # the job's end and duration beside its start's code and host; a job that reused or resumed earlier work records
    # no duration: it is not what the job costs
    seconds = result["seconds"] if result.get("from_scratch") else None
    record_end(cfg.out_dir, seconds)
    out = Path(cfg.out_dir)
    print(format_summary(result["results"]))
    print(SUMMARY_NOTE)
    print(f"full table: {out / RESULTS_MD}")
    if result["report"]:
        print(f"report: {result['report']}")
    for lines in result.get("recommendations", {}).values():
        print("\n".join(lines))
    print(result["total_line"])
    if cfg.results_dir:
        command, name = invocation("pipelines.train", argv)
        with user_errors(PROG):
            summary = summarize_main_job(cfg.out_dir, command, name, seconds)
            stored = write_summary(summary, cfg.results_dir, main_job_records(cfg.out_dir))
            print(f"results summary: {stored}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
