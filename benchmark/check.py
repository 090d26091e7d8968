"""Does the offline replay predict the engine? Every engine row's policy (and transformers' rule, under its own
curve) replayed on the labelled prompts under the run's curve, beside what the engine measured (:func:`run_check`)."""
from __future__ import annotations

import copy
import logging
import time
from typing import Any

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from benchmark.check_inputs import BenchFolder, rollout_length, row_policies
from benchmark.check_records import labelled_records, load_companion, own_output_rows
from benchmark.curve import HF_CURVE
from benchmark.rows import HF_METHOD
from compute.timing import CostModel
from data_gen.labelling import LabelModels, LabelOptions
from evaluation.replay import ReplayConfig, ReplayResult, prepare_replay_data, replay_policy
from predictors.base import StopPolicy
from predictors.baselines import ENTROPY_KINDS

log = logging.getLogger("pipelines.replay_check")


BAND = 0.10
"""The check's goal: the replay predicts the engine's tokens/s within 10%."""


ROW_KEYS = ("row", "spec", "measured_tokens_per_s", "predicted_tokens_per_s", "ratio", "measured_speedup",
            "predicted_speedup", "curve_tokens_per_s", "measured_mean_accepted", "predicted_mean_accepted",
            "measured_draft_ms", "curve_draft_ms", "measured_verify_ms", "curve_verify_ms", "unpriced_ms_per_token",
            "measured_mean_drafted", "predicted_mean_drafted", "measured_rounds", "predicted_rounds",
            "curve_vs_best_entropy", "note")
"""The fields of one row of the check (None where not measured or not replayed)."""


def run_check(folder: BenchFolder, draft: PreTrainedModel, target: PreTrainedModel,
              tokenizer: PreTrainedTokenizerBase, companion: PreTrainedModel | None = None, *,
              gen_batch_size: int = 8, label_batch_tokens: int = 4096) -> dict[str, Any]:
    """Label the folder's prompts, replay every engine row, compare; returns the ``replay_check`` section.

    ``companion`` (None: loaded from the benchmark's config when a row's policy reads it) joins the labelling only then.
    """
    t0 = time.perf_counter()
    policies = row_policies(folder, draft, tokenizer)
    ready = [p for _, p, _ in policies if p is not None]
    if not policies:
        raise ValueError(f"{folder.path / 'benchmark.json'} has no engine row to replay")
    needs_companion = any(p.needs_companion for p in ready)
    if needs_companion and companion is None:
        companion = load_companion(folder.models)
    cfg = folder.decoding
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    opts = LabelOptions(top_k=cfg.top_k_features, store_hidden=any("draft_hidden" in p.required_columns for p in ready),
                        temperature=cfg.temperature, top_p=cfg.top_p, pad_token_id=int(pad or 0))
    rollout_len = rollout_length(ready, cfg.max_draft_len)
    models = LabelModels(draft, target, companion if needs_companion else None)
    columns, rollouts = labelled_records(folder, models, opts, rollout_len, gen_batch_size, label_batch_tokens)
    own = own_output_rows(folder, policies, models, opts, gen_batch_size, label_batch_tokens)
    rows, note = replay_rows(folder, policies, columns, own)
    add_curve_ratios(rows, folder.rows)
    summary = summarize(rows)
    log.info(summary_line(summary))
    return {"mode": folder.mode, "rows": rows, "summary": summary, "data": note, "records": len(columns["offset"]),
            "rollouts": rollouts, "rollout_len": rollout_len,
            "cost_model": str(folder.cost_model_file or folder.path / "cost_model.json"),
            "hf_cost_model": str(folder.path / HF_CURVE) if folder.hf_cost_model is not None else None,
            "statistic": folder.cost_model.extra.get("statistic", "min"),
            "seconds": round(time.perf_counter() - t0, 1)}


