"""Label draft tokens by parallel passes: draft, target and companion each run once over a whole sequence.

A record depends only on its prefix and the drafted token, so any sequence (a rollout, a continuation, dataset text) is
labelled by one forward of each model over the padded batch; at position j the logits at j - 1 score the token. In a
rollout segment the drafted token is ``tokens[j]``; in a teacher-forced one it is drawn from q at j while the sequence
goes on with ``tokens[j]``. With ``sample_draw`` greedy data also records a token sampled from q at every position, at
no model cost.

Usage: ``records, stats = label_sequences(LabelModels(draft, target), seqs, LabelOptions())``
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from compute.draft_stats import sample_tokens
from compute.models import layer_output, shared_depth
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
    states: dict[str, Tensor] = field(default_factory=dict)
    """Role -> that model's final-norm hidden states over the sequence, when it already ran over it
    (:class:`CachedPass`); its labelling pass then skips the sequence."""


@dataclass
class LabelModels:
    """The models of one pair (plus an optional companion) sharing one tokenizer."""

    draft: PreTrainedModel
    target: PreTrainedModel
    companion: PreTrainedModel | None = None

    def companion_tap(self) -> tuple[int, nn.Module] | None:
        """(layers, final norm) of a companion whose layers are the draft's first N, so its states come from the draft's
        own pass; None otherwise."""
        depth = shared_depth(self.companion, self.draft)
        return (depth, self.companion.get_decoder().norm) if depth and self.companion is not None else None


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
    """With greedy data: also record a token sampled from q (draw ``sample``) at every labelled position, at no model
    cost."""
    min_shared_prefix: int = 16
    """Shortest prefix common to a batch's sequences that is passed once and its KV cache shared; 0 turns sharing off.
    """


@dataclass
class LabelStats:
    """Counts and time of one labelling call."""

    sequences: int = 0
    tokens_passed: int = 0
    """Tokens of the batch (a shared prompt once) each model passes, here or earlier for sequences carrying their
    states."""
    records: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "target": 0.0, "companion": 0.0})


def _body_hidden(model: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, shared: int = 0) -> Tensor:
    """[B, T, H] final-norm hidden states of a causal LM, without the LM head; the first ``shared`` tokens, common to
    all rows, pass once and their KV cache is repeated over the batch."""
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


def right_padded(tokens: list[list[int]], pad_token_id: int, width: int | None = None) -> tuple[Tensor, Tensor]:
    """([B, W] ids, [B, W] mask) of token lists right-padded to ``width`` (default the longest, at least 1)."""
    width = width or max(1, max(len(t) for t in tokens))
    ids = torch.full((len(tokens), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(tokens), width), dtype=torch.long)
    for r, t in enumerate(tokens):
        ids[r, : len(t)] = torch.tensor(t, dtype=torch.long)
        mask[r, : len(t)] = 1
    return ids, mask


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
    """Label every segment position of ``seqs`` (no segment at 0) with one pass of each model over the right-padded
    batch; returns (record columns in ``data_gen.schema`` order, stats)."""
    stats = LabelStats(sequences=len(seqs))
    if opts.sample_draw and opts.temperature > 0:
        raise ValueError("sample_draw adds a sampled token beside the argmax one of greedy data; with temperature "
                         f"{opts.temperature:g} every token is sampled already (set --sample_draw false)")
    if not seqs:
        return {}, stats
    batch = _LabelBatch.of(seqs, opts, next(models.draft.parameters()).device)
    stats.tokens_passed = int(batch.mask.sum()) - batch.shared * (len(seqs) - 1)
    hidden: dict[str, Tensor] = {}
    roles = [("draft", models.draft), ("target", models.target)]
    if models.companion is not None:
        roles.append(("companion", models.companion))
    for role, model in roles:
        t0 = time.perf_counter()
        hidden[role] = _role_states(model, role, batch)
        stats.seconds[role] += time.perf_counter() - t0
    draws = ["greedy" if opts.temperature <= 0 else "sample"] + (["sample"] if opts.sample_draw else [])
    feats, seq_tokens = _label_rows(models, batch, hidden, opts, draws, generator, stats)
    parts = [_assemble(seqs, {k: torch.cat(v) for k, v in feats[d].items()}, seq_tokens.cpu(), d) for d in draws]
    records = {k: [x for part in parts for x in part[k]] for k in parts[0]}
    stats.records = len(batch.rows_b) * len(draws)
    return records, stats


@dataclass
class _LabelBatch:
    """One labelling call's sequences, right-padded on the models' device, and the rows (positions) it labels."""

    seqs: list[SequenceSpec]
    ids: Tensor
    """[B, W] token ids, right-padded."""
    mask: Tensor
    """[B, W] attention mask."""
    lens: list[int]
    shared: int
    """Tokens at the start of every sequence passed once (0: none)."""
    spans: list[tuple[int, int, int]]
    """(sequence, start, end) of every labelled segment, in row order."""
    rows_b: list[int]
    """Sequence of each labelled row: logits at j - 1 score token j."""
    rows_j: list[int]
    """Position j of each labelled row."""

    @classmethod
    def of(cls, seqs: list[SequenceSpec], opts: LabelOptions, device: torch.device) -> _LabelBatch:
        """The batch of ``seqs``; ValueError for states or segments that do not fit their sequence."""
        lens = [len(s.tokens) for s in seqs]
        ids, mask = right_padded([s.tokens for s in seqs], opts.pad_token_id)
        for b, s in enumerate(seqs):
            for role, st in s.states.items():
                if st.shape[0] < lens[b] - 1:
                    raise ValueError(f"sequence {s.seq_id}: {role} states cover {st.shape[0]} positions, its tokens "
                                     f"need {lens[b] - 1}")
            for seg in s.segments:
                if not 1 <= seg.start <= seg.end <= lens[b]:
                    raise ValueError(f"segment [{seg.start}, {seg.end}) out of range for sequence {s.seq_id} of "
                                     f"{lens[b]}")
        shared = shared_prefix_len([s.tokens for s in seqs]) if len(seqs) > 1 else 0
        shared = shared if opts.min_shared_prefix > 0 and shared >= opts.min_shared_prefix else 0
        spans = [(b, seg.start, seg.end) for b, s in enumerate(seqs) for seg in s.segments]
        rows_b = [b for b, j0, j1 in spans for _ in range(j0, j1)]
        rows_j = [j for _, j0, j1 in spans for j in range(j0, j1)]
        return cls(seqs, ids.to(device), mask.to(device), lens, shared, spans, rows_b, rows_j)


def _role_states(model: PreTrainedModel, role: str, batch: _LabelBatch) -> Tensor:
    """[N, H] the ``role`` model's state predicting each labelled row's token: from the states a sequence carries, else
    one pass over the others."""
    seqs, lens = batch.seqs, batch.lens
    need = [b for b, s in enumerate(seqs) if role not in s.states]  # sequences this model has not run over yet
    per_seq: dict[int, Tensor] = {b: s.states[role] for b, s in enumerate(seqs) if role in s.states}
    if need:
        w = max(lens[b] for b in need)  # the sequences left may be shorter than the batch: no padding past them
        whole = len(need) == len(seqs)
        sub_ids, sub_mask = (batch.ids, batch.mask) if whole else (batch.ids[need, :w], batch.mask[need, :w])
        h = _body_hidden(model, sub_ids, sub_mask, batch.shared if whole else 0)
        for k, b in enumerate(need):
            per_seq[b] = h[k, : lens[b] - 1]
        del h
    return torch.cat([per_seq[b][j0 - 1 : j1 - 1] for b, j0, j1 in batch.spans]).to(batch.ids.device)


def _label_rows(
    models: LabelModels, batch: _LabelBatch, hidden: dict[str, Tensor], opts: LabelOptions, draws: list[str],
    generator: torch.Generator | None, stats: LabelStats,
) -> tuple[dict[str, dict[str, list[Tensor]]], Tensor]:
    """Features of every labelled row, per draw, through the LM heads ``opts.head_chunk`` rows at a time, and [N] the
    sequence's own token at each row."""
    device = batch.ids.device
    feats: dict[str, dict[str, list[Tensor]]] = {d: {} for d in draws}
    seq_tokens = batch.ids[torch.tensor(batch.rows_b, device=device), torch.tensor(batch.rows_j, device=device)]
    rollout_flag = torch.tensor(
        [seg.rollout for s in batch.seqs for seg in s.segments for _ in range(seg.end - seg.start)], device=device
    )
    for lo in range(0, len(batch.rows_b), opts.head_chunk):
        sl = slice(lo, lo + opts.head_chunk)
        d_logits, t_logits, c_logits = _head_logits(models, hidden, sl, stats)
        drafted = draw_draft_tokens(d_logits, opts.temperature, opts.top_p, generator)
        tokens_by_draw = {draws[0]: torch.where(rollout_flag[sl], seq_tokens[sl], drafted)}
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
                raise _non_finite_error(models, batch.seqs, batch.rows_b, lo, d_logits, t_logits, c_logits) from None
            for k, v in f.items():
                feats[draw].setdefault(k, []).append(v.cpu())
    return feats, seq_tokens


