"""The vLLM benchmark's replay check: each row's own steps priced with vLLM's curve, beside its measured time.

The curve gives the shape of a step's cost (a draft forward against a verification of L tokens, at each batch size);
its levels come from the steps timed beside the rows: per batch size, one factor on the draft's forwards and one on
the target's verifications, fitted to fixed rows' measured decode seconds (:func:`step_levels`). The rows of the
policies' engine are priced at the levels of the static Ks run in that engine (``static:K (policies' engine)``,
seconds apart from them); every other row, and a batch size without such rows, at the levels of vLLM's own fixed rows
(the target alone, vLLM's K), whose engines run at another pace, each unit of vLLM's own engines (and of the
policies' engine where it borrows their levels) at the target alone's pace beside it (:func:`at_reference_pace`).
A curve is timed apart from the rows; on a host whose speed moves by a third the rows then run
1.1-1.5x slower than it says, and not by one factor: with two engines loaded the target's steps slowed more than the
draft's. The policy rows are priced by those levels, never fitted to themselves.

A row's unit (a prompt at batch 1, a group at batch B) ran a sequence of engine steps (``StepClock``): its prefill
steps are taken as measured (the curve prices decoding, not prefill), and each decode step is priced at the batch
size it ran at (``runtimes.vllm.stopper.curve_for_batch``):

- the target alone: ``target(1)``;
- vLLM's static K (or the per-batch schedule's K at that batch): ``K * draft + target(K + 1)`` for the share of
  request-steps vLLM's counters say verified drafts, ``draft + target(1)`` for the rest (the draft still runs);
- a specstop policy: its rounds as the proposer logged them (requests, draft forwards run, mean tokens a request
  verified), each ``forwards * draft + target(mean verified)``, averaged and charged per decode step (a step that
  skipped the draft ran no forward and is priced at the curve's skipped step where it holds one; otherwise the first
  forward runs even when every request stops at once).

What it leaves out: requests of a batch finishing at different steps share the last steps with fewer rows than the
curve's batch (priced at the curve of the batch size the step had), and a policy round's mixed lengths are priced at
their mean length.

Usage::

    levels = step_levels(rows, curves, k_of)
    predicted = predicted_seconds(row, curves, k_of=lambda b: 3, level=levels[row.batch])  # (draft, target) factors
    checked = check_rows(rows, curves, k_of)  # the policies' engine at its own static Ks' levels
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from compute.timing import CostModel
from predictors.batch_goodput import BatchCost
from runtimes.vllm.bench import RowRun, reference_rows
from runtimes.vllm.engine import StepLog
from runtimes.vllm.stopper import curve_for_batch

__all__ = ["predicted_seconds", "step_price", "step_parts", "step_levels", "check_rows"]


def step_parts(cm: CostModel, k: int) -> tuple[float, float]:
    """(draft forwards, verification) seconds of a decode step with ``k`` drafts a request at ``cm``'s batch size
    (k = 0: the target alone)."""
    return k * cm.draft_s_per_token, cm.target_time(k + 1)


def step_price(cm: CostModel, k: int) -> float:
    """Seconds of a decode step with ``k`` drafts a request at ``cm``'s batch size (k = 0: the target alone)."""
    return sum(step_parts(cm, k))


Level = tuple[float, float]
"""Factors on the curve's draft forwards and on its target verifications."""


def _verify_s(cm: CostModel, forwards: int, mean_len: float) -> float:
    """A policy round's verification: a round that ran no draft forward at what the batch rule prices "draft
    nothing" at (``BatchCost.step_s``: the curve's skipped step where it holds one), else the target's pass of
    ``mean_len``."""
    if forwards == 0:
        return BatchCost.from_cost_model(cm, 1, first_forward_paid=False).step_s(0, 0)
    return cm.target_time(mean_len)


def _policy_step(rounds: list[tuple[int, int, float]], curves: dict[int, CostModel]) -> tuple[float, float] | None:
    """A policy row's mean step: (draft seconds, verification seconds) over its logged rounds."""
    if not rounds:
        return None
    draft = sum(positions * curve_for_batch(curves, batch).draft_s_per_token for batch, positions, _ in rounds)
    verify = sum(_verify_s(curve_for_batch(curves, batch), positions, length) for batch, positions, length in rounds)
    return draft / len(rounds), verify / len(rounds)


def drafted_share(row: RowRun) -> float:
    """The share of a row's request-steps that verified drafts, from vLLM's own counters (``drafts``: request-steps
    with drafts) over the decode steps' requests; 1 when the row kept no counters."""
    slots = sum(s.batch for steps in row.steps for s in steps if s.decode)
    if "drafts" not in row.counters or not slots:
        return 1.0
    return min(1.0, row.counters["drafts"] / slots)


def predicted_seconds(row: RowRun, curves: dict[int, CostModel], k_of: Callable[[int], int] | None,
                      level: Level = (1.0, 1.0)) -> list[float]:
    """Per unit of ``row``, the seconds its steps cost under ``curves``, the draft's forwards times ``level[0]`` and
    the verifications times ``level[1]`` (``k_of(batch)``: vLLM's K at a batch size, None for a policy row, priced by
    its logged rounds); prefill steps as measured. A speculative engine's step that verified no draft (vLLM drafted
    none for it: :func:`drafted_share`) still runs the draft's forward: ``draft + target(1)``."""
    units = _unit_seconds(row, curves, k_of)
    return [prefill + level[0] * draft + level[1] * verify for prefill, draft, verify in units]


