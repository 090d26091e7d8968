"""Stop policies scored on held-out labelled draft tokens (:func:`run_evaluation`): classification tables,
calibration, the offline replay, threshold tuning and the report; the main job calls it with its trained policies.

Usage: ``python -m pipelines.evaluate --config configs/evaluate.yaml``.
"""
from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from compute.timing import CostModel, assumed_cost_model
from evaluation.calibration import (
    CalibrationResult,
    calibrate_policies,
    calibrated_scores,
    cross_fitted_scores,
    goodput_policies,
)
from evaluation.classification import DEFAULT_LABEL_SPECS, score_table, sprinter_table
from evaluation.data import (
    BASE_COLUMNS,
    data_temperature,
    draft_fingerprint,
    label_specs_by_draw,
    load_columns,
    subset,
)
from evaluation.replay import ReplayConfig, ReplayResult, replay_table, tune_threshold, with_threshold
from evaluation.report import ReportInputs, report_metrics, write_report
from predictors.base import StopPolicy
from predictors.export import export_predictor, update_metadata
from predictors.labels import draw_mask, label_name
from predictors.tracking import TrackingConfig

__all__ = ["EvaluateConfig", "run_evaluation", "load_policies", "load_cost_model", "store_calibrations",
           "cost_aware_rows", "ScoredTokens"]

log = logging.getLogger("pipelines.evaluate")


@dataclass
class EvaluateConfig(TrackingConfig):
    """Arguments of ``python -m pipelines.evaluate`` (YAML files mirror these fields)."""

    data_dir: str
    """Folder of the Parquet shards (``shard-*.parquet``, or any ``*.parquet``), with config.json / cost_model.json."""
    extra_data_dirs: list[str] = field(default_factory=list)
    """More shard folders read with data_dir as one data set (same models and features; e.g. a code-domain run)."""
    out_dir: str = "runs/evaluate"
    """Report folder (report.md, plots/, CSV tables)."""
    predictors: list[str] = field(default_factory=list)
    """Predictor refs: export folders (with predictor.json) or ``models:/name@alias`` registry URIs."""
    split: str = "test"
    """Split evaluated (the ``split`` column; by prompt)."""
    tune_split: str = "val"
    """Split the latency-optimal thresholds are tuned on."""
    calibrate: bool = True
    """Fit a calibration map per policy and training-free score (auto: isotonic or Platt), report its expected
    calibration error on ``split`` and replay each calibrated policy under the cost-aware rule ('<name> (goodput)')."""
    calibration_fit: str = "train+val"
    """Rows the maps are fitted on. ``train+val``: the training-free scores on every train and ``tune_split`` row; a
    learned predictor on its out-of-fold scores over the same prompts when the caller gives its training config (the
    main job; ``evaluation.calibration.cross_fitted_scores``), else on ``tune_split`` (noted in the report). ``val``:
    every map on ``tune_split`` (a validation split of a few prompts fits noisier maps: their calibration error on the
    test split is several times that of maps fitted on the training prompts)."""
    calibration_method: str = "auto"
    """auto (isotonic or Platt, whichever has the lower cross-validated Brier score on the fit rows), isotonic or
    platt."""
    tune_thresholds: bool = False
    """Tune each learned policy's threshold for predicted speedup on ``tune_split`` (reported, and replayed as the row
    '<name> (val-tuned)': :class:`RowId`)."""
    store_thresholds: bool = False
    """Write the tuned threshold into each local export folder's predictor.json
    (``predictors.export.update_metadata``)."""
    label_specs: list[tuple[str, float]] = field(
        default_factory=lambda: [tuple(spec) for spec in DEFAULT_LABEL_SPECS]
    )
    """Label families (family, lambda) scored against: greedy, ratio (q/p <= lambda), soft (min(1, p/q))."""
    n_boot: int = 200
    """Bootstrap resamples of prompts for the confidence intervals (0: none)."""
    seed: int = 0
    """Seed of the bootstrap and of the prompt subsample."""
    max_prompts: int | None = None
    """Evaluate at most this many prompts of the split (random, seeded); None: all."""
    replay_modes: list[str] = field(default_factory=lambda: ["greedy", "sampling"])
    """Verification modes replayed: greedy (first mismatch) and / or sampling (expected acceptance)."""
    replay_origins: list[str] | None = field(default_factory=lambda: ["target"])
    """Origins replayed (target: exact for greedy); falls back to all sequences when none match. null: all."""
    static_lengths: list[int] = field(default_factory=lambda: list(range(1, 11)))
    """Static draft lengths replayed as baselines."""
    cost_model: str | None = None
    """Cost model JSON (default: <data_dir>/cost_model.json)."""
    assume_cost_model: bool = False
    """Without a cost model, replay with an explicitly labelled assumed one (else speedups are reported unavailable)."""
    force: bool = False
    """Load predictors trained for another draft model anyway (otherwise refused)."""
    skip_refused: bool = False
    """A predictor that cannot be loaded (refused, missing) is listed in the report instead of stopping the run."""
    experiment: str = field(default="specstop-evaluate", kw_only=True)
    """MLflow experiment of the run the command line starts (the field: ``predictors.tracking``)."""

    def __post_init__(self) -> None:
        bad = [m for m in self.replay_modes if m not in ("greedy", "sampling")]
        if bad:
            raise ValueError(f"--replay_modes has {bad}; use greedy and / or sampling")
        fams = [f for f, _ in self.label_specs if f not in ("greedy", "ratio", "soft")]
        if fams:
            raise ValueError(f"--label_specs has unknown families {fams}; use greedy, ratio, soft")
        if self.calibration_fit not in ("train+val", "val"):
            raise ValueError(f"--calibration_fit {self.calibration_fit!r}: use train+val or val")
        if self.calibration_method not in ("isotonic", "platt", "auto"):
            raise ValueError(f"--calibration_method {self.calibration_method!r}: use auto, isotonic or platt")
        if self.n_boot < 0:
            raise ValueError(f"--n_boot must be >= 0, got {self.n_boot}")
        if self.store_thresholds and not self.tune_thresholds:
            raise ValueError("--store_thresholds needs --tune_thresholds true")
        self.label_specs = [(str(f), float(lam)) for f, lam in self.label_specs]


