"""Stored runs of vLLM's benchmark: their summary (``rendering.result_store`` kind ``vllm_benchmark``) and the
Markdown that fills ``<!-- results:vllm -->`` (docs/vllm.md) and the README's vLLM line, so that every figure there
comes from a stored file.

Usage::

    write_summary(summarize_vllm_benchmark("outputs/benchmark-vllm", "python -m pipelines.vllm_bench ..."), "results")
    print(vllm_block(load_summaries("results")))
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from benchmark.verify import Disagreement, MissingRecords, same, stand_ins
from compute.timing import SKIP_STEP
from rendering.result_store import (
    SCHEMA,
    Summary,
    SummaryError,
    config_hash,
    cpu_label,
    dated,
    machine_facts,
    newest,
    provenance,
)
from runtimes.vllm.bench import RowRole, RowRun
from runtimes.vllm.bench_report import calibration_verdict, goals_of, ratio_text, share_interval, table_entries
from runtimes.vllm.engine import StepLog
from runtimes.vllm.settings import BatchPick

__all__ = ["summarize_vllm_benchmark", "verify_vllm_summary", "recomputed_entries", "vllm_block",
           "vllm_readme_lines"]

VERIFIED = ("tokens_per_s", "measured_tokens_per_s",
            "speedup", "speedup_lo", "speedup_hi", "identical", "prompts", "acceptance", "idle_share",
            "vs_fastest_fixed", "fastest_fixed", "vs_engine_fixed", "engine_fixed", "by_position",
            "in_flight_tokens_per_s", "vs_fastest_fixed_in_flight", "fastest_fixed_in_flight",
            "vs_fixed_chosen_elsewhere", "fixed_chosen_elsewhere", "vs_fixed_chosen_elsewhere_in_flight",
            "fixed_chosen_elsewhere_in_flight")
"""The fields of a stored vLLM row recomputed from its records."""

VLLM_ROW_FIELDS = ("row", "batch", "spec", "tokens_per_s", "measured_tokens_per_s",
                   "speedup", "speedup_lo", "speedup_hi", "identical",
                   "prompts", "acceptance", "idle_share", "replayed_tokens_per_s", "replay_ratio", "tokens",
                   "unit_seconds", "vs_fastest_fixed", "fastest_fixed", "vs_engine_fixed", "engine_fixed",
                   "by_position", "records", "role", "in_flight_tokens_per_s", "vs_fastest_fixed_in_flight",
                   "fastest_fixed_in_flight", "vs_fixed_chosen_elsewhere", "fixed_chosen_elsewhere",
                   "vs_fixed_chosen_elsewhere_in_flight", "fixed_chosen_elsewhere_in_flight")


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    except FileNotFoundError as e:
        raise SummaryError(f"{path}: missing (is the run finished?)") from e


def summarize_vllm_benchmark(out_dir: str | Path, command: str, config_name: str = "benchmark-vllm",
                             duration_s: float | None = None) -> dict[str, Any]:
    """The summary of a finished ``pipelines.vllm_bench`` run in ``out_dir`` (benchmark.json, config.yaml,
    cost_model.vllm.json)."""
    out = Path(out_dir)
    bench, config = _read(out / "benchmark.json"), _read(out / "config.yaml")
    curve = _read(out / "cost_model.vllm.json")
    machine = machine_facts(curve.get("machine") or {})
    curves = {b: {"draft_ms": round(1e3 * c["draft_s_per_token"], 2),
                  "target_ms": {L: round(1e3 * t, 2) for L, t in c["target_s"].items()},
                  **({"skip_ms": round(1e3 * c["extra"][SKIP_STEP], 2)} if SKIP_STEP in c.get("extra", {}) else {})}
              for b, c in (curve.get("extra", {}).get("batch_curves") or {}).items()}
    return {
        "schema": SCHEMA, "kind": "vllm_benchmark", "config": config_name, "command": command,
        **provenance(out, duration_s), "config_hash": config_hash(config),
        "machine": machine, "compute_path": "vllm", "vllm": machine.get("vllm"),
        "vllm_dtype": curve.get("dtype") or "bfloat16",
        "pair": {"draft": config["models"]["draft"], "target": config["models"]["target"]},
        "n_prompts": config["n_prompts"], "max_new_tokens": config["max_new_tokens"],
        "batch_sizes": config["batch_sizes"], "n_boot": config.get("n_boot"), "seed": config.get("seed"),
        "rows": [{k: r[k] for k in VLLM_ROW_FIELDS if k in r} for r in bench["table"]],
        "goals": bench.get("goals"), "picks": bench.get("picks"), "recommendation": bench.get("recommendation"),
        "curves": curves, **({"queue_groups": config["queue_groups"]} if config.get("queue_groups", 1) > 1 else {}),
        **({"interleave": True} if config.get("interleave") else {}),
    }



def row_from_records(entry: dict[str, Any]) -> RowRun:
    """A vLLM row rebuilt from a stored entry's per-unit records, each output as its stand-in
    (``benchmark.verify.stand_ins``)."""
    rec = entry.get("records")
    if not rec:
        raise MissingRecords(f"row {entry.get('row')!r} has no per-unit records")
    outs = stand_ins(rec)
    size = rec["unit_size"]
    row = RowRun(name=entry["row"], batch=entry["batch"], spec=entry.get("spec") or "", role=RowRole(**entry["role"]))
    row.outputs = [outs[i:i + size] for i in range(0, len(outs), size)]  # type: ignore[misc]
    row.seconds = list(rec["seconds"])
    row.beside = list(rec.get("beside_seconds") or [])
    row.unit_counters = [{"drafts": r, "draft_tokens": d, "accepted": a}
                         for r, d, a in zip(rec["rounds"], rec["drafted"], rec["accepted"])]
    row.unit_idle = list(zip(rec["idle_rows"], rec["draft_rows"]))
    row.unit_positions = list(rec["positions"] or [{} for _ in row.seconds])
    if rec.get("in_flight_tokens"):  # each unit's steps with its group in flight, as one step
        row.steps = [[StepLog(s, len(unit), decode=True, tokens=t)] for unit, t, s in
                     zip(row.outputs, rec["in_flight_tokens"], rec["in_flight_seconds"])]
    return row


def recomputed_entries(entries: list[dict[str, Any]], batch_sizes: list[int], seed: int, n_boot: int,
                       ) -> list[dict[str, Any]]:
    """Stored rows' report entries computed again from their records by the report's own routine
    (``bench_report.table_entries``), the replay's ratios as stored, in the stored form (tuples as lists, positions
    keyed by strings)."""
    rows = [row_from_records(r) for r in entries]
    replay = [{"row": r["row"], "batch": r["batch"], "ratio": r.get("replay_ratio"),
               "replayed_tokens_per_s": r.get("replayed_tokens_per_s")} for r in entries]  # the replay's own
    return json.loads(json.dumps(table_entries(rows, batch_sizes, seed, n_boot, replay)))


def verify_vllm_summary(data: dict[str, Any]) -> Disagreement | None:
    """The first figure of a vLLM summary that its records do not give (None: all agree); MissingRecords when it
    holds none. Each row's entry is computed again by the report's own routine (``bench_report.table_entries``)."""
    if data.get("seed") is None or data.get("n_boot") is None:
        raise MissingRecords("no seed and n_boot of its bootstrap")
    table = recomputed_entries(data["rows"], data["batch_sizes"], int(data["seed"]), int(data["n_boot"]))
    for stored, new in zip(data["rows"], table):
        for key in VERIFIED:
            if key in stored and not same(stored[key], new.get(key)):
                return Disagreement(f"{stored['row']} at batch {stored['batch']}", key, stored[key], new.get(key))
    picks = [BatchPick(**p) for p in data.get("picks") or []]
    goals = json.loads(json.dumps(goals_of(table, picks, data["batch_sizes"], [])))
    stored = {k: v for k, v in (data.get("goals") or {}).items() if not k.startswith("differing")}  # ties: logits
    return goal_difference(stored, {k: goals.get(k) for k in stored}, "goals")


def goal_difference(stored: Any, new: Any, path: str) -> Disagreement | None:
    """The first goal (``goals.batch_4.recommended_vs_fastest``) whose stored value the recomputed one is not."""
    if isinstance(stored, dict) and isinstance(new, dict):
        for k, v in stored.items():
            found = goal_difference(v, new.get(k), f"{path}.{k}")
            if found is not None:
                return found
        return None
    return None if same(stored, new) else Disagreement("goals", path.removeprefix("goals."), stored, new)


def _paired(s: Summary) -> bool:
    """The run paired every row's units with the target alone's run beside them."""
    return any((r.get("records") or {}).get("beside_seconds") for r in s.data["rows"])


def _rows_table(s: Summary, batch: int) -> list[str]:
    paired = _paired(s)
    rows = [r for r in s.data["rows"] if r["batch"] == batch]
    engine = any(r.get("vs_engine_fixed") for r in rows)
    in_engine_head = "| vs fastest static K in its engine [95% CI] " if engine else ""
    elsewhere = any(r.get("vs_fixed_chosen_elsewhere") for r in rows)
    elsewhere_head = "| vs fixed setting fastest on the other groups [95% CI] " if elsewhere else ""
    flight = any(r.get("in_flight_tokens_per_s") is not None for r in rows)
    flight_head = "| tokens/s, group in flight | vs fastest fixed, group in flight [95% CI] " if flight else ""
    lines = ["| row | tokens/s" + (" (paired) | measured tokens/s" if paired else "") + " | vs target alone [95% CI] "
             "| vs fastest fixed setting [95% CI] " + elsewhere_head + in_engine_head + flight_head
             + "| output = target alone | acceptance | replayed / measured | rows of stopped requests |",
             "|---|---|---|---|---|---|---|---|" + ("---|" if paired else "") + ("---|" if elsewhere else "")
             + ("---|" if engine else "")
             + ("---|---|" if flight else "")]
    for r in rows:
        ci = ratio_text([r.get("speedup"), r.get("speedup_lo"), r.get("speedup_hi")])
        in_engine = f" | {ratio_text(r.get('vs_engine_fixed'))}" if engine else ""
        acc = "" if r.get("acceptance") is None else f"{r['acceptance']:.2f}"
        rr = "" if r.get("replay_ratio") is None else f"{r['replay_ratio']:.3f}"
        idle = "" if r.get("idle_share") is None else f"{r['idle_share']:.0%}"
        measured = f" | {r.get('measured_tokens_per_s') or r['tokens_per_s']:.2f}" if paired else ""
        fixed = ratio_text(r.get("vs_fastest_fixed"))
        fixed += f" | {ratio_text(r.get('vs_fixed_chosen_elsewhere'))}" if elsewhere else ""
        rate = "" if r.get("in_flight_tokens_per_s") is None else f"{r['in_flight_tokens_per_s']:.2f}"
        in_flight = f" | {rate} | {ratio_text(r.get('vs_fastest_fixed_in_flight'))}" if flight else ""
        lines.append(f"| `{r['row']}` | {r['tokens_per_s']:.2f}{measured} | {ci} | {fixed}{in_engine}{in_flight} "
                     f"| {r['identical']}/{r['prompts']} | {acc} | {rr} | {idle} |")
    return lines


def d_batches(s: Summary) -> list[int]:
    """The batch sizes of a stored run."""
    return list(s.data["batch_sizes"])


def _goal_lines(s: Summary) -> list[str]:
    g = s.data.get("goals") or {}
    out = []
    for b in s.data["batch_sizes"]:
        x = g.get(f"batch_{b}") or {}
        if x.get("recommended_vs_fastest") is not None:
            out.append(f"- {b} concurrent: the recommended setting (`{x['recommended_row']}`) ran "
                       f"{x['recommended_vs_fastest']:.3f}x the fastest fixed setting measured (`{x['fastest_fixed']}`)"
                       f", {x['recommended_vs_target_alone']:.3f}x the target alone")
        if x.get("best_policy_vs_recommended") is not None:
            out.append(f"- {b} concurrent: the best specstop policy inside vLLM (`{x['best_policy']}`) ran "
                       f"{x['best_policy_vs_recommended']:.3f}x the recommended setting")
    policies = _policy_rows(s.data)
    for b in d_batches(s):
        x = g.get(f"batch_{b}") or {}
        for row, ratio in (x.get("policies_vs_fastest_fixed") or {}).items():
            if ratio and ratio[0] is not None:
                out.append(f"- {b} concurrent: `{row}` ran {ratio_text(ratio)} the fastest fixed setting "
                           f"(`{x.get('fastest_fixed')}`)"
                           + _in_engine(x, row))
        for suffix, where in (("", ""), ("_in_flight", ", every request of a group in flight")):
            for row, ratio in (x.get(f"policies_vs_fixed_chosen_elsewhere{suffix}") or {}).items():
                if row in policies:
                    out.append(f"- {b} concurrent{where}: `{row}` ran {ratio_text(ratio)} the fixed setting fastest "
                               f"on the run's other groups ({_choices(x[f'fixed_chosen_elsewhere{suffix}'])})")
        for row, ratio in (x.get("policies_vs_fastest_fixed_in_flight") or {}).items():
            out.append(f"- {b} concurrent, every request of a group in flight: `{row}` ran {ratio_text(ratio)} the "
                       f"fastest fixed setting on that measure (`{x.get('fastest_fixed_in_flight')}`)")
        for row, gap in (x.get("calibration_gap") or {}).items():
            if gap is not None:
                out.append(f"- {b} concurrent: `{row}`'s calibrated acceptance against vLLM's accepted share, the "
                           f"largest gap at draft positions 1-4: {gap:.3f}; {_calibration_against_goal(s, row, b)}")
    if g.get("recommended_vs_defaults_geomean") is not None:
        out.append(f"- the recommended setting at each batch size against vLLM's defaults (K = 5), geometric mean over "
                   f"the batch sizes: {g['recommended_vs_defaults_geomean']:.3f}x")
    if g.get("per_batch_vs_defaults_geomean") is not None:
        out.append(f"- one engine with the recommended `num_speculative_tokens_per_batch_size` against vLLM's "
                   f"defaults (K = 5), geometric mean: {g['per_batch_vs_defaults_geomean']:.3f}x")
    if g.get("identical_share_min") is not None:
        out.append(f"- outputs equal to the target alone's: at least {g['identical_share_min']:.0%} of prompts in "
                   "every row")
    if g.get("differing_outputs"):
        top1 = g.get("differing_reference_top1_share")
        out.append(f"- the {g['differing_outputs']} outputs that differ first differ where the target's two tokens' "
                   f"float32 logits are at most {g['differing_max_abs_gap']:.3f} apart (a tie at bfloat16's "
                   f"precision); the target alone's token is float32's argmax in {top1:.0%} of them")
    if g.get("replay_worst_abs_error") is not None:
        out.append(f"- replay against measurement: worst |replayed / measured - 1| = "
                   f"{g['replay_worst_abs_error']:.3f}")
    return out


def _choices(names: list[str]) -> str:
    """``vllm:1 for 3 groups, vllm:3 for 1``: which fixed setting each group was compared with."""
    counts = {n: names.count(n) for n in dict.fromkeys(names)}
    return ", ".join(f"`{n}` for {c} group{'s' if c > 1 else ''}" for n, c in counts.items())


def _calibration_against_goal(s: Summary, row: str, batch: int, tol: float = 0.03) -> str:
    """The row's calibration against the goal of ``tol``, counting the sampling error of vLLM's accepted share at the
    tokens judged at each position (``calibration_verdict``)."""
    entry = next(r for r in s.data["rows"] if r["row"] == row and r["batch"] == batch)
    counts = [c for j, c in entry["by_position"].items() if int(j) <= 4 and c[0]]
    verdict = calibration_verdict(entry["by_position"], tol=tol)
    if verdict == "within":
        return f"within {tol} at every position beyond sampling error"
    if verdict.startswith("beyond"):
        return f"more than {tol} off {verdict[len('beyond '):]} beyond sampling error"
    widest = max((hi - lo) / 2 for lo, hi in (share_interval(int(n), share) for n, _, share in counts))
    return (f"against {tol}: not decided at {min(int(c[0]) for c in counts)}-{max(int(c[0]) for c in counts)} "
            f"tokens judged a position (vLLM's share known to +-{widest:.2f} at 95%)")


def _in_engine(goals_at_b: dict, row: str) -> str:
    """The suffix ``, 0.99x [0.95, 1.03] the fastest static K in its own engine (`static:1 ...`)`` where the row has
    that ratio, else ""."""
    ratio = (goals_at_b.get("policies_vs_engine_fixed") or {}).get(row)
    if not ratio or ratio[0] is None:
        return ""
    return f", {ratio_text(ratio)} the fastest static K in its own engine (`{goals_at_b['fastest_engine_fixed']}`)"


def _calibration_table(s: Summary, positions: int = 4) -> list[str]:
    """Per row and batch size with judged tokens: predicted / vLLM's acceptance at draft positions 1..``positions``."""
    rows = [r for r in s.data["rows"] if r.get("by_position")]
    if not rows:
        return []
    head = " | ".join(f"position {j}" for j in range(1, positions + 1))
    lines = [f"| row | batch | {head} |", "|---|---|" + "---|" * positions]
    for r in rows:
        cells = []
        for j in range(1, positions + 1):
            c = r["by_position"].get(str(j))
            cells.append(f"{c[1]:.2f} / {c[2]:.2f} ({c[0]})" if c and c[0] else "")
        lines.append(f"| `{r['row']}` | {r['batch']} | " + " | ".join(cells) + " |")
    return lines


