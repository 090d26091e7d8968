"""Does the offline replay predict the engine? The benchmark's prompts labelled with the data generator's code, every
engine row's policy replayed under the benchmark's measured curve, predicted against measured tokens/s.

Labelling (``data_gen.generate.label_continuation``, the generator's labelling passes and rollouts): along the
target-only output the benchmark produced for each prompt (no extra target decoding), records of origin ``target``
teacher-forced, plus, in greedy mode, the draft's own rollout from every prefix where the drafted token fails greedy
match and from the end of the output, as long as the longest draft a benchmarked policy can make. An approximate row
(SPRINTER, greedy) is labelled along its own output, which the benchmark keeps (:func:`own_output_rows`).

Replay (``evaluation.replay``): every engine row's policy (static, tuned baselines, learned exports, ``goodput:`` rows;
not target-only, the transformers rows or the eager reference), rebuilt from the spec and threshold the benchmark
recorded, is replayed on those records under the benchmark's curve (``cost_model_rows.json``, pooled from probes
between its prompts, else ``cost_model.json``, measured before its rows), in its decoding mode, with its
``max_draft_len`` and ``max_new_tokens`` (``ReplayConfig.branch_rollouts``: past a round's first mismatch the round
reads the draft's rollout, as the engine's draft does). In greedy mode on an exact compute path the replay follows the
engine's own trajectory (same rounds, drafted and accepted tokens), so what remains between predicted and measured
tokens/s is the cost curve and what it leaves out (stop decisions, the decoder's own overhead).

Per engine row: predicted tokens/s = the row's tokens over (those tokens at the replay's seconds per token under the
curve + the row's measured prefill; older reports without prefill times: the replay's own tokens/s);
measured tokens/s; predicted / measured; predicted and measured mean accepted and mean drafted tokens per round and
rounds (a miss in acceptance or in drafting is the trajectory's, the rest is the curve's); ``curve_tokens_per_s``, the
replay's own tokens/s under the curve. Written to ``benchmark.json`` (``replay_check``), a section of
``benchmark.md`` and ``replay_check.png`` (predicted against measured, identity line and +-10% band); logged to
MLflow. The labelling logs one line per prompt with an ETA, the check one summary line (worst |predicted / measured -
1| and its row).

Usage:
    python -m pipelines.replay_check --bench_dir outputs/benchmark     # on a finished benchmark's folder
    python -m pipelines.benchmark --config configs/benchmark.yaml      # runs it at the end (replay_check: true)
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import json
import logging
import textwrap
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.timing import STATISTICS, CostModel
from data_gen.labelling import LabelModels, LabelOptions
from pipelines.benchmark import CURVE_DURING_ROWS, ENTROPY_KINDS, BenchmarkConfig, metric_key
from predictors.base import HINDSIGHT, StopPolicy

if TYPE_CHECKING:
    from evaluation.replay import ReplayResult

log = logging.getLogger(__name__)

BAND = 0.10
"""Issue 14's goal: the replay predicts the engine's tokens/s within 10%."""
SECTION = "## Replay check"
"""The heading of the check's section in benchmark.md (replaced when the check runs again)."""
PLOT = "replay_check.png"
ROW_KEYS = ("row", "spec", "measured_tokens_per_s", "predicted_tokens_per_s", "ratio", "measured_speedup",
            "predicted_speedup", "curve_tokens_per_s", "measured_mean_accepted", "predicted_mean_accepted",
            "measured_draft_ms", "curve_draft_ms", "measured_verify_ms", "curve_verify_ms",
            "measured_mean_drafted", "predicted_mean_drafted", "measured_rounds", "predicted_rounds",
            "curve_vs_best_entropy", "note")
"""The fields of one row of the check (None where not measured or not replayed)."""


