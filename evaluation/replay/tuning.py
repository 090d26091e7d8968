"""Replay tables and threshold tuning: the training-free baselines replayed beside the learned policies, threshold
sweeps over a grid of score quantiles, the threshold of best predicted speedup, and the table of every policy."""
from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from compute.timing import CostModel
from evaluation.replay.rounds import OracleSchedule, ReplayResult, replay_policy
from evaluation.replay.scores import missing_columns, scores_for, with_threshold
from evaluation.replay.sequences import ReplayConfig, ReplayData, prepare_replay_data
from predictors.base import StopPolicy
from predictors.baselines import SVIP, AdaEDL, HFHeuristic, MaxConfidence, Oracle, StaticLength

__all__ = ["default_grid", "default_replay_policies", "replay_table", "threshold_sweep", "tune_threshold"]


def default_replay_policies(
    static_lengths: Iterable[int] = range(1, 11), max_draft_len: int = 40, online_roc: bool = False
) -> dict[str, StopPolicy]:
    """The training-free baselines replayed next to the learned policies."""
    pols: dict[str, StopPolicy] = {
        f"static-{k}": StaticLength(k, max_draft_len=max(max_draft_len, k)) for k in static_lengths
    }
    pols["hf-heuristic"] = HFHeuristic(initial=5, max_draft_len=max_draft_len)
    pols["svip"] = SVIP(h=0.3, gamma=0.15, max_draft_len=max_draft_len)
    pols["adaedl"] = AdaEDL(lam=0.6, gamma=0.2, max_draft_len=max_draft_len, online=True)
    pols["max-confidence"] = MaxConfidence(threshold=0.4, max_draft_len=max_draft_len)
    if online_roc:
        # transformers' online ROC re-tuning: one sklearn roc_curve per round, slow on large data, so opt-in.
        pols["hf-confidence-roc"] = MaxConfidence(threshold=0.4, max_draft_len=max_draft_len, online_roc=True)
    pols["oracle"] = Oracle(threshold=0.5, max_draft_len=max_draft_len)
    pols["oracle-schedule"] = OracleSchedule(threshold=0.5, max_draft_len=max_draft_len)
    return pols


def default_grid(policy: StopPolicy, data: ReplayData, n: int = 15, scores: np.ndarray | None = None) -> list[float]:
    """Thresholds to sweep: quantiles of the policy's scores on the data, plus its own threshold."""
    if scores is None:
        scores = scores_for(policy, data, None)
    if scores is None or scores.size == 0:
        base = np.linspace(0.05, 0.95, n)
    else:
        flat = (scores[:, 0] if scores.ndim == 2 else scores).ravel()  # first drafted position for position scores
        base = np.quantile(flat[np.isfinite(flat)], np.linspace(0.02, 0.98, n))
    grid = sorted(set(np.round(np.append(base, policy.threshold), 6).tolist()))
    return [float(g) for g in grid]


def threshold_sweep(
    policy: StopPolicy,
    data: ReplayData,
    cost_model: CostModel,
    grid: Sequence[float] | None = None,
    mode: str = "greedy",
    max_draft_len: int | None = None,
    verify_all: bool = False,
) -> pd.DataFrame:
    """Replay ``policy`` at each threshold of ``grid`` (default :func:`default_grid`); one row per threshold
    (``verify_all``: see :func:`replay_policy`)."""
    scores = scores_for(policy, data, max_draft_len)
    grid = list(grid) if grid is not None else default_grid(policy, data, scores=scores)
    rows = []
    for thr in grid:
        p = with_threshold(policy, thr)
        r = replay_policy(p, data, cost_model, mode, max_draft_len=max_draft_len, scores=scores, verify_all=verify_all)
        rows.append({"threshold": float(thr), **r.as_row()})
    return pd.DataFrame(rows)


def tune_threshold(
    policy: StopPolicy,
    columns: Mapping[str, object],
    cost_model: CostModel,
    grid: Sequence[float] | None = None,
    *,
    split: str | None = "val",
    mode: str = "greedy",
    origins: tuple[str, ...] | None = ("target",),
) -> tuple[float, float]:
    """Threshold maximising predicted speedup on the ``split`` rows (DISCO tunes for latency, not F1).

    Args:
        policy: the policy to tune (not modified).
        columns: record columns; rows of ``split`` are used when a ``split`` column exists (pass split=None to use all).
        cost_model: round latency model.
        grid: thresholds to try (default: quantiles of the policy's scores).
        split: rows to tune on ('val'); mode: greedy or sampling verification; origins: sequences replayed (see
            :class:`ReplayConfig`; falls back to every sequence when none match).
    Returns:
        (best threshold, its predicted speedup). The policy is replayed with its threshold rule (SV's goodput length
        has no threshold to tune); an approximate policy (SPRINTER) as if every drafted token were verified, so the
        speed it is tuned for rewards stopping at the tokens the target would reject (taking its drafts unverified,
        the fastest threshold would never stop; its output's quality has no place in the objective).

    Example (what the main job does after training)::

        thr, sp = tune_threshold(policy, val_columns, CostModel.from_json(data_dir / "cost_model.json"))
        update_metadata(export_folder, threshold=thr, tuning={"split": "val", "speedup": sp})
    """
    if split is not None and "split" in columns and not np.any(np.asarray(columns["split"]).astype(str) == split):
        raise ValueError(f"tune_threshold: no rows in split {split!r}")
    cfg = ReplayConfig(mode=mode, origins=origins, split=split if "split" in columns else None)
    data = prepare_replay_data(columns, cfg)
    sweep = threshold_sweep(policy, data, cost_model, grid, mode, verify_all=True)
    best = sweep.loc[sweep["speedup"].idxmax()]
    return float(best["threshold"]), float(best["speedup"])


