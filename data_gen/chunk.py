"""Produce one chunk's records (one shard) in phases, whose order fixes the random draws each gets:

1. :func:`plan_chunk`: origins, prefix lengths, the text origin's answers;
2. :func:`target_continuations`: the target's continuations (and greedy spec trajectories), cache kept for labelling;
3. :func:`sampled_spec_trajectories`: assisted generation for the spec origin when sampling;
4. :func:`draft_side`: the draft's pass over every prefix, then its continuation and rollout;
5. :func:`feed_target_rollouts`: the rollouts fed through the target's caches;
6. :func:`sequence_specs`, :func:`label_chunk`: the sequences, labelled in passes within a token budget.

Usage: ``records, stats = produce_chunk(cfg, models, tok, prompts, rendered, [0, 1, 2], chunk=0)``
"""
from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from data_gen.config import GenerateConfig
from data_gen.continuations import GenStats, speculative_trajectory
from data_gen.labelling import CachedPass, LabelModels, LabelOptions, Segment, SequenceSpec, draft_pass, label_sequences
from data_gen.planning import Planned, batches, batches_from_longest, label_batches, plan_prompt
from data_gen.prompts import split_of

StepCallback = Callable[[str, int], None]
"""Called after each batch of a phase with its name and the records labelled so far in the chunk."""


@dataclass
class ChunkStats:
    """Cost accounting of one chunk: records, generation and labelling seconds per origin and model."""

    records_by_origin: Counter = field(default_factory=Counter)
    gen_seconds_by_origin: defaultdict = field(default_factory=lambda: defaultdict(float))
    gen_tokens_by_origin: Counter = field(default_factory=Counter)
    label_seconds_by_origin: defaultdict = field(default_factory=lambda: defaultdict(float))
    label_seconds: dict = field(default_factory=lambda: defaultdict(float))
    text_fallbacks: int = 0
    tokens_passed: int = 0
    """Tokens the labelling passes sent through each model (a shared prompt once)."""
    positions: int = 0
    """Labelled positions (each model's LM head ran on these; two records each with sample_draw)."""


@dataclass
class ChunkContext:
    """What every phase of a chunk reads (config, models, prompts, special tokens) and the accounting it writes."""

    cfg: GenerateConfig
    models: LabelModels
    rendered: list[list[int]]
    """Token ids of every prompt of the run (indexed by ``Planned.prompt_index``)."""
    pad: int
    eos: int | list[int] | None
    stats: ChunkStats = field(default_factory=ChunkStats)
    on_step: StepCallback | None = None

    def step(self, phase: str) -> None:
        """Report a finished batch of ``phase`` to ``on_step``."""
        if self.on_step is not None:
            self.on_step(phase, sum(self.stats.records_by_origin.values()))


def produce_chunk(
    cfg: GenerateConfig,
    models: LabelModels,
    tok,
    prompts: list,
    rendered: list[list[int]],
    chunk_indices: list[int],
    chunk: int,
    *,
    on_step: StepCallback | None = None,
) -> tuple[dict[str, list], ChunkStats]:
    """Plan, generate and label the sequences of one chunk of prompts; returns its records and cost accounting.
    ``on_step`` is a heartbeat after each batch and takes no part in the records."""
    ctx = ChunkContext(cfg, models, rendered, tok.pad_token_id, tok.eos_token_id, on_step=on_step)
    torch.manual_seed(cfg.seed * 100_003 + chunk)
    plans = plan_chunk(ctx, tok, prompts, chunk_indices)
    target_runs = target_continuations(ctx, plans)
    sampled_spec_trajectories(ctx, plans)
    draft_side(ctx, plans, chunk)
    feed_target_rollouts(ctx, target_runs)
    del target_runs  # the target's caches, before the labelling passes allocate theirs
    records = label_chunk(ctx, sequence_specs(cfg, prompts, rendered, plans), chunk)
    return records, ctx.stats


def plan_chunk(ctx: ChunkContext, tok, prompts: list, chunk_indices: list[int]) -> list[Planned]:
    """The chunk's planned sequences; a text origin without a reference answer falls back to draft (``text_fallbacks``).
    """
    plans: list[Planned] = []
    for i in chunk_indices:
        plans += plan_prompt(ctx.cfg, i, prompts[i].id)
    for pl in plans:
        if pl.origin == "text":
            ref = prompts[pl.prompt_index].reference
            if not ref:
                pl.origin = "draft"
                ctx.stats.text_fallbacks += 1
            else:
                pl.cont = tok(ref, add_special_tokens=False)["input_ids"][: pl.m]
    return plans


