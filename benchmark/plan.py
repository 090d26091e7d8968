"""The rows of a benchmark (:func:`row_plan`: target-only first) and the order they run in (:func:`run_rows`):
``order: prompt`` runs every row on one prompt before the next, ``repeats`` times in a seeded shuffled order
(:func:`pass_order`), each row's seconds on it adjusted for each pass's host speed
(``benchmark.records.pass_adjusted``), so drift of the host hits all rows alike; with ``interleave`` the rows that can
(target-only, the engine's) decode the prompt together a step at a time (``benchmark.interleave``); ``order: row``
runs each row over all prompts in turn."""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from benchmark.bench import Bench, RunOrder
from benchmark.config import BenchmarkConfig
from benchmark.curve import measure_curve
from benchmark.interleave import Lane, interleave
from benchmark.records import pass_adjusted
from benchmark.resume import PromptStore
from benchmark.rows import Row
from benchmark.runners import (
    engine_lane,
    run_engine,
    run_hf,
    run_hf_policy,
    run_reference,
    run_target_only,
    target_only_lane,
)
from benchmark.tuning import tune_on_validation, tune_predictors, tune_runtime
from compute.timing import CostModel
from data_gen.progress import Heartbeat

log = logging.getLogger("pipelines.benchmark")


Runner = Callable[[Bench], Row]
"""Runs one row on the prompts of the bench it is given (all of them, or one in ``order: prompt``)."""


@dataclass(frozen=True)
class SteppedRunner:
    """A :data:`Runner` whose row can also decode a one-prompt bench a step at a time (``lane``: its
    :class:`~benchmark.interleave.Lane`, or None where it cannot), for ``interleave``."""

    run: Runner
    lane: Callable[[Bench], Lane | None]

    def __call__(self, bench: Bench) -> Row:
        return self.run(bench)


def row_plan(cfg: BenchmarkConfig, bench: Bench) -> list[tuple[str, Runner]]:
    """(name, runner) for every row, in order; target-only first. What is tuned on validation is tuned first."""
    tuned = tune_on_validation(cfg.policies, bench, cfg.tune_data_dir, cfg.max_static)
    if cfg.tune_predictors and cfg.tune_data_dir is not None:
        tuned.update(tune_predictors(cfg.predictors, bench, cfg.tune_data_dir))
    hf_settings = {}  # hf row kind -> its tuned settings (the recommended row's)
    if "recommended" in cfg.hf_rows:
        hf_settings["recommended"] = tune_runtime("transformers", bench, cfg.tune_data_dir).settings()
    plan: list[tuple[str, Runner]] = [("target-only", SteppedRunner(run_target_only, target_only_lane))]
    for kind in cfg.hf_rows:
        settings = hf_settings.get(kind)
        plan.append((f"hf:{kind}", lambda b, k=kind, s=settings: run_hf(b, k, s)))
    for spec in [*cfg.policies, *cfg.predictors]:
        if spec.startswith("hfp:"):
            plan.append((spec, lambda b, s=spec[4:]: run_hf_policy(b, s)))
        elif spec in tuned:
            pol, label, rebuild = tuned[spec]
            plan.append((label, _engine_runner(pol, label, rebuild)))
        else:
            plan.append((spec, _engine_runner(spec)))
    if cfg.reference_compute and cfg.reference_compute != cfg.models.compute:
        models = replace(cfg.models, compute=cfg.reference_compute)
        n_new = cfg.reference_max_new_tokens or cfg.max_new_tokens
        warm = cfg.warmup
        plan.append((f"target-only ({cfg.reference_compute})", lambda b: run_reference(b, models, n_new, warm)))
    return plan


def _engine_runner(spec: str | Any, label: str | None = None, rebuild: dict[str, Any] | None = None) -> SteppedRunner:
    """An engine row's runner, whole (``run_engine``) or a round at a time (``engine_lane``), on the same arguments."""
    return SteppedRunner(lambda b: run_engine(b, spec, label, rebuild), lambda b: engine_lane(b, spec, label, rebuild))


PromptDone = Callable[[list[Row], int], None]
"""Called with the rows so far (plan order) and how many decodes they cover (prompts, or with several samples a
prompt (prompt, sample) pairs, prompt by prompt), after each one of ``order: prompt``."""