# ---------------------------------------------------------------------------------------------------------- inputs
def load_cost_model(cfg: EvaluateConfig) -> tuple[CostModel | None, str]:
    """(CostModel or None, a note for the report)."""
    path = Path(cfg.cost_model) if cfg.cost_model else Path(cfg.data_dir) / "cost_model.json"
    if path.is_file():
        return CostModel.from_json(path), f"cost model from {path}"
    if cfg.cost_model:
        raise FileNotFoundError(f"--cost_model {path} does not exist")
    if cfg.assume_cost_model:
        return assumed_cost_model(), f"no {path}: speedups use an ASSUMED cost model (--assume_cost_model true)"
    return None, f"no {path}: speedups unavailable (pass --assume_cost_model true for a labelled assumption)"


def predictor_name(policy: StopPolicy | None, ref: str, taken: set[str]) -> str:
    """Row name of a loaded predictor: its kind and label (``disco (greedy match)``), numbered when taken twice; the
    reference (folder or URI) goes in the tables' ``ref`` column. A predictor that did not load: the ref's last part."""
    if policy is not None:
        label = policy.train_info.get("label") or {}
        base = f"{policy.kind} ({label['name']})" if label.get("name") else policy.kind
    else:
        base = ref.rstrip("/").split("/")[-1] if not ref.startswith("models:/") else ref.removeprefix("models:/")
    name, i = base, 2
    while name in taken:
        name, i = f"{base} #{i}", i + 1
    return name


VAL_TUNED = "val-tuned"
"""The tuning of a row replayed at the threshold of highest replayed speedup on the tuning split."""


@dataclass(frozen=True)
class RowId:
    """Who a row of the evaluation's tables is: the policy's ``kind``, the name it is evaluated under (``spec``: a
    predictor's name or a baseline's) and how its threshold was set (``tuning``: None as given, :data:`VAL_TUNED`)."""

    kind: str
    spec: str
    tuning: str | None = None

    @property
    def label(self) -> str:
        """The row's name in the tables: ``spec``, followed by ``(tuning)`` when the threshold was tuned."""
        return self.spec if self.tuning is None else f"{self.spec} ({self.tuning})"