def replay_table(
    columns: Mapping[str, object],
    policies: Mapping[str, StopPolicy | None],
    cost_model: CostModel,
    cfg: ReplayConfig | None = None,
    *,
    static_lengths: Iterable[int] = range(1, 11),
    include_baselines: bool = True,
    sweep: bool = True,
    grid_size: int = 15,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Replay every policy (the given ones plus the baselines) at its own threshold, and sweep thresholds.

    Args:
        columns: record columns (numpy arrays / lists).
        policies: name -> policy (None: listed with the reason 'not loaded').
        cost_model: round latency model.
        cfg: sequence selection and verification mode.
        static_lengths: static draft lengths added as baselines (the best one is added as 'static-best').
        include_baselines: add :func:`default_replay_policies`.
        sweep: also replay each thresholded policy over a grid (the second frame).
    Returns:
        (table, sweep): one row per policy (policy, kind, threshold, ..., speedup, reason), and one row per
        (policy, threshold) of the sweep; ``table.attrs["round_tokens"]``: per goodput policy, the (expected, replayed)
        tokens of each round; ``table.attrs["results"]``: per replayed row (``static-best`` too), its
        :class:`ReplayResult` (the per-sequence tokens and seconds its speedup pools).
    """
    cfg = cfg or ReplayConfig()
    data = prepare_replay_data(columns, cfg)
    all_pols: dict[str, StopPolicy | None] = {}
    if include_baselines:
        all_pols.update(default_replay_policies(static_lengths, online_roc=cfg.online_roc_baseline))
    all_pols.update(policies)
    common = {
        "mode": cfg.mode,
        "sequences": data.note,
        "exact_accepts": data.exact,
        "cost_model": "assumed" if cost_model.assumed else "measured",
    }
    rows, sweeps = [], []
    results: dict[str, ReplayResult] = {}
    for name, pol in all_pols.items():
        base = {"policy": name, "kind": pol.kind if pol else "", "threshold": pol.threshold if pol else float("nan")}
        if pol is None:
            rows.append({**base, **common, "reason": "policy not loaded"})
            continue
        miss = missing_columns(pol, data.features)
        if miss:
            rows.append({**base, **common, "reason": f"missing columns {miss}"})
            continue
        p = copy.deepcopy(pol)
        try:
            r = replay_policy(p, data, cost_model, cfg.mode, max_draft_len=cfg.max_draft_len)
        except ValueError as e:  # a goodput policy without a map for this mode, a curve of one length
            rows.append({**base, **common, "reason": str(e)})
            continue
        results[name] = r
        # SV's rounds follow its goodput rule, SPRINTER's its approximate sequential verification
        rows.append({**base, **common, **r.as_row(), "verification": pol.verification, "reason": ""})
        if sweep and pol.tunable:
            sw = threshold_sweep(pol, data, cost_model, None, cfg.mode, cfg.max_draft_len)
            sw.insert(0, "policy", name)
            sweeps.append(sw)
    table = pd.DataFrame(rows)
    static = table[table["policy"].str.startswith("static-") & table.get("speedup", pd.Series(dtype=float)).notna()]
    if len(static):
        best = static.loc[static["speedup"].idxmax()].to_dict()
        results[f"static-best (k={best['policy'].removeprefix('static-')})"] = results[best["policy"]]
        best["policy"] = f"static-best (k={best['policy'].removeprefix('static-')})"
        table = pd.concat([table, pd.DataFrame([best])], ignore_index=True)
    if sweeps:
        sweep_df = pd.concat(sweeps, ignore_index=True)
    else:
        sweep_df = pd.DataFrame(columns=["policy", "threshold", "speedup"])
    table.attrs["round_tokens"] = {name: r.round_tokens for name, r in results.items() if r.round_tokens}
    table.attrs["results"] = results
    return table, sweep_df