@dataclass
class ReplayCheckConfig:
    """Everything ``python -m pipelines.replay_check`` does."""

    bench_dir: str = "outputs/benchmark"
    """A finished benchmark's out_dir: benchmark.json, config.yaml and cost_model.json."""
    gen_batch_size: int = 8
    """Draft rollouts generated per batch."""
    label_batch_tokens: int = 4096
    """Memory budget of one labelling pass: padded tokens (batch x longest) per forward."""
    statistic: str | None = None
    """min, median or mean: summarise the benchmark's curve from its raw timings by this statistic (None: as written;
    min is the uncontended cost, median what a step typically costs on a shared machine, mean what it costs on average,
    the expectation of a row's total time; the curve probed during the rows is pooled by the mean)."""
    tracking: bool = True
    """Log the check to MLflow (one run in the benchmark's experiment)."""
    tracking_uri: str | None = None
    """MLflow tracking URI (default: the benchmark's, else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)."""

    def __post_init__(self) -> None:
        if self.statistic is not None and self.statistic not in STATISTICS:
            raise ValueError(f"--statistic {self.statistic!r}: use {', '.join(STATISTICS)} (or leave it unset)")
        if self.gen_batch_size < 1 or self.label_batch_tokens < 1:
            raise ValueError(f"gen_batch_size={self.gen_batch_size} and label_batch_tokens={self.label_batch_tokens} "
                             "must be >= 1")


@dataclass
class BenchFolder:
    """What the check reads from a finished benchmark's folder."""

    path: Path
    cfg: BenchmarkConfig
    rows: list[dict[str, Any]]
    """benchmark.json's rows."""
    names: list[str]
    """Prompt ids."""
    prompts: list[list[int]]
    """Prompt token ids, as the benchmark decoded them."""
    continuations: list[list[int]]
    """target-only's output per prompt."""
    cost_model: CostModel
    """The curve the check prices with: the benchmark's probes between its prompts pooled (``cost_model_rows.json``)
    where it took them, else the curve it measured before the rows (``cost_model.json``)."""
    cost_model_file: Path | None = None
    """The file ``cost_model`` was read from."""
    decision_cost_model: CostModel | None = None
    """The curve the benchmark's cost-aware policies decided with (``cost_model.json``; None: ``cost_model``)."""

    @property
    def base(self) -> dict[str, Any]:
        """The target-only row."""
        return next(r for r in self.rows if r.get("row") == "target-only")

    @property
    def mode(self) -> str:
        return "greedy" if self.cfg.temperature == 0 else "sampling"


