"""A vLLM benchmark run put together (``python -m pipelines.vllm_bench``): the prompts, vLLM's curve, the per-batch
recommendation, the engines and their rows (``runtimes.vllm.bench``), the replay check (``runtimes.vllm.check``)
and the report (``runtimes.vllm.bench_report``).

Usage (in ``.venv-vllm``)::

    report = run_vllm_benchmark(VllmBenchConfig(policies=["adaedl:0.648"]))

A stopped run resumes where it stopped: the curve, vLLM's acceptance, the traces and their refit and each engine's
rows of each pass are read back from ``out_dir``, and a ``PartClock`` adds the seconds they took to the run's duration.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmark.bench import PromptChoice, load_benchmark_prompts
from compute.code_version import PartClock
from compute.cpu import cpu_model
from compute.timing import BATCH_CURVES, CostModel
from data_gen.prompts import PromptSourceConfig
from evaluation.data import load_columns
from main_job.recommend import vllm_batch_picks
from runtimes.vllm.bench import (
    EngineRows,
    Reference,
    RowRole,
    RowRun,
    VllmBenchConfig,
    merge_passes,
    row_from_dict,
    run_engine,
)
from runtimes.vllm.bench_report import VllmReport, build_report
from runtimes.vllm.check import check_rows
from runtimes.vllm.curve import VllmCurveSettings, measure_vllm_acceptance, measure_vllm_curve
from runtimes.vllm.engine import EngineSpec, hf_folder, prepare_env
from runtimes.vllm.proposer import PolicySettings, check_vllm, folder_fingerprint, install, load_curves
from runtimes.vllm.settings import ACCEPTANCE, BatchPick, acceptance_picks, paste_lines, schedule_ranges
from runtimes.vllm.ties import tie_gaps
from runtimes.vllm.traces import refit_calibration

log = logging.getLogger("pipelines.vllm_bench")

__all__ = ["run_vllm_benchmark", "prompt_ids", "COST_FILE"]

COST_FILE = "cost_model.vllm.json"


def prompt_ids(sources: list[PromptSourceConfig], target_dir: str, split: str | None, n: int, *,
               use_chat_template: bool = True, max_prompt_tokens: int = 512, seed: int = 0,
               ) -> tuple[list[list[int]], list[str]]:
    """Token ids (with the target's tokenizer) and ids of ``n`` prompts of ``split`` from ``sources``, chosen as the
    benchmark chooses them (``benchmark.bench.load_benchmark_prompts``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    choice = PromptChoice(prompt_texts=None, prompts=sources, seed=seed, split=split, n_prompts=n,
                          use_chat_template=use_chat_template, max_prompt_tokens=max_prompt_tokens)
    ids, names, _ = load_benchmark_prompts(choice, tok)
    return ids, names


def _prompts(cfg: VllmBenchConfig, target_dir: str, split: str | None, n: int) -> tuple[list[list[int]], list[str]]:
    return prompt_ids(cfg.prompts, target_dir, split, n, use_chat_template=cfg.use_chat_template,
                      max_prompt_tokens=cfg.max_prompt_tokens, seed=cfg.seed)


def stored_parts(cfg: VllmBenchConfig) -> list[Path]:
    """What a start of the run in ``cfg.out_dir`` would read back instead of measuring: its curve (unless a cost file
    is given), its traces and refitted calibration, its engines' finished parts."""
    out = Path(cfg.out_dir)
    curve = [out / COST_FILE] if cfg.cost_file is None and (out / COST_FILE).is_file() else []
    return [*curve, *sorted((out / "traces").glob("shard-*.parquet")), *sorted((out / "calibrated").glob("*/*.json")),
            *sorted((out / "engines").glob("*.json"))]


def _check_pair(cm: CostModel, cfg: VllmBenchConfig, where: str, remedy: str) -> None:
    """Refuse a curve measured for another pair or dtype, or (on the CPU) on another machine, naming ``where`` it came
    from."""
    machine = cpu_model() if cfg.models.device == "cpu" else None
    if why := cm.mismatch(cfg.models.draft, cfg.models.target, machine=machine, dtype=cfg.vllm_dtype):
        raise ValueError(f"{where}: measured for another pair, dtype or machine ({'; '.join(why)}); {remedy}")


def _keep(cm: CostModel, path: Path, cfg: VllmBenchConfig) -> None:
    """Write vLLM's curve to ``path`` and beside recommend_data's data (where the main job's recommendation reads
    it) when that folder is given."""
    cm.to_json(path)
    if cfg.recommend_data:
        cm.to_json(Path(cfg.recommend_data) / COST_FILE)


def _curves(cfg: VllmBenchConfig, target: str, draft: str, clock: PartClock) -> tuple[Path, dict[int, CostModel]]:
    """vLLM's curve: the file given, else the one a previous run of out_dir measured, else measured now; written to
    out_dir (and, when measured, beside recommend_data)."""
    out = Path(cfg.out_dir) / COST_FILE
    if cfg.cost_file is None and out.is_file():
        _check_pair(CostModel.from_json(out), cfg, str(out), "move it aside (with the engines/ folder beside it) or "
                    "give another --out_dir to measure anew")
        log.info("vLLM's curve read back from %s (a resumed run; delete it to measure again)", out)
        clock.read_back("curve")
        return out, load_curves(out)
    if cfg.cost_file is not None:
        cm = CostModel.from_json(cfg.cost_file)
        _check_pair(cm, cfg, f"--cost_file {cfg.cost_file}",
                    "measure it again with python -m pipelines.measure_costs --runtime vllm")
        cm.to_json(out)
    else:
        t0 = time.time()
        cm = measure_vllm_curve(VllmCurveSettings(target=target, draft=draft, batches=tuple(cfg.curve_batches),
                                                  device=cfg.models.device, target_name=cfg.models.target,
                                                  draft_name=cfg.models.draft, dtype=cfg.vllm_dtype))
        _keep(cm, out, cfg)
        clock.ran("curve", time.time() - t0)
    return out, load_curves(out)


def _acceptance(cfg: VllmBenchConfig, cost_path: Path, target: str, draft: str, clock: PartClock) -> list[float]:
    """vLLM's own acceptance on the validation prompts (``runtimes.vllm.curve.measure_vllm_acceptance``), kept in
    the curve file's ``extra`` (and beside recommend_data's data): read back when there, else measured now."""
    cm = CostModel.from_json(cost_path)
    if ACCEPTANCE not in cm.extra:
        t0 = time.time()
        prompts, _ = _prompts(cfg, target, cfg.acceptance_split, cfg.acceptance_prompts)
        cm.extra[ACCEPTANCE] = {**measure_vllm_acceptance(target, draft, prompts, cfg.policy_k, cfg.max_new_tokens,
                                                          cfg.models.device, cfg.vllm_dtype),
                                "split": cfg.acceptance_split}
        _keep(cm, cost_path, cfg)
        clock.ran("acceptance", time.time() - t0)
    elif cfg.cost_file is None:  # measured by an earlier start of this run (a given cost file's is not this run's)
        clock.read_back("acceptance")
    return list(cm.extra[ACCEPTANCE]["survival"])


def _plan(cfg: VllmBenchConfig, target: str, draft: str, picks: list[BatchPick]) -> list[EngineRows]:
    """The engines in the order they load: the target alone (its two rows, or its first and a second build of it with
    ``second_build``; its engine stays loaded as every other engine's reference), vLLM's static Ks, the recommended
    schedule, specstop's policies (with the policies each request of which stops alone, the static Ks run by its
    proposer and by vLLM's own loop; those policies in an engine of their own when no other policy runs)."""
    seqs = max(cfg.batch_sizes)
    base = EngineSpec(target=target, max_num_seqs=max(seqs, 2), device=cfg.models.device, dtype=cfg.vllm_dtype)
    ks = sorted({*cfg.static_k, cfg.default_k, *(p.k for p in picks if p.batch == 1 and p.k)})
    one = next((p.k for p in picks if p.batch == 1), None)
    if cfg.second_build:
        groups = [EngineRows(base, [RowRole("target")]),
                  EngineRows(base, [RowRole("target", again=True, rebuilt=True)], fresh=True)]
    else:
        groups = [EngineRows(base, [RowRole("target"), RowRole("target", again=True)])]
    for k in ks:
        role = RowRole("static", k=k, recommended=k == one, defaults=k == cfg.default_k)
        groups.append(EngineRows(replace(base, draft=draft, k=k), [role]))
    if picks:
        ranges = schedule_ranges(picks, base.max_num_seqs)
        top = max(r[2] for r in ranges)
        if top and len({r[2] for r in ranges}) > 1:
            groups.append(EngineRows(replace(base, draft=draft, k=top, per_batch=ranges),
                                     [RowRole("per_batch", recommended=True)]))
    if cfg.policies or cfg.following_policies:  # the static Ks of the policies' engine only beside policies
        roles = [RowRole("policy", spec=p) for p in cfg.policies]
        roles += [RowRole("policy", spec=p, following=True) for p in cfg.following_policies]
        roles += [RowRole("policy", spec=p, per_request=True, with_policies=True) for p in cfg.per_request_policies]
        roles += [RowRole("static", k=k, in_proposer=True) for k in cfg.proposer_static_k]
        roles += [RowRole("static", k=k, in_proposer=True, own_loop=True) for k in cfg.engine_vllm_k]
        groups.append(EngineRows(replace(base, draft=draft, k=cfg.policy_k), roles, plugin=True))
    elif cfg.per_request_policies:
        groups.append(EngineRows(replace(base, draft=draft, k=cfg.policy_k),
                                 [RowRole("policy", spec=p, per_request=True) for p in cfg.per_request_policies],
                                 plugin=True, batch_rule=False))
    return groups


RUN_FIELDS = ("models", "prompts", "split", "n_prompts", "use_chat_template", "max_prompt_tokens", "max_new_tokens",
              "policy_k", "seed")
"""The config fields every engine's rows depend on (the batch size is the part's own; vLLM's dtype is its engine's)."""


def _engine_key(group: EngineRows, cfg: VllmBenchConfig, pass_no: int, batch: int) -> str:
    """What an engine's stored rows at one batch size in one pass depend on: the run's prompts and lengths, its
    speculative config, the proposer and the policies in it (not the rows' names, which say what the plan
    recommends), the pass and the batch size."""
    what = {"run": {k: getattr(cfg, k) for k in RUN_FIELDS}, "engine": asdict(group.engine), "plugin": group.plugin,
            "specs": [[r.proposer_spec, r.following] for r in group.roles], "pass": pass_no, "batch": batch,
            "batch_rule": group.batch_rule,
            "paired": "target alone before and after every row"}
    if cfg.queue_groups != 1 and batch > 1:  # streams from a queue (closed groups keep the keys stored before them)
        what["queue_groups"] = cfg.queue_groups
    curve = Path(cfg.out_dir) / COST_FILE
    if group.plugin and curve.is_file():  # cost-aware policies price rounds with the curve (not the acceptance)
        batches = CostModel.from_json(curve).extra.get(BATCH_CURVES)
        what["curve"] = hashlib.sha256(json.dumps(batches, sort_keys=True).encode()).hexdigest()
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:12]


RunEngine = Callable[[list[int], Callable[[int, list[RowRun]], None]], list[RowRun]]
"""Runs an engine's rows at the batch sizes given, calling back with each batch size's rows as soon as they are done."""


def _engine_rows(i: int, n: int, group: EngineRows, cfg: VllmBenchConfig, pass_no: int, run: RunEngine,
                 clock: PartClock) -> list[RowRun]:
    """One engine's rows in one pass, part by part (a batch size each): a part is read back from
    ``out_dir/engines/<key>.json`` when an earlier start of the run finished it (a stopped run resumes at the first
    batch size an engine has not finished; a plan that changed reruns only what changed), else run and stored as
    soon as it is done; an engine that fails is logged in one line and its rows left out (the others still run, and
    its finished parts stay for a resume)."""
    keys = {batch: _engine_key(group, cfg, pass_no, batch) for batch in cfg.batch_sizes}
    paths = {batch: Path(cfg.out_dir) / "engines" / f"{key}.json" for batch, key in keys.items()}
    got: dict[int, list[RowRun]] = {}
    for batch, path in paths.items():
        stored = json.loads(path.read_text())["rows"] if path.is_file() else []
        if len(stored) == len(group.roles):
            got[batch] = [replace(row_from_dict(r), name=role.name, role=role) for r, role in zip(stored, group.roles)]
            clock.read_back(f"engine {keys[batch]}")
    what = f"pass {pass_no + 1} of {cfg.repeats}, engine {i} of {n}: {', '.join(group.rows)}"
    todo = [b for b in cfg.batch_sizes if b not in got]
    if got:
        log.info("%s: batch sizes %s read back from %s", what, sorted(got), Path(cfg.out_dir) / "engines")
    if todo:
        log.info("%s (batch sizes %s)", what, todo)
        started = [time.time()]

        def done(batch: int, rows: list[RowRun]) -> None:
            paths[batch].parent.mkdir(parents=True, exist_ok=True)
            paths[batch].write_text(json.dumps({"engine": asdict(group.engine), "plugin": group.plugin,
                                                "batch": batch, "rows": [asdict(r) for r in rows]}))
            clock.ran(f"engine {keys[batch]}", time.time() - started[0])  # loading counts to the first part
            started[0] = time.time()
            got[batch] = rows

        try:
            run(todo, done)
        except Exception as e:  # noqa: BLE001 - one engine's failure (vLLM's own) must not lose the others' rows
            log.error("%s failed: %s", what, str(e).splitlines()[0][:300])
            return []
    return [row for batch in cfg.batch_sizes for row in got[batch]]


def _units(prompts: list[list[int]], cfg: VllmBenchConfig) -> dict[int, list[list[list[int]]]]:
    """Batch size -> its units' prompts (``VllmBenchConfig.unit_size`` each)."""
    sizes = {b: cfg.unit_size(b) for b in cfg.batch_sizes}
    return {b: [prompts[i:i + n] for i in range(0, len(prompts), n)] for b, n in sizes.items()}


def run_vllm_benchmark(cfg: VllmBenchConfig, clock: PartClock | None = None) -> VllmReport:
    """Run everything (see the module docstring) and write the report to ``cfg.out_dir``; ``clock`` keeps each
    part's seconds (one on ``out_dir`` when not given)."""
    clock = clock or PartClock(cfg.out_dir)
    check_vllm()
    prepare_env(cfg.kv_cache_gb, device=cfg.models.device)
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    target = hf_folder(cfg.models.target, cfg.models.cache_dir)
    draft = hf_folder(cfg.models.draft, cfg.models.cache_dir)
    prompts, names = _prompts(cfg, target, cfg.split, cfg.n_prompts)
    cost_path, curves = _curves(cfg, target, draft, clock)
    if cfg.acceptance_prompts:
        picks = acceptance_picks(_acceptance(cfg, cost_path, target, draft, clock), curves)
    elif cfg.recommend_data:
        picks = vllm_batch_picks(load_columns(cfg.recommend_data, ["val", "test"]), curves)
    else:
        picks = []
    for line in paste_lines(picks, draft, max(cfg.batch_sizes)) if picks else []:
        log.info("recommended: %s", line)

    fingerprint = folder_fingerprint(draft, cfg.models.draft, cfg.vllm_dtype)

    def settings_of(spec: str, batch_rule: bool = True, **more: Any) -> PolicySettings:
        return PolicySettings(spec=spec, costs=str(cost_path), max_draft_len=cfg.policy_k,
                              calibration_dir=cfg.calibration_dir, draft_fingerprint=fingerprint,
                              batch_rule=batch_rule, **more)

    if cfg.trace_predictor and cfg.trace_prompts:
        _trace_and_refit(cfg, target, draft, settings_of, clock)
    # each builds before the rows: a bad spec fails in a line
    for spec in [*cfg.policies, *cfg.per_request_policies, *cfg.following_policies]:
        install(settings_of(spec))
    plan = _plan(cfg, target, draft, picks)
    units = _units(prompts, cfg)
    reference = Reference(plan[0].engine)
    try:
        rows = _run_passes(plan, cfg, lambda g, batches, done: run_engine(g, {b: units[b] for b in batches}, cfg,
                                                                          settings_of, reference, done), clock)
    finally:
        reference.close()
    k_of = _k_of(plan)
    check = check_rows(rows, curves, k_of)
    return build_report(cfg, rows, names, picks, check, curves, paste_lines(picks, draft, max(cfg.batch_sizes))
                        if picks else [], _ties(rows, units, target))


def _trace_and_refit(cfg: VllmBenchConfig, target: str, draft: str, settings_of: Any, clock: PartClock) -> Path:
    """Trace ``trace_predictor`` in vLLM on ``trace_prompts`` prompts of ``acceptance_split`` (one request at a
    time, drafting to ``policy_k``) into ``out_dir/traces`` and refit its calibration on them into
    ``out_dir/calibrated/<name>``; a finished refit is read back."""
    export = Path(cfg.trace_predictor)
    dest = Path(cfg.out_dir) / "calibrated" / export.parent.name
    traces = Path(cfg.out_dir) / "traces"
    if (dest / "predictor.json").is_file():
        log.info("vLLM-calibrated export read back from %s", dest)
        clock.read_back("trace")
        clock.read_back("refit")
        return dest
    if list(traces.glob("shard-*.parquet")):
        clock.read_back("trace")
    else:
        t0 = time.time()
        prompts, _ = _prompts(cfg, target, cfg.acceptance_split, cfg.trace_prompts)
        spec = EngineSpec(target=target, draft=draft, k=cfg.policy_k, max_num_seqs=2, device=cfg.models.device,
                          dtype=cfg.vllm_dtype)
        group = EngineRows(spec, [RowRole("policy", spec=str(export))], plugin=True, batch_rule=False)
        log.info("tracing %s in vLLM on %d %s prompts into %s", export, len(prompts), cfg.acceptance_split, traces)
        run_engine(group, {1: [[p] for p in prompts]}, cfg,
                   lambda spec, batch_rule, **_: settings_of(spec, False, traces_dir=str(traces), trace_all=True))
        clock.ran("trace", time.time() - t0)
    t0 = time.time()
    refit = refit_calibration(traces, export, dest)
    clock.ran("refit", time.time() - t0)
    return refit


def _ties(rows: list[RowRun], units: dict[int, list[list[list[int]]]], target: str) -> list[dict]:
    """The differing outputs' logit gaps (``runtimes.vllm.ties``); a failure is logged in one line and leaves them
    out (the rows are kept)."""
    try:
        return tie_gaps(rows, units, target)
    except Exception as e:  # noqa: BLE001 - an explanation of the outputs must not lose the measured rows
        log.error("the differing outputs' logit gaps were not computed: %s", str(e).splitlines()[0][:300])
        return []


def _run_passes(plan: list[EngineRows], cfg: VllmBenchConfig, run: Any, clock: PartClock) -> list[RowRun]:
    """Every engine's rows over ``cfg.repeats`` passes in alternating order (first to last, then last to first),
    each prompt's faster run kept (``runtimes.vllm.bench.merge_passes``); ``run(group, batch_sizes, done)`` runs an
    engine's rows (:data:`RunEngine`); ``clock`` keeps each part's seconds."""
    passes: list[dict[int, list[RowRun]]] = []
    for p in range(cfg.repeats):
        order = list(enumerate(plan, 1))
        passes.append({i: _engine_rows(i, len(plan), g, cfg, p, lambda todo, done, g=g: run(g, todo, done), clock)
                       for i, g in (order if p % 2 == 0 else reversed(order))})
    rows: list[RowRun] = []
    for i in range(1, len(plan) + 1):
        runs = [got[i] for got in passes if got.get(i)]
        if runs:
            rows += [merge_passes([r[j] for r in runs]) for j in range(len(runs[0]))]
    return rows


def _k_of(plan: list[EngineRows]) -> dict[str, Any]:
    """Row name -> vLLM's K at a batch size (None for rows specstop's proposer decides, priced by its rounds)."""
    out: dict[str, Any] = {}
    for g in plan:
        for role in g.roles:
            name = role.name
            if g.plugin and role.own_loop:  # vLLM's own loop in the policies' engine
                out[name] = (lambda k: lambda b: k)(role.k)
            elif g.plugin:
                out[name] = None
            elif g.engine.per_batch:
                out[name] = (lambda ranges: lambda b: next(k for s, e, k in ranges if s <= b <= e))(g.engine.per_batch)
            else:
                out[name] = (lambda k: lambda b: k)(g.engine.k)
    return out