def add_refs(df: pd.DataFrame | None, refs: dict[str, str], rows: Mapping[str, RowId]) -> None:
    """Add the ``ref`` column (a loaded predictor's folder or URI; empty for the baselines) beside ``policy``; a row of
    ``rows`` (label -> identity: the tuned rows) takes its policy's ref."""
    if df is not None and len(df) and "policy" in df.columns:
        df["ref"] = [refs.get(rows[n].spec if n in rows else str(n), "") for n in df["policy"]]


def load_policies(cfg: EvaluateConfig) -> tuple[dict[str, StopPolicy | None], dict[str, str], list[str]]:
    """(name -> policy or None, name -> ref, notes): predictors loaded from refs, refused on a draft mismatch."""
    from predictors.registry import load_reference  # imports mlflow: only when predictors are named

    fp = draft_fingerprint(cfg.data_dir)
    pols: dict[str, StopPolicy | None] = {}
    refs: dict[str, str] = {}
    notes: list[str] = []
    for ref in cfg.predictors:
        try:
            policy = load_reference(ref, draft_fingerprint=fp, force=cfg.force, tracking_uri=cfg.tracking_uri)
        except Exception as e:
            if not cfg.skip_refused:
                raise
            policy = None
            notes.append(f"predictor {ref} NOT evaluated: {type(e).__name__}: {e}")
        name = predictor_name(policy, ref, set(pols))
        pols[name] = policy
        refs[name] = ref
    if fp is None and cfg.predictors:
        notes.append(
            "data_dir/config.json holds no draft fingerprint: predictors were not checked against the draft model"
        )
    return pols, refs, notes


@dataclass
class ScoredTokens:
    """The tokens of one draw the classification table scores: their columns, the label specs scored on them and each
    scorer's per-token scores (``score_table``'s ``scores_into``)."""

    columns: dict[str, np.ndarray]
    specs: list[tuple[str, float]]
    scores: dict[str, np.ndarray]


@dataclass
class Inputs:
    """What one evaluation reads: its policies and their refs, the records, and the report's notes so far."""

    pols: dict[str, StopPolicy | None]
    refs: dict[str, str]
    notes: list[str]
    allcols: dict[str, np.ndarray]
    """Rows of every split read (evaluated, tuning, calibration fit)."""
    cols: dict[str, np.ndarray]
    """Rows of the evaluated split (prompts subsampled to ``max_prompts``)."""


def _sample_prompts(columns: dict[str, np.ndarray], k: int | None, seed: int) -> dict[str, np.ndarray]:
    if k is None or "sample_id" not in columns:
        return columns
    ids = np.unique(columns["sample_id"].astype(str))
    if len(ids) <= k:
        return columns
    keep = np.random.default_rng(seed).choice(ids, k, replace=False)
    return subset(columns, np.isin(columns["sample_id"].astype(str), keep))


def load_inputs(cfg: EvaluateConfig, policies: Mapping[str, StopPolicy | None] | None) -> Inputs:
    """The policies (passed in, and loaded from ``cfg.predictors``) and the rows of every split the run reads."""
    pols: dict[str, StopPolicy | None] = dict(policies or {})
    refs: dict[str, str] = {}
    notes: list[str] = []
    if cfg.predictors:
        loaded, refs, load_notes = load_policies(cfg)
        pols.update(loaded)
        notes += load_notes
    extra = tuple(sorted({c for p in pols.values() if p is not None for c in p.required_columns} - set(BASE_COLUMNS)))
    fit_split = (cfg.tune_thresholds or cfg.calibrate) and cfg.tune_split != cfg.split
    splits = [cfg.split] + ([cfg.tune_split] if fit_split else [])
    if cfg.calibrate and cfg.calibration_fit == "train+val" and "train" not in splits:
        splits.append("train")
    allcols = load_columns([cfg.data_dir, *cfg.extra_data_dirs], splits, extra)
    if "split" in allcols:
        cols = subset(allcols, allcols["split"].astype(str) == cfg.split)
    else:
        cols = allcols
        notes.append("no split column: every row evaluated")
    if not len(cols.get("seq_id", [])):
        raise ValueError(f"no rows in split {cfg.split!r} of {cfg.data_dir}")
    cols = _sample_prompts(cols, cfg.max_prompts, cfg.seed)
    n_prompts = len(np.unique(cols["sample_id"].astype(str))) if "sample_id" in cols else -1
    notes.insert(0, f"data: {', '.join([cfg.data_dir, *cfg.extra_data_dirs])}, split {cfg.split!r}: "
                    f"{len(cols['seq_id'])} tokens, {n_prompts} prompts")
    return Inputs(pols, refs, notes, allcols, cols)


