"""What to set in vLLM for a pair on this machine, per batch size: ``num_speculative_tokens`` at batch 1 and
``num_speculative_tokens_per_batch_size`` (vLLM's batch-size Dynamic SD), each K tuned on a data folder's validation
split under vLLM's own curve at that batch size (``benchmark.vllm_curve``), K = 0 (no drafting) wherever no K beats
the target alone (``main_job.recommend.vllm_batch_picks`` tunes them).

At B concurrent requests every request runs the same K each step and a step costs ``K * draft + target(K + 1)`` at
batch B; each request's rounds are replayed over the labelled draft tokens (the replay of every runtime's rule), so a
batch's tokens/s is B times a sequence's and the speedup over the target alone is the sequence's (the ragged end of a
batch, where requests finish at different steps, is left out).

Usage::

    picks = vllm_batch_picks(load_columns("outputs/default/data", ["val", "test"]), curves)
    print("\\n".join(paste_lines(picks, "DRAFT", max_num_seqs=8)))
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["BatchPick", "schedule_ranges", "paste_lines"]


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

    def to_dict(self) -> dict:
        return asdict(self)


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
    if one.k:
        cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": one.k}
        lines.append(f"batch 1: speculative_config={json.dumps(cfg)} (replayed {one.test_speedup:.2f}x the target "
                     "alone on the test split)")
    else:
        lines.append(f"batch 1: do not speculate (the best K, {one.best_k}, replays {one.val_speedup:.2f}x the "
                     "target alone on the validation split)")
    losing = [p.batch for p in picks if not p.k]
    if len(losing) == len(picks):
        lines.append("every batch size measured: do not speculate (no speculative_config)")
        return lines
    cfg = {"method": "draft_model", "model": draft, "num_speculative_tokens": top,
           "num_speculative_tokens_per_batch_size": [list(r) for r in ranges]}
    lines.append(f"by batch size: speculative_config={json.dumps(cfg)}")
    lines.append(f"vllm serve TARGET --max-num-seqs {max_num_seqs} --speculative-config '{json.dumps(cfg)}'")
    if losing:
        lines.append(f"at {', '.join(map(str, losing))} concurrent requests no K beats the target alone: where most "
                     "traffic runs that wide, serve without speculative_config (a K of 0 in the schedule still runs "
                     "the draft model every step)")
    return lines