def vllm_section(s: Summary) -> str:
    """One stored vLLM benchmark as Markdown."""
    d = s.data
    m = d["machine"]
    parts = [f"Measured ({d['n_prompts']} test prompts x {d['max_new_tokens']} new tokens, greedy, vLLM "
             f"{d.get('vllm') or '?'} in {d.get('vllm_dtype', 'bfloat16')} on {cpu_label(m)}, {m.get('threads', '?')} "
             f"threads; {dated(d)}; "
             f"`{d['command']}`):", ""]
    if d.get("queue_groups", 1) > 1:
        q = d["queue_groups"]
        parts += [f"Served from a queue: at B concurrent requests a unit is a stream of {q} x B prompts, at most B in "
                  "flight and the next admitted as one finishes (a server at max concurrency B); \"group in flight\" "
                  "counts its steps that ran B requests, its tail and admissions left out.", ""]
    if _paired(s) and d.get("interleave"):
        parts += ["Interleaved: each row ran each unit (a prompt, or a group of B prompts) together with the target "
                  "alone, their engine steps in turns (the one with fewer new tokens next), each step timed alone; "
                  "tokens/s (paired) scales each unit's time by the target alone's own row over its steps beside the "
                  "row, so each ratio is measured in the same seconds of the host; " + (
                      "the target alone's second row ran in a second build of its engine, beside the first (how far "
                      "two builds of one engine differ: the floor under a ratio of two engines)." if _rebuilt(d) else
                      "the target alone's second row ran after its first in its engine (one engine cannot step "
                      "beside itself)."), ""]
    elif _paired(s):
        parts += ["Paired: the target alone ran each unit (a prompt, or a group of B prompts) right before an "
                  "engine's first row ran it and right after each row; tokens/s (paired) scales each unit's time by "
                  "the target alone's own row over the mean of its two runs around the row, so each ratio is measured "
                  "seconds apart; the target alone's second row is paired with its first (the noise floor).", ""]
    for b in d["batch_sizes"]:
        parts += [f"{b} concurrent request{'s' if b > 1 else ''}:", "", *_rows_table(s, b), ""]
    calib = _calibration_table(s)
    if calib:
        parts += ["Calibrated acceptance against vLLM's, per draft position (tokens judged: sent with every earlier "
                  "token accepted; predicted: the mean calibrated acceptance; vLLM: the share it accepted):", "",
                  *calib, ""]
    if d.get("recommendation"):
        parts += ["The recommendation this run tuned under vLLM's own curve:", "",
                  *[f"- {x}" for x in d["recommendation"]], ""]
    goals = _goal_lines(s)
    parts += ["Against the goals:", "", *goals, ""] if goals else []
    return "\n".join(parts).rstrip()


