"""The main job's stages (:func:`train_all`): generate, train each predictor (or reuse an export made from the same
config and data), evaluate, cross-validate, recommend and register; the table goes to ``<out_dir>/results.md``.

Usage: ``python -m pipelines.train --config configs/default.yaml``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from pytorch_lightning.loggers import MLFlowLogger

import predictors.training as training
from compute.code_version import record_start
from data_gen.config import GenerateConfig
from data_gen.folders import data_identity, has_columns
from data_gen.generate import ensure_data
from data_gen.progress import ChainProgress, Stage, plural
from data_gen.shards import finished_chunks, shard_path
from evaluation.classification import DEFAULT_LABEL_SPECS, FREE_SCORES
from evaluation.crossval import CrossValConfig, CrossValRun, run_crossval
from evaluation.evaluate import EvaluateConfig, RowId, cost_aware_rows, run_evaluation, store_calibrations
from main_job.recommend import (
    RecommendConfig,
    draft_name,
    recommend_runtimes,
    recommendation_records,
    write_recommendations,
)
from main_job.verify import best_free_score, cv_figures, cv_records, replay_records, test_records, write_records
from predictors.export import export_predictor, load_predictor, read_metadata, update_metadata
from predictors.labels import label_name
from predictors.registry import check_reachable, register_predictor, registry_name, resolve_tracking_uri
from predictors.tracking import Experiment, TrackingURI
from predictors.training import DiscoConfig, SprinterConfig, SVTableConfig
from rendering.result_store import MAIN_JOB_RECORDS
from rendering.train_results import RESULTS_MD, fmt, results_markdown
from runtimes.vllm.traces import trace_folder

log = logging.getLogger("pipelines.train")


@dataclass
class TrainJobConfig(Experiment, TrackingURI):
    """Arguments of ``python -m pipelines.train``; configs/default.yaml and configs/smoke.yaml mirror them."""

    data: GenerateConfig = field(
        default_factory=lambda: GenerateConfig(out_dir="outputs/default/data", max_records=50_000)
    )
    """How the labelled-token data is generated (``pipelines.generate``); its out_dir is the data folder."""
    extra_data: list[str] = field(default_factory=list)
    """More data runs: generate-config YAML files (paths from the working directory, e.g. configs/generate-code.yaml),
    generated like ``data`` and read with it as one data set; same models and features. ``data``'s folder holds the
    cost model."""
    trace_data: list[str] = field(default_factory=list)
    """Folders of serving traces (``SPECSTOP_VLLM_TRACES`` / ``PolicySettings.traces_dir``): their ``train`` requests
    join DISCO's training set, so it learns what the runtime accepts (SPRINTER and SV need columns traces lack). Same
    draft as the data's; the evaluation stays on the data's test split."""
    generate_if_missing: bool = True
    """Generate (or resume) the data when the folder has no shards or fewer records than data.max_records."""
    out_dir: str = "outputs/default/train"
    """Checkpoints, exports (``<out_dir>/<kind>/export``), the evaluation report and the results table."""
    predictors: list[str] = field(default_factory=lambda: ["disco", "sprinter", "sv"])
    """Learned predictors to train: disco, sprinter, sv."""
    disco: DiscoConfig = field(default_factory=lambda: DiscoConfig(extra_features=("draft_max_prob", "draft_entropy")))
    """DISCO FFN training (greedy-match labels)."""
    sprinter: SprinterConfig = field(default_factory=SprinterConfig)
    """SPRINTER verifier training (q/p <= lam labels)."""
    sv: SVTableConfig = field(default_factory=SVTableConfig)
    """SV bin table fitting (needs companion columns in the data)."""
    evaluate: bool = True
    """Run the evaluation (classification, replay, threshold tuning, report) after training."""
    n_boot: int = 200
    """Bootstrap resamples over prompts for the evaluation's confidence intervals."""
    crossval_folds: int = 0
    """> 0 (at least 3): also cross-validate DISCO and SPRINTER over that many folds of prompts
    (``pipelines.crossval``):
    every prompt tested once, AUC against the best training-free score with a paired bootstrap interval (the table's
    cv_* columns; the report under ``<out_dir>/crossval``)."""
    recommend: bool = True
    """Tune the speculative settings of every runtime whose curve the data folder holds (transformers' and vLLM's from
    its own curve, llama.cpp's from ``cost_model.llamacpp.json``; ``pipelines.recommend``) after the evaluation, and
    print what to paste."""
    register: bool = True
    """Register every trained predictor in the MLflow model registry (champion alias on improvement)."""
    retrain: bool = False
    """Train (and register) every predictor anew, even one whose export in out_dir was made from the same config and
    data (by default such an export is reused, so a stopped job resumes where it stopped)."""
    results_dir: str | None = None
    """Also store the run's summary in this folder (e.g. results), which ``python -m pipelines.results`` renders."""

    def __post_init__(self) -> None:
        bad = [p for p in self.predictors if p not in ("disco", "sprinter", "sv")]
        if bad:
            raise ValueError(f"--predictors has unknown kinds {bad}; use disco, sprinter, sv")
        if self.crossval_folds and self.crossval_folds < 3:
            raise ValueError(f"crossval_folds={self.crossval_folds}: use 0 (off) or at least 3")