# ----------------------------------------------------------------------------------------------------------- inputs
def read_bench_folder(path: str | Path, cfg: BenchmarkConfig | None = None) -> BenchFolder:
    """A finished benchmark's folder (``cfg``: its config when the caller holds it, else read from config.yaml);
    a missing file, or a benchmark.json without target-only's row or its output ids, is named in the error."""
    path = Path(path)
    if not path.is_dir():
        raise NotADirectoryError(f"--bench_dir {path}: no such folder; run the benchmark first (python -m "
                                 f"pipelines.benchmark --config configs/benchmark.yaml writes outputs/benchmark)")
    report = _read_json(path / "benchmark.json")
    rows = report.get("rows") or []
    base = next((r for r in rows if r.get("row") == "target-only"), None)
    if base is None:
        raise ValueError(f"{path / 'benchmark.json'} has no 'target-only' row: the replay check labels target-only's "
                         f"output (the prompts it replays); rerun the benchmark")
    if "output_ids" not in base or "prompt_ids" not in report:
        raise ValueError(f"{path / 'benchmark.json'}: the 'target-only' row has no output_ids (written before the "
                         f"replay check existed); rerun python -m pipelines.benchmark --config {path / 'config.yaml'}")
    before = path / "cost_model.json"
    if not before.is_file():
        raise FileNotFoundError(f"{before}: no such file (the benchmark writes the curve it measured there)")
    during = path / CURVE_DURING_ROWS  # missing for a benchmark without probes between its prompts
    decided = CostModel.from_json(before)
    cm_file, cm = (during, CostModel.from_json(during)) if during.is_file() else (before, decided)
    return BenchFolder(path, cfg or _read_config(path / "config.yaml"), rows, list(report.get("prompts") or []),
                       report["prompt_ids"], base["output_ids"], cm, cm_file, decided)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; run the benchmark into {path.parent} first (python -m "
                                f"pipelines.benchmark --config configs/benchmark.yaml --out_dir {path.parent})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _read_config(path: Path) -> BenchmarkConfig:
    """The benchmark's resolved config (its cost_file is not needed: the folder holds the curve)."""
    from pipelines.cli import parse_config

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (the benchmark writes its resolved config there)")
    return parse_config(BenchmarkConfig, ["--config", str(path), "--cost_file", "null"], "")


def row_policies(folder: BenchFolder, draft: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
                 ) -> list[tuple[dict[str, Any], StopPolicy | None, str]]:
    """(row, policy or None, note) for every engine row: its policy rebuilt from the recorded spec and threshold."""
    from decoding.policies import build_policy
    from evaluation.replay import with_threshold

    cfg = folder.cfg
    out: list[tuple[dict[str, Any], StopPolicy | None, str]] = []
    for r in (r for r in folder.rows if r.get("method") == "engine"):
        if not r.get("spec"):
            out.append((r, None, "no policy spec in benchmark.json"))
            continue
        try:
            pol = build_policy(r["spec"], draft=draft, draft_tokenizer=tokenizer, max_draft_len=cfg.max_draft_len,
                               force=cfg.force)
        except (ValueError, KeyError, FileNotFoundError) as e:
            out.append((r, None, f"policy not rebuilt: {e}"))
            continue
        if r.get("threshold") is not None:
            pol = with_threshold(pol, float(r["threshold"]))
        if pol.verification == HINDSIGHT:  # the oracle's rounds as the engine runs them
            pol.drafts_failing_token = True
        out.append((r, pol, row_note(pol, cfg, own_output=bool(r.get("output_ids")))))
    return out


def row_note(policy: StopPolicy, cfg: BenchmarkConfig, own_output: bool = False) -> str:
    """Why the replay cannot follow the engine's trajectory for this row ('' when it can). ``own_output``: the row
    recorded its output (an approximate policy's in greedy decoding, replayed along it: :func:`own_output_rows`)."""
    notes = []
    if policy.verification == HINDSIGHT and cfg.temperature > 0:
        notes.append("sampling oracle: the replay drafts the expected acceptable run, the engine's time is estimated")
    elif not policy.exact and not (own_output and cfg.temperature == 0):
        notes.append("approximate policy: rounds checked at their last token as the engine checks them, along "
                     "target-only's output, which the engine leaves at a mismatch it takes unverified")
    if cfg.batch_size > 1:
        notes.append("engine batched: the replay runs one sequence a round")
    if cfg.temperature > 0:
        notes.append("sampling: expected acceptance along target-only's sampled output")
    return "; ".join(notes)


def rollout_length(policies: list[StopPolicy], max_draft_len: int) -> int:
    """The longest draft a policy can make in the engine (``max_draft_len`` caps every round)."""
    caps = [p.round_cap(max_draft_len) if type(p).update is StopPolicy.update else min(p.max_draft_len, max_draft_len)
            for p in policies]
    return max(caps, default=max_draft_len) or 1


# ----------------------------------------------------------------------------------------------------------- labelling
def label_prompts(folder: BenchFolder, models: LabelModels, opts: LabelOptions, rollout_len: int,
                  gen_batch_size: int = 8, label_batch_tokens: int = 4096, outputs: list[list[int]] | None = None,
                  what: str = "target-only's output") -> tuple[dict[str, np.ndarray], int]:
    """Records along each prompt's target-only output (``outputs``: another row's, labelled without rollouts) and the
    draft's rollouts from its branch points (greedy mode), logging each prompt with an ETA; returns (columns,
    rollouts)."""
    from data_gen.generate import label_continuation

    branches = outputs is None and folder.mode == "greedy"
    outputs = folder.continuations if outputs is None else outputs
    todo = [(i, ids, c) for i, (ids, c) in enumerate(zip(folder.prompts, outputs)) if c]
    total, done_tokens, rollouts = sum(len(c) for _, _, c in todo), 0, 0
    gen = torch.Generator().manual_seed(folder.cfg.seed)
    parts: list[dict[str, list]] = []
    t0 = time.perf_counter()
    for k, (i, ids, cont) in enumerate(todo):
        name = folder.names[i] if i < len(folder.names) else str(i)
        recs, st = label_continuation(models, ids, cont, opts, sample_id=f"{i}:{name}", rollout_len=rollout_len,
                                      branches=branches, source="benchmark",
                                      gen_batch_size=gen_batch_size, label_batch_tokens=label_batch_tokens,
                                      generator=gen)
        parts.append(recs)
        done_tokens += len(cont)
        rollouts += st.rollouts
        spent = time.perf_counter() - t0
        log.info("replay check: labelled prompt %d/%d along %s (%d positions, %d draft rollouts, %d records) in "
                 "%.0fs; ETA %.0fs", k + 1, len(todo), what, len(cont), st.rollouts, st.records, spent,
                 spent / done_tokens * (total - done_tokens))
    if not parts:
        raise ValueError(f"{folder.path / 'benchmark.json'}: {what} is empty for every prompt: nothing to replay")
    columns = {k: np.asarray(list(itertools.chain.from_iterable(p[k] for p in parts))) for k in parts[0]}
    return columns, rollouts


# ----------------------------------------------------------------------------------------------------------- replay
def replay_rows(folder: BenchFolder, policies: list[tuple[dict[str, Any], StopPolicy | None, str]],
                columns: dict[str, np.ndarray], own: dict[str, dict[str, np.ndarray]] | None = None
                ) -> tuple[list[dict[str, Any]], str]:
    """Every engine row replayed on the labelled prompts under the benchmark's curve; returns (rows, data note).

    ``own``: row name -> records along that row's own output (:func:`own_output_rows`), replayed instead."""
    from evaluation.replay import ReplayConfig, prepare_replay_data, replay_policy

    cfg = folder.cfg
    rc = ReplayConfig(mode=folder.mode, origins=("target",), branch_rollouts=folder.mode == "greedy",
                      max_new_tokens=cfg.max_new_tokens, fallback_to_all=False)
    data = prepare_replay_data(columns, rc)
    out = []
    for row, pol, note in policies:
        res = None
        if pol is not None:
            try:
                rows_data = data if row["row"] not in (own or {}) else prepare_replay_data(own[row["row"]], rc)
                res = replay_policy(copy.deepcopy(pol), rows_data, folder.cost_model, folder.mode,
                                    max_draft_len=cfg.max_draft_len, decision_cost_model=folder.decision_cost_model)
            except (ValueError, KeyError) as e:  # a goodput policy without a map for the mode, missing columns
                note = f"not replayed: {e}"
        out.append(compare_row(row, res, note, folder.cost_model))
    return out, data.note


def curve_pass_seconds(row: dict[str, Any], cost_model: CostModel) -> float:
    """The curve's mean seconds over the row's own verification passes: t(L) averaged over the lengths it verified
    (``verify_lengths``), not t at their mean length, which a curve with a step (t(17) about twice t(16)) would
    under-price for a row whose lengths vary; rows written before the lengths were kept: t(mean length)."""
    hist = row.get("verify_lengths")
    if not hist:
        return cost_model.target_time(row["verify_mean_tokens"])
    n = sum(hist.values())
    return sum(c * cost_model.target_time(int(L)) for L, c in hist.items()) / n


def compare_row(row: dict[str, Any], res: ReplayResult | None, note: str,
                cost_model: CostModel | None = None) -> dict[str, Any]:
    """One row of the check: the engine's measured figures beside the replay's (``res`` None: not replayed), and the
    step costs the engine realised beside the curve's (draft step; verification pass over the row's own lengths)."""
    rounds = row.get("rounds") or 0
    out: dict[str, Any] = dict.fromkeys(ROW_KEYS)
    out.update(row=row["row"], spec=row.get("spec"), measured_tokens_per_s=row.get("tokens_per_s"),
               measured_speedup=row.get("speedup"), measured_rounds=rounds or None, note=note,
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
    merged = res.first_verify_s if row.get("prompt_passes") else 0.0  # verified inside the measured prefill
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
    prefill (draft cache filled with the prompt, the target's pass over it: not in the curve). Reports without prefill
    times: the replay's own tokens/s.

    Not anchored on target-only's measured time (the check before the tenth session divided it by the replayed
    speedup): target-only is timed through ``generate`` and bracketed (the faster of two runs per prompt), so its
    per-token time sat 10-20% below the curve's one-token step while the engine's draft steps and verification passes
    matched the curve (benchmark of 2026-11-24, ninth session): every prediction came out that much too high."""
    pre_row, tokens = row.get("prefill_seconds"), row.get("tokens")
    if not pre_row or not tokens:
        return 1.0 / curve_s_per_token
    return float(tokens) / (float(tokens) * curve_s_per_token + sum(pre_row))


def add_curve_ratios(rows: list[dict[str, Any]], bench_rows: list[dict[str, Any]]) -> None:
    """Each replayed row's ``curve_vs_best_entropy``: its tokens/s under the curve over the best entropy bound's
    (SVIP, AdaEDL rows, the best by the same measure). Greedy decoding is deterministic, so a row's rounds, drafted and
    accepted tokens are the same in every run; the curve prices them alike for every row, where the measured ratios
    also carry the host's speed at the moment each row ran (DISCO against the best entropy bound measured 1.045x,
    1.10x and 1.00x in three runs of the tenth session, 1.033x, 1.041x and 1.035x under their curves). It leaves out
    the stop decisions' own time (the benchmark's ``stop_overhead`` column)."""
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
        companion = _load_companion(folder.cfg)
    cfg = folder.cfg
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
            "statistic": folder.cost_model.extra.get("statistic", "min"),
            "seconds": round(time.perf_counter() - t0, 1)}


RECORDS = "replay_check_records.npz"
"""The labelled records of a check, kept in the benchmark's folder: a second check (another statistic) reuses them."""


