"""The vLLM benchmark's report: per batch size each row's tokens/s at the target alone's pace (:func:`paired_rows`),
its speedup over vLLM's target alone with a 95% paired bootstrap interval over units (prompts at batch 1, groups at
batch B), identical outputs, vLLM's acceptance counters, the replay check, and for policy rows the share of draft
rows that stopped requests rode and their speed against the fastest static K run in their own engine
(:func:`against_engine_fixed`), and every row against vLLM's fastest fixed setting: the one fastest on the units
compared (biased against the row: the best of several noisy rows) and, unit by unit, the one fastest on the run's
other units (:func:`against_fixed_chosen_elsewhere`); then the issue's checks (``goals``): the recommendation
against the fastest static K, the per-batch setting against one fixed K, the best policy against the recommended
static K, exact outputs, replay agreement.

Writes ``benchmark.json`` and ``benchmark.md`` to the run's folder.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmark.records import output_hash, paired_ratio
from benchmark.rows import Row, ratio_ci
from compute.timing import CostModel
from runtimes.vllm.bench import RowRole, RowRun, VllmBenchConfig, reference_rows
from runtimes.vllm.settings import BatchPick

__all__ = ["VllmReport", "build_report", "goals_of", "markdown", "paired_rows", "table_entries", "unit_records",
           "against_engine_fixed", "against_fixed_chosen_elsewhere", "chosen_elsewhere", "ratio_text"]


@dataclass
class VllmReport:
    """What ``python -m pipelines.vllm_bench`` returns and writes."""

    table: list[dict[str, Any]]
    goals: dict[str, Any]
    recommendation: list[str]
    picks: list[dict[str, Any]]
    replay_check: list[dict[str, Any]]
    curves: dict[str, dict[str, Any]] = field(default_factory=dict)
    prompts: list[str] = field(default_factory=list)
    ties: list[dict[str, Any]] = field(default_factory=list)
    """Each output that differs from the target alone's, at its first difference, with the target's float32 logit
    gap there (``runtimes.vllm.ties``)."""


def ratio_text(x: list | None) -> str:
    """``1.02x [0.98, 1.06]`` of a stored [ratio, low, high] (empty where there is none)."""
    return "" if not x or x[0] is None else f"{x[0]:.2f}x [{x[1]:.2f}, {x[2]:.2f}]"


def _as_row(r: RowRun) -> Row:
    return Row(name=r.name, method="vllm", seconds=list(r.seconds),
               outputs=[[t for o in unit for t in o] for unit in r.outputs])


def paired_rows(rows: list[RowRun]) -> list[RowRun]:
    """Each row's seconds on a unit scaled by the target alone's first row's seconds on it over the target alone's
    seconds beside it (``RowRun.at_pace``): every row as if run at the pace the target alone's own row ran at, so
    that a row's ratio to the target alone is the ratio measured seconds apart on each unit. Rows without ``beside``
    (the first target row itself) are kept as measured."""
    first = reference_rows(rows)
    return [r.at_pace(first[r.batch]) if r.batch in first else r for r in rows]


def row_entry(r: RowRun, ref: RowRun, boot: np.ndarray, check: dict[str, Any], measured: RowRun) -> dict[str, Any]:
    sp, lo, hi = ratio_ci(_as_row(r), _as_row(ref), boot)
    same = sum(a == b for u, v in zip(r.outputs, ref.outputs) for a, b in zip(u, v))
    c = r.counters
    return {"row": r.name, "batch": r.batch, "spec": r.spec, "tokens_per_s": round(r.tokens_per_s, 3),
            "measured_tokens_per_s": round(measured.tokens_per_s, 3),
            "speedup": None if sp is None else round(sp, 4), "speedup_lo": None if lo is None else round(lo, 4),
            "speedup_hi": None if hi is None else round(hi, 4), "identical": same,
            "prompts": sum(len(u) for u in r.outputs), "tokens": r.tokens, "seconds": round(sum(r.seconds), 3),
            "draft_tokens": int(c.get("draft_tokens", 0)), "accepted": int(c.get("accepted", 0)),
            "acceptance": round(c["accepted"] / c["draft_tokens"], 4) if c.get("draft_tokens") else None,
            "idle_share": round(r.idle_rows / r.draft_rows, 4) if r.draft_rows else None,
            "replayed_tokens_per_s": check.get("replayed_tokens_per_s"), "replay_ratio": check.get("ratio"),
            "unit_seconds": [round(s, 4) for s in measured.seconds], "records": unit_records(measured),
            "in_flight_tokens_per_s": _rate(r.in_flight()),
            "role": None if r.role is None else asdict(r.role),
            "by_position": {str(j): [n, round(pred, 4), round(obs, 4)] for j, (n, pred, obs) in r.by_position.items()}}


def _rate(flight: list[tuple[int, float]] | None) -> float | None:
    """tokens/s over :meth:`RowRun.in_flight`'s units (None where it has none)."""
    return None if flight is None else round(sum(t for t, _ in flight) / sum(s for _, s in flight), 3)