def keep_greedy_draws(ev: Inputs, by_draw: Mapping[str, tuple[dict[str, np.ndarray], list[tuple[str, float]]]]
                      ) -> None:
    """Data of two draws per position: the replay, the tuning and the SPRINTER checks read the greedy draws (they
    follow the draft's own rollouts)."""
    main = draw_mask(ev.cols, "greedy")
    if main is None:
        return
    ev.cols = subset(ev.cols, main)
    ev.allcols = subset(ev.allcols, draw_mask(ev.allcols, "greedy"))
    ev.notes.append("records of two draws per position: " + "; ".join(
        f"{len(c['seq_id'])} {d}-draw tokens scored against {', '.join(label_name(f, lam) for f, lam in specs)}"
        for d, (c, specs) in by_draw.items()) + "; replay on the greedy draws")


# ------------------------------------------------------------------------------------------------------------- run
def run_evaluation(cfg: EvaluateConfig, policies: Mapping[str, StopPolicy | None] | None = None,
                   cross_fit: Mapping[str, tuple[str, Any]] | None = None, cross_fit_folds: int = 5) -> dict[str, Any]:
    """Classification tables, SPRINTER checks, offline replay (and threshold tuning) and the report.

    Args:
        cfg: the configuration.
        policies: name -> policy to evaluate directly (the main job passes its trained policies); ``cfg.predictors``
            refs are loaded and added.
        cross_fit: name -> (kind, training config) of learned policies whose calibration maps are fitted on
            out-of-fold scores over the train and ``tune_split`` prompts (``cfg.calibration_fit`` train+val), in
            ``cross_fit_folds`` folds; checkpoints under ``<out_dir>/cross-fit``.
    Returns:
        dict with report (path), classification, sprinter, replay, sweep (DataFrames), tuned (name -> (threshold,
        val speedup)), metrics (flat dict), cost_model (or None), notes; ``scored``: per draw the
        :class:`ScoredTokens` the classification table was computed from, ``replayed``: per replay mode each row's
        ``ReplayResult`` (the records a stored main job's figures are recomputed from).
    """
    ev = load_inputs(cfg, policies)
    by_draw = label_specs_by_draw(ev.cols, cfg.label_specs)
    calib = calibrate_phase(cfg, ev.pols, ev.allcols, ev.cols, ev.notes, cross_fit or {},
                            cross_fit_folds) if cfg.calibrate else None
    keep_greedy_draws(ev, by_draw)
    cm, cm_note = load_cost_model(cfg)
    ev.notes.append(cm_note)
    temp = data_temperature(cfg.data_dir)
    if temp is not None and temp > 0 and "greedy" in cfg.replay_modes:
        ev.notes.append(f"data generated at temperature {temp:g}: the stored target continuations are sampled, so the "
                        "greedy replay is an approximation even on target sequences")

    log.info("classification tables on %d tokens", len(ev.cols["seq_id"]))
    scored = {d: ScoredTokens(c, specs, {}) for d, (c, specs) in by_draw.items()}
    cls = pd.concat([score_table(t.columns, ev.pols, t.specs, n_boot=cfg.n_boot, seed=cfg.seed,
                                 scores_into=t.scores).assign(draw=d) for d, t in scored.items()], ignore_index=True)
    spr = sprinter_table(ev.cols, ev.pols)
    replay_pols: dict[str, StopPolicy | None] = dict(ev.pols)
    if calib is not None:
        replay_pols.update(goodput_policies({**ev.pols, **calibrated_scores()}, calib.maps))
    replay_cm = cm if cm is not None else assumed_cost_model()
    tuned, tuned_rows = tune_thresholds(cfg, ev, replay_cm, replay_pols) if cfg.tune_thresholds else ({}, {})
    replay, sweep, round_tokens, replayed = replay_modes(cfg, ev, replay_pols, replay_cm)
    for df in (cls, spr, replay, sweep):
        add_refs(df, ev.refs, {row.label: row for row in tuned_rows.values()})
    if cm is None and replay is not None:
        for c in ("time_s", "speedup"):
            if c in replay:
                replay[c] = np.nan
        if sweep is not None and "speedup" in sweep:
            sweep["speedup"] = np.nan
    if policies:
        ev.notes.append(f"policies passed in by the caller (not in the command above; pass their export folders with "
                        f"--predictors to reproduce): {sorted(policies)}")
    report = write_report(cfg.out_dir, ReportInputs(
        classification=cls, replay=replay, sweep=sweep, sprinter=spr, cost_model=cm, columns=ev.cols,
        policies=ev.pols, command=command_line(cfg), notes=ev.notes, tuned=tuned,
        calibration=calib.table if calib is not None else None, reliability=calib.curves if calib is not None else None,
        round_tokens=round_tokens,
    ), tracking=cfg.tracking)
    (Path(cfg.out_dir) / "evaluate_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    return {
        "report": report,
        "classification": cls,
        "scored": scored,
        "sprinter": spr,
        "replay": replay,
        "replayed": replayed,
        "sweep": sweep,
        "tuned": tuned,
        "tuned_rows": tuned_rows,
        "metrics": report_metrics(cls, replay, calib.table if calib is not None else None),
        "calibration": calib,
        "cost_model": cm,
        "notes": ev.notes,
    }


