"""Plan a chunk's sequences (origins and prefix lengths, deterministic in the seed and prompt id) and cut them into
generation batches and labelling passes."""
from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from data_gen.config import GenerateConfig
from data_gen.labelling import SequenceSpec, shared_prefix_len
from data_gen.schema import ORIGINS


@dataclass
class Planned:
    """One sequence to produce: a prompt, an origin and how many continuation tokens precede the rollout."""

    prompt_index: int
    origin: str
    m: int
    seq_id: str
    cont: list[int] = field(default_factory=list)
    rollout: list[int] = field(default_factory=list)
    states: dict[str, torch.Tensor] = field(default_factory=dict)
    """Role -> the states a model computed while writing part of the sequence (``SequenceSpec.states``)."""


def rng_for(seed: int, key: str) -> np.random.Generator:
    """A numpy generator seeded by ``seed`` and a string key (the same key always draws the same numbers)."""
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def plan_prompt(cfg: GenerateConfig, index: int, sample_id: str) -> list[Planned]:
    """Draw the origins and prefix lengths of one prompt's sequences (deterministic in seed and sample id)."""
    rng = rng_for(cfg.seed, sample_id)
    names = [o for o in ORIGINS if cfg.origins.get(o, 0) > 0]
    shares = np.array([cfg.origins[o] for o in names], dtype=float)
    out = []
    for r in range(cfg.sequences_per_prompt):
        origin = str(rng.choice(names, p=shares / shares.sum()))
        lo, hi = cfg.text_tokens if origin == "text" and cfg.text_tokens else cfg.prefix_tokens
        m = 0 if origin == "prompt" else int(rng.integers(lo, hi + 1))
        out.append(Planned(index, origin, m, f"{sample_id}#{r}"))
    return out


def batches(items: list, size: int) -> Iterator[list]:
    """Consecutive slices of ``items`` of at most ``size`` each."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


def batches_from_longest(items: list, size: int) -> Iterator[list]:
    """Batches of at most ``size`` of length-sorted ``items`` cut from the longest down: ceil(n / size) batches with the
    fewest decoding steps."""
    if items:
        first = len(items) % size or size
        yield items[:first]
        yield from batches(items[first:], size)


def label_batches(seqs: list[SequenceSpec], budget_tokens: int) -> list[list[SequenceSpec]]:
    """Pack sequences into labelling passes within ``budget`` tokens, a prompt's sequences together (their prompt passes
    once), the rest by length."""
    by_prompt: dict[str, list[SequenceSpec]] = defaultdict(list)
    for s in seqs:
        by_prompt[s.sample_id].append(s)
    out: list[list[SequenceSpec]] = []
    singles: list[SequenceSpec] = []
    for group in by_prompt.values():
        cur: list[SequenceSpec] = []
        for s in sorted(group, key=lambda s: len(s.tokens)):
            shared = shared_prefix_len([c.tokens for c in [*cur, s]])
            if cur and shared + (len(cur) + 1) * (len(s.tokens) - shared) > budget_tokens:
                out.append(cur) if len(cur) > 1 else singles.append(cur[0])
                cur = []
            cur.append(s)
        if cur:
            out.append(cur) if len(cur) > 1 else singles.append(cur[0])
    cur = []
    for s in sorted(singles, key=lambda s: len(s.tokens)):
        if cur and (len(cur) + 1) * len(s.tokens) > budget_tokens:
            out.append(cur)
            cur = []
        cur.append(s)
    if cur:
        out.append(cur)
    return out
