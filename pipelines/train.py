"""The main job: labelled draft tokens -> trained, evaluated, registered stop predictors, and a comparison table.

1. Generate the labelled-token shards if the data folder is missing or short of its budget (resumes otherwise).
2. Train the learned predictors with Lightning (DISCO FFN, SPRINTER verifier, SV bin table), each logged to MLflow
   through MLFlowLogger (params, per-epoch metrics, data fingerprint, model identities, resolved config).
3. Evaluate them on the test split against the training-free scores (ROC / F1 / replayed speedup) and tune each
   threshold for predicted speedup on the validation split (``pipelines.evaluate``); the report is logged to MLflow.
   With ``crossval_folds`` > 0, also cross-validate DISCO and SPRINTER over folds of prompts (``pipelines.crossval``).
4. Export each predictor (safetensors + JSON) with its tuned threshold, register it in the MLflow registry, move the
   ``champion`` alias when it beats the current champion on validation AUC, and print the table.

Usage:
    python -m pipelines.train                                 # default config: the real Qwen2.5-Coder pair
    python -m pipelines.train --config configs/smoke.yaml     # tiny random-init models, under a minute
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data_gen.generate import GenerateConfig
from pipelines.cli import parse_config, resolve_tracking_uri, setup_logging, user_errors
from predictors.training import DiscoConfig, SprinterConfig, SVTableConfig

log = logging.getLogger("pipelines.train")


@dataclass
class TrainJobConfig:
    """Arguments of ``python -m pipelines.train``; configs/default.yaml and configs/smoke.yaml mirror them."""

    data: GenerateConfig = field(
        default_factory=lambda: GenerateConfig(out_dir="outputs/default/data", max_records=50_000)
    )
    """How the labelled-token data is generated (``pipelines.generate``); its out_dir is the data folder."""
    extra_data: list[str] = field(default_factory=list)
    """More data runs: generate-config YAML files (paths from the working directory, e.g. configs/generate-code.yaml),
    generated like ``data`` and read with it as one data set; same models and features. ``data``'s folder holds the
    cost model."""
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
    register: bool = True
    """Register every trained predictor in the MLflow model registry (champion alias on improvement)."""
    tracking_uri: str | None = None
    """MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db); a remote server works too."""
    experiment: str = "specstop"
    """MLflow experiment name."""

    def __post_init__(self) -> None:
        bad = [p for p in self.predictors if p not in ("disco", "sprinter", "sv")]
        if bad:
            raise ValueError(f"--predictors has unknown kinds {bad}; use disco, sprinter, sv")
        if self.crossval_folds and self.crossval_folds < 3:
            raise ValueError(f"crossval_folds={self.crossval_folds}: use 0 (off) or at least 3")


def _ensure_data(cfg: TrainJobConfig) -> list[Path]:
    """The data folders (``data`` first, then ``extra_data``), each generated or resumed when short."""
    from data_gen.shards import SHARD_GLOB, finished_chunks
    from pipelines.generate import generate

    dirs = []
    for gen in [cfg.data, *map(_generate_config, cfg.extra_data)]:
        data_dir = Path(gen.out_dir)
        have = sum(finished_chunks(data_dir).values()) if data_dir.exists() else 0
        short = have == 0 or (gen.max_records is not None and have < gen.max_records)
        if short and cfg.generate_if_missing:
            log.info("data folder %s has %d records: generating (resumes finished shards)", data_dir, have)
            generate(gen)
        elif have == 0:
            raise FileNotFoundError(
                f"no shards ({SHARD_GLOB}) in {data_dir}; run python -m pipelines.generate or pass --generate_if_missing true"
            )
        dirs.append(data_dir)
    return dirs


def _generate_config(path: str) -> GenerateConfig:
    """A generate config from its YAML file (an ``extra_data`` entry)."""
    from pipelines.cli import parse_config

    if not Path(path).is_file():
        raise FileNotFoundError(f"extra_data entry {path!r} is not a file (give generate-config YAML paths from {Path.cwd()})")
    return parse_config(GenerateConfig, ["--config", path], "generate config")


def _data_identity(data_dirs: list[Path]) -> dict[str, Any]:
    """Fingerprints of the data and of the models that made it (from the generators' config.json / summary.json).

    Several folders must come from the same draft / target / companion; their data fingerprints are joined."""
    from data_gen.shards import CONFIG_FILE, SUMMARY_FILE, finished_chunks

    def read(d: Path, name: str) -> dict:
        return json.loads((d / name).read_text()) if (d / name).exists() else {}

    cfgs = [read(d, CONFIG_FILE) for d in data_dirs]
    fps = cfgs[0].get("resolved", {}).get("fingerprints", {})
    for d, c in zip(data_dirs[1:], cfgs[1:]):
        other = c.get("resolved", {}).get("fingerprints", {})
        if other and fps and other != fps:
            raise ValueError(f"data folders {data_dirs[0]} and {d} were made by different models ({fps} vs {other}); "
                             f"a predictor trains on one model pair")
    summary = read(data_dirs[0], SUMMARY_FILE)
    prints = [c.get("fingerprint") for c in cfgs]
    return {
        "data_fingerprint": prints[0] if len(prints) == 1 else "+".join(str(p) for p in prints),
        "records": sum(sum(finished_chunks(d).values()) for d in data_dirs),
        "draft": fps.get("draft"),
        "target": fps.get("target"),
        "companion": fps.get("companion"),
        "acceptance_rate": summary.get("overall", {}).get("acceptance_rate"),
        "greedy_match_rate": summary.get("overall", {}).get("greedy_match_rate"),
    }


def _has_columns(data_dirs: list[Path], columns: tuple[str, ...]) -> bool:
    from data_gen.shards import folder_columns

    return all(set(columns) <= names for names in folder_columns(data_dirs).values())


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


def train_all(cfg: TrainJobConfig) -> dict[str, Any]:
    """Run the whole chain; returns {"results": rows of the table, "report": path, "data": identity}."""
    from pytorch_lightning.loggers import MLFlowLogger

    from predictors.export import export_predictor, update_metadata
    from predictors.registry import check_reachable, register_predictor, registry_name
    from predictors.training import fit_predictor

    t0 = time.perf_counter()
    uri = resolve_tracking_uri(cfg.tracking_uri)
    check_reachable(uri)  # fail before any work when the tracking server is down
    data_dirs = _ensure_data(cfg)
    ident = _data_identity(data_dirs)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resolved_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2, default=str))
    kinds_cfg = {"disco": cfg.disco, "sprinter": cfg.sprinter, "sv": cfg.sv}
    needs = {"sprinter": ("draft_hidden",), "sv": ("companion_sim", "companion_accept")}
    policies: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    exports: dict[str, Path] = {}
    loggers: dict[str, MLFlowLogger] = {}
    for kind in cfg.predictors:
        if not _has_columns(data_dirs, needs.get(kind, ())):
            why = f"data has no {needs[kind]} columns (" + (
                "configure data.models.companion" if kind == "sv" else "set data.store_hidden true") + ")"
            log.warning("skipping %s: %s", kind, why)
            rows[kind] = {"predictor": kind, "status": f"skipped: {why}"}
            continue
        logger = MLFlowLogger(experiment_name=cfg.experiment, tracking_uri=uri, run_name=f"train-{kind}")
        logger.log_hyperparams({**_flat_params(kind, kinds_cfg[kind]), **_flat_params("data", ident),
                                "data.generate": json.dumps(dataclasses.asdict(cfg.data), default=str)[:6000]})
        log.info("training %s", kind)
        policy, metrics = fit_predictor(kind, kinds_cfg[kind], data_dirs, out / kind, logger=logger)
        folder = export_predictor(policy, out / kind / "export", {
            "draft_fingerprint": ident["draft"], "target": ident["target"], "companion": ident["companion"],
            "data_fingerprint": ident["data_fingerprint"], "data_dir": ", ".join(map(str, data_dirs)),
        })
        policies[kind], exports[kind], loggers[kind] = policy, folder, logger
        free = [metrics[k] for k in ("val_auc_max_prob", "val_auc_draft_prob", "val_auc_neg_entropy") if k in metrics]
        rows[kind] = {"predictor": kind, "status": "trained", "label": _own_label(kinds_cfg[kind])[0],
                      "val_auc": metrics.get("val_auc"), "val_auc_best_free": max(free) if free else None,
                      "epochs": metrics.get("epochs_run"), "n_train": metrics.get("n_train")}
        if kind == "sv":
            rows[kind]["info_gain_bits"] = metrics.get("val_information_gain_bits")
            rows[kind]["info_gain_frac"] = metrics.get("val_information_gain_frac")
    report = None
    if cfg.evaluate and policies:
        report = _evaluate(cfg, data_dirs, policies, exports, rows, uri)
    if cfg.crossval_folds and any(k in policies for k in ("disco", "sprinter")):
        _crossval(cfg, data_dirs, [k for k in ("disco", "sprinter") if k in policies], rows, uri)
    for kind, folder in exports.items():
        if cfg.register:
            try:
                reg = register_predictor(folder, registry_name(kind, ident["draft"]), float(rows[kind]["val_auc"] or 0.0),
                                         run_id=loggers[kind].run_id, tracking_uri=uri)
            except ConnectionError as e:
                raise ConnectionError(f"{e}. The trained predictor is kept on disk at {folder}") from e
            rows[kind].update(registered=f"{reg['name']} v{reg['version']}", champion=reg["champion"])
        update_metadata(folder, registry=rows[kind].get("registered"))
    result = {"results": list(rows.values()), "report": str(report) if report else None, "data": ident,
              "seconds": time.perf_counter() - t0}
    (out / "results.json").write_text(json.dumps(result, indent=2, default=str))
    return result


def _evaluate(cfg: TrainJobConfig, data_dirs: list[Path], policies: dict, exports: dict, rows: dict, uri: str) -> Path:
    """Test-split evaluation of the trained policies against the baselines; tuned thresholds go into the exports."""
    import mlflow

    from evaluation.classification import DEFAULT_LABEL_SPECS, FREE_SCORES
    from pipelines.evaluate import EvaluateConfig, run_evaluation
    from predictors.export import update_metadata

    own = {kind: _own_label(c) for kind, c in (("disco", cfg.disco), ("sprinter", cfg.sprinter), ("sv", cfg.sv))}
    specs = [tuple(spec) for spec in DEFAULT_LABEL_SPECS]
    specs += [spec for kind, (_, spec) in own.items() if kind in policies and spec not in specs]
    ecfg = EvaluateConfig(data_dir=str(data_dirs[0]), extra_data_dirs=[str(d) for d in data_dirs[1:]],
                          out_dir=str(Path(cfg.out_dir) / "report"), tune_thresholds=True, label_specs=specs,
                          n_boot=cfg.n_boot, tracking=True, tracking_uri=uri, experiment=cfg.experiment)
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(cfg.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(cfg.experiment)
    previous_uri = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(run_name="evaluate", experiment_id=exp_id):
            res = run_evaluation(ecfg, policies)
    finally:
        mlflow.set_tracking_uri(previous_uri)
    table = res.get("classification")
    for kind in policies:
        label = own[kind][0]
        rows[kind]["test_auc"] = _headline_auc(table, kind, label)
        free = {name: _headline_auc(table, name, label) for name in FREE_SCORES}
        free = {k: v for k, v in free.items() if v is not None}
        if free:
            best = max(free, key=free.__getitem__)
            rows[kind].update(best_free=best, test_auc_best_free=free[best])
        tuned = res.get("tuned", {}).get(kind)
        if tuned:
            thr, speed = tuned
            policies[kind].threshold = float(thr)
            rows[kind].update(threshold=float(thr), val_speedup=float(speed))
            update_metadata(exports[kind], threshold=float(thr), tuned_val_speedup=float(speed))
    from pipelines.evaluate import cost_aware_rows, store_calibrations  # calibration maps, cost-aware (goodput) rows

    store_calibrations(res, {k: exports[k] for k in policies if k in exports}, Path(cfg.out_dir) / "calibrated")
    for name, row in cost_aware_rows(res, list(policies)).items():
        rows.setdefault(name, {"predictor": name}).update(row)
    return Path(res["report"])


def _crossval(cfg: TrainJobConfig, data_dirs: list[Path], kinds: list[str], rows: dict, uri: str) -> None:
    """Cross-validate the job's DISCO / SPRINTER configs; the cv_* columns of the table (group "all")."""
    from pipelines.crossval import CrossValConfig, CrossValRun, run_crossval

    runs = [CrossValRun(kind, kind, **{kind: getattr(cfg, kind)}) for kind in kinds]
    ccfg = CrossValConfig(data_dir=str(data_dirs[0]), extra_data_dirs=[str(d) for d in data_dirs[1:]],
                          out_dir=str(Path(cfg.out_dir) / "crossval"), runs=runs, folds=cfg.crossval_folds,
                          n_boot=cfg.n_boot, tracking=True, tracking_uri=uri, experiment=cfg.experiment)
    table = run_crossval(ccfg)["table"]
    for r in table[table["group"] == "all"].to_dict("records"):
        rows[r["predictor"]].update({f"cv_{k}": r.get(k) for k in ("auc", "best_free", "auc_best_free", "diff", "diff_lo", "diff_hi")})


def _own_label(kcfg: Any) -> tuple[str, tuple[str, float]]:
    """(label name, (family, lambda)) a predictor is trained for (the SV table: the label its val AUC is reported
    on)."""
    from predictors.labels import label_name

    family = getattr(kcfg, "auc_label", None) or kcfg.label_family
    return label_name(family, kcfg.lam), (family, float(kcfg.lam))


def _headline_auc(table: Any, policy: str, label: str = "greedy match") -> float | None:
    """Test AUC of ``policy`` for ``label`` over the whole split (the evaluation's headline row)."""
    if table is None or not len(table) or "auc" not in table:
        return None
    sel = table[(table["group_by"] == "all") & (table["policy"] == policy) & (table["label"] == label)]
    return float(sel["auc"].iloc[0]) if len(sel) else None


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the results."""
    cols = ["predictor", "status", "label", "val_auc", "val_auc_best_free", "test_auc", "best_free", "test_auc_best_free",
            "cv_auc", "cv_best_free", "cv_auc_best_free", "cv_diff", "cv_diff_lo", "cv_diff_hi", "threshold",
            "val_speedup", "test_speedup", "ece_greedy", "ece_sampling", "info_gain_bits", "info_gain_frac", "registered",
            "champion"]
    cols = [c for c in cols if any(c in r for r in rows)]
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    setup_logging()
    with user_errors("python -m pipelines.train"):
        cfg = parse_config(TrainJobConfig, argv, __doc__)
        result = train_all(cfg)
    print(format_table(result["results"]))
    if result["report"]:
        print(f"\nreport: {result['report']}")
    print(f"done in {result['seconds']:.0f}s")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