def _flat_params(prefix: str, obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if dataclasses.is_dataclass(obj):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_params(f"{prefix}.{k}" if prefix else str(k), v))
    else:
        out[prefix] = str(obj)[:500]
    return out


TRAIN_STATE = "train_state.json"
"""Beside each predictor's export (``<out_dir>/<kind>/``): what it was trained from (config and data), its table row,
its MLflow run and its registered version; written once the export is complete, so a stopped job reuses it."""


def _planned_stages(cfg: TrainJobConfig) -> list[str]:
    stages = ["generate", *(f"train {k}" for k in cfg.predictors)]
    if cfg.evaluate:
        stages.append("evaluate")
    if cfg.crossval_folds and {"disco", "sprinter"} & set(cfg.predictors):
        stages.append("crossval")
    if cfg.evaluate and cfg.recommend:
        stages.append("recommend")
    if cfg.register:
        stages.append("register")
    return stages


def train_all(cfg: TrainJobConfig, extra_data: list[GenerateConfig], progress: bool | None = None,
              command: str | None = None) -> dict[str, Any]:
    """Run the whole chain; returns {"results": rows of the table, "report": path, "data": identity, "seconds",
    "stage_seconds", "from_scratch": whether no stage reused or resumed earlier work}.

    Args:
        extra_data: the configs of ``cfg.extra_data``'s files, read by the caller (the entry point parses them).
        progress: show the bar (None: when stderr is a terminal); the per-stage lines are logged either way.
        command: the command that started the job, recorded beside its code (its summary stores it).
    """
    uri = resolve_tracking_uri(cfg.tracking_uri)
    check_reachable(uri)  # fail before any work when the tracking server is down
    out = Path(cfg.out_dir)
    record_start(out, command=command)  # the stored summary names the code this job ran on, not the code at storing
    with ChainProgress(_planned_stages(cfg), log, disable=None if progress is None else not progress) as chain:
        with chain.stage("generate") as st:
            data_dirs = ensure_data([cfg.data, *extra_data], cfg.generate_if_missing, chain, st)
        ident = data_identity(data_dirs)
        traces = [trace_folder(p, ident.get("draft")) for p in cfg.trace_data]
        out.mkdir(parents=True, exist_ok=True)
        (out / "resolved_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
        job = _train_stages(cfg, chain, data_dirs, ident, uri, traces)
        report = None
        if cfg.evaluate and job.policies:
            with chain.stage("evaluate") as st:
                report = _evaluate(cfg, data_dirs, job, uri)
                st.summary = f"{plural(len(job.policies), 'predictor')} on the test split"
        cv_kinds = [k for k in ("disco", "sprinter") if k in job.policies]
        if cfg.crossval_folds and cv_kinds:
            with chain.stage("crossval") as st:
                _crossval(cfg, data_dirs, cv_kinds, job, uri)
                st.summary = f"{cfg.crossval_folds} folds x {', '.join(cv_kinds)}"
        recommendations: dict[str, list[str]] = {}
        if cfg.evaluate and cfg.recommend:
            with chain.stage("recommend") as st:
                recommendations = _recommend(cfg, data_dirs[0], job)
                st.summary = ", ".join(recommendations) or "no runtime curve"
        if cfg.register and job.exports:
            with chain.stage("register") as st:
                st.summary = _register(job, ident, uri)
        for kind, folder in job.exports.items():
            row = job.rows[kind]
            registry = None
            if "registry_name" in row:
                registry = {"name": row["registry_name"], "version": row["registry_version"]}
            _update_metadata_if_changed(folder, registry=registry)
        rows = job.rows
        times = chain.times()
        result = {"results": list(rows.values()), "report": str(report) if report else None, "data": ident,
                  "seconds": times["total"], "stage_seconds": times, "total_line": chain.total_line(),
                  "from_scratch": chain.from_scratch(),
                  "recommendations": recommendations}
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    (out / RESULTS_MD).write_text(results_markdown(cfg.out_dir, result))
    _store_records(out, job)
    return result


def _store_records(out: Path, job: Trained) -> None:
    """The records the table's figures are recomputed from (``main_job.verify``) into ``<out>/records.parquet``;
    a records file of an earlier run there is removed when this one has none (no evaluation)."""
    path = out / MAIN_JOB_RECORDS
    if job.records:
        write_records(path, job.records, job.records_meta)
    else:
        path.unlink(missing_ok=True)


@dataclass
class Trained:
    """The predictors the job trained or reused, by kind, and the rows of its table (one per predictor asked for)."""

    policies: dict[str, Any] = field(default_factory=dict)
    exports: dict[str, Path] = field(default_factory=dict)
    """Export folders."""
    states: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What each ``train_state.json`` holds (:data:`TRAIN_STATE`)."""
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: list[pd.DataFrame] = field(default_factory=list)
    """The sections of the records file (``main_job.verify``): test tokens, out-of-fold scores, replayed sequences."""
    records_meta: dict[str, Any] = field(default_factory=dict)
    """What the records file's metadata holds beside them (the cross-validation bootstrap's n_boot and seed)."""


def _train_stages(cfg: TrainJobConfig, chain: ChainProgress, data_dirs: list[Path], ident: dict,
                  uri: str, traces: list[Path]) -> Trained:
    """One stage per predictor kind: trained (or its export reused; DISCO on the data and ``traces``); a kind the data
    cannot train gets a status row."""
    kinds_cfg = {"disco": cfg.disco, "sprinter": cfg.sprinter, "sv": cfg.sv}
    job = Trained()
    for kind in cfg.predictors:
        with chain.stage(f"train {kind}") as st:
            dirs = [*data_dirs, *traces] if kind == "disco" else data_dirs
            got = _train_one(cfg, kind, kinds_cfg[kind], dirs, ident, uri, st)
        if got is None:
            job.rows[kind] = {"predictor": kind, "status": st.info["status"]}
            continue
        job.policies[kind], job.exports[kind], job.states[kind] = got
        job.rows[kind] = dict(job.states[kind]["row"])
    return job


def _train_one(cfg: TrainJobConfig, kind: str, kcfg: Any, data_dirs: list[Path], ident: dict, uri: str,
               st: Stage) -> tuple[Any, Path, dict[str, Any]] | None:
    """Train and export one predictor, or reuse its export when ``train_state.json`` says it was made from the same
    config and data; returns (policy, export folder, state), or None when the data lacks its columns."""
    needs = {"sprinter": ("draft_hidden",), "sv": ("companion_sim", "companion_accept")}
    if not has_columns(data_dirs, needs.get(kind, ())):
        why = f"data has no {needs[kind]} columns (" + (
            "configure data.models.companion" if kind == "sv" else "set data.store_hidden true") + ")"
        log.warning("skipping %s: %s", kind, why)
        st.summary, st.info["status"] = f"skipped: {why}", f"skipped: {why}"
        return None
    kdir = Path(cfg.out_dir) / kind
    folder, state_file = kdir / "export", kdir / TRAIN_STATE
    key = _train_key(kind, kcfg, data_dirs, ident)
    state = _read_json(state_file)
    if not cfg.retrain and state.get("key") == key:
        try:
            policy = load_predictor(folder)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            log.warning("export %s does not load (%s): training %s again", folder, e, kind)
        else:
            if hasattr(kcfg, "threshold"):  # as trained; the evaluation tunes it again, as on the first run
                policy.threshold = float(kcfg.threshold)
            st.reused = True
            st.summary = f"reused export {folder} (same config and data; --retrain true trains it again)"
            return policy, folder, state
    state_file.unlink(missing_ok=True)  # from here until the new state is written, the export is not finished
    logger = MLFlowLogger(experiment_name=cfg.experiment, tracking_uri=uri, run_name=f"train-{kind}")
    logger.log_hyperparams({**_flat_params(kind, kcfg), **_flat_params("data", ident),
                            "data.generate": json.dumps(dataclasses.asdict(cfg.data), default=str)[:6000]})
    beat = st.heartbeat
    on_epoch = None if beat is None else lambda done, n: beat.update(done, n, unit="epochs")
    policy, metrics = training.fit_predictor(kind, kcfg, data_dirs, kdir, logger=logger, on_epoch=on_epoch)
    export_predictor(policy, folder, {
        "draft_fingerprint": ident["draft"], "target": ident["target"], "companion": ident["companion"],
        "data_fingerprint": ident["data_fingerprint"], "data_dir": [str(d) for d in data_dirs],
    })
    free = [metrics[k] for k in ("val_auc_max_prob", "val_auc_draft_prob", "val_auc_neg_entropy") if k in metrics]
    row = {"predictor": kind, "status": "trained", "label": _own_label(kcfg)[0],
           "val_auc": metrics.get("val_auc"), "val_auc_best_free": max(free) if free else None,
           "epochs": metrics.get("epochs_run"), "n_train": metrics.get("n_train")}
    if kind == "sv":
        row["info_gain_bits"] = metrics.get("val_information_gain_bits")
        row["info_gain_frac"] = metrics.get("val_information_gain_frac")
    state = {"key": key, "row": row, "run_id": logger.run_id}
    _write_json(state_file, state)
    epochs = f"{plural(int(row['epochs']), 'epoch')}, " if row.get("epochs") else ""
    st.summary = f"{epochs}{row['n_train'] or 0:,.0f} training records, val AUC {fmt(row['val_auc'])}"
    return policy, folder, state


def _register(job: Trained, ident: dict, uri: str) -> str:
    """Register each export (not again when its state holds a version registered at ``uri``); the stage's summary."""
    exports, states, rows = job.exports, job.states, job.rows
    done = []
    for kind, folder in exports.items():
        reg = states[kind].get("registered")
        if reg and reg.get("uri") == uri:
            done.append(f"{kind} v{reg['version']} (kept)")
        else:
            chatter = io.StringIO()  # MLflow prints "Successfully registered model ..." to stderr; the log says it
            try:
                with contextlib.redirect_stderr(chatter):
                    reg = register_predictor(folder, registry_name(kind, ident["draft"]),
                                             float(rows[kind]["val_auc"] or 0.0), run_id=states[kind].get("run_id"),
                                             tracking_uri=uri)
            except ConnectionError as e:
                raise ConnectionError(f"{e}. The trained predictor is kept on disk at {folder}") from e
            reg = {"uri": uri, "name": reg["name"], "version": reg["version"], "champion": bool(reg["champion"])}
            states[kind]["registered"] = reg
            _write_json(folder.parent / TRAIN_STATE, states[kind])
            done.append(f"{kind} v{reg['version']}")
        rows[kind].update(registry_name=reg["name"], registry_version=int(reg["version"]), champion=reg["champion"])
    return ", ".join(done)


