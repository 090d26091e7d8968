"""Label draft tokens by parallel passes: draft, target and companion each run once over a whole sequence.

A draft token's record depends only on its prefix and on the token drawn, so any sequence (a draft rollout, a target or
speculative-decoding continuation, dataset text) is labelled by one forward pass of each model over the padded batch.
At a position j of the labelled segment the prefix is ``tokens[:j]`` and the logits at index j-1 score position j:

- in a *rollout* segment (the draft's own continuation) the drafted token is ``tokens[j]``;
- in a *teacher-forced* segment the drafted token is drawn from q at j (argmax when greedy, a sample otherwise),
  while the sequence goes on with ``tokens[j]``.

With ``sample_draw`` (greedy data) every labelled position also gives a second record, ``draw="sample"``: a token drawn
from q (temperature 1) with its own q(x), p(x), min(1, p/q) and greedy match. The distributions are already computed,
so the sampled draw costs no model FLOPs, and the sampling-mode labels (q/p <= lambda, min(1, p/q)) get their own
tokens.

Only the positions being labelled go through the LM heads (a [N, V] slice, not [B, T, V]).

Usage: ``records, stats = label_sequences(LabelModels(draft, target), seqs, LabelOptions())``
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedModel

from data_gen.features import probs_from_logits, token_features


@dataclass
class Segment:
    """A labelled span ``[start, end)`` of a sequence's token positions."""

    start: int
    end: int
    origin: str
    """Prefix origin recorded for the tokens of this span (see data_gen.schema.ORIGINS)."""
    rollout: bool
    """True when the span is the draft's own rollout (the drafted token is the sequence's token)."""


@dataclass
class SequenceSpec:
    """One sequence to label with its identity and labelled segments."""

    sample_id: str
    source: str
    domain: str
    split: str
    seq_id: str
    tokens: list[int]
    segments: list[Segment]
    draft_hidden: Tensor | None = None
    """[len(tokens) - 1, H] the draft's final-norm hidden state at every position but the last, when the draft already
    ran over the sequence while writing its rollout (:func:`draft_pass`); the draft's labelling pass is then skipped."""


@dataclass
class LabelModels:
    """The models of one pair (plus an optional companion) sharing one tokenizer."""

    draft: PreTrainedModel
    target: PreTrainedModel
    companion: PreTrainedModel | None = None


@dataclass
class LabelOptions:
    """How records are computed."""

    top_k: int = 10
    """Top-k draft probabilities stored per token."""
    store_hidden: bool = True
    """Store the draft's last hidden state (float16) for SPRINTER."""
    temperature: float = 0.0
    """0: greedy (teacher-forced draft tokens are argmax q); > 0: sampled from q at this temperature."""
    top_p: float = 1.0
    """Nucleus mass of the sampling distributions."""
    pad_token_id: int = 0
    """Token used for right padding (masked out)."""
    head_chunk: int = 256
    """Labelled positions sent through the LM heads at once (bounds the [N, V] logits memory)."""
    sample_draw: bool = False
    """With greedy data (temperature 0): also record, at every labelled position, a token sampled from q (draw
    "sample") beside the argmax one (draw "greedy"); no extra model pass."""
    min_shared_prefix: int = 16
    """When every sequence of a batch starts with the same tokens (several sequences of one prompt), a common prefix
    this long or longer is passed once and its KV cache shared by the batch; 0 turns sharing off."""


@dataclass
class LabelStats:
    """Counts and time of one labelling call."""

    sequences: int = 0
    tokens_passed: int = 0
    records: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "target": 0.0, "companion": 0.0})


def _body_hidden(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, shared: int = 0) -> Tensor:
    """[B, T, H] last hidden states of a causal LM (final norm applied), without the LM head.

    With ``shared`` > 0 the first ``shared`` tokens, the same in every row, are passed once (batch 1) and their KV
    cache is repeated over the batch for the rest: same states, fewer FLOPs when a prompt is shared.
    """
    decoder = model.get_decoder()
    if shared <= 0:
        return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    b = input_ids.shape[0]
    pre = decoder(input_ids=input_ids[:1, :shared], attention_mask=attention_mask[:1, :shared], use_cache=True)
    cache = pre.past_key_values
    cache.batch_repeat_interleave(b)
    rest = decoder(
        input_ids=input_ids[:, shared:], attention_mask=attention_mask, past_key_values=cache, use_cache=True
    )
    return torch.cat([pre.last_hidden_state.expand(b, -1, -1), rest.last_hidden_state], dim=1)


