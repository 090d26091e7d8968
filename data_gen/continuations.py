"""Sequential generation the labelling needs: batched draft / target continuations with transformers' ``generate``, and
speculative-decoding trajectories with its assisted generation (batch 1).

Usage: ``conts, stats = continue_batch(model, prompts, max_new_tokens=[64, 32], pad_token_id=0, eos_token_id=2)``
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel


@dataclass
class GenStats:
    """Tokens produced and seconds spent by sequential generation."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, other: GenStats) -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds


def _gen_config(
    max_new: int, temperature: float, top_p: float, pad: int, eos: int | list[int] | None
) -> GenerationConfig:
    sample = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new,
        do_sample=sample,
        temperature=temperature if sample else None,
        top_p=top_p if sample else None,
        top_k=0 if sample else None,
        pad_token_id=pad,
        eos_token_id=eos,
    )


def _strip(tokens: list[int], pad: int, eos: int | list[int] | None) -> list[int]:
    """Cut a generated continuation at its first EOS (kept) and drop padding."""
    eos_set = set([eos] if isinstance(eos, int) else (eos or []))
    out: list[int] = []
    for t in tokens:
        out.append(t)
        if t in eos_set:
            break
    while out and out[-1] == pad and pad not in eos_set:
        out.pop()
    return out


@torch.no_grad()
def continue_batch(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    *,
    pad_token_id: int,
    eos_token_id: int | list[int] | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> tuple[list[list[int]], GenStats]:
    """Continue each prompt with ``model`` (left-padded batch) up to its own ``max_new_tokens``; returns (new tokens per
    prompt cut at EOS, stats)."""
    out: list[list[int]] = [[] for _ in prompts]
    todo = [i for i, n in enumerate(max_new_tokens) if n > 0]
    stats = GenStats()
    if not todo:
        return out, stats
    device = next(model.parameters()).device
    width = max(len(prompts[i]) for i in todo)
    ids = torch.full((len(todo), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, i in enumerate(todo):
        p = prompts[i]
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    longest = max(max_new_tokens[i] for i in todo)
    t0 = time.perf_counter()
    gen = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        generation_config=_gen_config(longest, temperature, top_p, pad_token_id, eos_token_id),
    )
    stats.seconds = time.perf_counter() - t0
    for r, i in enumerate(todo):
        cont = _strip(gen[r, width:].tolist(), pad_token_id, eos_token_id)[: max_new_tokens[i]]
        out[i] = cont
        stats.tokens += len(cont)
    return out, stats


@torch.no_grad()
def speculative_trajectory(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    prompt: list[int],
    max_new_tokens: int,
    *,
    pad_token_id: int,
    eos_token_id: int | list[int] | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    num_assistant_tokens: int = 5,
) -> tuple[list[int], GenStats]:
    """A speculative-decoding trajectory of one prompt with transformers' assisted generation (static draft length)."""
    stats = GenStats()
    if max_new_tokens <= 0:
        return [], stats
    device = next(target.parameters()).device
    draft.generation_config.num_assistant_tokens = num_assistant_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    ids = torch.tensor([prompt], device=device)
    t0 = time.perf_counter()
    gen = target.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        assistant_model=draft,
        generation_config=_gen_config(max_new_tokens, temperature, top_p, pad_token_id, eos_token_id),
    )
    stats.seconds = time.perf_counter() - t0
    cont = _strip(gen[0, len(prompt):].tolist(), pad_token_id, eos_token_id)[:max_new_tokens]
    stats.tokens = len(cont)
    return cont, stats
