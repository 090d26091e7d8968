"""Grouped k-fold cross-validation over prompts: does a learned predictor beat the training-free scores, and by how
much?

Every prompt is tested once (fold i scored by a predictor trained on k - 2 folds, early-stopped on fold i + 1); the
out-of-fold AUCs are compared with the best training-free score's by a paired bootstrap over prompts (why and how:
docs/methods.md).

Usage: python -m pipelines.crossval --config configs/crossval.yaml
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from evaluation.classification import FREE_SCORES, score_levels, weighted_auc
from evaluation.plots import plot_crossval, plot_learning_curve
from predictors.calibration import MODES, calibration_label, ece_noise_floor, expected_calibration_error, fit_calibrator
from predictors.labels import label_name
from predictors.tracking import TrackingConfig, mlflow_api, mlflow_run
from predictors.training import DiscoConfig, SprinterConfig, TrainConfig, fit_predictor, make_datamodule

log = logging.getLogger(__name__)

__all__ = ["crossvalidate", "summarise", "to_markdown", "calibration_summary", "calibration_markdown", "CrossValRun",
           "CrossValConfig", "run_crossval"]

_KEEP = ("sample_id", "domain", "draw", "greedy_match", "accept_prob", *FREE_SCORES.values())


def _free_score(name: str, values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    return -v if name == "neg-entropy" else v


def crossvalidate(
    predictors: Mapping[str, tuple[str, Any]], data_dir: Any, out_dir: str | Path, folds: int = 5,
    train_fraction: float = 1.0,
) -> pd.DataFrame:
    """Train every predictor (name -> (kind, config)) on each of ``folds`` >= 3 grouped folds of ``data_dir`` and
    collect its out-of-fold scores, checkpoints under ``<out_dir>/<name>/fold-<i>``.

    ``train_fraction`` < 1 trains on a nested share of each fold's training prompts (a learning curve). Returns one row
    per (predictor, test token): fold, sample_id, domain, label y, the learned score and the training-free scores.
    """
    parts = []
    t0 = time.perf_counter()
    runs = [(name, i) for name in predictors for i in range(folds)]
    for n_done, (name, i) in enumerate(runs):
        kind, cfg = predictors[name]
        if kind not in ("disco", "sprinter"):
            raise ValueError(f"cross-validation trains disco or sprinter predictors, got {name!r} of kind {kind!r}")
        dm = make_datamodule(kind, cfg, data_dir, folds=(folds, i, train_fraction), extra_columns=_KEEP)
        run_dir = Path(out_dir) / name / (f"fold-{i}" if train_fraction == 1 else f"train{train_fraction:g}-fold-{i}")
        policy, metrics = fit_predictor(kind, cfg, data_dir, run_dir, datamodule=dm)
        dm.setup("test")
        x, y, _ = dm.tensors["test"]
        with torch.no_grad():
            score = policy.net.eval()(x).double().numpy()  # the logit: ranks as the policy's score
            val_score = policy.net(dm.tensors["val"][0]).double().numpy()
        raw = dm.raw["test"]
        calibrated = _calibrated_out_of_fold(val_score, dm.raw["val"], score, raw)
        part = pd.DataFrame({
            "predictor": name, "label": label_name(cfg.label_family, cfg.lam), "draw": "all",
            "train_fraction": train_fraction, "n_train": int(metrics["n_train"]), "fold": i,
            "y": y.numpy().astype(np.float64), "score": score,
            **{c: raw[c] for c in _KEEP if c in raw},  # draw: the rows' own (one-draw data: all)
            **calibrated,
        })
        if "domain" not in part:
            part["domain"] = "all"
        parts.append(part)
        elapsed = time.perf_counter() - t0
        log.info("cross-validation %s (train share %g) fold %d/%d: %d test tokens, val AUC %.4f, %.0fs elapsed, "
                 "ETA %.0fs", name, train_fraction, i + 1, folds, len(part), metrics.get("val_auc", float("nan")),
                 elapsed, elapsed / (n_done + 1) * (len(runs) - n_done - 1))
    return pd.concat(parts, ignore_index=True)


def _calibrated_out_of_fold(val_score: np.ndarray, val_raw: Mapping[str, np.ndarray], test_score: np.ndarray,
                            test_raw: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``cal_<mode>[_<free score>]`` columns: each fold's scores mapped to a decoding mode's acceptance by a map fitted
    on that fold's validation prompts (NaN on rows of another draw)."""
    out: dict[str, np.ndarray] = {}
    scorers = {"": (val_score, test_score)}
    scorers.update({f"_{f}": (_free_score(f, val_raw[c]), _free_score(f, test_raw[c]))
                    for f, c in FREE_SCORES.items() if c in val_raw and c in test_raw})
    for mode in MODES:
        want = "greedy" if mode == "greedy" else "sample"
        if any("draw" in r and not (np.asarray(r["draw"]).astype(str) == want).any() for r in (val_raw, test_raw)):
            continue  # this fold's rows hold the other draw only: its acceptance is not this mode's
        if any(("greedy_match" if mode == "greedy" else "accept_prob") not in r for r in (val_raw, test_raw)):
            continue
        v_mask, v_y = calibration_label(val_raw, mode)  # the raw columns hold q (a training-free score)
        t_mask, _ = calibration_label(test_raw, mode)
        for suffix, (vs, ts) in scorers.items():
            col = np.full(len(test_score), np.nan)
            try:
                col[t_mask] = fit_calibrator(vs[v_mask], v_y).apply(ts[t_mask])
            except ValueError:  # too few validation rows or one class
                continue
            out[f"cal_{mode}{suffix}"] = col
    return out