def unit_records(r: RowRun) -> dict[str, Any]:
    """The row's per-unit records (a unit: a group or stream of prompts at its batch size): seconds and vLLM's
    counters per unit, tokens and an output hash per prompt (``benchmark.records``), and the tokens and seconds of
    the unit's steps that ran its batch size of requests (:meth:`RowRun.in_flight`)."""
    counters = [r.unit_counters[i] if i < len(r.unit_counters) else {} for i in range(len(r.seconds))]
    flight = r.in_flight()
    return {"unit_size": len(r.outputs[0]) if r.outputs else r.batch, "seconds": [float(s) for s in r.seconds],
            "in_flight_tokens": None if flight is None else [int(t) for t, _ in flight],
            "in_flight_seconds": None if flight is None else [float(s) for _, s in flight],
            "beside_seconds": [float(s) for s in r.beside] or None,
            "rounds": [int(c.get("drafts", 0)) for c in counters],
            "drafted": [int(c.get("draft_tokens", 0)) for c in counters],
            "accepted": [int(c.get("accepted", 0)) for c in counters],
            "idle_rows": [int(u[0]) for u in r.unit_idle], "draft_rows": [int(u[1]) for u in r.unit_idle],
            "positions": [dict(u) for u in r.unit_positions] if any(r.unit_positions) else None,
            "tokens": [len(o) for unit in r.outputs for o in unit],
            "output_sha1": [output_hash(o) for unit in r.outputs for o in unit]}


def role_of(entry: dict[str, Any]) -> RowRole:
    """A report entry's row role (``RowRole``: what the row runs, as typed values)."""
    return RowRole(**entry["role"])


