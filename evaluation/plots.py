"""PNG plots of the evaluation report (matplotlib, Agg): ROC overlay, threshold vs predicted speedup, oracle lengths,
acceptance against entropy, cross-validation, reliability.

Usage: ``plot_roc(roc_points(columns, policies), "out/roc.png")``
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

__all__ = ["plot_roc", "plot_threshold_speedup", "plot_oracle_hist", "plot_accept_vs_entropy", "plot_crossval",
           "plot_learning_curve", "plot_reliability", "plot_expected_vs_measured"]


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_roc(roc: Mapping[str, tuple[np.ndarray, np.ndarray, float]], path: str | Path, title: str = "ROC") -> Path:
    """Overlay of ROC curves: name -> (fpr, tpr, auc) (from ``evaluation.classification.roc_points``)."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, (fpr, tpr, auc) in sorted(roc.items(), key=lambda kv: -kv[1][2]):
        ax.plot(fpr, tpr, label=f"{name} (AUC {auc:.3f})")
    ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title=title, xlim=(0, 1), ylim=(0, 1.01))
    if not roc:
        ax.text(0.5, 0.5, "no scorer could be evaluated\n(one class only, or missing columns)", ha="center")
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def plot_threshold_speedup(sweep: pd.DataFrame, table: pd.DataFrame | None, path: str | Path, title: str = "") -> Path:
    """Predicted speedup against threshold per policy, with the best static length and the oracle as reference lines."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    if sweep is not None and len(sweep):
        for name, g in sweep.groupby("policy", sort=False):
            g = g.sort_values("threshold")
            ax.plot(g["threshold"], g["speedup"], marker=".", label=str(name))
    if table is not None and len(table) and "speedup" in table:
        refs = table[table["policy"].str.startswith(("static-best", "oracle"))]
        for _, r in refs.iterrows():
            if np.isfinite(r["speedup"]):
                ax.axhline(r["speedup"], ls="--", lw=0.9, color="gray")
                ax.text(ax.get_xlim()[0], r["speedup"], f" {r['policy']} {r['speedup']:.2f}x", fontsize=7, va="bottom")
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set(xlabel="threshold (policy score scale)", ylabel="predicted speedup vs target only",
           title=title or "threshold vs predicted speedup (replay)")
    if sweep is None or not len(sweep):
        ax.text(0.5, 0.5, "no threshold sweep", transform=ax.transAxes, ha="center")
    else:
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_oracle_hist(columns: Mapping[str, Any], path: str | Path, max_len: int = 40) -> Path:
    """Histogram of the oracle draft length (``oracle_len``), censored runs stacked separately."""
    fig, ax = plt.subplots(figsize=(6, 4))
    if "oracle_len" in columns and len(np.asarray(columns["oracle_len"])):
        L = np.minimum(np.asarray(columns["oracle_len"], dtype=np.int64), max_len)
        cens = np.asarray(columns.get("oracle_censored", np.zeros(len(L), bool)), dtype=bool)
        bins = np.arange(0, max_len + 2) - 0.5
        ax.hist(
            [L[~cens], L[cens]], bins=bins, stacked=True, label=["ended by a mismatch", "censored (end of rollout)"]
        )
        ax.set_yscale("log")
        ax.set_xlim(-0.5, min(max_len, int(L.max()) + 1) + 0.5)
        ax.legend(fontsize=8)
        ax.set_title(f"oracle draft length (n={len(L)}, mean {L.mean():.2f}, capped at {max_len})")
    else:
        ax.text(0.5, 0.5, "no oracle_len column", transform=ax.transAxes, ha="center")
    ax.set(xlabel="consecutive greedy matches from this token", ylabel="tokens")
    return _save(fig, path)


def plot_accept_vs_entropy(columns: Mapping[str, Any], path: str | Path, bins: int = 20) -> Path:
    """SVIP's Figure 2: mean acceptance and greedy-match rate against draft entropy (equal-count bins), with SVIP's and
    AdaEDL's bounds."""
    fig, ax = plt.subplots(figsize=(6, 4.5))
    if "draft_entropy" in columns and len(np.asarray(columns["draft_entropy"])):
        H = np.asarray(columns["draft_entropy"], dtype=np.float64)
        edges = np.unique(np.quantile(H, np.linspace(0, 1, bins + 1)))
        idx = np.clip(np.searchsorted(edges, H, side="right") - 1, 0, max(len(edges) - 2, 0))
        centers = np.array([H[idx == b].mean() for b in range(len(edges) - 1) if (idx == b).any()])
        for col, label in (("accept_prob", "mean min(1, p/q)"), ("greedy_match", "greedy-match rate")):
            if col in columns:
                v = np.asarray(columns[col], dtype=np.float64)
                means = [v[idx == b].mean() for b in range(len(edges) - 1) if (idx == b).any()]
                ax.plot(centers, means, "o-", label=label)
        hh = np.linspace(0, max(H.max(), 1e-3), 100)
        ax.plot(hh, 1 - np.sqrt(0.15 * hh), "k--", lw=0.8, label="SVIP 1 - sqrt(0.15 H)")
        ax.plot(hh, 1 - np.sqrt(0.2 * hh), "k:", lw=0.8, label="AdaEDL 1 - sqrt(0.2 H)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no draft_entropy column", transform=ax.transAxes, ha="center")
    ax.set(xlabel="draft entropy H(q) (nats)", ylabel="acceptance", title="acceptance against draft entropy")
    return _save(fig, path)


