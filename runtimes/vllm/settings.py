"""What to set in vLLM for a pair on this machine: ``num_speculative_tokens`` at batch 1 and
``num_speculative_tokens_per_batch_size``, each K tuned under vLLM's own curve at that batch size, K = 0 where none
beats the target alone by ``MARGINAL``.

Each K is priced with the acceptance vLLM measured on validation prompts where the curve file holds it (a step of K
drafts yields ``1 + S(1) + ... + S(K)`` tokens a request), else by replaying the labelled data; why the measured one is
preferred: docs/vllm.md.

Usage: .venv-vllm/bin/python -m pipelines.recommend --data_dir outputs/default/data --runtime vllm
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from compute.timing import CostModel

__all__ = ["BatchPick", "ACCEPTANCE", "MARGINAL", "measured_survival", "acceptance_picks", "schedule_ranges",
           "paste_lines"]

MARGINAL = 1.15
"""Predicted speedup a K must reach to be recommended over the target alone: a step's price on a shared 2-core CPU is
off by up to ~7%, so a smaller gain is inside the curve's error."""

ACCEPTANCE = "vllm_acceptance"
"""Key in a vLLM curve's ``extra``: ``{"survival": [S(1), ..., S(K)], "drafts", "k", "prompts", "split"}`` from vLLM's
counters on validation prompts."""


@dataclass(frozen=True)
class BatchPick:
    """The K tuned at one batch size."""

    batch: int
    k: int
    """num_speculative_tokens (0: do not speculate at this batch size)."""
    val_speedup: float
    """The tuned K's replayed speedup over the target alone on validation, at this batch's curve."""
    test_speedup: float
    """The same K on the test split (1.0 for K = 0)."""
    best_k: int
    """The fastest K on validation, even where it does not beat the target alone."""
    source: str = "replay"
    """``replay`` (the labelled validation split replayed) or ``vllm acceptance`` (priced with vLLM's measured
    acceptance)."""

    def to_dict(self) -> dict:
        return asdict(self)


def measured_survival(cm: CostModel, mode: str = "greedy") -> list[float] | None:
    """S(1..K) of vLLM's measured acceptance from its curve's ``extra``; None where not measured or ``mode`` is not
    greedy."""
    measured = cm.extra.get(ACCEPTANCE)
    return list(measured["survival"]) if measured and mode == "greedy" else None


def acceptance_picks(survival: Sequence[float], curves: Mapping[int, CostModel]) -> list[BatchPick]:
    """K per batch size priced with vLLM's measured acceptance: the most tokens/s against the target alone's step, 0
    where none reaches ``MARGINAL``; K bounded by ``survival`` and the curve."""
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
    """``num_speculative_tokens_per_batch_size``: each batch size's K up to the next one's (the last to
    ``max_num_seqs``), equal neighbours merged. Where no K pays the range takes ``best_k``, not 0: vLLM 0.32.0 still
    runs the draft's forward at K = 0, slower than K = 1 (docs/vllm.md)."""
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