def calibration_summary(oof: pd.DataFrame, n_bins: int = 15) -> pd.DataFrame:
    """ECE of the out-of-fold calibrated acceptances per predictor, training-free score and decoding mode: n, mean
    label, ECE and its noise floor."""
    rows = []
    for name, frame in oof.groupby("predictor", sort=False):
        for col in [c for c in frame.columns if c.startswith("cal_")]:
            mode, _, free = col[len("cal_"):].partition("_")
            label = "greedy_match" if mode == "greedy" else "accept_prob"
            ok = frame[col].notna().to_numpy()
            if not ok.any() or label not in frame:
                continue
            p, y = frame[col].to_numpy()[ok], frame[label].to_numpy(dtype=np.float64)[ok]
            rows.append({"score": free or name, "via": name, "mode": mode, "n": int(ok.sum()),
                         "prompts": int(frame.loc[ok, "sample_id"].nunique()), "mean_label": float(y.mean()),
                         "ece": expected_calibration_error(p, y, n_bins), "ece_floor": ece_noise_floor(p, n_bins)})
    return pd.DataFrame(rows)


def calibration_markdown(table: pd.DataFrame) -> str:
    """The out-of-fold calibration table as Markdown."""
    lines = ["| score | folds of | mode | n | prompts | mean label | ECE | ECE floor |", "|" + "---|" * 8]
    for r in table.to_dict("records"):
        lines.append(f"| {r['score']} | {r['via']} | {r['mode']} | {r['n']} | {r['prompts']} | {r['mean_label']:.4f} "
                     f"| {r['ece']:.4f} | {r['ece_floor']:.4f} |")
    return "\n".join(lines)


FoldRanks = list[tuple[np.ndarray, dict[str, tuple[int, np.ndarray]]]]
"""Per fold: its row mask and, per scorer, (number of score levels, level index of each of its rows)."""


def _fold_ranks(frame: pd.DataFrame, names: Sequence[str]) -> FoldRanks:
    """Rank every scorer's scores within each fold once (the bootstrap only reweights rows)."""
    fold = frame["fold"].to_numpy()
    scores = {n: frame["score"].to_numpy() if n == "learned" else _free_score(n, frame[FREE_SCORES[n]]) for n in names}
    out: FoldRanks = []
    for f in np.unique(fold):
        m = fold == f
        ranked = {}
        for n, s in scores.items():
            levels, inv = score_levels(s[m])
            ranked[n] = (len(levels), inv)
        out.append((m, ranked))
    return out