def own_output_rows(folder: BenchFolder, policies: list[tuple[dict[str, Any], StopPolicy | None, str]],
                    models: LabelModels, opts: LabelOptions, gen_batch_size: int = 8, label_batch_tokens: int = 4096
                    ) -> dict[str, dict[str, np.ndarray]]:
    """Row name -> records along that row's own output, for the approximate rows (``SEQUENTIAL``, SPRINTER) of a
    greedy benchmark: the engine takes a round's drafts unverified, so its output leaves target-only's at the first
    mismatch it takes, and every round it drafts reads a prefix of its own output: the drafted tokens are that output's
    tokens, and a round's checked last token is the output's token there (the bonus) or the draft's, replaced by the
    target's (the correction). Labelled teacher-forced along the output (no rollouts), the replay follows the engine's
    rounds exactly. Cached in the folder like the main records."""
    if folder.mode != "greedy":
        return {}
    out: dict[str, dict[str, np.ndarray]] = {}
    for row, pol, _ in policies:
        outputs = row.get("output_ids")
        if pol is None or pol.exact or not outputs:
            continue
        out[row["row"]] = labelled_records(folder, models, opts, 0, gen_batch_size, label_batch_tokens, outputs,
                                           f"{row['row']}'s output",
                                           f"replay_check_records-{_slug(row['row'])}.npz")[0]
    return out