def _first_target(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((t for t in entries if role_of(t).what == "target" and not role_of(t).again), None)


def against_fastest_fixed(at_b: list[RowRun], entries: list[dict], boot: np.ndarray) -> None:
    """Each other row's speedup over the fastest of vLLM's fixed settings at this batch size, with its interval."""
    fixed = [r for r in at_b if r.role is not None and r.role.fixed]
    fastest = max(fixed, key=lambda r: r.tokens_per_s)
    for r, e in zip(at_b, entries):
        if not (r.role is not None and r.role.fixed):
            sp, lo, hi = ratio_ci(_as_row(r), _as_row(fastest), boot)
            e["vs_fastest_fixed"] = [None if x is None else round(x, 4) for x in (sp, lo, hi)]
            e["fastest_fixed"] = fastest.name


def against_fastest_fixed_in_flight(at_b: list[RowRun], entries: list[dict], boot: np.ndarray) -> None:
    """Each other row against the fastest fixed setting on tokens/s with every request of its group in flight
    (:meth:`RowRun.in_flight`), with its interval over the units; nothing where a row's tokens were not counted."""
    fixed = [(r, f) for r in at_b if r.role is not None and r.role.fixed and (f := r.in_flight()) is not None]
    if not fixed:
        return
    fastest, ref = max(fixed, key=lambda x: _rate(x[1]) or 0.0)
    for r, e in zip(at_b, entries):
        if (r.role is not None and r.role.fixed) or (f := r.in_flight()) is None or len(f) != len(ref):
            continue
        ratio = paired_ratio([t for t, _ in f], [s for _, s in f], [t for t, _ in ref], [s for _, s in ref], boot)
        e["vs_fastest_fixed_in_flight"] = [round(x, 4) for x in ratio]
        e["fastest_fixed_in_flight"] = fastest.name


def chosen_elsewhere(fixed_units: list[list[tuple[float, float]]]) -> list[int] | None:
    """Per unit, the index of the fixed setting with the most tokens/s over the run's other units (``fixed_units``:
    per setting, per unit (tokens, seconds)); None with fewer than two units. The bar a unit is compared with is then
    not picked on that unit: the noise that makes one of several settings look fastest on a unit does not raise it,
    as it raises the fastest-measured bar (a winner's curse)."""
    n = len(fixed_units[0]) if fixed_units else 0
    if n < 2:
        return None
    totals = [(sum(t for t, _ in u), sum(s for _, s in u)) for u in fixed_units]

    def rate_without(i: int, u: int) -> float:
        seconds = totals[i][1] - fixed_units[i][u][1]
        return (totals[i][0] - fixed_units[i][u][0]) / seconds if seconds > 0 else 0.0

    return [max(range(len(fixed_units)), key=lambda i: rate_without(i, u)) for u in range(n)]


def _whole_units(r: RowRun) -> list[tuple[float, float]]:
    return [(sum(len(o) for o in outs), s) for outs, s in zip(r.outputs, r.seconds)]


def against_fixed_chosen_elsewhere(at_b: list[RowRun], entries: list[dict], boot: np.ndarray,
                                   in_flight: bool = False) -> None:
    """Each other row against, on each unit, the fixed setting fastest over the other units (:func:`chosen_elsewhere`),
    with its interval over the units (the choice made once, not again in each resample): the fair counterpart of
    :func:`against_fastest_fixed`, whose bar is the best of several noisy rows on the very units compared. On whole
    groups, or (``in_flight``) on the steps with every request of a group in flight."""
    def units(r: RowRun) -> list[tuple[float, float]] | None:
        return r.in_flight() if in_flight else _whole_units(r)

    fixed = [(r, u) for r in at_b if r.role is not None and r.role.fixed and (u := units(r)) is not None]
    choice = chosen_elsewhere([u for _, u in fixed]) if fixed else None
    if choice is None:
        return
    bar = [fixed[i][1][u] for u, i in enumerate(choice)]
    suffix = "_in_flight" if in_flight else ""
    for r, e in zip(at_b, entries):
        if (r.role is not None and r.role.fixed) or (mine := units(r)) is None or len(mine) != len(bar):
            continue
        ratio = paired_ratio([t for t, _ in mine], [s for _, s in mine], [t for t, _ in bar], [s for _, s in bar],
                             boot)
        e["vs_fixed_chosen_elsewhere" + suffix] = [round(x, 4) for x in ratio]
        e["fixed_chosen_elsewhere" + suffix] = [fixed[i][0].name for i in choice]


def against_engine_fixed(measured: list[RowRun], entries: list[dict], boot: np.ndarray) -> None:
    """Each row of the policies' engine against the fastest static K run there (specstop's ``static:K`` or vLLM's own
    loop), with its interval: on the seconds as measured, since the rows took turns on each unit seconds apart in one
    engine (no pairing with another engine's pace enters the ratio)."""
    fixed = [r for r in measured if r.role is not None and r.role.in_proposer]
    if not fixed:
        return
    fastest = max(fixed, key=lambda r: r.tokens_per_s)
    for r, e in zip(measured, entries):
        if r.role is not None and r.role.in_policies_engine and r is not fastest:
            sp, lo, hi = ratio_ci(_as_row(r), _as_row(fastest), boot)
            e["vs_engine_fixed"] = [None if x is None else round(x, 4) for x in (sp, lo, hi)]
            e["engine_fixed"] = fastest.name


def _rec_row(table: list[dict], batch: int, picks: list[BatchPick]) -> dict | None:
    """The recommended setting's row at ``batch``: the target alone where no K pays there, else the static K picked
    for that batch size (the pick of the nearest measured batch size at or above it)."""
    rows = [t for t in table if t["batch"] == batch]
    ordered = sorted(picks, key=lambda p: p.batch)
    pick = next((p for p in ordered if p.batch >= batch), ordered[-1] if ordered else None)
    if pick is None:
        return None
    if pick.k == 0:
        return _first_target(rows)
    return next((t for t in rows if role_of(t).what == "static" and role_of(t).k == pick.k
                 and not role_of(t).in_proposer), None)


def _tie_goals(ties: list[dict]) -> dict[str, Any]:
    """How the differing outputs differ: their count, the largest float32 logit gap between the two tokens at the
    first difference, and the share where the target alone's token is float32's argmax."""
    if not ties:
        return {"differing_outputs": 0}
    gaps = [abs(t["gap"]) for t in ties if t["gap"] is not None]
    return {"differing_outputs": len(ties), "differing_max_abs_gap": round(max(gaps), 4) if gaps else None,
            "differing_reference_top1_share": round(sum(t["reference_is_top1"] for t in ties) / len(ties), 4)}


def _calibration_gap(entry: dict[str, Any], positions: int = 4) -> float | None:
    """The largest |mean predicted acceptance - vLLM's accepted share| over draft positions 1..``positions``."""
    gaps = [abs(c[1] - c[2]) for j, c in entry["by_position"].items() if int(j) <= positions and c[0]]
    return round(max(gaps), 4) if gaps else None


def share_interval(n: int, share: float, z: float = 1.96) -> tuple[float, float]:
    """The Wilson 95% interval of an accepted share of ``n`` judged tokens (tokens taken as independent: they cluster
    by prompt, so the true interval is wider)."""
    centre, half = share + z * z / (2 * n), z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def calibration_verdict(by_position: dict[str, list], positions: int = 4, tol: float = 0.03) -> str:
    """Whether a row's calibrated acceptance is within ``tol`` of vLLM's accepted share at draft positions
    1..``positions``, counting the share's sampling error: ``within`` (every position's interval of predicted - share
    inside +-tol), ``beyond at position j`` (an interval wholly outside), else ``not decided``."""
    undecided = False
    for j, (n, pred, share) in sorted(by_position.items(), key=lambda x: int(x[0])):
        if int(j) > positions or not n:
            continue
        lo, hi = share_interval(int(n), share)
        gap_lo, gap_hi = pred - hi, pred - lo
        if gap_lo > tol or gap_hi < -tol:
            return f"beyond at position {j}"
        undecided |= gap_lo < -tol or gap_hi > tol
    return "not decided" if undecided else "within"


def goals_of(table: list[dict], picks: list[BatchPick], batch_sizes: list[int], ties: list[dict]) -> dict[str, Any]:
    """The issue's checks from the report's entries: per batch size the recommended setting against the fastest fixed
    one, the per-batch schedule and the recommendation against vLLM's defaults, the policies against them; exact
    outputs, the differing outputs' ties, replay agreement."""
    goals: dict[str, Any] = {}
    ratios, per_ratios = [], []
    for b in batch_sizes:
        rows = [t for t in table if t["batch"] == b]
        fixed = [t for t in rows if role_of(t).fixed]
        fastest = max(fixed, key=lambda t: t["tokens_per_s"])
        rec = _rec_row(table, b, picks)
        default = next((t for t in rows if role_of(t).defaults), None)
        alone = _first_target(rows)
        assert alone is not None, f"batch {b}: no target-alone row"
        g = {"fastest_fixed": fastest["row"], "recommended_row": rec and rec["row"]}
        per = next((t for t in rows if role_of(t).what == "per_batch"), None)
        if per is not None and default is not None:
            g["per_batch_vs_defaults"] = round(per["tokens_per_s"] / default["tokens_per_s"], 4)
            g["per_batch_vs_target_alone"] = round(per["tokens_per_s"] / alone["tokens_per_s"], 4)
            per_ratios.append(g["per_batch_vs_defaults"])
        if rec is not None:
            g["recommended_vs_fastest"] = round(rec["tokens_per_s"] / fastest["tokens_per_s"], 4)
            g["recommended_vs_target_alone"] = round(rec["tokens_per_s"] / alone["tokens_per_s"], 4)
            if default is not None:
                g["recommended_vs_defaults"] = round(rec["tokens_per_s"] / default["tokens_per_s"], 4)
                ratios.append(g["recommended_vs_defaults"])
        g["policies_vs_fastest_fixed"] = {t["row"]: t["vs_fastest_fixed"] for t in rows if "vs_fastest_fixed" in t}
        in_flight = {t["row"]: t["vs_fastest_fixed_in_flight"] for t in rows if "vs_fastest_fixed_in_flight" in t}
        if in_flight:  # with every request of a group in flight, as a server at this concurrency runs
            g["fastest_fixed_in_flight"] = next(t["fastest_fixed_in_flight"] for t in rows
                                                if "fastest_fixed_in_flight" in t)
            g["policies_vs_fastest_fixed_in_flight"] = in_flight
        for suffix in ("", "_in_flight"):  # against the fixed setting fastest on the other units
            elsewhere = {t["row"]: t[f"vs_fixed_chosen_elsewhere{suffix}"] for t in rows
                         if f"vs_fixed_chosen_elsewhere{suffix}" in t}
            if elsewhere:
                g[f"fixed_chosen_elsewhere{suffix}"] = next(t[f"fixed_chosen_elsewhere{suffix}"] for t in rows
                                                            if f"fixed_chosen_elsewhere{suffix}" in t)
                g[f"policies_vs_fixed_chosen_elsewhere{suffix}"] = elsewhere
        in_engine = {t["row"]: t["vs_engine_fixed"] for t in rows if "vs_engine_fixed" in t}
        if in_engine:
            g["fastest_engine_fixed"] = next(t["engine_fixed"] for t in rows if "engine_fixed" in t)
            g["policies_vs_engine_fixed"] = in_engine
        g["calibration_gap"] = {t["row"]: _calibration_gap(t) for t in rows if t.get("by_position")}
        policies = [t for t in rows if role_of(t).what == "policy" and not role_of(t).ablation]
        if policies and rec is not None:
            best = max(policies, key=lambda t: t["tokens_per_s"])
            g["best_policy"] = best["row"]
            g["best_policy_vs_recommended"] = round(best["tokens_per_s"] / rec["tokens_per_s"], 4)
            g["policy_idle_share"] = {t["row"]: t["idle_share"] for t in policies}
        goals[f"batch_{b}"] = g
    if ratios:
        goals["recommended_vs_defaults_geomean"] = round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 4)
    if per_ratios:
        goals["per_batch_vs_defaults_geomean"] = round(math.exp(sum(map(math.log, per_ratios)) / len(per_ratios)), 4)
    ident = [t["identical"] / t["prompts"] for t in table if t["prompts"]]
    goals["identical_share_min"] = round(min(ident), 4) if ident else None
    ratios_r = [abs(t["replay_ratio"] - 1) for t in table if t["replay_ratio"] is not None]
    goals.update(_tie_goals(ties))
    goals["replay_worst_abs_error"] = round(max(ratios_r), 4) if ratios_r else None
    return goals