def command_line(cfg: EvaluateConfig) -> str:
    """The command that reproduces the run's numbers (every field as a flag)."""
    return "python -m pipelines.evaluate " + " ".join(
        f"--{k} {shlex.quote(json.dumps(v) if not isinstance(v, str) else v)}" for k, v in asdict(cfg).items()
    )


def tune_thresholds(cfg: EvaluateConfig, ev: Inputs, replay_cm: CostModel, replay_pols: dict[str, StopPolicy | None]
                    ) -> tuple[dict[str, tuple[float, float]], dict[str, RowId]]:
    """Each tunable policy's threshold of highest replayed speedup on ``tune_split``: name -> (threshold, speedup),
    and name -> the tuned row's identity; each tuned policy joins ``replay_pols`` under that row's label (and its
    export, with ``store_thresholds``)."""
    allcols, notes = ev.allcols, ev.notes
    tuned: dict[str, tuple[float, float]] = {}
    rows: dict[str, RowId] = {}
    tune_cols = subset(allcols, allcols["split"].astype(str) == cfg.tune_split) if "split" in allcols else None
    if tune_cols is None or not len(tune_cols["seq_id"]):
        notes.append(f"threshold tuning skipped: no rows in split {cfg.tune_split!r}")
        return tuned, rows
    if replay_cm.assumed:
        notes.append("thresholds were tuned under an ASSUMED cost model (no measured cost_model.json)")
    origins = tuple(cfg.replay_origins) if cfg.replay_origins else None
    for name, p in ((k, v) for k, v in ev.pols.items() if v is not None):
        if not p.tunable:  # no score threshold, SV's goodput rule, or re-tuned online
            continue
        try:
            thr, sp = tune_threshold(p, tune_cols, replay_cm, split=None, mode=cfg.replay_modes[0], origins=origins)
        except (KeyError, ValueError) as e:
            notes.append(f"threshold tuning of {name} failed: {e}")
            continue
        tuned[name] = (thr, sp)
        rows[name] = RowId(p.kind, name, VAL_TUNED)
        replay_pols[rows[name].label] = with_threshold(p, thr)
        if cfg.store_thresholds and name in ev.refs and Path(ev.refs[name]).is_dir():
            update_metadata(ev.refs[name], threshold=thr,
                            tuning={"split": cfg.tune_split, "speedup": sp, "mode": cfg.replay_modes[0],
                                    "cost_model_assumed": replay_cm.assumed})
    return tuned, rows