def _aucs(y: np.ndarray, ranks: FoldRanks, names: Sequence[str], weights: np.ndarray | None = None) -> dict[str, float]:
    """Mean over folds of each scorer's AUC within the fold, weighted by the fold's token weight (scores of different
    folds come from different models)."""
    w = np.ones(len(y)) if weights is None else weights
    sums, total = dict.fromkeys(names, 0.0), 0.0
    for m, ranked in ranks:
        wf, yf = w[m], y[m]
        if (wf * yf).sum() <= 0 or (wf * (1.0 - yf)).sum() <= 0:
            continue  # one class only in this fold (or resample): it ranks nothing
        for name in names:
            n_levels, inv = ranked[name]
            sums[name] += wf.sum() * weighted_auc(inv, n_levels, wf * yf, wf * (1.0 - yf))
        total += wf.sum()
    return {name: sums[name] / total if total > 0 else float("nan") for name in names}


def summarise(oof: pd.DataFrame, n_boot: int = 200, seed: int = 0, ci: float = 0.95) -> pd.DataFrame:
    """AUC of each predictor's out-of-fold scores against the training-free scores, per domain; each AUC a mean over
    folds of the AUC within the fold.

    Returns one row per (predictor, train_fraction, group): auc, ``auc_<free>`` per training-free score, best_free, diff
    = auc - auc_best_free with its paired-bootstrap interval (diff_lo, diff_hi), p_win (share of resamples with diff >
    0) and folds_won.
    """
    rows = []
    rng = np.random.default_rng(seed)
    lo_q, hi_q = 100 * (1 - ci) / 2, 100 * (1 + ci) / 2
    if "train_fraction" not in oof:
        oof = oof.assign(train_fraction=1.0)
    for (name, fraction), frame in oof.groupby(["predictor", "train_fraction"], sort=False):
        free = [f for f, col in FREE_SCORES.items() if col in frame]
        groups = [("all", frame)] + [(str(d), g) for d, g in frame.groupby("domain", sort=True)] \
            if frame["domain"].nunique() > 1 else [("all", frame)]
        for group, g in groups:
            g = g.reset_index(drop=True)
            y = g["y"].to_numpy()
            row: dict[str, Any] = {"predictor": name, "label": g["label"].iloc[0], "draw": g["draw"].iloc[0],
                                   "train_fraction": float(fraction),
                                   "n_train": float(g.groupby("fold")["n_train"].first().mean())
                                   if "n_train" in g else np.nan,
                                   "group": group, "n": len(g), "prompts": g["sample_id"].nunique(),
                                   "pos_rate": float(y.mean())}
            if y.min() == y.max():
                rows.append({**row, "reason": "one class only"})
                continue
            ranks = _fold_ranks(g, ["learned", *free])
            point = _aucs(y, ranks, ["learned", *free])
            best = max(free, key=point.__getitem__)
            row.update(auc=point["learned"], **{f"auc_{f}": point[f] for f in free}, best_free=best,
                       auc_best_free=point[best], diff=point["learned"] - point[best])
            codes = np.unique(g["sample_id"].astype(str), return_inverse=True)[1]
            n_groups = int(codes.max()) + 1
            diffs = []
            for _ in range(n_boot):
                w = np.bincount(rng.integers(0, n_groups, n_groups), minlength=n_groups).astype(np.float64)[codes]
                a = _aucs(y, ranks, ["learned", best], w)
                diffs.append(a["learned"] - a[best])
            d = np.asarray(diffs)
            d = d[np.isfinite(d)]
            if d.size:
                row.update(diff_lo=float(np.percentile(d, lo_q)), diff_hi=float(np.percentile(d, hi_q)),
                           p_win=float((d > 0).mean()))
            if group == "all":
                won = 0
                for m, ranked in ranks:
                    if y[m].min() < y[m].max():
                        a = _aucs(y, [(m, ranked)], ["learned", best])
                        won += int(a["learned"] > a[best])
                row.update(folds_won=won, folds=len(ranks))
            rows.append(row)
    return pd.DataFrame(rows)


