"""Latency table for SV's goodput-maximising verification length: draft step time and target verification time by length.

Profiled on the machine in use (the models, device and dtype of the run): one draft (and companion) decoding step, and one
target forward over ``L + 1`` new tokens (the pending token plus ``L`` draft tokens) after a prompt of ``prompt_len``
tokens, median of ``repeats`` runs per length; lengths in between are interpolated linearly.

Usage:
    table, stats = profile_latency(draft, target, companion)
    table.save("latency.json"); table = LatencyTable.load("latency.json")
    best_len, goodput = goodput_length(accept_probs, table.round_latency)
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

__all__ = ["LatencyTable", "profile_latency"]


@dataclass
class LatencyTable:
    """Seconds per draft step and per target verification of L draft tokens."""

    draft_step_s: float
    """One draft decoding step (one token, KV cache warm)."""
    target_s: dict[int, float]
    """L -> seconds of one target forward over L + 1 tokens (L draft tokens plus the pending one)."""
    companion_step_s: float = 0.0
    """One companion decoding step (SV runs it beside the draft)."""
    meta: dict = field(default_factory=dict)
    """Where it was measured: device, dtype, prompt length, repeats."""

    def __post_init__(self) -> None:
        if not self.target_s:
            raise ValueError("target_s is empty: profile at least one verification length")
        self.target_s = {int(k): float(v) for k, v in self.target_s.items()}

    def target_latency(self, n: int) -> float:
        """Target verification seconds for n draft tokens (linear interpolation / extrapolation)."""
        xs = sorted(self.target_s)
        ys = [self.target_s[x] for x in xs]
        if n > xs[-1] and len(xs) > 1:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (n - xs[-1])
        return float(np.interp(n, xs, ys))

    def round_latency(self, n: int) -> float:
        """Seconds of one round that drafts and verifies n tokens: n draft (+ companion) steps and one target pass."""
        return n * (self.draft_step_s + self.companion_step_s) + self.target_latency(n)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> LatencyTable:
        return cls(**json.loads(Path(path).read_text()))


def profile_latency(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    companion: PreTrainedModel | None = None,
    prompt_len: int = 64,
    lengths: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 24, 32, 40),
    repeats: int = 3,
) -> tuple[LatencyTable, dict]:
    """Measure draft / companion step time and target verification time by draft length.

    Args:
        draft, target, companion: the models as used for decoding (device and dtype included).
        prompt_len: tokens in the KV cache before the timed forward.
        lengths: draft lengths L to time (the target runs over L + 1 tokens).
        repeats: timed runs per point (median), after one warm-up.
    Returns:
        (table, stats) with stats = {"seconds": profiling time}.
    """
    if not lengths or min(lengths) < 0:
        raise ValueError(f"lengths={lengths}: give non-negative draft lengths")
    t0 = time.perf_counter()
    vocab = min(m.get_output_embeddings().weight.shape[0] for m in (draft, target))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, prompt_len + max(lengths) + 1), generator=g)
    d_prompt = prompt[:, :prompt_len].to(draft.device)
    draft_s = _time_step_len(draft, d_prompt, d_prompt[:, -1:], repeats)
    comp_s = 0.0
    if companion is not None:
        c_prompt = prompt[:, :prompt_len].to(companion.device)
        comp_s = _time_step_len(companion, c_prompt, c_prompt[:, -1:], repeats)
    t_prompt = prompt.to(target.device)
    target_s = {}
    for n in sorted(set(lengths)):
        cache_prompt = t_prompt[:, :prompt_len]
        target_s[n] = _time_step_len(target, cache_prompt, t_prompt[:, prompt_len : prompt_len + n + 1], repeats)
    meta = {"device": str(target.device), "dtype": str(target.dtype), "prompt_len": prompt_len, "repeats": repeats}
    table = LatencyTable(draft_step_s=draft_s, target_s=target_s, companion_step_s=comp_s, meta=meta)
    return table, {"seconds": time.perf_counter() - t0}


@torch.no_grad()
def _time_step_len(model: PreTrainedModel, prompt: torch.Tensor, new: torch.Tensor, repeats: int) -> float:
    """Median seconds of a forward over ``new`` after ``prompt`` (KV cache prefilled, cropped back after each run)."""
    cache = DynamicCache(config=model.config)
    model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
    times = []
    for _ in range(repeats + 1):
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model(input_ids=new, past_key_values=cache, use_cache=True, logits_to_keep=0)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cache.crop(-new.shape[1])
    return statistics.median(times[1:])