Replayed = dict[str, dict[str, ReplayResult]]
"""Per replay mode, each replayed row's result by name."""


def replay_modes(cfg: EvaluateConfig, ev: Inputs, replay_pols: Mapping[str, StopPolicy | None], replay_cm: CostModel
                 ) -> tuple[pd.DataFrame | None, pd.DataFrame | None, dict[str, Any], Replayed]:
    """The replay table of every mode in ``cfg.replay_modes``, the threshold sweep (first mode), the cost-aware
    policies' (expected, replayed) tokens per round and each mode's rows' results: (replay, sweep, round_tokens,
    replayed)."""
    reps, sweeps = [], []
    round_tokens: dict[str, Any] = {}
    replayed: Replayed = {}
    for i, mode in enumerate(cfg.replay_modes):
        rcfg = ReplayConfig(mode=mode, origins=tuple(cfg.replay_origins) if cfg.replay_origins else None)
        try:
            rep, sw = replay_table(
                ev.cols, replay_pols, replay_cm, rcfg, static_lengths=cfg.static_lengths, sweep=(i == 0)
            )
        except (KeyError, ValueError) as e:
            ev.notes.append(f"replay ({mode}) not possible: {e}")
            continue
        replayed[mode] = rep.attrs.pop("results", {})  # kept apart: the frame's attrs are copied with every operation
        reps.append(rep)
        round_tokens.update({f"{name} [{mode}]": v for name, v in rep.attrs.get("round_tokens", {}).items()})
        if len(sw):
            sw.insert(1, "mode", mode)
            sweeps.append(sw)
    replay = pd.concat(reps, ignore_index=True) if reps else None
    sweep = pd.concat(sweeps, ignore_index=True) if sweeps else None
    return replay, sweep, round_tokens, replayed


# ----------------------------------------------------------------------------------------------------- calibration
def calibrate_phase(cfg: EvaluateConfig, pols: Mapping[str, StopPolicy | None], allcols: dict[str, np.ndarray],
                    cols: dict[str, np.ndarray], notes: list[str], cross_fit: Mapping[str, tuple[str, Any]],
                    folds: int) -> CalibrationResult | None:
    """Maps of every policy and calibrated training-free score, fitted as ``cfg.calibration_fit`` says, scored on
    ``split``."""
    if "split" not in allcols:
        notes.append("calibration skipped: the data has no split column")
        return None
    split = allcols["split"].astype(str)
    val = subset(allcols, split == cfg.tune_split)
    if not len(val["seq_id"]):
        notes.append(f"calibration skipped: no rows in split {cfg.tune_split!r}")
        return None
    free = calibrated_scores()
    if cfg.calibration_fit == "val":
        res = calibrate_policies({**pols, **free}, val, cols, cfg.calibration_method)
        notes.append(f"calibration maps fitted on the {cfg.tune_split} split")
        notes += res.notes
        return res
    both = subset(allcols, np.isin(split, ["train", cfg.tune_split]))
    scores, why = {}, {}
    for name in [k for k, p in pols.items() if p is not None and k in cross_fit]:
        kind, tcfg = cross_fit[name]
        try:
            scores[name] = cross_fitted_scores(kind, tcfg, [cfg.data_dir, *cfg.extra_data_dirs], Path(cfg.out_dir) /
                                               "cross-fit", both, folds=folds, within=("train", cfg.tune_split))
        except ValueError as e:  # too few prompts for the folds, a fold with one class...
            why[name] = f"cross-fitting failed ({e})"
    learned = {k: pols[k] for k in scores}
    others = {k: p for k, p in pols.items() if k not in learned}
    res = calibrate_policies({**learned, **free}, both, cols, cfg.calibration_method, fit_scores=scores)
    if others:  # learned predictors loaded from exports (no training config to refit them by fold), or refused
        rest = calibrate_policies(others, val, cols, cfg.calibration_method)
        res.maps.update(rest.maps)
        res.curves.update(rest.curves)
        res.table = pd.concat([res.table, rest.table], ignore_index=True)
        res.notes += rest.notes + [f"calibration of {name} fitted on the {cfg.tune_split} split: "
                                   f"{why.get(name, 'no training config to cross-fit it')}"
                                   for name in sorted(others) if others[name] is not None]
    notes.append(f"calibration maps fitted on the train and {cfg.tune_split} splits: the training-free scores' own "
                 f"scores, {sorted(learned) or 'no learned predictor'} out of fold ({folds} folds of those prompts, "
                 "each scored by a copy trained without it)")
    notes += res.notes
    return res


