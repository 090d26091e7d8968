"""transformers' assisted generation as a runtime with a curve of its own: its forward passes as ``generate`` runs them,
plus what ``generate`` adds around them per round and per drafted token.

specstop's engine curve leaves out ``generate``'s work between forwards (assistant calls, masks, logits processors,
cache cropping), so a replay priced with it over-predicts transformers. Here real target-only and fixed-length assisted
runs are timed by forward hooks; the curve is the median forward per length plus the outside time fitted as ``rounds x
per_round + drafted x per_draft``.

Usage: python -m pipelines.measure_costs --runtime transformers --data_dir outputs/default/data
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from compute.timing import CostModel, clock

__all__ = ["measure_transformers_costs", "ForwardTimer"]


class ForwardTimer:
    """Times a module's forward calls by hooks: each call's new tokens (its ``input_ids`` width) and seconds."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls: list[tuple[int, float]] = []
        self._t0, self._n = 0.0, 0
        self._device = next(model.parameters()).device
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post)]

    def _pre(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._n = int(ids.shape[-1]) if ids is not None else 0
        self._t0 = clock(self._device)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.calls.append((self._n, clock(self._device) - self._t0))

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.calls)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


@dataclass
class _Run:
    """One generation: the target's calls after the prefill and the draft's calls, each (new tokens, seconds), and the
    seconds outside every forward."""

    target: list[tuple[int, float]]
    draft: list[tuple[int, float]]
    outside_s: float

    @property
    def rounds(self) -> int:
        return len(self.target)

    @property
    def drafted(self) -> int:
        return len(self.draft)


def _generate(draft: Any, target: Any, prompt: torch.Tensor, k: int, new_tokens: int) -> _Run:
    """``new_tokens`` of greedy generation, timed: assisted at ``k`` drafts a round (no threshold), or target alone for
    ``k == 0``."""
    gc = draft.generation_config
    saved = {n: getattr(gc, n, None) for n in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                                "assistant_confidence_threshold")}
    gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = k, "constant", 0.0
    t_timer, d_timer = ForwardTimer(target), ForwardTimer(draft)
    try:
        t0 = clock(prompt.device)
        target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=draft if k else None,
                        do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        total = clock(prompt.device) - t0
    finally:
        t_timer.close()
        d_timer.close()
        for n, v in saved.items():
            setattr(gc, n, v)
    return _Run(t_timer.calls[1:], d_timer.calls, total - t_timer.seconds - d_timer.seconds)


def _curve(runs: dict[int, _Run], prompt_len: int) -> tuple[dict[int, float], float]:
    """(target seconds by L: median of the calls reading L tokens, non-decreasing; the draft's median step) over every
    run, prefills left out."""
    by_len: dict[int, list[float]] = {}
    for run in runs.values():
        for n, sec in run.target:
            by_len.setdefault(n, []).append(sec)
    steps = [sec for run in runs.values() for n, sec in run.draft if n < prompt_len]  # the prefill reads the prompt
    lengths = sorted(by_len)
    times = [float(np.median(by_len[n])) for n in lengths]
    for i in range(len(times) - 2, -1, -1):  # a longer forward never costs less: a slower shorter one was noise
        times[i] = min(times[i], times[i + 1])
    return dict(zip(lengths, times)), float(np.median(steps))


def measure_transformers_costs(draft: Any, target: Any, lengths: tuple[int, ...] = (1, 2, 4, 8, 16),
                               new_tokens: int = 64, prompt_len: int = 128, repeats: int = 2,
                               base: CostModel | None = None) -> CostModel:
    """transformers' curve of a pair: target-only and assisted ``generate`` at each of ``lengths`` (of ``repeats``, the
    run with the least outside time kept); ``runtime="transformers"``, the runs and the fit in ``extra``."""
    if len(lengths) < 2 or min(lengths) < 1:
        raise ValueError(f"lengths={lengths}: give at least two draft lengths >= 1 to fit two overheads")
    dev = next(target.parameters()).device
    vocab = min(int(draft.config.vocab_size), int(target.config.vocab_size))
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(dev)
    runs: dict[int, _Run] = {}
    with torch.inference_mode():
        _generate(draft, target, prompt, lengths[0], 8)  # warm-up: first-call allocations, lazy builds
        for k in (0, *lengths):
            runs[k] = min((_generate(draft, target, prompt, k, new_tokens) for _ in range(repeats)),
                          key=lambda r: r.outside_s)
    target_s, draft_s = _curve(runs, prompt_len)
    assisted = [runs[k] for k in lengths]
    a = np.array([[r.rounds, r.drafted] for r in assisted], dtype=np.float64)
    b = np.array([r.outside_s for r in assisted], dtype=np.float64)
    (per_round, per_draft), *_ = np.linalg.lstsq(a, b, rcond=None)
    per_round, per_draft = max(float(per_round), 0.0), max(float(per_draft), 0.0)
    extra = {"transformers_per_round_s": per_round, "transformers_per_draft_s": per_draft,
             "transformers_runs": [{"k": k, "rounds": r.rounds, "drafted": r.drafted, "outside_s": r.outside_s}
                                   for k, r in runs.items()],
             "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    known = base if base is not None else CostModel(draft_s_per_token=draft_s, target_s=target_s)
    return replace(known, runtime="transformers", draft_s_per_token=draft_s + per_draft, prompt_len=prompt_len,
                   target_s={L: t + per_round for L, t in target_s.items()}, extra=extra,
                   notes=f"transformers' generate: forwards as it runs them, plus {per_round * 1e3:.1f} ms a round "
                         f"and {per_draft * 1e3:.1f} ms a drafted token outside them")