def _unit_seconds(row: RowRun, curves: dict[int, CostModel], k_of: Callable[[int], int] | None,
                  ) -> list[tuple[float, float, float]]:
    """Per unit: (measured prefill seconds, curve-priced seconds of the draft's forwards, of the verifications)."""
    share = drafted_share(row)
    alone = row.role is not None and row.role.what == "target"  # no draft: every step is the target's
    out = []
    for steps, rounds in zip(row.steps, row.rounds or [[] for _ in row.steps]):
        prefill = sum(s.wall_s for s in steps if not s.decode)
        decode: list[StepLog] = [s for s in steps if s.decode]
        if k_of is None:
            draft, verify = _policy_step(rounds, curves) or (0.0, 0.0)
            out.append((prefill, draft * len(decode), verify * len(decode)))
            continue
        draft = verify = 0.0
        for s in decode:
            cm, k = curve_for_batch(curves, s.batch), k_of(s.batch)
            full = step_parts(cm, 0 if alone else k)
            idle = (0.0 if alone else cm.draft_s_per_token, cm.target_time(1))  # vLLM's K = 0 still runs the draft
            drafted = share if k and not alone else 0.0
            draft += drafted * full[0] + (1 - drafted) * idle[0]
            verify += drafted * full[1] + (1 - drafted) * idle[1]
        out.append((prefill, draft, verify))
    return out


def _engine_fixed(row: RowRun) -> bool:
    return row.role is not None and row.role.in_proposer


def step_levels(rows: list[RowRun], curves: dict[int, CostModel], k_of: dict[str, Callable[[int], int] | None],
                fitted: Callable[[RowRun], bool] | None = None) -> dict[int, Level]:
    """Per batch size, the (draft, verification) factors that bring the fixed rows' curve-priced decode seconds
    closest to their measured ones (least squares on each row's relative error); one shared factor where the rows
    cannot tell the two apart (no speculative fixed row, or a fit that is not positive); (1, 1) without a fixed row.
    ``fitted`` picks the fixed rows (default: vLLM's own, those with a K in ``k_of``)."""
    fitted = fitted or (lambda row: k_of.get(row.name) is not None)
    levels: dict[int, Level] = {}
    for batch in sorted({r.batch for r in rows}):
        parts, measured = [], []
        for row in rows:
            if row.batch != batch or not fitted(row):
                continue
            units = _unit_seconds(row, curves, k_of[row.name])
            parts.append((sum(u[1] for u in units), sum(u[2] for u in units)))
            measured.append(sum(s.wall_s for steps in row.steps for s in steps if s.decode))
        levels[batch] = _fit(np.array(parts).reshape(-1, 2), np.array(measured))
    return levels


def _fit(parts: np.ndarray, measured: np.ndarray) -> Level:
    """(draft, verification) factors minimising the fixed rows' relative errors, else one shared factor."""
    keep = measured > 0
    parts, measured = parts[keep], measured[keep]
    if not len(measured) or not parts.sum():
        return 1.0, 1.0
    if len(measured) >= 2 and np.linalg.matrix_rank(parts / measured[:, None]) == 2:
        (draft, verify), *_ = np.linalg.lstsq(parts / measured[:, None], np.ones(len(measured)), rcond=None)
        if draft > 0 and verify > 0:
            return float(draft), float(verify)
    one = float(measured.sum() / parts.sum())
    return one, one


def at_reference_pace(rows: list[RowRun]) -> list[RowRun]:
    """The rows as the replay prices them: each row of an engine of vLLM's own (the target alone's second row, vLLM's
    Ks, the per-batch schedule) with every unit at the target alone's pace, from its runs right before and after the
    row's (``RowRun.at_pace``): those engines ran minutes apart, and the host's pace between them moves by more than
    the curve can tell. The policies' engine's rows stay as measured where static Ks ran beside them at that batch
    size (seconds apart, they set their level); without such rows they are priced at vLLM's levels, so at that pace
    too."""
    first = reference_rows(rows)
    own_level = {r.batch for r in rows if _engine_fixed(r)}
    return [r if r.batch not in first or (r.role and r.role.in_policies_engine and r.batch in own_level)
            else r.at_pace(first[r.batch]) for r in rows]


def check_rows(rows: list[RowRun], curves: dict[int, CostModel], k_of: dict[str, Callable[[int], int] | None],
               ) -> list[dict]:
    """Per row and batch size: measured and replayed tokens/s and their ratio (measured seconds / replayed), each at
    the pace the row is priced at (:func:`at_reference_pace`), and the curve's levels it was priced at
    (:func:`step_levels`: on the draft's forwards, on the verifications; for the policies' engine those of its own
    static Ks where it ran some at that batch size)."""
    rows = at_reference_pace(rows)
    levels = step_levels(rows, curves, k_of)
    # the policies' engine's levels, at the batch sizes where it ran static Ks
    beside = step_levels([r for r in rows if _engine_fixed(r)], curves, k_of, fitted=_engine_fixed)
    out = []
    for row in rows:
        ours = row.role is not None and row.role.in_policies_engine
        level = beside.get(row.batch, levels[row.batch]) if ours else levels[row.batch]
        pred = sum(predicted_seconds(row, curves, k_of.get(row.name), level))
        meas = sum(row.seconds)
        draft, verify = level
        out.append({"row": row.name, "batch": row.batch, "measured_tokens_per_s": round(row.tokens_per_s, 3),
                    "replayed_tokens_per_s": round(row.tokens / pred, 3) if pred else None,
                    "ratio": round(meas / pred, 4) if pred else None, "draft_level": round(draft, 4),
                    "verify_level": round(verify, 4)})
    return out