def table_entries(rows: list[RowRun], batch_sizes: list[int], seed: int, n_boot: int,
                  check: list[dict]) -> list[dict[str, Any]]:
    """Each row's report entry, batch size by batch size (its times paired with the target alone's:
    :func:`paired_rows`), its intervals drawn from one seeded generator in that order (the report's and ``python -m
    pipelines.results --verify``'s)."""
    table = []
    rng = np.random.default_rng(seed)
    both = list(zip(rows, paired_rows(rows)))
    for b in batch_sizes:
        measured = [m for m, _ in both if m.batch == b]
        at_b = [p for m, p in both if m.batch == b]
        ref = next(r for r in at_b if r.role is not None and r.role.what == "target" and not r.role.again)
        boot = rng.integers(0, len(ref.seconds), size=(n_boot, len(ref.seconds)))
        entries = [row_entry(r, ref, boot, next((x for x in check if x["row"] == r.name and x["batch"] == b), {}), m)
                   for r, m in zip(at_b, measured)]
        against_fastest_fixed(at_b, entries, boot)
        against_fastest_fixed_in_flight(at_b, entries, boot)
        against_fixed_chosen_elsewhere(at_b, entries, boot)
        against_fixed_chosen_elsewhere(at_b, entries, boot, in_flight=True)
        against_engine_fixed(measured, entries, boot)
        table += entries
    return table