def run_rows(plan: list[tuple[str, Runner]], bench: Bench, how: RunOrder,
             store: PromptStore | None = None, on_prompt: PromptDone | None = None,
             beat: Heartbeat | None = None) -> list[Row]:
    """Every row on every prompt (each of its samples: ``bench.prompts`` holds one entry per decode), in the order
    ``how`` says, with progress and an ETA; returns the rows in plan order. With a ``store`` (order prompt), decodes it
    holds are read back instead of run and each one run is saved to it. ``beat`` (a heartbeat, when stderr is not a
    terminal) is told the decodes (or rows) done and the row running."""
    t0 = time.perf_counter()
    if how.order == "row":
        rows: list[Row] = []
        for i, (name, runner) in enumerate(plan):
            if beat is not None:
                beat.update(i, len(plan), note=f"row {name}", unit="rows")
            t_row = time.perf_counter()
            rows.append(runner(bench))
            rows[-1].runs = len(rows[-1].seconds)  # once per prompt
            _log_row(i, len(plan), name, rows, time.perf_counter() - t_row, t0)
        return rows
    merged: dict[str, Row] = {}
    n = len(bench.prompts)
    k = bench.decoding.samples_per_prompt
    stored = set(store.done()) if store is not None else set()
    ran = 0
    for j, prompt in enumerate(bench.prompts):
        i, s = bench.unit(j)
        if j in stored:
            assert store is not None
            rows_j, probe = store.load(j)
        else:
            t_prompt = time.perf_counter()
            view = replace(bench, prompts=[prompt], offset=j, reference=None)
            last = s == k - 1  # the curve is probed once a prompt, after its last sample
            rows_j, probe = run_prompt(plan, view, how if last else replace(how, curve_probes=False), beat)
            if store is not None:
                store.save(j, rows_j, probe, time.perf_counter() - t_prompt)
            ran += 1
        if probe is not None:
            bench.shared.setdefault("curve_probes", []).append(probe)
        for name, row in rows_j.items():
            if name in merged:
                merged[name].extend(row)
            else:
                merged[name] = row
        done = time.perf_counter() - t0
        base = merged[plan[0][0]]
        line = ", ".join(f"{name} x{r.tokens_per_s / base.tokens_per_s:.2f}" for name, r in list(merged.items())[1:6]
                         if base.tokens_per_s)
        status = "read back from an earlier run" if j in stored else f"done ({done:.0f}s"
        eta = "" if j in stored else f", ETA {done / ran * sum(1 for u in range(j + 1, n) if u not in stored):.0f}s)"
        what = f"{j + 1}/{n}" if k == 1 else f"{i + 1}/{n // k} sample {s + 1}/{k}"
        log.info("prompt %s %s%s: target-only %.3f tokens/s; so far %s ...", what, status, eta, base.tokens_per_s,
                 line)
        if on_prompt is not None and j not in stored:
            on_prompt([merged[name] for name, _ in plan], j + 1)
        if beat is not None:
            beat.update(j + 1, n, unit="prompts" if k == 1 else "samples",
                        resumed=sum(1 for u in stored if u <= j))
    return [merged[name] for name, _ in plan]


def run_prompt(plan: list[tuple[str, Runner]], view: Bench, how: RunOrder,
               beat: Heartbeat | None = None) -> tuple[dict[str, Row], CostModel | None]:
    """Every row of the plan on the one prompt of ``view`` (one decode of the run: a prompt, or one of its samples),
    ``repeats`` times, each pass in :func:`pass_order`: each row keeps its fastest run's outputs and counters, every
    run's seconds (``pass_seconds``) and, as its seconds, their pass-adjusted value
    (``benchmark.records.pass_adjusted``: a pass's slow phase, shared by its rows, cancels in their ratios); then the
    curve probed once (``curve_probes``, else None)."""
    label = _decode_label(view)
    rows_j: dict[str, Row] = {}
    runs: dict[str, list[float | None]] = {}  # each row's seconds pass by pass (None: its output differed)
    last: str | None = None
    for r in range(how.repeats):
        todo = [(name, runner) for name, runner in plan if not (name in rows_j and rows_j[name].reference)]
        for name, row in _pass_rows(pass_order(todo, view.offset, r, last), view, how.interleave,
                                    f"{label}, pass {r + 1}", beat):
            last = name
            if name not in rows_j:
                rows_j[name], runs[name] = row, [sum(row.seconds)]
                continue
            runs[name].append(sum(row.seconds) if row.outputs == rows_j[name].outputs else None)
            kept = _faster(rows_j[name], row, label)
            kept.runs = rows_j[name].runs + 1
            rows_j[name] = kept
    if how.repeats > 1:
        timed = {name: v for name, v in runs.items() if not rows_j[name].estimated}
        for name, seconds in pass_adjusted(timed).items():
            rows_j[name].seconds, rows_j[name].pass_seconds = [seconds], [timed[name]]
        rows_j[plan[0][0]].note = (f"reference; per prompt {how.repeats} runs in a shuffled order, each pass's slow "
                                   "phase taken out (the rows' median)")
    probe = measure_curve(view, repeats=1) if how.curve_probes else None
    return rows_j, probe