def vllm_block(summaries: list[Summary]) -> str:
    """docs/vllm.md's block: the newest stored vLLM benchmark of each host kind, newest first (a host kind prices
    speculation its own way), or how to store one."""
    by_host: dict[str, Summary] = {}
    for s in summaries:  # oldest first: a later run of a host kind replaces its earlier one
        if s.kind == "vllm_benchmark":
            by_host.pop(cpu_label(s.data["machine"]), None)
            by_host[cpu_label(s.data["machine"])] = s
    if not by_host:
        return ("No stored run yet: run `.venv-vllm/bin/python -m pipelines.vllm_bench --config "
                "configs/benchmark-vllm.yaml`, then `python -m pipelines.results --benchmark outputs/benchmark-vllm "
                "--config_name benchmark-vllm`.")
    runs = list(reversed(by_host.items()))
    if len(runs) == 1:
        return vllm_section(runs[0][1])
    return "\n\n".join(f"### {host}\n\n{vllm_section(s)}" for host, s in runs)


def vllm_readme_lines(summaries: list[Summary]) -> list[str]:
    """The README's vLLM paragraph and table (one element each): at each batch size the fastest of specstop's
    policies inside vLLM's proposer (by its measured tokens/s: the policies share one engine and took turns on each
    unit) against the fastest of vLLM's fixed settings (paired across engines) and the fastest static K its own engine
    ran (as measured), with the run's noise floor there (the target alone against itself)."""
    s = newest(summaries, "vllm_benchmark")
    if s is None:
        return []
    d = s.data
    policies = _policy_rows(d)
    lines = []
    for b in d["batch_sizes"]:
        rows = [r for r in d["rows"] if r["batch"] == b and (r.get("vs_fastest_fixed") or [None])[0] is not None
                and r["row"] in policies]
        if not rows:
            continue
        best = max(rows, key=lambda r: r.get("measured_tokens_per_s") or r["tokens_per_s"])
        engine = (f"{_one_or_ci(best['vs_engine_fixed'])} (`{best['engine_fixed']}`)"
                  if (best.get("vs_engine_fixed") or [None])[0] is not None else "")
        lines.append(f"| {b} | `{best['row']}` | {_one_or_ci(best['vs_fastest_fixed'])} (`{best['fastest_fixed']}`) "
                     f"| {engine} | {_noise_floor(d, b)} |")
    if not lines:
        return []
    return [f"vLLM, measured in vLLM itself ({dated(d)}, {cpu_label(d['machine'])}; [docs/vllm.md](docs/vllm.md)): "
            f"at each load the fastest of specstop's {len(policies)} policies in vLLM's proposer, by its measured "
            "tokens/s, against vLLM's fastest fixed setting (paired with the target alone across engines) and the "
            "fastest static K run by the same proposer in the same engine:",
            "\n".join(["| concurrent requests | fastest policy | vs vLLM's fastest fixed setting [95% CI] | vs fastest "
                       "static K in its engine [95% CI] | "
                       + ("target alone, a second build against the first" if _rebuilt(d) else
                          "target alone against itself") + " |", "|---|---|---|---|---|",
                       *lines])]