def to_markdown(table: pd.DataFrame) -> str:
    """The summary as a Markdown table (AUCs to 4 places, the difference with its interval)."""
    lines = ["| predictor | label (draw) | train tokens | group | n | prompts | learned AUC | best training-free | "
             "its AUC | difference [95% CI] | P(win) | folds won |", "|" + "---|" * 12]
    for r in table.to_dict("records"):
        n_train = f"{r['n_train']:.0f}" if np.isfinite(r.get("n_train", np.nan)) else ""
        head = (f"| {r['predictor']} | {r['label']} ({r['draw']}) | {n_train} | {r['group']} | {r['n']} "
                f"| {r['prompts']} |")
        if "auc" not in r or not np.isfinite(r.get("auc", np.nan)):
            lines.append(f"{head} {r.get('reason', '')} | | | | | |")
            continue
        folds = f"{int(r['folds_won'])}/{int(r['folds'])}" if np.isfinite(r.get("folds_won", np.nan)) else ""
        lines.append(
            f"{head} "
            f"{r['auc']:.4f} | {r['best_free']} | {r['auc_best_free']:.4f} | {r['diff']:+.4f} "
            f"[{r.get('diff_lo', np.nan):+.4f}, {r.get('diff_hi', np.nan):+.4f}] | {r.get('p_win', np.nan):.2f} "
            f"| {folds} |")
    return "\n".join(lines)


@dataclass
class CrossValRun:
    """One predictor of the comparison: a name, its kind and that kind's training config."""

    name: str
    """Row name in the table (e.g. disco, disco-ratio1.2)."""
    kind: str = "disco"
    """disco or sprinter."""
    disco: DiscoConfig = field(default_factory=DiscoConfig)
    """Training config when kind is disco (its label_family / lam give the label it is compared on)."""
    sprinter: SprinterConfig = field(default_factory=SprinterConfig)
    """Training config when kind is sprinter."""

    def __post_init__(self) -> None:
        if self.kind not in ("disco", "sprinter"):
            raise ValueError(f"run {self.name!r}: kind={self.kind!r}; cross-validation trains disco or sprinter")

    @property
    def config(self) -> TrainConfig:
        return self.disco if self.kind == "disco" else self.sprinter


@dataclass
class CrossValConfig(TrackingConfig):
    """Arguments of ``python -m pipelines.crossval`` (configs/crossval.yaml mirrors them)."""

    data_dir: str = "outputs/default/data"
    """Folder of the Parquet shards."""
    extra_data_dirs: list[str] = field(default_factory=list)
    """More shard folders read with data_dir as one data set (e.g. the code-domain run)."""
    out_dir: str = "outputs/default/crossval"
    """Tables, plot, out-of-fold scores, per-fold checkpoints and logs."""
    runs: list[CrossValRun] = field(default_factory=lambda: [CrossValRun("disco")])
    """The predictors compared."""
    folds: int = 5
    """Folds of prompts (>= 3: one tested, one for early stopping, the rest for training)."""
    train_fractions: list[float] = field(default_factory=lambda: [1.0])
    """Shares of each fold's training prompts to train on, e.g. [0.25, 0.5, 1.0]: a learning curve."""
    n_boot: int = 200
    """Bootstrap resamples of prompts for the intervals."""
    seed: int = 0
    """Bootstrap seed (the fold assignment uses each run's training seed)."""
    tracking: bool = field(default=False, kw_only=True)
    """Log to MLflow in a new ``crossval`` run when none is active (the field: ``predictors.tracking``)."""

    def __post_init__(self) -> None:
        if self.folds < 3:
            raise ValueError(f"folds={self.folds}: use at least 3 (one tested, one for early stopping, the rest train)")
        bad = [f for f in self.train_fractions if not 0 < f <= 1]
        if bad or not self.train_fractions:
            raise ValueError(f"train_fractions={self.train_fractions}: give shares in (0, 1]")
        names = [r.name for r in self.runs]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"runs need distinct names, got {names}")