def build_report(cfg: VllmBenchConfig, rows: list[RowRun], names: list[str], picks: list[BatchPick],
                 check: list[dict], curves: dict[int, CostModel], recommendation: list[str],
                 ties: list[dict] | None = None) -> VllmReport:
    """The report of a finished run, written to ``cfg.out_dir``."""
    table = table_entries(rows, cfg.batch_sizes, cfg.seed, cfg.n_boot, check)
    rep = VllmReport(table=table, goals=goals_of(table, picks, cfg.batch_sizes, ties or []),
                     recommendation=recommendation,
                     picks=[p.to_dict() for p in picks], replay_check=check,
                     curves={str(b): cm.to_dict() for b, cm in curves.items()}, prompts=names, ties=ties or [])
    out = Path(cfg.out_dir)
    (out / "benchmark.json").write_text(json.dumps({**asdict(rep), "config": asdict(cfg)}, indent=1, default=str))
    (out / "benchmark.md").write_text(markdown(rep))
    return rep


def markdown(rep: VllmReport) -> str:
    """The report as Markdown: one table per batch size, then the recommendation and the checks."""
    lines = []
    for b in sorted({t["batch"] for t in rep.table}):
        lines += [f"### {b} concurrent request{'s' if b > 1 else ''}", "",
                  "| row | tokens/s | vs target alone [95% CI] | vs fixed fastest on the other groups | vs fastest "
                  "static K in its engine | tokens/s, group in flight | vs fastest fixed, group in flight | output = "
                  "target alone | acceptance | replayed / measured | stopped rows ridden |", "|---" * 11 + "|"]
        for t in (t for t in rep.table if t["batch"] == b):
            ci = ratio_text([t["speedup"], t["speedup_lo"], t["speedup_hi"]])
            engine = ratio_text(t.get("vs_engine_fixed"))
            acc = f"{t['acceptance']:.2f}" if t["acceptance"] is not None else ""
            rr = f"{t['replay_ratio']:.3f}" if t["replay_ratio"] is not None else ""
            idle = f"{t['idle_share']:.0%}" if t["idle_share"] is not None else ""
            flight = f"{t['in_flight_tokens_per_s']:.2f}" if t.get("in_flight_tokens_per_s") is not None else ""
            elsewhere = ratio_text(t.get("vs_fixed_chosen_elsewhere"))
            lines.append(f"| {t['row']} | {t['tokens_per_s']:.2f} | {ci} | {elsewhere} | {engine} | {flight} "
                         f"| {ratio_text(t.get('vs_fastest_fixed_in_flight'))} | {t['identical']}/{t['prompts']} "
                         f"| {acc} | {rr} | {idle} |")
        lines.append("")
    lines += ["Recommended:", "", *[f"- {x}" for x in rep.recommendation], "", "Checks:", "",
              "```json", json.dumps(rep.goals, indent=1), "```", ""]
    return "\n".join(lines)