def _one_or_ci(x: list) -> str:
    """``1.02x [0.98, 1.06]``, or ``1.02x (one group: no interval)`` where the run had one unit."""
    return f"{x[0]:.2f}x (one group: no interval)" if x[1] == x[2] else ratio_text(x)


def _rebuilt(d: dict) -> bool:
    """The run's target alone ran its second row in a second build of its engine (``second_build``)."""
    return any(r["role"].get("rebuilt") for r in d["rows"])


def _noise_floor(d: dict, batch: int) -> str:
    """The target alone's second row over its first at ``batch`` (``1.01x``), or ""."""
    alone = [r for r in d["rows"] if r["batch"] == batch and r["role"]["what"] == "target"]
    again = [r for r in alone if r["role"].get("again")]
    first = [r for r in alone if r not in again]
    if not again or not first or not first[0]["tokens_per_s"]:
        return ""
    return f"{again[0]['tokens_per_s'] / first[0]['tokens_per_s']:.2f}x"


def _policy_rows(d: dict) -> set[str]:
    """The rows that run a specstop policy (not vLLM's own settings, nor the target alone's second row, nor a policy
    run again with a part of its rule off)."""
    roles = {r["row"]: RowRole(**r["role"]) for r in d["rows"]}
    return {name for name, role in roles.items() if role.what == "policy" and not role.ablation}
