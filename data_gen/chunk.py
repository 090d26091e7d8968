"""Produce one chunk's records: plan its prompts' sequences, write their prefixes and rollouts, label them.

A chunk (``prompts_per_shard`` prompts, one shard) runs in phases, each a function here, in this order (the order fixes
which random draws each phase gets, so it never changes):

1. :func:`plan_chunk`: origins and prefix lengths (``data_gen.planning``), dataset answers of the text origin;
2. :func:`target_continuations`: the target's continuations (target origin; spec too in greedy decoding) from a
   :class:`~data_gen.labelling.CachedPass` whose cache the target's labelling reuses;
3. :func:`sampled_spec_trajectories`: transformers' assisted generation for the spec origin when sampling;
4. :func:`draft_side`: the draft's pass over every prefix, its own continuation and rollout decoded from that cache;
5. :func:`feed_target_rollouts`: the rollouts fed through the target's continuation caches;
6. :func:`sequence_specs` and :func:`label_chunk`: the labelled sequences, labelled in passes within a token budget.

Each phase charges its seconds and tokens to the chunk's :class:`ChunkStats`, per origin.

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
"""Called after each batch of a phase with the phase's name (target, spec, draft, feed, label) and the records
labelled so far in the chunk (0 until the first labelling pass)."""


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
    """What every phase of a chunk reads (config, models, rendered prompts, special tokens) and the accounting the
    phases write."""

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

    ``on_step`` (optional) is called after each batch of every phase (see :data:`StepCallback`): a heartbeat while a
    chunk runs, which takes no part in the records.
    """
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
    """The chunk's planned sequences; a text origin gets its prompt's reference answer (or, without one, falls back to
    the draft origin, counted in ``text_fallbacks``)."""
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
    """The target's continuations of the target origin, and in greedy decoding of the spec origin too, in batches;
    returns each batch's pass (its cache, which the rollouts are fed to later) with its sequences.

    Exact speculative decoding emits the target's greedy continuation token for token (bit for bit on the packed
    paths, compute.compute_path), so in greedy decoding a spec trajectory is that continuation, made here in batches
    instead of one costly assisted generation per prompt. Sampling (temperature > 0) keeps real assisted-generation
    trajectories (:func:`sampled_spec_trajectories`). Both origins share one batch (on the packed paths a batch step
    of a few rows costs what one row costs), longest continuations together so that short ones do not wait for them.
    The target's pass over the prompt is also its labelling pass (``CachedPass``), so these sequences never go
    through the target twice.
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
    """With sampling, each spec-origin prefix is a real speculative-decoding trajectory (transformers' assisted
    generation, one prompt at a time); in greedy decoding :func:`target_continuations` wrote them."""
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
    """The models' device: a chunk's random streams live there (``torch.multinomial`` draws with a generator of its
    input's device; on the CPU the seeded streams are the ones every earlier data folder was drawn with)."""
    return next(ctx.models.draft.parameters()).device


def draft_side(ctx: ChunkContext, plans: list[Planned], chunk: int) -> None:
    """The draft's side, in one pass a sequence (``data_gen.labelling.draft_pass``): its hidden states over the prefix
    (the prompt, plus the continuation of the target / spec / text origins), then its own tokens decoded from that
    pass's cache: m + L for the draft origin (its continuation and rollout), L for the others (none after an
    end-of-sequence continuation). The labelling passes reuse these states, so no prefix goes through the draft twice.
    """
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
    """The draft's rollouts of the target-written sequences, through the target's continuation caches: the target's
    states over whole sequences, with no second pass over their prefixes."""
    for run, group in target_runs:
        run.feed([p.rollout for p in group])
        for r, p in enumerate(group):
            p.states["target"] = run.states(r)
        _charge_labelling(ctx.stats, group, ctx.rendered, "target", run.stats.pass_seconds)
        ctx.step("feed")


def sequence_specs(cfg: GenerateConfig, prompts: list, rendered: list[list[int]],
                   plans: list[Planned]) -> list[SequenceSpec]:
    """The sequences to label: each plan's prompt + continuation + rollout, with its labelled segments (the
    continuation, teacher-forced, with ``label_prefix``; the rollout) and the states the models computed already."""
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
    """Records of ``seqs`` (column lists, ``data_gen.schema`` order), labelled in passes of at most
    ``label_batch_tokens`` (``data_gen.planning.label_batches``: a prompt's sequences share one pass)."""
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
    """The first whole positions of a chunk's records that fit in ``limit`` records: both draws of a position (same
    ``seq_id`` and ``prefix_len``) are kept or dropped together, so a budget cut leaves no position with one draw."""
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