def _pass_rows(order: list[tuple[str, Runner]], view: Bench, together: bool, label: str,
               beat: Heartbeat | None) -> Iterator[tuple[str, Row]]:
    """Each row of one pass on the view's one decode, in ``order``; ``together`` (``interleave``): the rows that can
    (a :class:`SteppedRunner`'s lane) first, decoding it side by side a step at a time, then the others."""
    lanes: list[Lane] = []
    if together:
        alone = []
        for name, runner in order:
            lane = runner.lane(view) if isinstance(runner, SteppedRunner) else None
            if lane is None:
                alone.append((name, runner))
            else:
                lane.name = name
                lanes.append(lane)
        order = alone
    if lanes:
        if beat is not None:
            beat.note = f"{label}, {len(lanes)} rows interleaved"
        rows = interleave(lanes, view.target.device)
        yield from ((lane.name, rows[lane.name]) for lane in lanes)
    for name, runner in order:
        if beat is not None:
            beat.note = f"{label}, row {name}"
        yield name, runner(view)


def pass_order(rows: list[tuple[str, Runner]], decode: int, r: int,
               after: str | None) -> list[tuple[str, Runner]]:
    """The order of pass ``r`` on decode ``decode``: the rows shuffled by a seed of the decode and the pass (the same
    order when a run resumes), target-only (the first row) first in the first pass (the greedy oracle's look-ahead),
    and never ``after`` (the row that ran last) first, so that no row runs twice in a row. A slow phase of the host
    that lasts two runs then falls on a row's runs in two passes no more often than on any other pair's; alternating
    order ran the plan's ends back to back at every turn."""
    rng = random.Random(f"pass-order:{decode}:{r}")
    head, rest = (rows[:1], rows[1:]) if r == 0 else ([], list(rows))
    rng.shuffle(rest)
    order = head + rest
    if len(order) > 1 and order[0][0] == after:
        order[0], order[1] = order[1], order[0]
    return order


def _decode_label(view: Bench) -> str:
    """``prompt 3`` (one sample a prompt) or ``prompt 3, sample 2`` for the one decode of a per-prompt view."""
    i, s = view.unit(0)
    return f"prompt {i + 1}" if view.decoding.samples_per_prompt == 1 else f"prompt {i + 1}, sample {s + 1}"


def _faster(first: Row, again: Row, label: str) -> Row:
    """One row run twice on one decode (``label``: its prompt and sample): the faster run (its counters and engine
    timings are the ones kept), or the first when the outputs differ (then only one run decoded each output;
    logged)."""
    if again.outputs != first.outputs:
        log.warning("%s gave other tokens on %s the second time; keeping the first run", first.name, label)
        return first
    return again if sum(again.seconds) < sum(first.seconds) else first


def _log_row(i: int, n: int, name: str, rows: list[Row], seconds: float, t0: float) -> None:
    done = time.perf_counter() - t0
    base, row = rows[0].tokens_per_s, rows[-1]
    log.info("row %d/%d %s: %.3f tokens/s (x%.3f), %d tokens in %.0fs; ETA %.0fs", i + 1, n, name, row.tokens_per_s,
             row.tokens_per_s / base if base else 0.0, row.tokens, seconds, done / (i + 1) * (n - i - 1))