def run_crossval(cfg: CrossValConfig) -> dict[str, Any]:
    """Train every run on every fold, summarise, write and log the results; returns {"table", "markdown", "files",
    "oof": the out-of-fold scores the table summarises}."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = [cfg.data_dir, *cfg.extra_data_dirs] if cfg.extra_data_dirs else cfg.data_dir
    runs = {r.name: (r.kind, r.config) for r in cfg.runs}
    oof = pd.concat([crossvalidate(runs, data, out, cfg.folds, f) for f in sorted(set(cfg.train_fractions))],
                    ignore_index=True)
    table = summarise(oof, cfg.n_boot, cfg.seed)
    markdown = to_markdown(table)
    calibration = calibration_summary(oof[oof["train_fraction"] == max(cfg.train_fractions)])
    files = [out / "oof.parquet", out / "crossval.csv", out / "crossval.md", out / "crossval_config.json",
             out / "calibration.csv"]
    oof.to_parquet(files[0])
    table.to_csv(files[1], index=False)
    calibration.to_csv(files[4], index=False)
    files[2].write_text(f"# Cross-validated AUC: learned against training-free ({cfg.folds} folds of prompts)\n\n"
                        f"{markdown}\n\n## Calibrated acceptance, out of fold\n\nEach fold's score (learned, and each "
                        f"training-free score) mapped to its decoding mode's acceptance by a map fitted on the fold's "
                        f"validation prompts, scored on its test prompts; pooled over the folds, every prompt once. "
                        f"ECE floor: what a perfectly calibrated map scores by chance on as many tokens.\n\n"
                        f"{calibration_markdown(calibration)}\n")
    if len(calibration):
        worst = calibration.loc[calibration["ece"].idxmax()]
        log.info("out-of-fold calibration: ECE %.4f to %.4f over %d tokens a mode (worst %s, %s; floor %.4f)",
                 calibration["ece"].min(), worst["ece"], int(calibration["n"].min()), worst["score"], worst["mode"],
                 worst["ece_floor"])
    files[3].write_text(json.dumps(asdict(cfg), indent=2, default=str))
    files.append(plot_crossval(table, out / "crossval.png"))
    if len(set(cfg.train_fractions)) > 1:
        files.append(plot_learning_curve(table, out / "learning_curve.png"))
    _log_mlflow(cfg, table, files)
    return {"table": table, "markdown": markdown, "files": [str(f) for f in files], "oof": oof}


def _log_mlflow(cfg: CrossValConfig, table: Any, files: list[Path]) -> None:
    """The table's metrics and the files, into the active MLflow run, else a new ``crossval`` run with ``tracking``."""
    mlflow = mlflow_api()

    def log_all() -> None:
        for r in table.to_dict("records"):
            for key in ("auc", "auc_best_free", "diff", "diff_lo", "diff_hi", "p_win"):
                v = r.get(key)
                if isinstance(v, float) and math.isfinite(v):
                    share = "" if r["train_fraction"] == 1 else f"_train{r['train_fraction']:g}"
                    mlflow.log_metric(f"cv_{r['predictor']}{share}_{r['group']}_{key}", v)
        for f in files:
            mlflow.log_artifact(str(f), artifact_path="crossval")

    if mlflow.active_run() is not None:
        log_all()
    elif cfg.tracking:
        with mlflow_run(cfg.tracking_uri, cfg.experiment, "crossval"):
            mlflow.log_params({"folds": cfg.folds, "n_boot": cfg.n_boot, "runs": ",".join(r.name for r in cfg.runs),
                               "train_fractions": ",".join(map(str, cfg.train_fractions))})
            log_all()
