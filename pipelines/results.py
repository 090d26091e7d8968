"""Render the README's results table and docs/results.md from the run summaries stored in ``results/``.

Every figure the README and docs/results.md quote comes from a summary file (``rendering.result_store``), never typed by
hand. ``--check`` renders in memory and exits 1, naming the file, when a document differs from what the summaries
give (the unit suite runs it). ``--verify`` recomputes every rendered figure of each summary from its per-prompt
records (``benchmark.verify``) and exits 1 naming the first that disagrees. ``--main_job DIR`` /
``--benchmark DIR`` first store the summary of a finished run, with the provenance the run recorded; stored in a
folder other than ``results/`` (``--results_dir``), nothing is rendered.

Usage:
    python -m pipelines.results                      # rewrite the README's and docs/results.md's blocks
    python -m pipelines.results --check true         # exit 1 when they differ from results/
    python -m pipelines.results --verify true        # recompute every figure from the per-prompt records
    python -m pipelines.results --benchmark outputs/benchmark-full --config_name benchmark-full \\
        --command "python -m pipelines.benchmark --config configs/benchmark-full.yaml"
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmark.verify import MissingRecords, recomputed_summary, verify_benchmark
from compute.code_version import recorded_command
from main_job.verify import NoRecords, verify_main_job
from pipelines.cli import parse_config, setup_logging, user_errors
from rendering.device_results import summarize_device_check
from rendering.result_store import (
    Summary,
    SummaryError,
    load_summaries,
    main_job_records,
    sidecar_path,
    summarize_benchmark,
    summarize_main_job,
    write_summary,
)
from rendering.result_tables import fill, render_blocks, sampled_quality, verdict
from runtimes.vllm.results import summarize_vllm_benchmark, verify_vllm_summary, vllm_block, vllm_readme_lines

log = logging.getLogger(__name__)

DOCUMENTS = {"readme": "README.md", "docs": "docs/results.md", "llamacpp": "docs/llamacpp.md",
             "transformers": "docs/runtimes.md", "vllm": "docs/vllm.md", "gpu": "docs/gpu.md"}
"""Block name -> the file (from the repository root) that holds it."""


@dataclass
class ResultsConfig:
    """What to render, or which finished run to store first."""

    results_dir: str = "results"
    """Folder of the run summaries (JSON)."""
    root: str = "."
    """Repository root holding README.md and docs/."""
    check: bool = False
    """Render in memory and exit 1 when a document differs (nothing is written)."""
    main_job: str | None = None
    """Store the summary of the finished main job in this folder (its out_dir) before rendering."""
    benchmark: str | None = None
    """Store the summary of the finished benchmark in this folder (its out_dir) before rendering."""
    config_name: str | None = None
    """The config's name in the summary (default: default for a main job, benchmark for a benchmark)."""
    command: str | None = None
    """The command that reproduces the stored run (default: the one its start recorded, else the usual command for
    its config name)."""
    device_check: str | None = None
    """Store the summary of a GPU check (``scripts/device_check.sh``'s device-check.json) before rendering."""
    verify: bool = False
    """Recompute every rendered figure of each summary from its per-prompt records and exit 1 at the first that
    disagrees, or for a summary without records (nothing is written)."""


def store_runs(cfg: ResultsConfig) -> None:
    """Write the summaries of the runs named by ``--main_job`` / ``--benchmark``."""
    if cfg.main_job:
        name = cfg.config_name or "default"
        cmd = cfg.command or recorded_command(cfg.main_job) or f"python -m pipelines.train --config configs/{name}.yaml"
        summary = summarize_main_job(cfg.main_job, cmd, name)
        log.info("stored %s", write_summary(summary, cfg.results_dir, main_job_records(cfg.main_job)))
    if cfg.device_check:
        summary = summarize_device_check(cfg.device_check)
        log.info("stored %s", write_summary(summary, cfg.results_dir))
    if cfg.benchmark and (cfg.config_name or "").startswith("benchmark-vllm"):
        cmd = cfg.command or recorded_command(cfg.benchmark) or (
            f"python -m pipelines.vllm_bench --config configs/{cfg.config_name}.yaml")
        summary = summarize_vllm_benchmark(cfg.benchmark, cmd, cfg.config_name)
        log.info("stored %s", write_summary(summary, cfg.results_dir))
    elif cfg.benchmark:
        name = cfg.config_name or "benchmark"
        entry = "pipelines.llamacpp_bench" if name.startswith("benchmark-llamacpp") else "pipelines.benchmark"
        cmd = cfg.command or recorded_command(cfg.benchmark) or f"python -m {entry} --config configs/{name}.yaml"
        summary = summarize_benchmark(cfg.benchmark, cmd, name)
        log.info("stored %s", write_summary(summary, cfg.results_dir))


