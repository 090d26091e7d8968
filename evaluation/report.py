"""The evaluation report: report.md with the measured tables, PNG plots and CSVs in one folder, logged to MLflow.

Usage: ``path = write_report("runs/eval", ReportInputs(classification=cls_df, replay=rep_df, ...))``
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from compute.timing import CostModel
from evaluation.classification import roc_points
from evaluation.plots import (
    plot_accept_vs_entropy,
    plot_expected_vs_measured,
    plot_oracle_hist,
    plot_reliability,
    plot_roc,
    plot_threshold_speedup,
)
from predictors.base import StopPolicy
from predictors.labels import label_name

__all__ = ["ReportInputs", "write_report", "markdown_table", "report_metrics"]

log = logging.getLogger(__name__)


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return ""
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return "NaN"
        return f"{v:.{digits}f}" if abs(v) < 1e5 else f"{v:.3g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


INT_COLUMNS = {"n", "n_seqs", "n_rounds", "rounds", "censored_rounds", "static_best_k"}
"""Columns printed as integers (pandas turns them into floats when a row has NaN)."""


def markdown_table(df: pd.DataFrame | None, columns: Sequence[str] | None = None, digits: int = 3) -> str:
    """A pipe table of ``df`` (only ``columns`` that exist, plus ``ref`` after ``policy``); '(empty)' for no rows."""
    if df is None or not len(df):
        return "(empty)\n"
    cols = [c for c in (columns or df.columns) if c in df.columns]
    if "policy" in cols and "ref" in df.columns and "ref" not in cols:  # a predictor's folder or URI beside its name
        cols.insert(cols.index("policy") + 1, "ref")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df[cols].iterrows():
        cells = []
        for c in cols:
            v = r[c]
            if c in INT_COLUMNS and isinstance(v, (float, np.floating)) and np.isfinite(v):
                v = int(v)
            cells.append(_fmt(v, digits))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ci(df: pd.DataFrame, m: str) -> pd.Series:
    if f"{m}_lo" not in df:
        return df[m].map(_fmt)
    return [
        f"{_fmt(v)} [{_fmt(lo)}, {_fmt(hi)}]" if np.isfinite(lo) else _fmt(v)
        for v, lo, hi in zip(df[m], df[f"{m}_lo"], df[f"{m}_hi"])
    ]


def _metric_key(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", s)


def report_metrics(classification: pd.DataFrame | None, replay: pd.DataFrame | None,
                   calibration: pd.DataFrame | None = None) -> dict[str, float]:
    """Flat metrics for MLflow: ``auc/<label>/<policy>``, ``pr_auc/...``, ``f1_opt/...``, ``speedup/<policy>``,
    ``ece/<mode>/<policy>``, ..."""
    out: dict[str, float] = {}
    if calibration is not None and len(calibration):
        for _, r in calibration.iterrows():
            if np.isfinite(r["ece"]):
                out[_metric_key(f"ece/{r['mode']}/{r['policy']}")] = float(r["ece"])
    if classification is not None and len(classification):
        heads = classification[classification["group_by"] == "all"]
        for _, r in heads.iterrows():
            for m in ("auc", "pr_auc", "f1_opt", "f1_own"):
                v = r.get(m)
                if v is not None and np.isfinite(v):
                    out[_metric_key(f"{m}/{r['label']}/{r['policy']}")] = float(v)
    if replay is not None and len(replay) and "speedup" in replay:
        for _, r in replay.iterrows():
            for m in ("speedup", "tokens_per_call"):
                v = r.get(m)
                if v is not None and np.isfinite(v):
                    out[_metric_key(f"{m}/{r['policy']}")] = float(v)
    return out


def _log_mlflow(out_dir: Path, metrics: Mapping[str, float]) -> bool:
    try:
        import mlflow  # optional: the report is written without it
    except ImportError:
        return False
    if mlflow.active_run() is None:
        return False
    mlflow.log_artifacts(str(out_dir), artifact_path="evaluation")
    if metrics:
        mlflow.log_metrics({f"eval/{k}": v for k, v in metrics.items()})
    return True


def _calibration_plots(plots: Path, calibration: pd.DataFrame | None,
                       reliability: Mapping[tuple[str, str], Mapping[str, np.ndarray]] | None,
                       round_tokens: Mapping[str, Sequence[tuple[float, float]]] | None) -> dict[str, Path]:
    out: dict[str, Path] = {}
    if reliability:
        ece = {}
        if calibration is not None and len(calibration):
            ece = {(r["policy"], r["mode"]): float(r["ece"]) for _, r in calibration.iterrows()}
        out["reliability"] = plot_reliability(reliability, plots / "reliability.png", ece)
    if round_tokens:
        out["expected"] = plot_expected_vs_measured(round_tokens, plots / "expected_vs_measured.png")
    return out


def _calibration_section(calibration: pd.DataFrame | None) -> list[str]:
    if calibration is None or not len(calibration):
        return []
    return [
        "## Calibrated acceptance",
        "",
        "Each score mapped to the acceptance of a decoding mode (greedy match on the argmax draws; min(1, p/q) on the "
        "sampled draws), the map fitted on `n_fit` tokens outside the test split (the notes above say which: the "
        "training and validation prompts, a learned predictor's scores there out of fold) and scored here on the test "
        "split: expected calibration error (15 equal-width bins) of the raw score (when it is a probability) and of "
        "the calibrated acceptance; `ece_floor` is what a perfectly calibrated map scores on these tokens by chance "
        "(labels drawn from its own predictions), so an `ece` near it is as good as this test split can show; "
        "`ece_lo` / `ece_hi` bound the 95% interval of the ECE over resampled test prompts (tokens of a prompt share "
        "its acceptance level, so the split's ECE moves with which prompts it holds more than the floor says); "
        "`method` is the map cross-validation chose on the fit tokens. The cost-aware rows of the replay "
        "(`(goodput)`) price these acceptances with the cost model.",
        "",
        markdown_table(calibration, ["policy", "mode", "label", "method", "n", "n_fit", "mean_label", "ece_raw", "ece",
                                     "ece_floor", "ece_lo", "ece_hi"], digits=4),
    ]


@dataclass
class ReportInputs:
    """What :func:`write_report` writes: the evaluation's tables, the records and policies behind the plots, the header
    lines."""

    classification: pd.DataFrame | None = None
    """:func:`evaluation.classification.score_table` output."""
    replay: pd.DataFrame | None = None
    """:func:`evaluation.replay.replay_table`'s table."""
    sweep: pd.DataFrame | None = None
    """:func:`evaluation.replay.replay_table`'s threshold sweep."""
    sprinter: pd.DataFrame | None = None
    """:func:`evaluation.classification.sprinter_table` output."""
    cost_model: CostModel | None = None
    """The cost model the speedups use (None: speedups unavailable, said in the report)."""
    columns: Mapping[str, Any] | None = None
    """The evaluated records (for the ROC overlay, the oracle histogram and the entropy plot)."""
    policies: Mapping[str, StopPolicy | None] | None = None
    """The learned / extra policies (added to the ROC overlay next to the built-in scores)."""
    command: str = ""
    """The command that reproduces the numbers."""
    notes: Sequence[str] = ()
    """Extra lines for the report header (data selection, fallbacks)."""
    tuned: Mapping[str, tuple[float, float]] | None = None
    """Policy name -> (threshold, val speedup) from ``tune_threshold``."""
    roc_label: tuple[str, float] = ("greedy", 1.0)
    """(family, lambda) of the ROC overlay."""
    calibration: pd.DataFrame | None = None
    """``evaluation.calibration.CalibrationResult.table`` (ECE per policy and decoding mode)."""
    reliability: Mapping[tuple[str, str], Mapping[str, np.ndarray]] | None = None
    """(policy, mode) -> reliability bins, for the reliability diagram."""
    round_tokens: Mapping[str, Sequence[tuple[float, float]]] | None = None
    """Cost-aware policy -> (expected, replayed) tokens per round, for the expected-vs-measured plot."""