def replay_rows(folder: BenchFolder, policies: list[tuple[dict[str, Any], StopPolicy | None, str]],
                columns: dict[str, np.ndarray], own: dict[str, dict[str, np.ndarray]] | None = None
                ) -> tuple[list[dict[str, Any]], str]:
    """Every engine row replayed on the labelled prompts under the benchmark's curve, each transformers row under
    transformers' (its rounds capped by its own rule only); returns (rows, data note).

    ``own``: row name -> records along that row's own output (:func:`own_output_rows`), replayed instead."""
    cfg = folder.decoding
    rc = ReplayConfig(mode=folder.mode, origins=("target",), branch_rollouts=folder.mode == "greedy",
                      max_new_tokens=cfg.max_new_tokens, fallback_to_all=False)
    data = prepare_replay_data(columns, rc)
    out = []
    for row, pol, note in policies:
        res = None
        hf = row.get("method") == HF_METHOD  # transformers' rule under transformers' curve, its rounds uncapped
        cm = folder.hf_cost_model if hf and folder.hf_cost_model is not None else folder.cost_model
        if pol is not None:
            try:
                rows_data = data if row["row"] not in (own or {}) else prepare_replay_data(own[row["row"]], rc)
                res = replay_policy(copy.deepcopy(pol), rows_data, cm, folder.mode,
                                    max_draft_len=None if hf else cfg.max_draft_len,
                                    decision_cost_model=None if hf else folder.decision_cost_model)
            except (ValueError, KeyError) as e:  # a goodput policy without a map for the mode, missing columns
                note = f"not replayed: {e}"
        out.append(compare_row(row, res, note, cm))
    return out, data.note


def curve_pass_seconds(row: dict[str, Any], cost_model: CostModel) -> float:
    """The curve's mean seconds over the row's own verification passes: t(L) averaged over the lengths it verified
    (``verify_lengths``), not t at their mean length, which a curve with a step would under-price."""
    hist = row["verify_lengths"]
    n = sum(hist.values())
    return sum(c * cost_model.target_time(int(L)) for L, c in hist.items()) / n


def compare_row(row: dict[str, Any], res: ReplayResult | None, note: str,
                cost_model: CostModel | None = None) -> dict[str, Any]:
    """One row of the check: the engine's measured figures beside the replay's (``res`` None: not replayed), and the
    step costs the engine realised beside the curve's (draft step; verification pass over the row's own lengths),
    with the engine's decoding time outside those forwards (``unpriced_ms_per_token``, which the curve leaves out):
    with the replay following the engine's rounds, a miss is the forwards' realised cost or that time."""
    rounds = row.get("rounds") or 0
    out: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    out.update(row=row["row"], spec=row.get("spec"), measured_tokens_per_s=row.get("tokens_per_s"),
               measured_speedup=row.get("speedup"), measured_rounds=rounds or None, note=note,
               unpriced_ms_per_token=row.get("unpriced_ms_per_token"),
               measured_mean_accepted=round(row["accepted"] / rounds, 3) if rounds else None,
               measured_mean_drafted=round(row["draft_tokens"] / rounds, 3) if rounds else None)
    if cost_model is not None and row.get("draft_ms_per_step"):
        out.update(measured_draft_ms=row["draft_ms_per_step"],
                   curve_draft_ms=round(1000 * cost_model.draft_s_per_token, 2))
    if cost_model is not None and row.get("verify_ms_per_pass") and row.get("verify_mean_tokens"):
        out.update(measured_verify_ms=row["verify_ms_per_pass"],
                   curve_verify_ms=round(1000 * curve_pass_seconds(row, cost_model), 2))
    if res is None or not res.time_s > 0:
        return out
    hf = row.get("method") == HF_METHOD  # transformers verifies the first drafts in the prompt's pass, and its draft's
    # first step reads the prompt: both inside the row's measured prefill (the target's and the draft's prompt passes)
    merged = res.first_verify_s if row.get("prompt_passes") or hf else 0.0  # verified inside the measured prefill
    if hf and cost_model is not None:
        merged += len(row.get("prefill_seconds") or []) * cost_model.draft_s_per_token
    predicted = predicted_tokens_per_s(row, (res.time_s - merged) / res.tokens)
    measured = row.get("tokens_per_s") or 0.0
    out.update(predicted_tokens_per_s=round(predicted, 3), predicted_speedup=round(res.speedup, 4),
               ratio=round(predicted / measured, 4) if measured > 0 else None,
               curve_tokens_per_s=round(res.tokens / res.time_s, 3), predicted_rounds=res.rounds,
               predicted_mean_accepted=round(res.mean_accepted, 3),
               predicted_mean_drafted=round(res.drafted_per_round, 3))
    return out


