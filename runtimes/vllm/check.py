"""The vLLM benchmark's replay check: each row's own steps priced with vLLM's curve, beside its measured time.

The curve gives the shape of a step's cost (a draft forward against a verification of L tokens, at each batch size);
its level comes from the steps timed beside the rows: per batch size, the fixed rows' (the target alone, vLLM's K)
measured decode seconds over their curve-priced seconds (:func:`step_levels`). A curve keeps its fastest round, timed
apart from the rows; on a host whose speed moves by a third the rows then run 1.1-1.5x slower than it says, the same
for every row of a batch size. The policy rows are priced by that level, never fitted to themselves.

A row's unit (a prompt at batch 1, a group at batch B) ran a sequence of engine steps (``StepClock``): its prefill
steps are taken as measured (the curve prices decoding, not prefill), and each decode step is priced at the batch
size it ran at (``runtimes.vllm.stopper.curve_for_batch``):

- the target alone: ``target(1)``;
- vLLM's static K (or the per-batch schedule's K at that batch): ``K * draft + target(K + 1)`` for the share of
  request-steps vLLM's counters say verified drafts, ``draft + target(1)`` for the rest (the draft still runs);
- a specstop policy: its rounds as the proposer logged them (requests, draft forwards run, mean tokens a request
  verified), each ``forwards * draft + target(mean verified)``, averaged and charged per decode step (a step that
  skipped the draft ran no forward; otherwise the first runs even when every request stops at once).

What it leaves out: requests of a batch finishing at different steps share the last steps with fewer rows than the
curve's batch (priced at the curve of the batch size the step had), and a policy round's mixed lengths are priced at
their mean length.

Usage::

    levels = step_levels(rows, curves, k_of)
    predicted = predicted_seconds(row, curves, k_of=lambda b: 3, level=levels[row.batch])
"""
from __future__ import annotations

from collections.abc import Callable

from compute.timing import CostModel
from runtimes.vllm.bench import RowRun
from runtimes.vllm.engine import StepLog
from runtimes.vllm.stopper import curve_for_batch

__all__ = ["predicted_seconds", "step_price", "step_levels", "check_rows"]


def step_price(cm: CostModel, k: int) -> float:
    """Seconds of a decode step with ``k`` drafts a request at ``cm``'s batch size (k = 0: the target alone)."""
    return cm.target_time(1) if k == 0 else k * cm.draft_s_per_token + cm.target_time(k + 1)


def _policy_step(rounds: list[tuple[int, int, float]], curves: dict[int, CostModel]) -> float | None:
    if not rounds:
        return None
    total = 0.0
    for batch, positions, mean_len in rounds:
        cm = curve_for_batch(curves, batch)
        total += positions * cm.draft_s_per_token + cm.target_time(mean_len)
    return total / len(rounds)


def drafted_share(row: RowRun) -> float:
    """The share of a row's request-steps that verified drafts, from vLLM's own counters (``drafts``: request-steps
    with drafts) over the decode steps' requests; 1 when the row kept no counters."""
    slots = sum(s.batch for steps in row.steps for s in steps if s.decode)
    if "drafts" not in row.counters or not slots:
        return 1.0
    return min(1.0, row.counters["drafts"] / slots)


def predicted_seconds(row: RowRun, curves: dict[int, CostModel], k_of: Callable[[int], int] | None,
                      level: float = 1.0) -> list[float]:
    """Per unit of ``row``, the seconds its steps cost under ``curves`` times ``level`` (``k_of(batch)``: vLLM's K at a
    batch size, None for a policy row, priced by its logged rounds); prefill steps as measured. A speculative
    engine's step that verified no draft (vLLM drafted none for it: :func:`drafted_share`) still runs the draft's
    forward: ``draft + target(1)``."""
    return [prefill + level * decode for prefill, decode in _unit_seconds(row, curves, k_of)]


def _unit_seconds(row: RowRun, curves: dict[int, CostModel], k_of: Callable[[int], int] | None,
                  ) -> list[tuple[float, float]]:
    """Per unit: (measured prefill seconds, curve-priced decode seconds)."""
    share = drafted_share(row)
    out = []
    for steps, rounds in zip(row.steps, row.rounds or [[] for _ in row.steps]):
        prefill = sum(s.wall_s for s in steps if not s.decode)
        decode: list[StepLog] = [s for s in steps if s.decode]
        if k_of is None:
            out.append((prefill, (_policy_step(rounds, curves) or 0.0) * len(decode)))
            continue
        total = 0.0
        alone = row.role is not None and row.role.what == "target"  # no draft: every step is the target's
        for s in decode:
            cm, k = curve_for_batch(curves, s.batch), k_of(s.batch)
            idle = cm.target_time(1) if alone else cm.draft_s_per_token + cm.target_time(1)
            total += share * step_price(cm, k) + (1 - share) * idle if k else idle
        out.append((prefill, total))
    return out


def step_levels(rows: list[RowRun], curves: dict[int, CostModel], k_of: dict[str, Callable[[int], int] | None],
                ) -> dict[int, float]:
    """Per batch size, the fixed rows' measured decode seconds over their curve-priced decode seconds: the level of
    the curve on the host as the rows met it (1.0 at a batch size without a fixed row)."""
    measured: dict[int, float] = {}
    priced: dict[int, float] = {}
    for row in rows:
        fixed = k_of.get(row.name)
        if fixed is None:
            continue
        measured[row.batch] = measured.get(row.batch, 0.0) + sum(
            s.wall_s for steps in row.steps for s in steps if s.decode)
        priced[row.batch] = priced.get(row.batch, 0.0) + sum(d for _, d in _unit_seconds(row, curves, fixed))
    return {b: measured[b] / priced[b] if priced.get(b) else 1.0 for b in sorted({r.batch for r in rows})}


def check_rows(rows: list[RowRun], curves: dict[int, CostModel], k_of: dict[str, Callable[[int], int] | None],
               ) -> list[dict]:
    """Per row and batch size: measured and replayed tokens/s, their ratio (measured seconds / replayed) and the
    curve's level at that batch size (:func:`step_levels`)."""
    levels = step_levels(rows, curves, k_of)
    out = []
    for row in rows:
        pred = sum(predicted_seconds(row, curves, k_of.get(row.name), levels[row.batch]))
        meas = sum(row.seconds)
        out.append({"row": row.name, "batch": row.batch, "measured_tokens_per_s": round(row.tokens_per_s, 3),
                    "replayed_tokens_per_s": round(row.tokens / pred, 3) if pred else None,
                    "ratio": round(meas / pred, 4) if pred else None, "curve_level": round(levels[row.batch], 4)})
    return out