def target_continuations(ctx: ChunkContext, plans: list[Planned]) -> list[tuple[CachedPass, list[Planned]]]:
    """The target's continuations, in batches of similar length, with each batch's pass (whose cache the rollouts are
    fed to later).

    In greedy decoding exact speculative decoding emits the target's greedy continuation token for token, so spec
    trajectories are made here too, batched, instead of one assisted generation per prompt. The pass over the prompt is
    also the target's labelling pass.
    """
    cfg, st = ctx.cfg, ctx.stats
    on_target = ("target", "spec") if cfg.temperature == 0 else ("target",)
    runs: list[tuple[CachedPass, list[Planned]]] = []
    todo = sorted((p for p in plans if p.origin in on_target), key=lambda p: p.m)
    for group in batches_from_longest(todo, cfg.gen_batch_size):
        run = CachedPass(ctx.models.target, [ctx.rendered[p.prompt_index] for p in group], pad_token_id=ctx.pad)
        conts = run.decode([p.m for p in group], eos_token_id=ctx.eos, temperature=cfg.temperature, top_p=cfg.top_p)
        for p, c in zip(group, conts):
            p.cont = c
        _charge_by_origin(st, group, conts, GenStats(seconds=run.stats.step_seconds))
        runs.append((run, group))
        ctx.step("target")
    return runs


def sampled_spec_trajectories(ctx: ChunkContext, plans: list[Planned]) -> None:
    """With sampling, each spec-origin prefix is a real assisted-generation trajectory, one prompt at a time (greedy
    ones come from :func:`target_continuations`)."""
    cfg, st = ctx.cfg, ctx.stats
    if cfg.temperature == 0:
        return
    for p in (p for p in plans if p.origin == "spec"):
        p.cont, gs = speculative_trajectory(ctx.models.target, ctx.models.draft, ctx.rendered[p.prompt_index], p.m,
                                            pad_token_id=ctx.pad, eos_token_id=ctx.eos, temperature=cfg.temperature,
                                            top_p=cfg.top_p)
        st.gen_seconds_by_origin["spec"] += gs.seconds
        st.gen_tokens_by_origin["spec"] += gs.tokens
        ctx.step("spec")


def _device(ctx: ChunkContext) -> torch.device:
    """The models' device, where a chunk's seeded random streams live (``torch.multinomial`` draws on its input's
    device)."""
    return next(ctx.models.draft.parameters()).device


def draft_side(ctx: ChunkContext, plans: list[Planned], chunk: int) -> None:
    """The draft's side, one pass a sequence: its states over the prefix, then its own tokens decoded from that cache (m
    + L for the draft origin, L for the others), reused by labelling."""
    cfg, st, eos, L = ctx.cfg, ctx.stats, ctx.eos, ctx.cfg.rollout_len
    rng = torch.Generator(device=_device(ctx)).manual_seed(cfg.seed * 104_729 + chunk)
    todo = sorted(plans, key=lambda p: len(ctx.rendered[p.prompt_index]) + len(p.cont))
    for group in batches(todo, cfg.gen_batch_size):
        n_new = [p.m + L if p.origin == "draft" else 0 if (p.cont and p.cont[-1] == eos) else L for p in group]
        new, hid, ds, tapped = draft_pass(ctx.models.draft, [ctx.rendered[p.prompt_index] + p.cont for p in group],
                                          n_new, pad_token_id=ctx.pad, eos_token_id=eos, temperature=cfg.temperature,
                                          top_p=cfg.top_p, generator=rng, tap=ctx.models.companion_tap())
        for k, (p, c, h) in enumerate(zip(group, new, hid)):
            if p.origin == "draft":
                p.cont, p.rollout = c[: p.m], c[p.m:]
            else:
                p.rollout = c
            p.states["draft"] = h
            if tapped:  # the companion is the draft's first layers: its states from the same pass
                p.states["companion"] = tapped[k]
        _charge_by_origin(st, group, new, GenStats(seconds=ds.step_seconds))
        _charge_labelling(st, group, ctx.rendered, "draft", ds.pass_seconds)
        ctx.step("draft")


def feed_target_rollouts(ctx: ChunkContext, target_runs: list[tuple[CachedPass, list[Planned]]]) -> None:
    """The draft's rollouts of target-written sequences fed through the target's continuation caches (no second prefix
    pass)."""
    for run, group in target_runs:
        run.feed([p.rollout for p in group])
        for r, p in enumerate(group):
            p.states["target"] = run.states(r)
        _charge_labelling(ctx.stats, group, ctx.rendered, "target", run.stats.pass_seconds)
        ctx.step("feed")