def _head_logits(models: LabelModels, hidden: dict[str, Tensor], sl: slice,
                 stats: LabelStats) -> tuple[Tensor, Tensor, Tensor | None]:
    """float32 logits of rows ``sl`` from the draft's, target's and companion's heads, each head's time counted as its
    model's."""
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
    return d_logits, t_logits, c_logits


@dataclass
class PassStats:
    """Seconds of a :class:`CachedPass`: its prefix pass and extensions (labelling work) and its decoding steps."""

    pass_seconds: float = 0.0
    step_seconds: float = 0.0
    steps: int = 0


class CachedPass:
    """A batch of sequences through one model once: a prefix pass, then tokens decoded or fed per row on the same KV
    cache, every hidden state kept for labelling, so no token goes through the model twice.

    Usage::

        run = CachedPass(draft, prefixes, pad_token_id=pad)        # the prefix pass
        new = run.decode([16, 16], eos_token_id=eos)                # each row's own next tokens
        run.feed([[7, 8], [9]])                                     # the sequences go on with these (another model's)
        states = run.states(0)                                      # [tokens of row 0 in the cache, H]
    """

    @torch.no_grad()
    def __init__(self, model: PreTrainedModel, prefixes: list[list[int]], *, pad_token_id: int,
                 tap: tuple[int, nn.Module] | None = None) -> None:
        if not prefixes or any(len(p) == 0 for p in prefixes):
            raise ValueError("CachedPass needs at least one sequence and a non-empty prefix for each")
        self.pad = pad_token_id
        self.device = next(model.parameters()).device
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self.tap = tap
        self.stats = PassStats()
        self.lengths = [len(p) for p in prefixes]  # tokens of each row in the cache (padding excluded)
        ids, mask = right_padded(prefixes, pad_token_id)
        self.mask = mask.to(self.device)
        t0 = time.perf_counter()
        out, tapped = self._decode_call(input_ids=ids.to(self.device), attention_mask=self.mask, use_cache=True)
        self.cache, h = out.past_key_values, out.last_hidden_state  # [B, W, H]
        self._states: list[list[Tensor]] = [[h[r, : n]] for r, n in enumerate(self.lengths)]
        self._tapped: list[list[Tensor]] = [[tapped[r, : n]] for r, n in enumerate(self.lengths)] if tap else []
        self.stats.pass_seconds += time.perf_counter() - t0
        self.pending: list[int | None] = [None] * len(prefixes)
        """Per row, its last decoded token, not yet in the cache (fed before anything else)."""

    def _decode_call(self, **kw: Any) -> tuple[Any, Tensor | None]:
        """The decoder's forward, and with a tap the residual stream after its first ``tap[0]`` layers ([B, T, H])."""
        with layer_output(self.decoder.layers, self.tap[0] if self.tap else None) as seen:
            out = self.decoder(**kw)
        return out, seen[-1] if seen else None

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @torch.no_grad()
    def _forward(self, tokens: list[list[int]]) -> Tensor:
        """Feed each row its tokens (rows may get none) after its own; returns [B, T, H] states."""
        ids, new_mask = right_padded(tokens, self.pad)
        pos = torch.tensor(self.lengths)[:, None] + torch.arange(ids.shape[1])  # [B, T] each row's own positions
        self.mask = torch.cat([self.mask, new_mask.to(self.device)], dim=1)
        out, tapped = self._decode_call(input_ids=ids.to(self.device), attention_mask=self.mask,
                                        position_ids=pos.to(self.device), past_key_values=self.cache, use_cache=True)
        h = out.last_hidden_state
        for r, t in enumerate(tokens):
            if t:
                self._states[r].append(h[r, : len(t)])
                if tapped is not None:
                    self._tapped[r].append(tapped[r, : len(t)])
                self.lengths[r] += len(t)
        return h

    @torch.no_grad()
    def decode(self, n_new: list[int], *, eos_token_id: int | list[int] | None, temperature: float = 0.0,
               top_p: float = 1.0, generator: torch.Generator | None = None) -> list[list[int]]:
        """Decode up to ``n_new[r]`` tokens of each row's continuation (greedy or sampled), a row stopping at EOS
        (kept); once, right after the prefix pass."""
        if len(n_new) != self.batch or any(p is not None for p in self.pending) or len(self._states[0]) > 1:
            raise ValueError("CachedPass.decode runs once, right after the prefix pass, with one count per row")
        eos = set([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []))
        last = torch.stack([s[0][-1] for s in self._states])  # [B, H] scores each row's next token
        new: list[list[int]] = [[] for _ in range(self.batch)]
        active = [n > 0 for n in n_new]
        t0 = time.perf_counter()
        while True:
            tok = draw_draft_tokens(self.head(last).float(), temperature, top_p, generator).tolist()
            for r, t in enumerate(tok):
                if active[r]:
                    new[r].append(t)
                    active[r] = len(new[r]) < n_new[r] and t not in eos
            if not any(active):
                break
            h = self._forward([[tok[r]] if active[r] else [] for r in range(self.batch)])
            last = h[:, 0]
            self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self.pending = [c[-1] if c else None for c in new]
        return new

    @torch.no_grad()
    def feed(self, tails: list[list[int]]) -> None:
        """Each row's sequence goes on with ``tails[r]``: one forward over the pending decoded token and the tail but
        its last token (whose state would score nothing)."""
        if len(tails) != self.batch:
            raise ValueError(f"CachedPass.feed needs one token list per row ({self.batch}), got {len(tails)}")
        todo = [([p] if p is not None else []) + list(t[:-1]) if t else [] for p, t in zip(self.pending, tails)]
        self.pending = [p if not t else None for p, t in zip(self.pending, tails)]
        if any(todo):
            t0 = time.perf_counter()
            self._forward(todo)
            self.stats.pass_seconds += time.perf_counter() - t0

    def states(self, r: int) -> Tensor:
        """[tokens of row r in the cache, H]: the state at every position passed, each scoring the token after it."""
        return torch.cat(self._states[r])

    @torch.no_grad()
    def tapped_states(self, r: int) -> Tensor:
        """The final-norm states of the model cut after its first ``tap[0]`` layers (``truncated:N:<this model>``)."""
        if self.tap is None:
            raise ValueError("CachedPass.tapped_states needs a tap (layers, final norm) given at construction")
        return self.tap[1](torch.cat(self._tapped[r]))


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
    tap: tuple[int, nn.Module] | None = None,
) -> tuple[list[list[int]], list[Tensor], PassStats, list[Tensor]]:
    """A :class:`CachedPass` decoding ``n_new`` tokens a row: (new tokens, per row its states, stats, the same rows'
    states of a truncation of the draft, e.g. the companion)."""
    run = CachedPass(draft, prefixes, pad_token_id=pad_token_id, tap=tap)
    new = run.decode(n_new, eos_token_id=eos_token_id, temperature=temperature, top_p=top_p, generator=generator)
    n = [len(p) + len(c) - 1 for p, c in zip(prefixes, new)]
    tapped = [run.tapped_states(r)[: n[r]] for r in range(len(n))] if tap else []
    return new, [run.states(r)[: n[r]] for r in range(len(n))], run.stats, tapped


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
    drawn = sample_tokens(draft_logits, temperature, generator) if top_p >= 1.0 else None
    if drawn is not None:  # native inversion sampling: no [N, V] probabilities
        return drawn
    probs = probs_from_logits(draft_logits, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def run_positions(follows: np.ndarray, restart: np.ndarray) -> np.ndarray:
    """Draft position of each token: how many immediately preceding tokens the draft produced (``follows``), restarting
    where ``restart``."""
    pos = np.zeros(len(follows), dtype=np.int32)
    for j in range(1, len(follows)):
        pos[j] = 0 if restart[j] or not follows[j - 1] else pos[j - 1] + 1
    return pos


def oracle_lengths(match: np.ndarray, follows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Oracle draft length from each token of one segment (tokens while every one greedy-matches), and whether the end
    of observation cut it (censored)."""
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
    """Flat feature tensors of one draw (segment order) -> record columns with ids, positions and oracle lengths."""
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
