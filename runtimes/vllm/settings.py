"""What to set in vLLM for a pair on this machine, per batch size: ``num_speculative_tokens`` at batch 1 and
``num_speculative_tokens_per_batch_size`` (vLLM's batch-size Dynamic SD), each K tuned on a data folder's validation
split under vLLM's own curve at that batch size (``runtimes.vllm.curve``), K = 0 (no drafting) wherever no K beats
the target alone by ``MARGINAL`` (``main_job.recommend.vllm_batch_picks`` tunes them).

At B concurrent requests every request runs the same K each step and a step costs ``K * draft + target(K + 1)`` at
batch B; each request's rounds are replayed over the labelled draft tokens (the replay of every runtime's rule), so a
batch's tokens/s is B times a sequence's and the speedup over the target alone is the sequence's (the ragged end of a
batch, where requests finish at different steps, is left out).

Where vLLM's curve file also holds the acceptance vLLM itself measured on validation prompts (``ACCEPTANCE`` in its
``extra``: ``runtimes.vllm.curve.measure_vllm_acceptance``), :func:`acceptance_picks` prices each K with it instead:
with S(j) the share of vLLM's draft rounds whose first j drafts were all accepted, a step of K drafts yields
``1 + S(1) + ... + S(K)`` tokens a request. The labelled data's tokens come from another mix (rollouts from prefixes
of several origins, drafted by specstop's int8 draft) whose acceptance can sit far from what vLLM's bfloat16 draft
meets on a user's prompts; vLLM's own counters on the validation prompts are the closer estimate.

Usage::

    picks = acceptance_picks(curves[1].extra[ACCEPTANCE]["survival"], curves)   # vLLM's acceptance
    picks = vllm_batch_picks(load_columns("outputs/default/data", ["val", "test"]), curves)
    print("\\n".join(paste_lines(picks, "DRAFT", max_num_seqs=8)))
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from compute.timing import CostModel

__all__ = ["BatchPick", "ACCEPTANCE", "MARGINAL", "measured_survival", "acceptance_picks", "schedule_ranges",
           "paste_lines"]

MARGINAL = 1.15
"""The predicted speedup a K must reach to be recommended over the target alone: a step's price on a shared 2-core
CPU is off by up to about 7% (the vLLM benchmark's replay check) and a speedup is the ratio of two such prices, so a
smaller predicted gain is inside the curve's error, while the target alone risks nothing. The fastest K is still kept
(``best_k``) for the schedule."""

ACCEPTANCE = "vllm_acceptance"
"""Key in a vLLM curve's ``extra``: ``{"survival": [S(1), ..., S(K)], "drafts": n, "k": K, "prompts": n, "split":
"val"}``, measured by vLLM's counters on validation prompts."""


@dataclass(frozen=True)
class BatchPick:
    """The K tuned at one batch size."""

    batch: int
    k: int
    """num_speculative_tokens (0: do not speculate at this batch size)."""
    val_speedup: float
    """The tuned K's replayed speedup over the target alone on the validation split (at this batch's curve)."""
    test_speedup: float
    """The same K on the test split (1.0 for K = 0)."""
    best_k: int
    """The fastest K on validation, even where it does not beat the target alone."""
    source: str = "replay"
    """``replay`` (the labelled data's validation split replayed) or ``vllm acceptance`` (priced with the acceptance
    vLLM measured on validation prompts: both speedups are that prediction)."""

    def to_dict(self) -> dict:
        return asdict(self)


def measured_survival(cm: CostModel, mode: str = "greedy") -> list[float] | None:
    """S(1..K) of the acceptance vLLM measured on validation prompts, kept in its curve's ``extra`` (``ACCEPTANCE``);
    None where it was not measured, or for ``mode`` other than greedy (it was measured greedy)."""
    measured = cm.extra.get(ACCEPTANCE)
    return list(measured["survival"]) if measured and mode == "greedy" else None