def predicted_tokens_per_s(row: dict[str, Any], curve_s_per_token: float) -> float:
    """The engine row's tokens/s as the replay predicts it: the row's tokens at the replay's seconds per token under
    the curve (its rounds' draft steps and verification passes; the caller leaves out each prompt's first
    verification pass, which the engine runs inside the target's pass over the prompt), plus the row's own measured
    prefill (draft cache filled with the prompt, the target's pass over it: not in the curve). Rows that time no
    prefill apart (transformers'): the replay's own tokens/s.

    Not anchored on target-only's measured time (that time over the replayed speedup): target-only is timed through
    ``generate`` and bracketed (runs before and after the others, at their fastest pass's pace), so its per-token
    time sits below the curve's one-token step while the engine's draft steps and verification passes match the
    curve, and every prediction would come out too high by that gap."""
    pre_row, tokens = row.get("prefill_seconds"), row.get("tokens")
    if not pre_row or not tokens:
        return 1.0 / curve_s_per_token
    return float(tokens) / (float(tokens) * curve_s_per_token + sum(pre_row))


def add_curve_ratios(rows: list[dict[str, Any]], bench_rows: list[dict[str, Any]]) -> None:
    """Each replayed row's ``curve_vs_best_entropy``: its tokens/s under the curve over the best entropy bound's
    (SVIP, AdaEDL rows, the best by the same measure). Greedy decoding is deterministic, so a row's rounds, drafted and
    accepted tokens are the same in every run; the curve prices them alike for every row, where the measured ratios
    also carry the host's speed at the moment each row ran (so they move from run to run where the curve-priced ones
    stay put). It leaves out the stop decisions' own time (the benchmark's ``stop_overhead`` column)."""
    kinds = {r["row"]: r.get("kind") for r in bench_rows}
    entropy = [r for r in rows if kinds.get(r["row"]) in ENTROPY_KINDS and r["curve_tokens_per_s"]]
    if not entropy:
        return
    best = max(r["curve_tokens_per_s"] for r in entropy)
    for r in rows:
        if r["curve_tokens_per_s"]:
            r["curve_vs_best_entropy"] = round(r["curve_tokens_per_s"] / best, 4)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst |predicted / measured - 1| over all rows and over the rows the replay follows exactly (no note), how
    many rows fall within the band, and the row with the highest curve-priced ratio to the best entropy bound (not the
    oracle)."""
    scored = [r for r in rows if r["ratio"] is not None]

    def worst(rs: list[dict[str, Any]]) -> tuple[str | None, float | None]:
        if not rs:
            return None, None
        w = max(rs, key=lambda r: abs(r["ratio"] - 1))
        return w["row"], round(abs(w["ratio"] - 1), 4)

    row, err = worst(scored)
    exact_row, exact_err = worst([r for r in scored if not r["note"]])
    ranked = [r for r in rows if r.get("curve_vs_best_entropy") is not None and r["spec"] != "oracle"]
    top = max(ranked, key=lambda r: r["curve_vs_best_entropy"]) if ranked else None
    return {"worst_row": row, "worst_error": err, "worst_exact_row": exact_row, "worst_exact_error": exact_err,
            "within_band": sum(abs(r["ratio"] - 1) <= BAND for r in scored), "rows_scored": len(scored),
            "band": BAND, "best_curve_row": top["row"] if top else None,
            "best_curve_vs_best_entropy": top["curve_vs_best_entropy"] if top else None}


def summary_line(summary: dict[str, Any]) -> str:
    """One line: the worst |predicted / measured - 1| and its row (also among the rows the replay follows exactly)."""
    if summary["worst_row"] is None:
        return "replay check: no engine row replayed"
    line = (f"replay check: worst |predicted/measured - 1| = {summary['worst_error']:.3f} ({summary['worst_row']})")
    if summary["worst_exact_row"] is not None and summary["worst_exact_row"] != summary["worst_row"]:
        line += (f"; among rows the replay follows exactly {summary['worst_exact_error']:.3f} "
                 f"({summary['worst_exact_row']})")
    line += f"; {summary['within_band']} of {summary['rows_scored']} rows within {summary['band']:.0%}"
    if summary.get("best_curve_row"):
        line += (f"; under the curve the best row against the best entropy bound: {summary['best_curve_row']} "
                 f"{summary['best_curve_vs_best_entropy']:.3f}x")
    return line