def sequence_specs(cfg: GenerateConfig, prompts: list, rendered: list[list[int]],
                   plans: list[Planned]) -> list[SequenceSpec]:
    """The sequences to label: prompt + continuation + rollout, with their segments (the continuation with
    ``label_prefix``) and the states the models computed already."""
    seqs: list[SequenceSpec] = []
    for p in plans:
        prompt = prompts[p.prompt_index]
        ids = rendered[p.prompt_index]
        P, m = len(ids), len(p.cont)
        segs = []
        if cfg.label_prefix and m:
            segs.append(Segment(P, P + m, p.origin, rollout=p.origin == "draft"))
        if p.rollout:
            segs.append(Segment(P + m, P + m + len(p.rollout), p.origin, rollout=True))
        if segs:
            split = split_of(prompt.id, cfg.split_fractions, cfg.seed)
            seqs.append(
                SequenceSpec(prompt.id, prompt.source, prompt.domain, split, p.seq_id, ids + p.cont + p.rollout, segs,
                             states=p.states)
            )
    return seqs


def label_chunk(ctx: ChunkContext, seqs: list[SequenceSpec], chunk: int) -> dict[str, list]:
    """Records of ``seqs`` in ``data_gen.schema`` order, labelled in passes of at most ``label_batch_tokens``."""
    cfg, st = ctx.cfg, ctx.stats
    opts = LabelOptions(
        top_k=cfg.top_k, store_hidden=cfg.store_hidden, temperature=cfg.temperature, top_p=cfg.top_p,
        pad_token_id=ctx.pad, sample_draw=cfg.sample_draw,
    )
    gen = torch.Generator(device=_device(ctx)).manual_seed(cfg.seed * 7919 + chunk)
    parts: list[dict[str, list]] = []
    for batch in label_batches(seqs, cfg.label_batch_tokens):
        recs, ls = label_sequences(ctx.models, batch, opts, generator=gen)
        parts.append(recs)
        st.tokens_passed += ls.tokens_passed
        st.positions += ls.records // (2 if opts.sample_draw else 1)
        secs = sum(ls.seconds.values())
        for role, s in ls.seconds.items():
            st.label_seconds[role] += s
        n_by_origin = Counter(o for o in recs["origin"])
        for o, n in n_by_origin.items():
            st.records_by_origin[o] += n
            st.label_seconds_by_origin[o] += secs * n / max(1, ls.records)
        ctx.step("label")
    return {k: sum((r[k] for r in parts), []) for k in parts[0]} if parts else {}


def _charge_by_origin(st: ChunkStats, group: list[Planned], conts: list[list[int]], gs: GenStats) -> None:
    """Split one batched generation's seconds over its sequences' origins in proportion to the tokens each got."""
    tot = sum(len(c) for c in conts) or 1
    for p, c in zip(group, conts):
        st.gen_seconds_by_origin[p.origin] += gs.seconds * len(c) / tot
        st.gen_tokens_by_origin[p.origin] += len(c)


def _charge_labelling(st: ChunkStats, group: list[Planned], rendered: list[list[int]], role: str,
                      seconds: float) -> None:
    """Count a CachedPass's prefix pass and fed tokens as ``role``'s labelling time, split over origins by prompt
    length."""
    st.label_seconds[role] += seconds
    width = sum(len(rendered[p.prompt_index]) for p in group) or 1
    for p in group:
        st.label_seconds_by_origin[p.origin] += seconds * len(rendered[p.prompt_index]) / width


def cut_to_budget(records: dict[str, list], limit: int) -> dict[str, list]:
    """The first whole positions of a chunk's records within ``limit`` records: both draws of a position are kept or
    dropped together."""
    first: dict[tuple, int] = {}
    rank = [first.setdefault(key, len(first)) for key in zip(records["seq_id"], records["prefix_len"])]
    sizes = Counter(rank)
    kept, total = 0, 0
    while kept < len(first) and total + sizes[kept] <= limit:
        total += sizes[kept]
        kept += 1
    keep = [r < kept for r in rank]
    return {k: [v for v, m in zip(vals, keep) if m] for k, vals in records.items()}


def origin_cost(st: ChunkStats) -> dict[str, dict[str, float]]:
    """Per origin: records labelled (both draws), tokens generated sequentially, generation and labelling seconds."""
    return {
        o: {
            "records": int(st.records_by_origin[o]),
            "generated_tokens": int(st.gen_tokens_by_origin[o]),
            "generation_s": round(st.gen_seconds_by_origin[o], 3),
            "labelling_s": round(st.label_seconds_by_origin[o], 3),
        }
        for o in sorted(st.records_by_origin)
    }