def acceptance_picks(survival: Sequence[float], curves: Mapping[int, CostModel]) -> list[BatchPick]:
    """K per batch size priced with vLLM's measured acceptance (see the module docstring): the K with the most
    tokens/s against the target alone's step, 0 where none is predicted at least ``MARGINAL`` times as fast; K up to
    ``len(survival)`` and to the longest verification the curve measured."""
    picks = []
    for b in sorted(curves):
        cm = curves[b]
        top = min(len(survival), max(int(length) for length in cm.target_s) - 1)
        speed = {k: (1 + sum(survival[:k])) * cm.target_time(1) / (k * cm.draft_s_per_token + cm.target_time(k + 1))
                 for k in range(1, top + 1)}
        best = max(speed, key=lambda k: speed[k])
        k = best if speed[best] >= MARGINAL else 0
        picks.append(BatchPick(b, k, round(speed[best], 4), round(speed[k], 4) if k else 1.0, best,
                               source="vllm acceptance"))
    return picks


def schedule_ranges(picks: list[BatchPick], max_num_seqs: int) -> tuple[tuple[int, int, int], ...]:
    """``num_speculative_tokens_per_batch_size``: each measured batch size's K from it up to the next one's (the
    last up to ``max_num_seqs``), neighbours with the same K merged; the first range starts at 1. Where no K pays, the
    range takes the best K (``best_k``, at least 1), not 0: in vLLM 0.32.0 a step scheduled with K = 0 still runs the
    draft model's forward over the accepted tokens (it keeps the draft's KV cache in step), measured slower at
    4 concurrent requests than K = 1 (docs/vllm.md); the target alone is the answer there, without speculation."""
    ranges: list[list[int]] = []
    ordered = sorted(picks, key=lambda p: p.batch)
    for i, p in enumerate(ordered):
        start = 1 if i == 0 else p.batch
        end = ordered[i + 1].batch - 1 if i + 1 < len(ordered) else max(max_num_seqs, p.batch)
        k = p.k or max(1, p.best_k)
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, k])
    return tuple(tuple(r) for r in ranges)  # type: ignore[return-value]


def paste_lines(picks: list[BatchPick], draft: str, max_num_seqs: int) -> list[str]:
    """The settings to paste: offline ``speculative_config`` and ``vllm serve`` flags, batch 1's K and the schedule."""
    one = next((p for p in picks if p.batch == 1), picks[0])
    max_num_seqs = max(max_num_seqs, *(p.batch for p in picks))  # the schedule covers every batch size tuned
    ranges = schedule_ranges(picks, max_num_seqs)
    top = max(r[2] for r in ranges)
    lines = []
    measured = one.source == "vllm acceptance"
    if one.k:
        cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": one.k}
        why = ("predicted {:.2f}x the target alone from vLLM's acceptance on validation prompts" if measured
               else "replayed {:.2f}x the target alone on the test split").format(one.test_speedup)
        lines.append(f"batch 1: speculative_config={json.dumps(cfg)} ({why})")
    else:
        why = "predicts {:.2f}x the target alone from vLLM's acceptance on validation prompts" if measured \
            else "replays {:.2f}x the target alone on the validation split"
        lines.append(f"batch 1: do not speculate (the best K, {one.best_k}, {why.format(one.val_speedup)})")
    losing = [p.batch for p in picks if not p.k]
    if len(losing) == len(picks):
        lines.append("every batch size measured: do not speculate (no speculative_config)")
        return lines
    cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": top,
           "num_speculative_tokens_per_batch_size": [list(r) for r in ranges]}
    lines.append(f"by batch size: speculative_config={json.dumps(cfg)}")
    lines.append(f"vllm serve TARGET --max-num-seqs {max_num_seqs} --speculative-config '{json.dumps(cfg)}'")
    if losing:
        lines.append(f"at {', '.join(map(str, losing))} concurrent requests no K is predicted {MARGINAL:.2f}x the "
                     "target alone (a smaller gain is inside the curve's error): where most traffic runs that wide, "
                     "serve without speculative_config (a K of 0 in the schedule still runs the draft model every "
                     "step)")
    return lines
