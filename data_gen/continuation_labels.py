"""Records along a continuation the caller already has (a benchmark's target-only output) for the replay check: the
continuation labelled teacher-forced, plus the draft's rollout from every point a greedy decoder's draft leaves it.

Usage: ``records, stats = label_continuation(models, prompt_ids, output_ids, LabelOptions(), sample_id="p0")``
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from data_gen.continuations import continue_batch
from data_gen.labelling import LabelModels, LabelOptions, Segment, SequenceSpec, label_sequences
from data_gen.planning import batches, label_batches


@dataclass
class ContinuationStats:
    """What :func:`label_continuation` labelled and how long it took."""

    records: int = 0
    rollouts: int = 0
    """Draft rollouts generated and labelled (one per branch point)."""
    label_seconds: float = 0.0
    rollout_seconds: float = 0.0


def branch_offsets(records: dict[str, list], draw: str = "greedy") -> list[int]:
    """Offsets where the ``draw`` record fails greedy match, and the end: where a greedy decoder's draft leaves the
    continuation."""
    rows = [(o, m) for o, m, d, r in zip(records["offset"], records["greedy_match"], records["draw"],
                                         records["rollout"]) if d == draw and not r]
    return sorted({o for o, m in rows if not m} | {len(rows)})


def draft_rollouts(draft: PreTrainedModel, prefixes: list[list[int]], length: int, *, pad_token_id: int,
                   batch_size: int = 8) -> list[list[int]]:
    """The draft's greedy continuation of ``length`` tokens after each prefix, not stopped at EOS (a decoder's draft
    drafts on past one), in batches."""
    out: list[list[int]] = []
    for group in batches(prefixes, batch_size):
        conts, _ = continue_batch(draft, group, [length] * len(group), pad_token_id=pad_token_id, eos_token_id=[])
        out += conts
    return out


def label_continuation(
    models: LabelModels,
    prompt: list[int],
    continuation: list[int],
    opts: LabelOptions,
    *,
    sample_id: str,
    rollout_len: int,
    branches: bool = True,
    source: str = "given",
    domain: str = "chat",
    split: str = "test",
    gen_batch_size: int = 8,
    label_batch_tokens: int = 4096,
    generator: torch.Generator | None = None,
) -> tuple[dict[str, list], ContinuationStats]:
    """Records of origin ``target`` along ``continuation``, labelled teacher-forced as a target-origin prefix, plus with
    ``branches`` a ``rollout_len``-token draft rollout from every branch point (same ``seq_id``), which the replay
    follows past a round's first mismatch. Needs greedy data; returns (record columns, stats)."""
    if not prompt or not continuation:
        raise ValueError(f"{sample_id}: label_continuation needs a non-empty prompt and continuation")
    if branches and opts.temperature > 0:
        raise ValueError("branch rollouts follow greedy decoding: set branches=False for sampled data")
    P = len(prompt)
    seq_id = f"{sample_id}#0"
    stats = ContinuationStats()
    t0 = time.perf_counter()
    main = SequenceSpec(sample_id, source, domain, split, seq_id, prompt + continuation,
                        [Segment(P, P + len(continuation), "target", rollout=False)])
    parts = [label_sequences(models, [main], opts, generator=generator)[0]]
    stats.label_seconds += time.perf_counter() - t0
    if branches:
        offsets = branch_offsets(parts[0], "greedy")
        t0 = time.perf_counter()
        rollouts = draft_rollouts(models.draft, [prompt + continuation[:j] for j in offsets], rollout_len,
                                  pad_token_id=opts.pad_token_id, batch_size=gen_batch_size)
        stats.rollout_seconds += time.perf_counter() - t0
        t0 = time.perf_counter()
        seqs = [SequenceSpec(sample_id, source, domain, split, seq_id, prompt + continuation[:j] + r,
                             [Segment(P + j, P + j + len(r), "target", rollout=True)])
                for j, r in zip(offsets, rollouts) if r]
        for batch in label_batches(seqs, label_batch_tokens):
            parts.append(label_sequences(models, batch, opts, generator=generator)[0])
        stats.rollouts = len(seqs)
        stats.label_seconds += time.perf_counter() - t0
    records = {k: [x for part in parts for x in part[k]] for k in parts[0]}
    stats.records = len(records["offset"])
    return records, stats