PLOT_TITLES = {"roc": "ROC overlay", "sweep": "threshold vs predicted speedup", "oracle": "oracle draft length",
               "entropy": "acceptance against draft entropy (SVIP Figure 2)",
               "reliability": "reliability diagram of the calibrated acceptance (test split)",
               "expected": "cost-aware policies: expected against measured tokens per round"}
"""Section titles of the plots in report.md, by plot key."""


def write_report(out_dir: str | Path, inputs: ReportInputs, tracking: bool = True) -> Path:
    """Write report.md, plots/*.png and CSV tables into ``out_dir``; with ``tracking`` log them and the metrics to the
    active MLflow run. Returns the path of report.md."""
    out = Path(out_dir)
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    _write_tables(out, inputs)
    pngs = _draw_plots(plots, inputs)
    md = _header(inputs)
    md += _classification_section(inputs.classification)
    md += _sprinter_section(inputs.sprinter)
    md += _replay_section(inputs.replay, inputs.cost_model)
    md += _calibration_section(inputs.calibration)
    md += _tuned_section(inputs.tuned)
    md += ["## Plots", ""]
    for k, p in pngs.items():
        md += [f"### {PLOT_TITLES[k]}", "", f"![{PLOT_TITLES[k]}](plots/{p.name})", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    if tracking:
        try:
            _log_mlflow(out, report_metrics(inputs.classification, inputs.replay, inputs.calibration))
        except Exception as e:  # tracking must not lose the report already written
            log.warning("could not log the report to MLflow: %s", e)
    return path


def _write_tables(out: Path, r: ReportInputs) -> None:
    """The tables as CSV and the cost model as JSON."""
    for name, df in (("classification", r.classification), ("replay", r.replay), ("sweep", r.sweep),
                     ("sprinter", r.sprinter), ("calibration", r.calibration)):
        if df is not None:
            df.to_csv(out / f"{name}.csv", index=False)
    if r.cost_model is not None:
        r.cost_model.to_json(out / "cost_model.json")


def _draw_plots(plots: Path, r: ReportInputs) -> dict[str, Path]:
    """Plot key -> PNG written: ROC, oracle lengths and entropy (with records), the threshold sweep, calibration."""
    pngs: dict[str, Path] = {}
    if r.columns is not None:
        try:
            roc = roc_points(r.columns, r.policies or {}, *r.roc_label)
        except KeyError as e:
            roc = {}
            log.warning("ROC overlay skipped: %s", e)
        pngs["roc"] = plot_roc(roc, plots / "roc.png", f"ROC, label {label_name(*r.roc_label)}")
        pngs["oracle"] = plot_oracle_hist(r.columns, plots / "oracle_len_hist.png")
        pngs["entropy"] = plot_accept_vs_entropy(r.columns, plots / "accept_vs_entropy.png")
    replay, sweep = r.replay, r.sweep
    ref_rows = replay
    if replay is not None and sweep is not None and len(sweep) and "mode" in sweep and "mode" in replay:
        ref_rows = replay[replay["mode"] == sweep["mode"].iloc[0]]
    sweep_title = f"threshold vs predicted speedup ({sweep['mode'].iloc[0]} replay)" if (
        sweep is not None and len(sweep) and "mode" in sweep) else ""
    pngs["sweep"] = plot_threshold_speedup(sweep, ref_rows, plots / "threshold_speedup.png", sweep_title)
    pngs.update(_calibration_plots(plots, r.calibration, r.reliability, r.round_tokens))
    return pngs


def _header(r: ReportInputs) -> list[str]:
    """Title, the command, the notes, the tokens evaluated and the cost model (or why speedups are missing)."""
    md: list[str] = ["# specstop evaluation report", ""]
    if r.command:
        md += ["Reproduce with:", "", "```", r.command, "```", ""]
    md += [f"- {n}" for n in r.notes]
    if r.columns is not None:
        md.append(f"- tokens evaluated: {len(np.asarray(next(iter(r.columns.values()))))}")
    if r.cost_model is None:
        md.append("- **speedups unavailable**: no cost model (cost_model.json) was given; "
                  "replay reports tokens per call only.")
    else:
        md.append(f"- cost model: {r.cost_model.describe()}")
        if r.cost_model.assumed:
            md.append("- **every speedup below uses an ASSUMED cost model, not a measurement on this machine.**")
    return [*md, ""]


def _classification_section(classification: pd.DataFrame | None) -> list[str]:
    if classification is None or not len(classification):
        return []
    heads = classification[classification["group_by"] == "all"].copy()
    md = [
        "## Classification (test split)",
        "",
        "ROC AUC, PR-AUC (average precision) and F1 with 95% bootstrap intervals over prompts; soft labels count "
        "each token as a positive with weight min(1,p/q) and a negative with the rest. "
        "`f1_static_best`: DISCO's best static draft length (accept where position < k).",
        "",
    ]
    heads["auc (CI)"] = _ci(heads, "auc")
    heads["pr_auc (CI)"] = _ci(heads, "pr_auc")
    heads["f1_own (CI)"] = _ci(heads, "f1_own")
    for label, g in heads.groupby("label", sort=False):
        md += [f"### label: {label}", ""]
        md.append(markdown_table(g, ["policy", "n", "pos_rate", "auc (CI)", "pr_auc (CI)", "threshold",
                                     "f1_own (CI)", "f1_opt", "thr_f1_opt", "static_best_k", "f1_static_best",
                                     "f1_gain_vs_static", "f1_own_vs_static", "reason"]))
    br = classification[classification["group_by"] != "all"]
    if len(br):
        md += ["### Breakdown by origin and domain (greedy-match label)", ""]
        g = br[br["family"] == "greedy"] if (br["family"] == "greedy").any() else br
        md.append(markdown_table(
            g, ["group_by", "group", "policy", "n", "pos_rate", "auc", "pr_auc", "f1_own", "reason"]
        ))
    return [*md, ""]


def _sprinter_section(sprinter: pd.DataFrame | None) -> list[str]:
    if sprinter is None or not len(sprinter):
        return []
    return [
        "## SPRINTER theory against the data",
        "",
        "TPR / FPR at each policy's own threshold against q/p <= lambda; "
        "Theorem 1: TV(p, p_SPRINTER) = FPR x mean TV; "
        "Theorem 2: expected tokens before a target call with r = measured acceptable run per round, against the "
        "replayed count along draft rollouts.",
        "",
        markdown_table(sprinter, ["policy", "lam", "threshold", "tpr", "fpr", "mean_tv", "tv_bound",
                                  "accept_rate_thm1", "rounds", "censored_rounds", "mean_r",
                                  "e_tokens_theorem2", "e_tokens_replayed", "reason"]),
    ]


def _replay_section(replay: pd.DataFrame | None, cost_model: CostModel | None) -> list[str]:
    if replay is None or not len(replay):
        return []
    md = [
        "## Offline replay",
        "",
        "Tokens per target call = mean accepted + 1; wasted = drafted but not accepted, per round; speedup = "
        "predicted over target-only decoding under the cost model. Greedy replays accept up to the first mismatch; "
        "sampling replays use the expected acceptance.",
        "",
    ]
    cols = ["policy", "kind", "threshold", "verification", "n_rounds", "tokens_per_call", "mean_accepted",
            "drafted_per_round", "wasted_per_round", "expected_per_round", "speedup", "reason"]
    if cost_model is None:
        cols.remove("speedup")
    groups = replay.groupby("mode", sort=False) if "mode" in replay else [("", replay)]
    for mode, g in groups:
        md += [f"### {mode} verification" if mode else "### replay", ""]
        for col in ("sequences", "exact_accepts"):
            if col in g and g[col].notna().any():
                md.append(f"- {col}: {g[col].dropna().iloc[0]}")
        md += ["", markdown_table(g, cols)]
    return md


def _tuned_section(tuned: Mapping[str, tuple[float, float]] | None) -> list[str]:
    if not tuned:
        return []
    return ["### Thresholds tuned for latency on the validation split", "",
            markdown_table(pd.DataFrame([{"policy": k, "threshold": v[0], "val_speedup": v[1]}
                                         for k, v in tuned.items()]))]