def labelled_records(folder: BenchFolder, models: LabelModels, opts: LabelOptions, rollout_len: int,
                     gen_batch_size: int = 8, label_batch_tokens: int = 4096, outputs: list[list[int]] | None = None,
                     what: str = "target-only's output", name: str = RECORDS) -> tuple[dict[str, np.ndarray], int]:
    """(columns, rollouts) of :func:`label_prompts` along target-only's output (``outputs``: another row's, named
    ``what`` in the log), read from the folder's file ``name`` when it holds them for the same inputs, else labelled
    and stored there."""
    cached = _cached_records(folder, opts, rollout_len, models, name, outputs)
    if cached is not None:
        return cached
    columns, rollouts = label_prompts(folder, models, opts, rollout_len, gen_batch_size, label_batch_tokens, outputs,
                                      what)
    _store_records(folder, opts, rollout_len, models, columns, rollouts, name, outputs)
    return columns, rollouts


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def _records_key(folder: BenchFolder, opts: LabelOptions, rollout_len: int, models: LabelModels,
                 outputs: list[list[int]] | None = None) -> str:
    """What the labelled records depend on: the prompts, the outputs labelled (target-only's), the options and the
    models."""
    names = [str(getattr(m.config, "name_or_path", "")) for m in (models.draft, models.target, models.companion)
             if m is not None]
    blob = json.dumps([folder.prompts, folder.continuations if outputs is None else outputs, rollout_len, repr(opts),
                       names], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _cached_records(folder: BenchFolder, opts: LabelOptions, rollout_len: int, models: LabelModels,
                    name: str = RECORDS, outputs: list[list[int]] | None = None
                    ) -> tuple[dict[str, np.ndarray], int] | None:
    path = folder.path / name
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        if str(z["_key"]) != _records_key(folder, opts, rollout_len, models, outputs):
            return None
        log.info("replay check: reusing the labelled records in %s", path)
        return {k: z[k] for k in z.files if not k.startswith("_")}, int(z["_rollouts"])


def _store_records(folder: BenchFolder, opts: LabelOptions, rollout_len: int, models: LabelModels,
                   columns: dict[str, np.ndarray], rollouts: int, name: str = RECORDS,
                   outputs: list[list[int]] | None = None) -> None:
    arrays = {k: (v.astype(str) if v.dtype == object else v) for k, v in columns.items()}  # strings without pickle
    tmp = folder.path / (name + ".tmp.npz")
    np.savez(tmp, _key=_records_key(folder, opts, rollout_len, models, outputs), _rollouts=rollouts, **arrays)
    tmp.replace(folder.path / name)  # nothing half-written


def _load_companion(cfg: BenchmarkConfig) -> PreTrainedModel | None:
    from compute.models import load_model

    if not cfg.models.companion:
        return None  # the engine refused such rows too: they are reported as not replayed
    return load_model(cfg.models.spec(cfg.models.companion, "companion"))[0]


# ----------------------------------------------------------------------------------------------------------- report
def _fmt(v: Any, digits: int = 3) -> str:
    return "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else str(v))


def markdown_section(result: dict[str, Any]) -> str:
    """The check's section of benchmark.md: what was replayed, one table row per engine row, the summary line."""
    s = result["summary"]
    lines = [
        SECTION, "",
        f"Every engine row's policy replayed offline ({result['mode']}) on the benchmark's prompts, labelled along "
        f"target-only's output (an approximate row along its own) with the draft's rollouts ({result['rollouts']} "
        f"rollouts of {result['rollout_len']} "
        f"tokens, {result['records']} records; {result['data']}), under this run's curve ({result['cost_model']}). "
        "predicted tokens/s = tokens / (tokens x the replay's seconds per token under the curve + the row's measured "
        "prefill); accepted / drafted = draft tokens "
        "per round, measured / predicted; curve tok/s = the replay's own tokens/s under the curve (no prefill or "
        "overhead); vs entropy (curve) = curve tok/s over the best entropy bound's, the same rounds priced alike "
        "(greedy rounds do not change from run to run; measured ratios also carry the host's speed when each row "
        f"ran). Goal: predicted / measured within 1 +- {s['band']:.2f}.", "",
        "| row | measured tok/s | predicted tok/s | predicted / measured | accepted | drafted | rounds | "
        "curve tok/s | vs entropy (curve) | draft step ms, engine / curve | verification ms, engine / curve | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        pair = [f"{_fmt(r[f'measured_{k}'])} / {_fmt(r[f'predicted_{k}'])}"
                for k in ("mean_accepted", "mean_drafted", "rounds")]
        steps = [f"{_fmt(r.get(f'measured_{k}_ms'), 1)} / {_fmt(r.get(f'curve_{k}_ms'), 1)}"
                 if r.get(f"measured_{k}_ms") else "" for k in ("draft", "verify")]
        lines.append(f"| {r['row']} | {_fmt(r['measured_tokens_per_s'])} | {_fmt(r['predicted_tokens_per_s'])} | "
                     f"{_fmt(r['ratio'])} | {' | '.join(pair)} | {_fmt(r['curve_tokens_per_s'])} | "
                     f"{_fmt(r.get('curve_vs_best_entropy'))} | {' | '.join(steps)} | {r['note']} |")
    return "\n".join([*lines, "", summary_line(s) + ".", "", f"![predicted against measured]({PLOT})", ""])


def console_table(result: dict[str, Any], width: int = 100) -> str:
    """The check in aligned columns within ``width`` characters (row names cut with ``~``); notes are in
    benchmark.md."""
    head = ["row", "measured", "predicted", "ratio", "accepted m/p", "drafted m/p"]
    cells = [head] + [[r["row"], _fmt(r["measured_tokens_per_s"]), _fmt(r["predicted_tokens_per_s"]),
                       _fmt(r["ratio"]) + ("*" if r["note"] else ""),
                       f"{_fmt(r['measured_mean_accepted'], 2)}/{_fmt(r['predicted_mean_accepted'], 2)}",
                       f"{_fmt(r['measured_mean_drafted'], 2)}/{_fmt(r['predicted_mean_drafted'], 2)}"]
                      for r in result["rows"]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    widths[0] = max(12, min(widths[0], width - sum(w + 2 for w in widths[1:])))

    def cell(v: str, i: int) -> str:
        v = v if len(v) <= widths[i] else v[: widths[i] - 1] + "~"
        return v.ljust(widths[i]) if i == 0 else v.rjust(widths[i])

    lines = ["  ".join(cell(v, i) for i, v in enumerate(c)).rstrip()[:width] for c in cells]
    lines.insert(1, "-" * max(len(x) for x in lines))
    return "\n".join([*lines, "(* the replay cannot follow the engine for this row: see the note in benchmark.md)"])


def plot_check(result: dict[str, Any], path: Path) -> None:
    """Predicted against measured tokens/s per engine row, the identity line and the +-10% band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [r for r in result["rows"] if r["ratio"] is not None]
    band = result["summary"]["band"]
    top = 1.1 * max([r["measured_tokens_per_s"] for r in pts] + [r["predicted_tokens_per_s"] for r in pts] + [1e-9])
    fig, ax = plt.subplots(figsize=(6.5, 6))
    ax.fill_between([0, top], [0, (1 - band) * top], [0, (1 + band) * top], color="tab:green", alpha=0.15,
                    label=f"within {band:.0%}")
    ax.plot([0, top], [0, top], color="black", lw=0.8, label="identity")
    for r in pts:
        inside = abs(r["ratio"] - 1) <= band
        ax.scatter(r["measured_tokens_per_s"], r["predicted_tokens_per_s"], color="tab:blue" if inside else "tab:red",
                   marker="o" if not r["note"] else "x", zorder=3)
        ax.annotate(r["row"], (r["measured_tokens_per_s"], r["predicted_tokens_per_s"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured tokens/s (engine)")
    ax.set_ylabel("predicted tokens/s (replayed speedup x target-only)")
    ax.set_title("replay check (x: the replay cannot follow the engine)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_check(result: dict[str, Any], bench_dir: str | Path) -> None:
    """Add the check to benchmark.json (``replay_check``) and benchmark.md (its section, replaced on a rerun) and
    write replay_check.png."""
    bench_dir = Path(bench_dir)
    report = _read_json(bench_dir / "benchmark.json")
    report["replay_check"] = result
    (bench_dir / "benchmark.json").write_text(json.dumps(report, indent=2))
    md_path = bench_dir / "benchmark.md"
    md = md_path.read_text() if md_path.is_file() else ""
    md = md.split(f"\n{SECTION}\n")[0].rstrip("\n")
    md_path.write_text(f"{md}\n\n{markdown_section(result)}")
    plot_check(result, bench_dir / PLOT)


def check_metrics(result: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics of the check: per row the ratio and the predicted tokens/s, and the worst error."""
    out: dict[str, float] = {}
    for r in result["rows"]:
        if r["ratio"] is not None:
            out[f"{metric_key(r['row'])}/replay_ratio"] = float(r["ratio"])
            out[f"{metric_key(r['row'])}/replay_predicted_tokens_per_s"] = float(r["predicted_tokens_per_s"])
        if r.get("curve_vs_best_entropy") is not None:
            out[f"{metric_key(r['row'])}/curve_vs_best_entropy"] = float(r["curve_vs_best_entropy"])
    if result["summary"]["worst_error"] is not None:
        out["replay_check/worst_error"] = float(result["summary"]["worst_error"])
    return out


# ----------------------------------------------------------------------------------------------------------- main
def load_pair(cfg: BenchmarkConfig) -> tuple[PreTrainedModel, PreTrainedModel, PreTrainedTokenizerBase]:
    """The benchmark's draft and target, on its compute path (the companion loads only when a row reads it)."""
    from data_gen.generate import GenerateConfig, load_models

    models, tok = load_models(GenerateConfig(models=replace(cfg.models, companion=None)))
    return models.draft, models.target, tok


def log_check(result: dict[str, Any], folder: BenchFolder, tracking_uri: str | None) -> None:
    """One MLflow run in the benchmark's experiment: the check's metrics, benchmark.json / .md and the plot."""
    import mlflow

    from pipelines.cli import resolve_tracking_uri

    mlflow.set_tracking_uri(resolve_tracking_uri(tracking_uri or folder.cfg.tracking_uri))
    mlflow.set_experiment(folder.cfg.experiment)
    with mlflow.start_run(run_name="replay-check"):
        mlflow.log_params({"bench_dir": str(folder.path), "mode": result["mode"], "rollout_len": result["rollout_len"]})
        mlflow.log_metrics(check_metrics(result))
        for name in ("benchmark.json", "benchmark.md", PLOT):
            mlflow.log_artifact(str(folder.path / name))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, check the folder, write and log the check; returns the ``replay_check`` section."""
    from pipelines.cli import parse_config, setup_logging, user_errors

    setup_logging()
    with user_errors("python -m pipelines.replay_check"):
        cc = parse_config(ReplayCheckConfig, argv, __doc__)
        folder = read_bench_folder(cc.bench_dir)
        if cc.statistic:
            folder.cost_model = folder.cost_model.with_statistic(cc.statistic)
        torch.manual_seed(folder.cfg.seed)
        draft, target, tok = load_pair(folder.cfg)
        result = run_check(folder, draft, target, tok, gen_batch_size=cc.gen_batch_size,
                           label_batch_tokens=cc.label_batch_tokens)
        write_check(result, folder.path)
    if cc.tracking:
        log_check(result, folder, cc.tracking_uri)
    print(console_table(result))
    print(textwrap.fill(summary_line(result["summary"]), 100, subsequent_indent="  ", break_long_words=False,
                        break_on_hyphens=False))
    print(f"full table: {folder.path / 'benchmark.md'}")
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
