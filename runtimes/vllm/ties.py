"""Why a vLLM row's greedy output differs from the target alone's: how close the target's two candidates were there.

Exact speculative decoding returns the target's own greedy tokens, but vLLM's bfloat16 forwards are not
batch-invariant on the CPU: verifying K + 1 tokens in one forward rounds differently from decoding one, so where the
target's top two logits nearly tie, the argmax can flip (vLLM's own static-K rows flip at the same places as
specstop's policies). For each output that differs, this finds the first differing position and computes the target's
logits there once more in float32 with transformers (the prompt and the target alone's tokens before it as context):
``gap`` is logit(target alone's token) - logit(the row's token), ``top2_gap`` the distance between the two largest.
A gap of a few hundredths is a tie at bfloat16's precision; a large one would be a bug.

Usage (in ``.venv-vllm``, after the engines are released)::

    ties = tie_gaps(rows, units, target_dir="/root/.cache/specstop/qwen2.5-coder-1.5b-instruct")
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from runtimes.vllm.bench import TARGET_ALONE, RowRun

log = logging.getLogger("pipelines.vllm_bench")

__all__ = ["Divergence", "divergences", "tie_gaps"]


@dataclass(frozen=True)
class Divergence:
    """The first position where a row's output differs from the target alone's (same batch size)."""

    row: str
    batch: int
    unit: int
    slot: int
    """The prompt's place in its unit (0 at batch 1)."""
    position: int
    """Index of the first differing generated token."""
    reference: int
    """The target alone's token there."""
    token: int
    """The row's token there (-1: the row's output ended first)."""


def divergences(rows: list[RowRun]) -> list[Divergence]:
    """Every output of ``rows`` that differs from the target alone's at its batch size, at its first difference."""
    refs = {r.batch: r for r in rows if r.name == TARGET_ALONE}
    out = []
    for r in rows:
        ref = refs.get(r.batch)
        if ref is None or r is ref:
            continue
        for u, (mine, theirs) in enumerate(zip(r.outputs, ref.outputs)):
            for j, (a, b) in enumerate(zip(mine, theirs)):
                if a == b:
                    continue
                i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                if i >= len(b):
                    continue  # the reference ended first: no target token to compare with
                out.append(Divergence(r.name, r.batch, u, j, i, b[i], a[i] if i < len(a) else -1))
    return out


def tie_gaps(rows: list[RowRun], units: dict[int, list[list[list[int]]]], target_dir: str) -> list[dict]:
    """Each divergence of ``rows`` with the target's float32 logit gaps there (one forward per distinct context)."""
    divs = divergences(rows)
    if not divs:
        return []
    from transformers import AutoModelForCausalLM

    refs = {r.batch: r for r in rows if r.name == TARGET_ALONE}
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    logits_at: dict[tuple[int, int, int, int], torch.Tensor] = {}
    out = []
    for d in divs:
        key = (d.batch, d.unit, d.slot, d.position)
        if key not in logits_at:
            context = units[d.batch][d.unit][d.slot] + refs[d.batch].outputs[d.unit][d.slot][:d.position]
            with torch.inference_mode():
                logits_at[key] = model(torch.tensor([context])).logits[0, -1].float()
        z = logits_at[key]
        top = torch.topk(z, 2).values
        gap = float(z[d.reference] - z[d.token]) if d.token >= 0 else None
        out.append({**asdict(d), "gap": None if gap is None else round(gap, 4),
                    "top2_gap": round(float(top[0] - top[1]), 4), "reference_is_top1": bool(z.argmax() == d.reference)})
    log.info("%d outputs differ from the target alone's; float32 logit gap at the first difference: max %.3f",
             len(out), max((abs(t["gap"]) for t in out if t["gap"] is not None), default=float("nan")))
    del model
    return out