def renders_documents(cfg: ResultsConfig) -> bool:
    """Whether ``results_dir`` is the repository's ``results/``: the documents render from it alone, so that a summary
    stored in another folder (a scratch one) never empties their blocks."""
    return (Path(cfg.root) / cfg.results_dir).resolve() == (Path(cfg.root) / "results").resolve()


def render(cfg: ResultsConfig) -> list[Path]:
    """Fill every document's block from the summaries; returns the documents that differ(ed)."""
    summaries = load_summaries(Path(cfg.root) / cfg.results_dir)
    blocks = render_blocks(summaries, {"vllm": vllm_block(summaries)}, vllm_readme_lines(summaries))
    differ = []
    for name, rel in DOCUMENTS.items():
        path = Path(cfg.root) / rel
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing; it must hold the <!-- results:{name} --> block")
        text = path.read_text()
        new = fill(text, name, blocks[name], path)
        if new != text:
            differ.append(path)
            if not cfg.check:
                path.write_text(new)
    return differ


def verify_summary(s: Summary) -> str | None:
    """What in a stored summary its records do not give (None: every rendered figure recomputes): the first
    disagreeing figure (row, field, stored and recomputed value), a verdict that reads otherwise, or a summary that
    holds no per-prompt records (stored by older code; a main job's are in its sidecar file,
    ``main_job.verify``)."""
    remeasure = f"no per-prompt records: re-measure with {s.data['command']}"
    try:
        if s.kind == "benchmark":
            first = verify_benchmark(s.data)
            again = Summary(s.path, recomputed_summary(s.data))
            if first is None and (verdict(s), sampled_quality(s)) != (verdict(again), sampled_quality(again)):
                return f"the verdict reads otherwise from the records: {verdict(again)} {sampled_quality(again)}"
        elif s.kind == "vllm_benchmark":
            first = verify_vllm_summary(s.data)
        elif s.kind == "main_job":
            first = verify_main_job(s.data, sidecar_path(s.path))
        else:
            return None  # the GPU check stores its steps' statuses: nothing in it is computed
    except (MissingRecords, NoRecords):
        return remeasure
    return None if first is None else first.line("first disagreeing figure")


def verify_all(cfg: ResultsConfig) -> int:
    """One line per summary: ``ok`` when every rendered figure recomputes from its records, else what disagrees
    (:func:`verify_summary`); 1 when any does not."""
    failed = 0
    for s in load_summaries(Path(cfg.root) / cfg.results_dir):
        problem = verify_summary(s)
        ok = "ok, every figure recomputed from its records" if s.kind != "device_check" else "ok, nothing computed"
        print(f"{s.path.name}: {problem or ok}", file=sys.stderr if problem else sys.stdout)
        failed += problem is not None
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    setup_logging()
    with user_errors("python -m pipelines.results"):
        cfg = parse_config(ResultsConfig, argv, __doc__)
        if cfg.verify:
            try:
                return verify_all(cfg)
            except SummaryError as e:
                raise ValueError(str(e)) from e
        try:
            if not cfg.check:
                store_runs(cfg)
                if not renders_documents(cfg):
                    load_summaries(Path(cfg.root) / cfg.results_dir)  # the folder and its summaries still checked
                    log.info("README and docs not rendered: they render from %s only",
                             Path(cfg.root) / "results")
                    return 0
            differ = render(cfg)
        except SummaryError as e:
            raise ValueError(str(e)) from e
    if cfg.check:
        for path in differ:
            print(f"{path}: differs from what {cfg.results_dir}/ renders; run python -m pipelines.results",
                  file=sys.stderr)
        return 1 if differ else 0
    for path in differ:
        log.info("rewrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
