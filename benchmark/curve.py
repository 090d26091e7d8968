"""The verification curve of a benchmark run (``compute.timing.CostModel``): read from ``cost_file`` or measured before
the rows (what the policies decide with), and probed between the prompts (``curve_probes``: the host's average speed
while the rows ran, which the replay check prices with)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from benchmark.bench import Bench
from compute.compute_path import compute_path_of, cpu_info
from compute.timing import CostModel, measure_cost_model, pool_cost_models
from runtimes.transformers.costs import measure_transformers_costs

log = logging.getLogger("pipelines.benchmark")


CURVE_DURING_ROWS = "cost_model_rows.json"
"""The curve pooled from probes between the prompts (``curve_probes``), beside the one measured before the rows."""
HF_CURVE = "cost_model.transformers.json"
"""transformers' own curve (``hf_curve``), beside the run's."""


def load_cost_model(cost_file: str | None, bench: Bench) -> CostModel:
    """``cost_file`` (warned when measured for another pair, path or CPU) or a measurement of L = 1..16 now."""
    if cost_file:
        cm = CostModel.from_json(cost_file)
        for diff in cm.mismatch(str(bench.draft.config.name_or_path), str(bench.target.config.name_or_path),
                                compute_path_of(bench.target), cpu_info()):
            log.warning("cost file %s does not match this run: %s", cost_file, diff)
        return cm
    t0 = time.perf_counter()
    cm = measure_curve(bench, repeats=3)
    log.info("verification curve measured in %.0fs:\n%s", time.perf_counter() - t0, cm.curve_table())
    return cm


def load_hf_curve(bench: Bench, out_dir: Path, resume: bool) -> CostModel:
    """transformers' curve of the pair: the one in ``out_dir`` when a resumed run (``resume``) measured it, else
    measured now (``runtimes.transformers.costs``) and written there, beside the run's own."""
    path = out_dir / HF_CURVE
    if resume and path.is_file():
        return CostModel.from_json(path)
    t0 = time.perf_counter()
    cm = measure_transformers_costs(bench.draft, bench.target, base=bench.cost_model)
    cm.to_json(path)
    log.info("transformers' curve measured in %.0fs:\n%s", time.perf_counter() - t0, cm.curve_table())
    return cm


def measure_curve(bench: Bench, repeats: int) -> CostModel:
    """The pair's curve at every verification length 1..16, 24 and one past the draft cap."""
    return measure_cost_model(bench.draft, bench.target, bench.companion,
                              lengths=(*range(1, 17), 24, bench.decoding.max_draft_len + 1), repeats=repeats)


def write_curve_during_rows(bench: Bench, out_dir: Path) -> None:
    """``cost_model_rows.json`` from the probes taken between the prompts (none in row order or without probes: an
    earlier run's file is removed), and a log line comparing it with the curve measured before the rows."""
    probes = bench.shared.get("curve_probes") or []
    if not probes:
        (out_dir / CURVE_DURING_ROWS).unlink(missing_ok=True)  # an earlier run's probes do not describe this one
        return
    cm = pool_cost_models(probes)
    cm.to_json(out_dir / CURVE_DURING_ROWS)
    before = bench.cost_model
    if before is not None:
        log.info("curve during the rows (mean of %d probes): t(1) %.1f ms, t(8) / t(1) %.2f, draft step %.1f ms; "
                 "before the rows: %.1f ms, %.2f, %.1f ms", len(probes), 1e3 * cm.target_time(1),
                 cm.target_time(8) / cm.target_time(1), 1e3 * cm.draft_s_per_token, 1e3 * before.target_time(1),
                 before.target_time(8) / before.target_time(1), 1e3 * before.draft_s_per_token)