def store_calibrations(result: Mapping[str, Any], exports: Mapping[str, str | Path], free_dir: str | Path | None
                       ) -> dict[str, Path]:
    """Write the fitted maps into the export folders (``predictor.json`` ``calibration``; the registry then holds them)
    and export each calibrated training-free score to ``<free_dir>/<kind>`` (``goodput:<that folder>``, or
    ``build_policy("goodput:<kind>", calibration_dir=free_dir)``). Returns name -> folder written."""
    calib = result.get("calibration")
    if calib is None:
        return {}
    written: dict[str, Path] = {}
    for name, maps in calib.maps.items():
        stored = {m: c.to_dict() for m, c in maps.items()}
        if name in exports:
            update_metadata(exports[name], calibration=stored)
            written[name] = Path(exports[name])
    if free_dir is not None:
        for name, pol in calibrated_scores().items():
            if name in calib.maps:
                folder = export_predictor(pol, Path(free_dir) / pol.kind, {"calibration": {
                    m: c.to_dict() for m, c in calib.maps[name].items()}})
                written[name] = folder
    return written


def cost_aware_rows(result: Mapping[str, Any], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Rows for the main job's table, keyed by row name: each policy's ECE per decoding mode (``ece_greedy``,
    ``ece_sampling``), ``<name> (goodput)`` with the replayed speedup of the cost-aware rule on the test split
    (``test_speedup``, first replay mode), and the best training-free score thresholded and cost-aware."""
    replay, calib = result.get("replay"), result.get("calibration")
    ece: dict[str, dict[str, float]] = {}
    if calib is not None and len(calib.table):
        for _, r in calib.table.iterrows():
            ece.setdefault(r["policy"], {})[f"ece_{r['mode']}"] = float(r["ece"])
    rows: dict[str, dict[str, Any]] = {name: dict(ece.get(name, {})) for name in names}
    if replay is None or not len(replay) or "speedup" not in replay:
        return rows
    rep = replay[replay["mode"] == replay["mode"].iloc[0]] if "mode" in replay else replay
    speed = {str(p): float(v) for p, v in zip(rep["policy"], rep["speedup"]) if np.isfinite(v)}

    def row(name: str, label: str, policy: str) -> dict[str, Any]:
        """Row ``name`` of the table with the ECE of ``policy``, the calibrated policy it is built from."""
        return {"predictor": name, "label": label, "test_speedup": speed[name], **ece.get(policy, {})}

    for name in names:
        if f"{name} (goodput)" in speed:
            rows[f"{name} (goodput)"] = row(f"{name} (goodput)", "cost-aware", name)
    free = [n for n in calibrated_scores() if f"{n} (goodput)" in speed]
    if free:
        best = max(free, key=lambda n: speed[f"{n} (goodput)"])
        rows[f"{best} (goodput)"] = row(f"{best} (goodput)", "cost-aware, best training-free", best)
    fixed = {k: v for k, v in speed.items() if k in ("svip", "adaedl", "max-confidence") or k.startswith("static-best")}
    if fixed:
        best = max(fixed, key=fixed.__getitem__)
        rows[best] = row(best, "thresholded, best training-free", best)
    return rows