def shared_prefix_len(seqs: list[list[int]]) -> int:
    """Length of the longest common prefix of the token lists, kept at least one token short of the shortest list."""
    if not seqs:
        return 0
    limit = min(len(s) for s in seqs) - 1
    n = 0
    while n < limit and all(s[n] == seqs[0][n] for s in seqs[1:]):
        n += 1
    return n


@torch.no_grad()
def label_sequences(
    models: LabelModels, seqs: list[SequenceSpec], opts: LabelOptions, generator: torch.Generator | None = None
) -> tuple[dict[str, list], LabelStats]:
    """Label every segment position of ``seqs`` with one pass of each model over the right-padded batch.

    Args:
        models: draft, target and optional companion.
        seqs: sequences with labelled segments; a segment may not start at 0 (a token needs a prefix).
        opts: feature and sampling options.
        generator: RNG for teacher-forced sampled draft tokens.
    Returns:
        (records as column lists in data_gen.schema order, stats).
    """
    stats = LabelStats(sequences=len(seqs))
    if opts.sample_draw and opts.temperature > 0:
        raise ValueError("sample_draw adds a sampled token beside the argmax one of greedy data; with temperature "
                         f"{opts.temperature:g} every token is sampled already (set --sample_draw false)")
    if not seqs:
        return {}, stats
    device = next(models.draft.parameters()).device
    lens = [len(s.tokens) for s in seqs]
    width = max(lens)
    ids = torch.full((len(seqs), width), opts.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : lens[b]] = torch.tensor(s.tokens)
        mask[b, : lens[b]] = 1
        for seg in s.segments:
            if not 1 <= seg.start <= seg.end <= lens[b]:
                raise ValueError(f"segment [{seg.start}, {seg.end}) out of range for sequence {s.seq_id} of {lens[b]}")
    ids, mask = ids.to(device), mask.to(device)
    shared = shared_prefix_len([s.tokens for s in seqs]) if len(seqs) > 1 else 0
    shared = shared if opts.min_shared_prefix > 0 and shared >= opts.min_shared_prefix else 0
    stats.tokens_passed = int(mask.sum()) - shared * (len(seqs) - 1)

    # Rows (b, j) to label: logits at j-1 score token j.
    rows_b: list[int] = []
    rows_j: list[int] = []
    for b, s in enumerate(seqs):
        for seg in s.segments:
            rows_b.extend([b] * (seg.end - seg.start))
            rows_j.extend(range(seg.start, seg.end))
    bi = torch.tensor(rows_b, device=device)
    ji = torch.tensor(rows_j, device=device)

    hidden: dict[str, Tensor] = {}
    roles = [("draft", models.draft), ("target", models.target)]
    if models.companion is not None:
        roles.append(("companion", models.companion))
    for role, model in roles:
        t0 = time.perf_counter()
        if role == "draft" and all(s.draft_hidden is not None for s in seqs):  # from draft_pass: no second pass
            hidden[role] = torch.cat([s.draft_hidden[seg.start - 1 : seg.end - 1] for s in seqs  # type: ignore[index]
                                      for seg in s.segments]).to(device)
            continue
        h = _body_hidden(model, ids, mask, shared)
        hidden[role] = h[bi, ji - 1]  # [N, H] state that predicts token j
        del h
        stats.seconds[role] += time.perf_counter() - t0

    main_draw = "greedy" if opts.temperature <= 0 else "sample"
    draws = [main_draw] + (["sample"] if opts.sample_draw else [])
    feats: dict[str, dict[str, list[Tensor]]] = {d: {} for d in draws}
    seq_tokens = ids[bi, ji]  # [N] the sequence's own token at j
    rollout_flag = torch.tensor(
        [seg.rollout for s in seqs for seg in s.segments for _ in range(seg.end - seg.start)], device=device
    )
    for lo in range(0, len(rows_b), opts.head_chunk):
        sl = slice(lo, lo + opts.head_chunk)
        t0 = time.perf_counter()
        d_logits = models.draft.get_output_embeddings()(hidden["draft"][sl]).float()
        stats.seconds["draft"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        t_logits = models.target.get_output_embeddings()(hidden["target"][sl]).float()
        stats.seconds["target"] += time.perf_counter() - t0
        c_logits = None
        if models.companion is not None:
            t0 = time.perf_counter()
            c_logits = models.companion.get_output_embeddings()(hidden["companion"][sl]).float()
            stats.seconds["companion"] += time.perf_counter() - t0
        drafted = draw_draft_tokens(d_logits, opts.temperature, opts.top_p, generator)
        tokens_by_draw = {main_draw: torch.where(rollout_flag[sl], seq_tokens[sl], drafted)}
        if opts.sample_draw:
            tokens_by_draw["sample"] = draw_draft_tokens(d_logits, 1.0, opts.top_p, generator)
        for draw, tokens in tokens_by_draw.items():
            try:
                f = token_features(
                    d_logits,
                    tokens,
                    target_logits=t_logits,
                    companion_logits=c_logits,
                    draft_hidden=hidden["draft"][sl] if opts.store_hidden else None,
                    top_k=opts.top_k,
                    temperature=opts.temperature if opts.temperature > 0 else 1.0,
                    top_p=opts.top_p,
                )
            except FloatingPointError:  # token_features checks finiteness once; name the model and the samples here
                raise _non_finite_error(models, seqs, rows_b, lo, d_logits, t_logits, c_logits) from None
            for k, v in f.items():
                feats[draw].setdefault(k, []).append(v.cpu())
    parts = [_assemble(seqs, {k: torch.cat(v) for k, v in feats[d].items()}, seq_tokens.cpu(), d) for d in draws]
    records = {k: [x for part in parts for x in part[k]] for k in parts[0]}
    stats.records = len(rows_b) * len(draws)
    return records, stats


@dataclass
class DraftPassStats:
    """Seconds of :func:`draft_pass`: the prefix pass (labelling work) and the decoding steps (sequential)."""

    prefix_seconds: float = 0.0
    step_seconds: float = 0.0
    steps: int = 0


@torch.no_grad()
def draft_pass(
    draft: PreTrainedModel,
    prefixes: list[list[int]],
    n_new: list[int],
    *,
    pad_token_id: int,
    eos_token_id: int | list[int] | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[list[int]], list[Tensor], DraftPassStats]:
    """The draft's whole share of labelling in one pass: its hidden states over each prefix, then ``n_new`` tokens of
    its own continuation decoded from that pass's KV cache, so no sequence goes through the draft twice.

    Separately, a rollout re-reads its prefix (prompt and continuation) in a prefill and the labelling pass reads it
    again; here the labelling pass is the prefill. The prefixes run right-padded in one batch; each decoding step feeds
    every row its own position (``position_ids``) and masks the padding left between its prefix and its new tokens.

    Args:
        draft: the draft LM.
        prefixes: token ids of each sequence before its draft tokens (at least one token each).
        n_new: draft tokens to append to each (0 allowed); a row stops early at an end-of-sequence token (kept).
        pad_token_id, eos_token_id: padding and end of sequence.
        temperature, top_p: greedy (0) or sampled draft tokens, as the data's sampling distribution.
        generator: RNG of sampled tokens.
    Returns:
        (new tokens per sequence, per sequence its [len(prefix) + len(new) - 1, H] hidden states, stats).
    """
    if any(len(p) == 0 for p in prefixes):
        raise ValueError("draft_pass needs a non-empty prefix for every sequence")
    stats = DraftPassStats()
    if not prefixes:
        return [], [], stats
    device = next(draft.parameters()).device
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
    decoder, head = draft.get_decoder(), draft.get_output_embeddings()
    lens = [len(p) for p in prefixes]
    b, width = len(prefixes), max(lens)
    ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for r, p in enumerate(prefixes):
        ids[r, : lens[r]] = torch.tensor(p)
        mask[r, : lens[r]] = 1
    ids, mask = ids.to(device), mask.to(device)
    t0 = time.perf_counter()
    out = decoder(input_ids=ids, attention_mask=mask, use_cache=True)
    cache, h = out.past_key_values, out.last_hidden_state  # [B, W, H]
    hidden = [[h[r, : lens[r]]] for r in range(b)]
    last = h[torch.arange(b, device=device), torch.tensor(lens, device=device) - 1]  # [B, H] scores the next token
    stats.prefix_seconds = time.perf_counter() - t0
    new: list[list[int]] = [[] for _ in range(b)]
    active = [n > 0 for n in n_new]
    t0 = time.perf_counter()
    step = 0
    while any(active):
        logits = head(last).float()  # [B, V]
        tok = draw_draft_tokens(logits, temperature, top_p, generator)
        for r, t in enumerate(tok.tolist()):
            if active[r]:
                new[r].append(t)
                active[r] = len(new[r]) < n_new[r] and t not in eos
        if not any(active):
            break
        fed = [r for r in range(b) if active[r]]  # rows whose next token is still to come
        mask = torch.cat([mask, torch.tensor([[int(a)] for a in active], device=device)], dim=1)
        pos = torch.tensor([[lens[r] + step] for r in range(b)], device=device)
        out = decoder(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                      use_cache=True)
        last = out.last_hidden_state[:, -1]
        for r in fed:
            hidden[r].append(last[r : r + 1])
        step += 1
        stats.steps += 1
    stats.step_seconds = time.perf_counter() - t0
    return new, [torch.cat(parts)[: lens[r] + len(new[r]) - 1] for r, parts in enumerate(hidden)], stats


def _non_finite_error(models: LabelModels, seqs, rows_b, lo, *logits: Tensor | None) -> FloatingPointError:
    """The error for NaN / inf logits, naming the model and the samples (nothing of the batch is written)."""
    for role, lg in zip(("draft", "target", "companion"), logits):
        if lg is not None and not torch.isfinite(lg).all():
            bad_rows = (~torch.isfinite(lg)).any(-1).nonzero().flatten().tolist()
            bad = sorted({seqs[rows_b[lo + r]].seq_id for r in bad_rows})
            name = getattr(getattr(models, role).config, "name_or_path", role)
            return FloatingPointError(
                f"{role} model {name!r} gave NaN or inf logits on sample(s) {bad}; nothing of this batch was written "
                f"(check the model's dtype: float16 overflows on CPU, use float32 or bfloat16)"
            )
    return FloatingPointError("non-finite logits")


def draw_draft_tokens(
    draft_logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> Tensor:
    """[N] tokens the draft would draw at these positions: argmax when greedy, else a sample of q."""
    if temperature <= 0:
        return draft_logits.argmax(-1)
    probs = probs_from_logits(draft_logits, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def run_positions(follows: np.ndarray, restart: np.ndarray) -> np.ndarray:
    """Draft position of each token: how many immediately preceding tokens the draft itself produced in this run.

    Args:
        follows: [N] bool, the drafted token equals the sequence's next token (the draft 'produced' it).
        restart: [N] bool, a draft window starts here (segment start).
    """
    pos = np.zeros(len(follows), dtype=np.int32)
    for j in range(1, len(follows)):
        pos[j] = 0 if restart[j] or not follows[j - 1] else pos[j - 1] + 1
    return pos


def oracle_lengths(match: np.ndarray, follows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Oracle draft length from each token of one segment, and whether it was cut by the end of observation.

    Drafting from j, token j+i is accepted when every token j..j+i greedy-matches; the run is observable only while the
    draft's token is the sequence's token (``follows``): otherwise the next prefix is unknown and the run is censored.
    """
    n = len(match)
    length = np.zeros(n, dtype=np.int32)
    censored = np.zeros(n, dtype=bool)
    for j in range(n - 1, -1, -1):
        if not match[j]:
            continue
        if j + 1 < n and follows[j]:
            length[j] = 1 + length[j + 1]
            censored[j] = censored[j + 1]
        else:
            length[j] = 1
            censored[j] = True
    return length, censored


def _assemble(seqs: list[SequenceSpec], f: dict[str, Tensor], seq_tokens: Tensor, draw: str) -> dict[str, list]:
    """Turn flat feature tensors (segment order) of one draw into record columns with ids, positions and oracle
    lengths."""
    drafted = f["draft_token"].numpy()
    match = f["greedy_match"].numpy()
    next_tok = seq_tokens.numpy()
    follows = drafted == next_tok
    cols: dict[str, list] = {
        k: []
        for k in (
            "sample_id", "source", "domain", "split", "seq_id", "origin", "draw", "rollout", "prefix_len", "offset",
            "position", "next_token", "oracle_len", "oracle_censored",
        )
    }
    i = 0
    for s in seqs:
        for seg in s.segments:
            n = seg.end - seg.start
            sl = slice(i, i + n)
            restart = np.zeros(n, dtype=bool)
            restart[0] = True
            olen, cens = oracle_lengths(match[sl], follows[sl])
            cols["sample_id"] += [s.sample_id] * n
            cols["source"] += [s.source] * n
            cols["domain"] += [s.domain] * n
            cols["split"] += [s.split] * n
            cols["seq_id"] += [s.seq_id] * n
            cols["origin"] += [seg.origin] * n
            cols["draw"] += [draw] * n
            cols["rollout"] += [seg.rollout] * n
            cols["prefix_len"] += list(range(seg.start, seg.end))
            cols["offset"] += list(range(n))
            cols["position"] += run_positions(follows[sl], restart).tolist()
            cols["next_token"] += next_tok[sl].tolist()
            cols["oracle_len"] += olen.tolist()
            cols["oracle_censored"] += cens.tolist()
            i += n
    for k, v in f.items():
        if v.dim() == 1:
            cols[k] = v.tolist()
        else:
            cols[k] = v.numpy().tolist() if k != "draft_hidden" else list(v.numpy())
    return cols
