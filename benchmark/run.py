"""A benchmark run from start to end (:func:`run_benchmark`): the models, prompts and curve loaded (or a stopped run's
read back: :func:`load_bench`), a warm-up, the rows planned and run, the report rewritten after each prompt and at the
end, the curve probed between the prompts, and the replay check (:func:`run_replay_check`).

This is where the benchmark's config is read: the parts below it take the settings they use (``DecodeSettings``,
``RunOrder``, a folder, a file), so what a field changes is found from here."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmark.bench import Bench, DecodeSettings, RunOrder, load_benchmark_prompts, sample_units, stop_tokens
from benchmark.check import run_check
from benchmark.check_inputs import read_bench_folder
from benchmark.check_report import write_check
from benchmark.config import BenchmarkConfig
from benchmark.curve import load_cost_model, load_hf_curve, write_curve_during_rows
from benchmark.plan import row_plan, run_rows
from benchmark.report import finish_rows, write_report
from benchmark.resume import PROMPTS_DIR, PromptStore, run_identity
from benchmark.rows import Row
from benchmark.runners import release_reference, warm_up
from compute.code_version import check_resume, new_run
from compute.compute_path import compute_path_of, cpu_info
from data_gen.config import GenerateConfig
from data_gen.generate import load_models
from data_gen.progress import Heartbeat

log = logging.getLogger("pipelines.benchmark")


def run_benchmark(cfg: BenchmarkConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Load models and prompts, run every row (progress and ETA per row), write the report; returns (rows, stats)."""
    t_start = time.perf_counter()
    how = RunOrder.of(cfg)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store = None
    if cfg.order == "prompt":
        store = PromptStore(out_dir / PROMPTS_DIR, cfg.samples_per_prompt)
        if not cfg.resume:
            store.set_aside()
    bench, names, p_stats = load_bench(cfg, store)
    assert bench.cost_model is not None
    bench.cost_model.to_json(out_dir / "cost_model.json")
    if cfg.hf_curve:
        bench.hf_cost_model = load_hf_curve(bench, out_dir, cfg.resume)
    k = cfg.samples_per_prompt
    log.info("benchmark: %d prompts%s x %d new tokens, device %s, compute path %s", len(names),
             f" x {k} samples" if k > 1 else "", cfg.max_new_tokens, cfg.models.device, cfg.models.compute)
    with Heartbeat(log, "benchmark set-up (warm-up, thresholds tuned on validation)"):
        if cfg.warmup:
            warm_up(bench)
        plan = row_plan(cfg, bench)
    read_back: float | None = 0.0  # a resumed run: the earlier prompts' wall time (None: not recorded)
    if store is not None:
        store.check_rows([name for name, _ in plan])
        read_back = store.wall_seconds()

    def report_so_far(rows: list[Row], done: int) -> None:  # a run stopped now leaves its finished prompts' report
        if done < len(bench.prompts) and done % k == 0:
            view, first = replace(bench, prompts=bench.prompts[:done]), names[:done // k]
            write_report(finish_rows(rows, view, cfg.n_boot, quiet=True, names=first), view, first, out_dir,
                         cfg.models, how, of=len(names))

    try:
        with Heartbeat(log, "benchmark", total=len(bench.prompts), unit="prompts" if k == 1 else "samples") as beat:
            rows = run_rows(plan, bench, how, store, report_so_far, beat)
    finally:
        release_reference(bench)
    table = finish_rows(rows, bench, cfg.n_boot, names=names)
    write_report(table, bench, names, out_dir, cfg.models, how)
    write_curve_during_rows(bench, out_dir)
    with Heartbeat(log, "benchmark replay check"):
        check = run_replay_check(bench, out_dir, cfg) if cfg.replay_check else None
    seconds = None if read_back is None else time.perf_counter() - t_start + read_back
    return table, {"prompts": p_stats, "seconds": seconds, "replay_check": check}


def load_bench(cfg: BenchmarkConfig, store: PromptStore | None = None) -> tuple[Bench, list[str], dict]:
    """Load the models (one compute path for all rows), the prompts and the verification curve: the stored run's when
    ``store`` holds one to continue (checked to be this config, these prompts and this machine), else ``cost_file``'s
    or measured now."""
    models, tok = load_models(GenerateConfig(models=cfg.models))
    prompts, names, p_stats = load_benchmark_prompts(cfg, tok)
    bench = Bench(DecodeSettings.of(cfg), models.draft, models.target, models.companion, tok,
                  sample_units(prompts, cfg.samples_per_prompt), stop_tokens(tok, models.target))
    identity = run_identity(cfg, prompts) if store is not None else None
    if store is not None:
        bench.cost_model = store.resume(identity, cpu_info(), str(bench.draft.config.name_or_path),
                                        str(bench.target.config.name_or_path), compute_path_of(bench.target))
        if bench.cost_model is not None:
            check_resume(cfg.out_dir)  # the rows stored so far ran on the first start's code and host kind
            log.info("benchmark: continuing the run in %s (%d of %d %s done) on its first curve", store.folder,
                     len(store.done()), len(bench.prompts), "prompts" if cfg.samples_per_prompt == 1 else "samples")
            return bench, names, p_stats
    new_run(cfg.out_dir)  # nothing stored is continued: the run's code is this start's
    bench.cost_model = load_cost_model(cfg.cost_file, bench)
    if store is not None:
        store.begin(identity, bench.cost_model)
    return bench, names, p_stats


def run_replay_check(bench: Bench, out_dir: Path, cfg: BenchmarkConfig) -> dict[str, Any] | None:
    """``pipelines.replay_check`` on the folder just written (its report, as the command reads it, and the run's
    config, which its config.yaml holds), with the bench's models (nothing loads again). A check that fails is logged
    with the command that reruns it and returns None: the measured rows stand and are logged."""
    log.info("replay check: labelling the %d prompts along target-only's output", len(bench.prompts))
    try:
        check = run_check(read_bench_folder(out_dir, lambda _: cfg), bench.draft, bench.target, bench.tokenizer,
                          bench.companion)
        write_check(check, out_dir)
    except Exception:  # an optional phase after the measurement: keep the benchmark's results
        log.exception("replay check failed; the benchmark's results are written. Rerun the check alone with: python "
                      "-m pipelines.replay_check --bench_dir %s", out_dir)
        return None
    return check