def _train_key(kind: str, kcfg: Any, data_dirs: list[Path], ident: dict) -> str:
    """Hash of what a predictor is trained from: its config, the data config and every shard (name, rows, size)."""
    shards = [
        [str(d), c, n, shard_path(d, c).stat().st_size]
        for d in data_dirs
        for c, n in sorted(finished_chunks(d).items())
    ]
    blob = json.dumps({"kind": kind, "config": dataclasses.asdict(kcfg), "data": ident["data_fingerprint"],
                       "shards": shards}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def _update_metadata_if_changed(folder: Path, **fields: Any) -> None:
    """``predictors.export.update_metadata`` only when a field changes (a reused export's files stay untouched)."""
    meta = read_metadata(folder)
    if any(meta.get(k) != v for k, v in fields.items()):
        update_metadata(folder, **fields)


def _evaluate(cfg: TrainJobConfig, data_dirs: list[Path], job: Trained, uri: str) -> Path:
    """Test-split evaluation of the trained policies against the baselines, in an ``evaluate`` MLflow run; the table's
    test columns, tuned thresholds into the exports, the calibration maps stored, the cost-aware rows added."""
    policies, exports, rows = job.policies, job.exports, job.rows
    own = {kind: _own_label(c) for kind, c in (("disco", cfg.disco), ("sprinter", cfg.sprinter), ("sv", cfg.sv))}
    specs = [tuple(spec) for spec in DEFAULT_LABEL_SPECS]
    specs += [spec for kind, (_, spec) in own.items() if kind in policies and spec not in specs]
    ecfg = EvaluateConfig(data_dir=str(data_dirs[0]), extra_data_dirs=[str(d) for d in data_dirs[1:]],
                          out_dir=str(Path(cfg.out_dir) / "report"), tune_thresholds=True, label_specs=specs,
                          n_boot=cfg.n_boot, tracking=True, tracking_uri=uri, experiment=cfg.experiment)
    res = _evaluation_run(cfg, ecfg, policies, uri)
    table = res.get("classification")
    replayed = _first_mode_results(res)
    for kind in policies:
        label = own[kind][0]
        rows[kind]["test_auc"] = _headline_auc(table, kind, label)
        best = best_free_score({name: _headline_auc(table, name, label) for name in FREE_SCORES})
        if best is not None:
            rows[kind].update(best_free=best[0], test_auc_best_free=best[1])
        tuned = res.get("tuned", {}).get(kind)
        if tuned:
            thr, speed = tuned
            policies[kind].threshold = float(thr)
            rows[kind].update(threshold=float(thr), val_speedup=float(speed))
            _update_metadata_if_changed(exports[kind], threshold=float(thr), tuned_val_speedup=float(speed))
        speed = _replayed_speedup(res.get("replay"), kind, res.get("tuned_rows", {}).get(kind))
        if speed is not None:
            rows[kind]["test_speedup"] = speed[1]
            rows[kind]["decoding"] = "exact" if policies[kind].exact else "approximate"
            job.records.append(replay_records(kind, "test_speedup", speed[0], replayed[speed[0]]))
    store_calibrations(res, {k: exports[k] for k in policies if k in exports}, Path(cfg.out_dir) / "calibrated")
    for name, row in cost_aware_rows(res, list(policies)).items():
        rows.setdefault(name, {"predictor": name}).update(row)
        if "test_speedup" in row:
            job.records.append(replay_records(name, "test_speedup", name, replayed[name]))
    job.records += test_records(res.get("scored", {}), {k: own[k] for k in policies})
    return Path(res["report"])


def _first_mode_results(res: dict[str, Any]) -> dict[str, Any]:
    """Each replayed row's result in the first replay mode (the one the table's speedups are read from)."""
    replay = res.get("replay")
    if replay is None or not len(replay):
        return {}
    first = replay["mode"].iloc[0] if "mode" in replay else next(iter(res.get("replayed") or {}), None)
    return (res.get("replayed") or {}).get(first, {})


def _evaluation_run(cfg: TrainJobConfig, ecfg: EvaluateConfig, policies: dict[str, Any], uri: str) -> dict[str, Any]:
    """``run_evaluation`` inside an ``evaluate`` run of the job's experiment at ``uri`` (the process's tracking URI is
    restored after), the learned policies' calibration maps cross-fitted from their training configs."""
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(cfg.experiment)
    previous_uri = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(run_name="evaluate", experiment_id=exp_id):
            return run_evaluation(ecfg, policies, cross_fit={k: (k, getattr(cfg, k)) for k in policies},
                                  cross_fit_folds=max(3, cfg.crossval_folds or 5))
    finally:
        mlflow.set_tracking_uri(previous_uri)


def _crossval(cfg: TrainJobConfig, data_dirs: list[Path], kinds: list[str], job: Trained, uri: str) -> None:
    """Cross-validate the job's DISCO / SPRINTER configs; the cv_* columns of the table (group "all"), the out-of-fold
    scores kept as records."""
    runs = [CrossValRun(kind, kind, **{kind: getattr(cfg, kind)}) for kind in kinds]
    ccfg = CrossValConfig(data_dir=str(data_dirs[0]), extra_data_dirs=[str(d) for d in data_dirs[1:]],
                          out_dir=str(Path(cfg.out_dir) / "crossval"), runs=runs, folds=cfg.crossval_folds,
                          n_boot=cfg.n_boot, tracking=True, tracking_uri=uri, experiment=cfg.experiment)
    run = run_crossval(ccfg)
    for predictor, figures in cv_figures(run["table"]).items():
        job.rows[predictor].update(figures)
    job.records.append(cv_records(run["oof"]))
    job.records_meta.update(cv_n_boot=ccfg.n_boot, cv_seed=ccfg.seed)


def _recommend(cfg: TrainJobConfig, data_dir: Path, job: Trained) -> dict[str, list[str]]:
    """Each runtime's tuned settings (those whose curve the data folder holds) as the lines to print, also written
    to ``<out_dir>/recommend.json``; their replayed sequences kept as records."""
    rcfg = RecommendConfig(data_dir=str(data_dir), train_dir=cfg.out_dir)
    recs = recommend_runtimes(rcfg)
    if recs:
        write_recommendations(recs, Path(cfg.out_dir) / "recommend.json")
    for rt, rec in recs.items():
        job.records += recommendation_records(rt, rec)
    return {rt: rec.lines(draft_name(rcfg, rt)) for rt, rec in recs.items()}


def _own_label(kcfg: Any) -> tuple[str, tuple[str, float]]:
    """(label name, (family, lambda)) a predictor is trained for (the SV table: the label its val AUC is reported
    on)."""
    family = getattr(kcfg, "auc_label", None) or kcfg.label_family
    return label_name(family, kcfg.lam), (family, float(kcfg.lam))


def _headline_auc(table: Any, policy: str, label: str = "greedy match") -> float | None:
    """Test AUC of ``policy`` for ``label`` over the whole split (the evaluation's headline row)."""
    if table is None or not len(table) or "auc" not in table:
        return None
    sel = table[(table["group_by"] == "all") & (table["policy"] == policy) & (table["label"] == label)]
    return float(sel["auc"].iloc[0]) if len(sel) else None


def _replayed_speedup(replay: Any, kind: str, tuned: RowId | None) -> tuple[str, float] | None:
    """(row, speedup) of the val-tuned policy (its row: ``tuned``; else the policy as trained) in the first replay mode
    on the test split."""
    if replay is None or not len(replay) or "speedup" not in replay:
        return None
    first = replay[replay["mode"] == replay["mode"].iloc[0]] if "mode" in replay else replay
    for name in ([tuned.label] if tuned else []) + [kind]:
        sel = first[first["policy"] == name]
        if len(sel) and sel["speedup"].notna().iloc[0]:
            return name, float(sel["speedup"].iloc[0])
    return None