def plot_crossval(table: pd.DataFrame, path: str | Path) -> Path:
    """Cross-validated AUC difference (learned minus best training-free) with its interval, one row per predictor and
    group; right of zero the learned one wins."""
    rows = table[np.isfinite(table.get("diff", pd.Series(np.nan, index=table.index)))] if len(table) else table
    if len(rows) and "train_fraction" in rows:
        rows = rows[rows["train_fraction"] == rows["train_fraction"].max()]
    fig, ax = plt.subplots(figsize=(9, 0.4 * max(len(rows), 1) + 1.4))
    for i, r in enumerate(rows.to_dict("records")):
        lo, hi = r.get("diff_lo", r["diff"]), r.get("diff_hi", r["diff"])
        color = "tab:green" if lo > 0 else ("tab:red" if hi < 0 else "tab:gray")
        # a percentile interval of a few prompts may miss its own point estimate: draw the bar to what it covers
        ax.errorbar(r["diff"], i, xerr=[[max(0.0, r["diff"] - lo)], [max(0.0, hi - r["diff"])]], fmt="o", color=color,
                    capsize=3)
        if not lo <= r["diff"] <= hi:
            ax.plot([lo, hi], [i, i], color=color, lw=1, ls=":")
    labels = [f"{r['predictor']} · {r['label']} · {r['group']} (vs {r['best_free']})" for r in rows.to_dict("records")]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.axvline(0.0, color="k", lw=0.8)
    ax.invert_yaxis()
    ax.set(xlabel="AUC difference: learned - best training-free (95% CI over prompts)",
           title="Cross-validated: does the learned predictor win? (green: yes, red: no, gray: tie)")
    if not len(rows):
        ax.text(0.5, 0.5, "no comparison could be made", ha="center", transform=ax.transAxes)
    return _save(fig, path)


def plot_learning_curve(table: pd.DataFrame, path: str | Path) -> Path:
    """Cross-validated AUC difference against training tokens per fold, one line per predictor with its interval as a
    band."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    rows = table[(table["group"] == "all") & np.isfinite(table.get("diff", pd.Series(np.nan, index=table.index)))] \
        if len(table) else table
    for name, g in rows.groupby("predictor", sort=False):
        g = g.sort_values("n_train")
        line, = ax.plot(g["n_train"], g["diff"], marker="o", label=f"{name} ({g['label'].iloc[0]})")
        if "diff_lo" in g:
            ax.fill_between(g["n_train"], g["diff_lo"], g["diff_hi"], color=line.get_color(), alpha=0.15)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="training tokens per fold", ylabel="AUC difference to the best training-free score",
           title="Learning curve (cross-validated, 95% CI over prompts)")
    if len(rows):
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no comparison could be made", ha="center", transform=ax.transAxes)
    return _save(fig, path)


def plot_reliability(curves: Mapping[tuple[str, str], Mapping[str, np.ndarray]], path: str | Path,
                     ece: Mapping[tuple[str, str], float] | None = None) -> Path:
    """Reliability diagrams, one panel per decoding mode: mean acceptance against mean calibrated prediction per bin,
    one line per policy."""
    modes = sorted({m for _, m in curves}) or ["greedy"]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.2 * len(modes), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for (name, m), b in sorted(curves.items()):
            if m != mode:
                continue
            ok = b["count"] > 0
            err = (ece or {}).get((name, m))
            ax.plot(b["mean_pred"][ok], b["mean_label"][ok], "o-", ms=3,
                    label=name if err is None else f"{name} (ECE {err:.3f})")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        label = "greedy match" if mode == "greedy" else "min(1, p/q)"
        ax.set(xlabel="calibrated acceptance (bin mean)", ylabel=f"observed {label}", xlim=(0, 1), ylim=(0, 1),
               title=f"reliability, {mode} decoding (test split)")
        ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def plot_expected_vs_measured(round_tokens: Mapping[str, Sequence[tuple[float, float]]], path: str | Path,
                              n_bins: int = 8) -> Path:
    """Per cost-aware policy: tokens a round expected (calibrated acceptance of the verified prefix + 1) against tokens
    the replay measured, binned."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    top = 1.0
    for name, pairs in sorted(round_tokens.items()):
        if not len(pairs):
            continue
        e, m = np.asarray(pairs, dtype=np.float64).T
        edges = np.unique(np.quantile(e, np.linspace(0, 1, n_bins + 1)))
        idx = np.clip(np.searchsorted(edges, e, side="right") - 1, 0, max(len(edges) - 2, 0))
        xs = [e[idx == i].mean() for i in np.unique(idx)]
        ys = [m[idx == i].mean() for i in np.unique(idx)]
        ax.plot(xs, ys, "o-", ms=3, label=f"{name}: {m.mean():.2f} measured vs {e.mean():.2f} expected")
        top = max(top, max(xs), max(ys))
    ax.plot([1, top], [1, top], "k--", lw=0.8)
    ax.set(xlabel="expected tokens per round", ylabel="measured tokens per round (replay)",
           title="cost-aware policies: expected vs measured tokens per round")
    ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)
