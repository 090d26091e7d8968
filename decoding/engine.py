"""Speculative decoding engine with a pluggable stop policy (exact greedy / sampling verification, batches, KV caches).

One round: the draft proposes tokens one at a time; after each drafted token its features are computed with
``data_gen.features.token_features`` (the same function data generation uses) plus ``position`` (index of the token in
the current draft window) and the policy decides whether to draft another; then the target verifies the window in one
forward pass (exact: greedy match or min(1, p/q) with a correction from norm(max(0, p - q)) and a bonus token), the
policy is told the outcome (``policy.update``) and both KV caches (transformers ``DynamicCache``) are cropped.

How a round runs follows what the policy declares (``predictors.base.StopPolicy``), never its kind:
- ``verification == GOODPUT`` (SV, any ``goodput:`` policy): the score is a calibrated acceptance; the round drafts
  while the expected tokens/s of the lengths still reachable improves and verifies the best prefix (the one rule of
  ``predictors.goodput``, priced by the measured ``compute.timing.CostModel``, the same call as the offline replay).
- ``verification == SEQUENTIAL`` (SPRINTER, ``policy.exact`` False): approximate sequential verification; drafted tokens
  before the last one are taken unverified, the target checks only the last token (min(1, p/q) or a resample from
  norm(max(0, p - q))).
- ``policy.needs_target`` (the oracle): analysis only; the target runs one step per drafted token to give
  ``greedy_match``; that time is reported apart (``DecodeStats.analysis_time``). In greedy decoding, given each
  sequence's target-only output (``generate(..., reference=...)``), ``greedy_match`` is read from it instead (exact
  greedy decoding emits that output token for token) and the oracle's rounds verify like any other's: measured time.

Phases of ``SpeculativeDecoder.generate`` (in the manner of gpt-fast's generate.py): prefill; then per round
``_draft_round`` (draft steps, each ``_draft_step`` with the stop decision ``_decide``), ``_verify_round`` (one target
pass, per-sequence ``_verify``) and ``_settle`` (statistics, cache bookkeeping, limits).

Batches (B > 1): prompts left-padded; each sequence drafts its own length; a sequence that stopped drafting feeds masked
dummy tokens while the others continue; rejected positions become masked holes in the caches (positions come from the
attention mask), and the caches are cropped to the longest live sequence after every round.

Usage:
    dec = SpeculativeDecoder(draft, target, StaticLength(5))
    out, stats = dec.generate(input_ids, attention_mask=None, max_new_tokens=64, eos_token_id=tok.eos_token_id, seed=0)
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from compute.draft_stats import greedy_draft_stats, native_available, pair_stats, sample_tokens
from compute.models import layer_output, shared_depth
from compute.timing import CostModel, clock, measure_cost_model
from data_gen.features import COMPANION_COLUMNS, probs_from_logits, token_features
from predictors import goodput
from predictors.base import GOODPUT, SEQUENTIAL, RoundFeedback, StopPolicy
from predictors.calibration import mode_of
from predictors.counts import RoundCounts

__all__ = ["DecodeStats", "SpeculativeDecoder"]


OLD_NAMES = {"new_tokens": "tokens", "draft_tokens": "drafted"}
"""Counter names of stored records written before the shared vocabulary (``predictors.counts``) -> today's."""


@dataclass
class DecodeStats(RoundCounts):
    """Counters and timings of one or more ``generate`` calls (add them with ``+``).

    The round counts (``rounds``, ``tokens``, ``drafted``, ``verified``, ``accepted``) are those of
    ``predictors.counts.RoundCounts``, whole numbers here, summed over all sequences."""

    target_calls: int = 0
    """Target forward passes (verification rounds; prefill not counted)."""
    wasted: int = 0
    """Draft tokens proposed but not emitted (rejected or cut by SV's goodput length)."""
    accepted_lengths: list[int] = field(default_factory=list)
    """Accepted draft tokens per sequence-round."""
    draft_lengths: list[int] = field(default_factory=list)
    """Drafted tokens per sequence-round."""
    verified_lengths: list[int] = field(default_factory=list)
    """Drafted tokens sent to the target per sequence-round (fewer than drafted under the goodput rule)."""
    prompt_passes: int = 0
    """Sequence-rounds verified inside the target's pass over the prompt (each sequence's first: the target reads its
    prompt together with the first drafts, so that pass's time is in ``prefill_time``, not ``target_time``)."""
    prompt_pass_lengths: list[int] = field(default_factory=list)
    """Drafted tokens verified in those passes (also in ``verified_lengths``)."""
    expected_tokens: list[float] = field(default_factory=list)
    """Goodput policies: tokens each sequence-round was expected to emit (1 + E[accepted] of the verified prefix)."""
    draft_forwards: int = 0
    """Draft forward passes (batched steps)."""
    draft_time: float = 0.0
    """Seconds in draft (and companion) forward passes."""
    target_time: float = 0.0
    """Seconds in target verification forward passes (prefill excluded)."""
    stop_decisions: int = 0
    """Batched stop decisions taken (one per draft step)."""
    stop_time: float = 0.0
    """Seconds computing features and policy decisions (in greedy decoding on a CPU also the drafted token's argmax,
    which the features' native pass reads off for free)."""
    analysis_time: float = 0.0
    """Seconds in analysis-only target look-ahead (oracle); included in wall_time."""
    prefill_time: float = 0.0
    """Seconds prefilling the prompts into every model's cache (the target's pass over the prompts, which also verifies
    the first drafts, included); included in wall_time."""
    wall_time: float = 0.0
    """Seconds of the whole call(s)."""

    @classmethod
    def from_dict(cls, d: dict) -> DecodeStats:
        """Stats from their ``dataclasses.asdict`` form, also as stored before the shared vocabulary (``OLD_NAMES``;
        ``verified``, not kept then, is the sum of ``verified_lengths``)."""
        d = {OLD_NAMES.get(k, k): v for k, v in d.items()}
        if "verified" not in d:
            d["verified"] = sum(d.get("verified_lengths", ()))
        return cls(**d)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def target_calls_per_token(self) -> float:
        return self.target_calls / self.tokens if self.tokens else 0.0

    @property
    def stop_overhead(self) -> float:
        """Cost of one stop decision as a fraction of one draft forward pass."""
        if not self.stop_decisions or not self.draft_forwards or self.draft_time <= 0:
            return 0.0
        return (self.stop_time / self.stop_decisions) / (self.draft_time / self.draft_forwards)

    def __add__(self, other: DecodeStats) -> DecodeStats:
        out = DecodeStats()
        for name in self.__dataclass_fields__:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def summary(self) -> dict[str, float]:
        """Flat metrics for logging."""
        return {
            "tokens": self.tokens,
            "rounds": self.rounds,
            "verified": self.verified,
            "tokens_per_s": self.tokens_per_s,
            "mean_accepted": self.mean_accepted,
            "target_calls_per_token": self.target_calls_per_token,
            "drafted": self.drafted,
            "wasted": self.wasted,
            "stop_overhead": self.stop_overhead,
            "wall_time": self.wall_time,
            "analysis_time": self.analysis_time,
            "prefill_time": self.prefill_time,
        }


def _name(model: PreTrainedModel) -> str:
    """A model's name as the cost model records it (``config.name_or_path``)."""
    return str(getattr(model.config, "name_or_path", "") or type(model).__name__)


@contextmanager
def _one_thread(device: torch.device):
    """Run small per-token tensor work on one CPU thread: for [B, V] vectors OpenMP start-up and spin-waits cost more
    than the work itself (several times more on a shared CPU)."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class _Stream:
    """One model's KV cache plus its per-position validity mask [B, S] (0 = padding or a discarded token)."""

    def __init__(self, model: PreTrainedModel, batch: int, device: torch.device) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.mask = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.tapped: Tensor | None = None

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @torch.inference_mode()
    def forward(
        self, tokens: list[list[int]], left_pad: bool, keep_logits: int = 1, hidden: bool = False,
        tap: int | None = None
    ) -> tuple[Tensor, Tensor | None, list[list[int]]]:
        """Feed each sequence its tokens (possibly none); returns (logits [B, n, V] of the last n = ``keep_logits``
        positions, 0 meaning every position (transformers' ``logits_to_keep``), last hidden, cache indices). With
        ``tap`` = N, ``self.tapped`` holds the [B, H] residual stream after the first N layers at the last position
        (the states of a companion that is those layers)."""
        batch = len(tokens)
        n = max(1, max(len(t) for t in tokens))
        device = self.mask.device
        ids = torch.zeros(batch, n, dtype=torch.long, device=device)
        m = torch.zeros(batch, n, dtype=torch.long, device=device)
        idx: list[list[int]] = []
        for b, t in enumerate(tokens):
            start = n - len(t) if left_pad else 0
            if t:
                ids[b, start : start + len(t)] = torch.tensor(t, device=device)
                m[b, start : start + len(t)] = 1
            idx.append([self.length + start + j for j in range(len(t))])
        pos = (self.mask.sum(-1, keepdim=True) + m.cumsum(-1) - 1).clamp_min(0)
        self.mask = torch.cat([self.mask, m], dim=1)
        with layer_output(self.model.get_decoder().layers, tap) as seen:
            out = self.model(
                input_ids=ids,
                attention_mask=self.mask,
                position_ids=pos,
                past_key_values=self.cache,
                use_cache=True,
                output_hidden_states=hidden,
                logits_to_keep=keep_logits,
            )
        h = out.hidden_states[-1][:, -1] if hidden else None
        self.tapped = seen[-1][:, -1] if seen else None
        return out.logits, h, idx

    def discard(self, b: int, indices: list[int]) -> None:
        if indices:
            self.mask[b, indices] = 0

    def crop(self) -> None:
        """Drop trailing positions no sequence still needs."""
        valid = self.mask.any(0).nonzero()
        keep = int(valid.max()) + 1 if valid.numel() else 0
        if keep < self.length:
            self.cache.crop(keep - self.length)  # negative: tokens to remove
            self.mask = self.mask[:, :keep]


@dataclass
class _Decoding:
    """The state of one ``generate`` call that outlives a round (B sequences)."""

    tgt: _Stream
    drf: _Stream
    cmp: _Stream | None
    t_pending: list[list[int]]
    """[B][n] tokens the target has not processed yet (the last emitted ones)."""
    d_pending: list[list[int]]
    """[B][n] the same for the draft (and companion)."""
    outputs: list[list[int]]
    """[B][emitted] new tokens per sequence."""
    done: list[bool]
    """[B] finished (eos or max_new_tokens)."""
    eos: set[int]
    max_new_tokens: int
    gen: torch.Generator | None
    stats: DecodeStats
    device: torch.device
    reference: list[list[int]] | None = None
    """[B][N] target-only greedy output (the oracle's look-ahead without target steps), or None."""
    peek: bool = False
    """The oracle runs the target one step per drafted token (no reference given)."""
    prompt_pending: list[bool] = field(default_factory=list)
    """[B] the target has not read sequence b's prompt yet: its first verification pass reads it."""

    @property
    def batch(self) -> int:
        return len(self.done)

    def streams(self) -> list[_Stream]:
        return [s for s in (self.tgt, self.drf, self.cmp) if s is not None]


@dataclass
class _Round:
    """What one round drafted, per sequence b of the batch (lists of length B; n_b drafted tokens for sequence b)."""

    caps: list[int]
    """[B] most tokens sequence b may draft this round."""
    active: list[bool]
    """[B] sequence b is still drafting."""
    drafted: list[list[int]]
    """[B][n_b] drafted token ids."""
    q_rows: list[list[Tensor]]
    """[B][n_b] of [V]: sampling distribution of each drafted token (sampling only)."""
    q_x: list[list[float]]
    """[B][n_b] q(x) of each drafted token (policy feedback)."""
    scores: list[list[float]]
    """[B][n_b] goodput policies: calibrated acceptance of each drafted token."""
    peek_logits: list[list[Tensor]]
    """[B][n_b] of [V]: analysis only, the target's logits at each drafted token."""
    t_idx: list[list[int]]
    """[B] target cache index of the pending + drafted tokens fed this round."""
    d_idx: list[list[int]]
    """[B] draft (and companion) cache index of the tokens fed this round."""

    @classmethod
    def start(cls, caps: list[int]) -> _Round:
        def empty() -> list:
            return [[] for _ in caps]

        return cls(caps, [c > 0 for c in caps], empty(), empty(), empty(), empty(), empty(), empty(), empty())

    def feed(self, pending: list[list[int]], step: int) -> list[list[int]]:
        """[B] tokens each active sequence feeds at this draft step: its pending tokens first, then its last draft."""
        return [(pending[b] if step == 0 else [self.drafted[b][-1]]) if self.active[b] else []
                for b in range(len(self.caps))]


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``draft`` proposals, drafting lengths chosen by ``policy``.

    Args:
        draft, target: causal LMs sharing one tokenizer (check it with ``compute.models.check_same_tokenizer``).
        policy: the stop policy (``predictors.base.StopPolicy``).
        companion: companion LM for SV-type policies (run alongside the draft on the same tokens).
        temperature: 0 for greedy decoding, > 0 for exact speculative sampling.
        top_p: nucleus mass of the sampling distributions (draft and target alike).
        max_draft_len: hard cap on draft tokens per round (on top of ``policy.draft_cap()``).
        top_k_features: top-k draft probabilities in the features (must match the predictor's training data).
        cost_model: the measured verification curve, ``compute.timing.CostModel`` (``pipelines.measure_costs``);
            goodput policies (SV, ``goodput:``) price their rounds with it (measured on the fly when missing; a curve
            measured for other models or another CPU is used with a warning naming both, one with fewer than two
            lengths is refused).
    """

    def __init__(
        self,
        draft: PreTrainedModel,
        target: PreTrainedModel,
        policy: StopPolicy,
        companion: PreTrainedModel | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_draft_len: int = 40,
        top_k_features: int = 10,
        cost_model: CostModel | None = None,
    ) -> None:
        if temperature < 0:
            raise ValueError(f"temperature={temperature}: must be >= 0 (0 = greedy)")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p={top_p}: must be in (0, 1]")
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len={max_draft_len}: must be >= 1")
        widths = {n: m.get_output_embeddings().weight.shape[0] for n, m in (("draft", draft), ("target", target))}
        if companion is not None:
            widths["companion"] = companion.get_output_embeddings().weight.shape[0]
        if len(set(widths.values())) > 1:
            raise ValueError(f"draft / target / companion vocabulary sizes differ: {widths}")
        reads_companion = policy.needs_companion
        if reads_companion and companion is None:
            cols = [c for c in policy.required_columns if c in COMPANION_COLUMNS]
            raise ValueError(
                f"policy {policy.kind!r} needs a companion model (columns {cols}); none is configured "
                f"(pass companion=... / --companion)"
            )
        # A companion the policy does not read is not run: it would only slow the draft loop down.
        self.draft, self.target, self.policy = draft, target, policy
        self.companion = companion if reads_companion else None
        self.companion_depth = shared_depth(self.companion, draft)
        """N when the companion's layers are the draft's first N (``compute.models.share_truncated_layers``, as
        ``load_models`` loads a ``truncated:N:<draft>`` companion): its states come from the draft's step and only its
        final norm and LM head run."""
        self.temperature, self.top_p = float(temperature), float(top_p)
        # (builds / loads the native statistics now, not inside the first timed decision)
        self._fused_greedy = (next(draft.parameters()).device.type == "cpu" and native_available()
                              and self.temperature == 0 and self.top_p >= 1.0)
        """Greedy on a CPU with the native statistics: each draft step's argmax and stop features in one call
        (``compute.draft_stats.greedy_draft_stats``)."""
        self.max_draft_len, self.top_k_features = int(max_draft_len), int(top_k_features)
        self.cost_model = cost_model
        self.needs_hidden = "draft_hidden" in policy.required_columns
        self.analysis = policy.needs_target
        self.sequential = policy.verification == SEQUENTIAL
        self.goodput = policy.verification == GOODPUT
        policy.use_mode(mode_of(self.temperature))  # a goodput policy picks its calibration map (or names the fix)
        self._cost: goodput.RoundCost | None = None
        if self.goodput and cost_model is not None:
            self._cost = self._round_cost()

    # ------------------------------------------------------------------ helpers
    def _probs(self, logits: Tensor) -> Tensor:
        return probs_from_logits(logits, self.temperature, self.top_p)

    def _pick(self, logits: Tensor, gen: torch.Generator | None) -> Tensor:
        """[B, V] logits -> [B] token: argmax (greedy) or a draw from the sampling distribution (without top-p, straight
        from the logits by the native inversion sampler, whose softmax equals ``_probs``' to float rounding)."""
        if self.temperature == 0:
            return logits.argmax(-1)
        if self.top_p >= 1.0:
            tok = sample_tokens(logits, self.temperature, gen)
            if tok is not None:
                return tok
        return self._draw(self._probs(logits), gen)

    @staticmethod
    def _draw(probs: Tensor, gen: torch.Generator | None) -> Tensor:
        """[B, V] probabilities -> [B] one draw per row. On a CPU by the native inversion sampler on their logs
        (``compute.draft_stats.sample_tokens``: one uniform per row against block sums accumulated in double, zero
        probabilities never drawn); ``torch.multinomial`` took 2.2-2.4 ms a draw over the Qwen vocabulary (151,936
        tokens), 16% of a draft step, against 0.04-0.1 ms. Elsewhere, or without the native build,
        ``torch.multinomial``."""
        tok = sample_tokens(probs.log(), 1.0, gen) if probs.device.type == "cpu" else None
        return tok if tok is not None else torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    def _sample(self, probs: Tensor, gen: torch.Generator | None) -> int:
        """[V] probabilities -> one sampled token id."""
        return int(self._draw(probs.unsqueeze(0), gen)[0])

    def _round_cost(self) -> goodput.RoundCost:
        """The goodput rule's round cost (draft and companion steps, the target curve), checked against this run."""
        if self._cost is not None:
            return self._cost
        if self.cost_model is None:
            self.cost_model = measure_cost_model(self.draft, self.target, self.companion,
                                                 lengths=(1, 2, 4, 8, 16, 24, 32, 41), repeats=1)
        from compute.compute_path import compute_path_of, cpu_info

        goodput.check_cost_model(self.cost_model, _name(self.draft), _name(self.target), compute_path_of(self.target),
                                 dict(cpu_info()))
        self._cost = goodput.RoundCost.from_cost_model(self.cost_model, companion=self.companion is not None)
        return self._cost

    # ------------------------------------------------------------------ main loop
    @torch.inference_mode()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 64,
        eos_token_id: int | list[int] | None = None,
        seed: int | None = None,
        reference: list[list[int]] | None = None,
    ) -> tuple[Tensor, DecodeStats]:
        """Decode up to ``max_new_tokens`` per sequence.

        Args:
            input_ids: [B, T] prompt ids, left-padded when B > 1.
            attention_mask: [B, T] 1 for prompt tokens, 0 for left padding (None: all ones).
            max_new_tokens: most new tokens per sequence (> 0).
            eos_token_id: token id(s) ending a sequence (kept in the output).
            seed: seed of the sampling generator (sampling only).
            reference: greedy only, for a policy that needs the target (the oracle): each sequence's target-only output
                on this path, read for ``greedy_match`` instead of a target step per drafted token.
        Returns:
            ([B, T + N] prompt + new tokens, right-padded with the pad / eos id), stats.
        """
        t_start = time.perf_counter()
        input_ids, mask = self._check_prompt(input_ids, attention_mask, max_new_tokens)
        st = self._prefill(input_ids, mask, max_new_tokens, eos_token_id, seed)
        st.stats.prefill_time = clock(st.device) - t_start
        self._use_reference(st, reference)
        while not all(st.done):
            rnd = self._draft_round(st)
            n_sent = self._verification_lengths(st, rnd)
            self._verify_round(st, rnd, n_sent)
            for s in st.streams():
                s.crop()
        st.stats.wall_time = clock(st.device) - t_start
        return torch.cat([input_ids, self._padded_outputs(st)], dim=1), st.stats

    def _use_reference(self, st: _Decoding, reference: list[list[int]] | None) -> None:
        """Set how the oracle learns ``greedy_match``: from ``reference`` (greedy) or one target step per draft."""
        if reference is not None:
            if self.temperature > 0:
                raise ValueError("reference outputs stand for the target's look-ahead in greedy decoding only "
                                 "(temperature 0); drop reference= for sampling")
            if len(reference) != st.batch:
                raise ValueError(f"reference: {len(reference)} outputs for a batch of {st.batch}")
            st.reference = [list(r) for r in reference]
        st.peek = self.analysis and st.reference is None

    def _check_prompt(self, input_ids: Tensor, attention_mask: Tensor | None, max_new_tokens: int
                      ) -> tuple[Tensor, Tensor]:
        """Validate the inputs; returns ([B, T] ids, [B, T] long mask) on the target's device."""
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be > 0")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"empty prompt: input_ids must be [B, T] with T > 0, got shape {tuple(input_ids.shape)}")
        device = self.target.device
        input_ids = input_ids.to(device)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(device).long()
        if (mask.sum(-1) == 0).any():
            raise ValueError("empty prompt: a sequence has no tokens (attention_mask all zero)")
        if (mask[:, -1] == 0).any():
            raise ValueError("prompts must be left-padded: attention_mask[:, -1] has zeros")
        return input_ids, mask

    def _prefill(self, input_ids: Tensor, mask: Tensor, max_new_tokens: int, eos_token_id: int | list[int] | None,
                 seed: int | None) -> _Decoding:
        """Fresh draft (and companion) caches holding every prompt token but the last (their first pending input); the
        target's is empty, its whole prompt pending: its first verification pass reads the prompt and the first drafts
        in one forward (as transformers' assisted generation does: one target pass a prompt fewer than a prefill
        followed by a first verification)."""
        device = self.target.device
        if eos_token_id is None:
            eos = set()
        else:
            eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        gen = None
        if self.temperature > 0:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed if seed is not None else torch.seed() % 2**63)
        batch = input_ids.shape[0]
        self.policy.reset()
        own_pass = self.companion is not None and not self.companion_depth
        cmp = _Stream(self.companion, batch, device) if own_pass else None
        st = _Decoding(
            tgt=_Stream(self.target, batch, device), drf=_Stream(self.draft, batch, device), cmp=cmp,
            t_pending=[], d_pending=[], outputs=[[] for _ in range(batch)], done=[False] * batch, eos=eos,
            max_new_tokens=max_new_tokens, gen=gen, stats=DecodeStats(), device=device,
        )
        prompts = [input_ids[b][mask[b].bool()].tolist() for b in range(batch)]
        if input_ids.shape[1] > 1:
            for s in st.streams():
                if s is not st.tgt:  # the target reads its prompt in the first verification pass, with the drafts
                    s.forward([p[:-1] for p in prompts], left_pad=True)
        st.t_pending = [list(p) for p in prompts]
        st.d_pending = [[p[-1]] for p in prompts]
        st.prompt_pending = [True] * batch
        return st

    def _padded_outputs(self, st: _Decoding) -> Tensor:
        """[B, N] the new tokens, right-padded with the pad (else eos, else 0) id; counts them in the stats."""
        st.stats.tokens = sum(len(o) for o in st.outputs)
        pad = self.target.config.pad_token_id
        if pad is None:
            pad = next(iter(st.eos)) if st.eos else 0
        width = max(len(o) for o in st.outputs)
        new = torch.full((st.batch, width), int(pad), dtype=torch.long, device=st.device)
        for b, o in enumerate(st.outputs):
            if o:
                new[b, : len(o)] = torch.tensor(o, device=st.device)
        return new

    # ------------------------------------------------------------------ drafting
    def _draft_round(self, st: _Decoding) -> _Round:
        """Draft step by step until every live sequence stopped (policy decision or cap)."""
        caps = [0] * st.batch
        for b in range(st.batch):
            if not st.done[b]:
                caps[b] = self.policy.round_cap(self.max_draft_len, st.max_new_tokens - len(st.outputs[b]) - 1)
        rnd = _Round.start(caps)
        step = 0
        while any(rnd.active):
            self._draft_step(st, rnd, step)
            step += 1
        return rnd

    def _draft_step(self, st: _Decoding, rnd: _Round, step: int) -> None:
        """One batched draft forward pass (B sequences), the stop decision, and the drafted tokens appended."""
        t0 = clock(st.device)
        feed = rnd.feed(st.d_pending, step)
        logits, hid, idx = st.drf.forward(feed, left_pad=True, hidden=self.needs_hidden,
                                          tap=self.companion_depth)
        c_logits = None
        if st.cmp is not None:
            c_logits = st.cmp.forward(feed, left_pad=True)[0][:, -1]
        elif self.companion_depth:  # the companion is the draft's first layers: its head on the draft's state there
            c_logits = self.companion.get_output_embeddings()(self.companion.get_decoder().norm(st.drf.tapped))
        st.stats.draft_time += clock(st.device) - t0
        st.stats.draft_forwards += 1
        logits = logits[:, -1]  # [B, V]
        for b in range(st.batch):
            rnd.d_idx[b] += idx[b]
        tok = None if self._fused_greedy else self._pick(logits, st.gen)  # [B]
        t_logits = self._peek_target(st, rnd, step) if st.peek else None  # [B, V]
        t0 = clock(st.device)
        stats = None
        if tok is None:  # greedy on a CPU: the argmax the features' native pass finds, one call on all threads
            tok, stats = greedy_draft_stats(logits, max(1, self.top_k_features)) or (self._pick(logits, st.gen), None)
        c_stats = None
        if c_logits is not None and stats is not None:  # SV's companion columns: one native call on all threads too
            c_stats = pair_stats(logits, c_logits, tok, self.temperature)
            c_stats = None if c_stats is None else c_stats[0]
        with _one_thread(st.device):
            feats = token_features(logits, tok, target_logits=t_logits, companion_logits=c_logits, draft_hidden=hid,
                                   top_k=self.top_k_features, temperature=self.temperature, top_p=self.top_p,
                                   columns=self.policy.required_columns, stats=stats, companion_stats=c_stats)
            feats["position"] = torch.full((st.batch,), step, dtype=torch.long, device=st.device)
            if self.analysis and not st.peek:
                feats["greedy_match"] = self._reference_match(st, rnd, tok)
            keep, sc = self._decide(feats, rnd)
        st.stats.stop_time += clock(st.device) - t0
        st.stats.stop_decisions += 1
        q_all = self._probs(logits) if self.temperature > 0 else None  # [B, V]
        toks, qs = tok.tolist(), feats["q"].tolist()
        for b in range(st.batch):
            if not rnd.active[b]:
                continue
            rnd.drafted[b].append(toks[b])
            rnd.q_x[b].append(qs[b])
            if q_all is not None:
                rnd.q_rows[b].append(q_all[b])
            if t_logits is not None:
                rnd.peek_logits[b].append(t_logits[b])
            if sc is not None:
                rnd.scores[b].append(float(sc[b]))
            if len(rnd.drafted[b]) >= rnd.caps[b] or not keep[b]:
                rnd.active[b] = False

    @staticmethod
    def _reference_match(st: _Decoding, rnd: _Round, tok: Tensor) -> Tensor:
        """[B] the drafted token equals the target-only output at its position (False past its end)."""
        assert st.reference is not None
        match = []
        for b, t in enumerate(tok.tolist()):
            pos = len(st.outputs[b]) + len(rnd.drafted[b])
            match.append(pos < len(st.reference[b]) and st.reference[b][pos] == t)
        return torch.tensor(match, device=tok.device)

    def _peek_target(self, st: _Decoding, rnd: _Round, step: int) -> Tensor:
        """Analysis only: the target's [B, V] logits at the token each active sequence feeds (one step)."""
        t0 = clock(st.device)
        tl, _, tidx = st.tgt.forward(rnd.feed(st.t_pending, step), left_pad=True)
        for b in range(st.batch):
            rnd.t_idx[b] += tidx[b]
        st.stats.analysis_time += clock(st.device) - t0
        return tl[:, -1]

    def _decide(self, feats: dict[str, Tensor], rnd: _Round) -> tuple[list[bool], list[float] | None]:
        """[B] draft another token after this one; goodput policies also return their [B] calibrated acceptances and
        decide by the goodput rule alone (``predictors.goodput.keep_drafting``, as the replay does)."""
        if not self.goodput:
            return self.policy.keep_drafting(feats).tolist(), None
        sc = self.policy.score_list(feats)
        cost = self._round_cost()
        keep = [bool(rnd.active[b]) and goodput.keep_drafting([*rnd.scores[b], float(sc[b])], cost, rnd.caps[b])
                for b in range(len(sc))]
        return keep, sc

    # ------------------------------------------------------------------ verification
    def _verification_lengths(self, st: _Decoding, rnd: _Round) -> list[int]:
        """[B] drafted tokens sent to the target: all of them, or the goodput rule's best prefix (across a batch
        sharing one target pass, ``predictors.goodput.batch_lengths``)."""
        if not self.goodput:
            return [len(d) for d in rnd.drafted]
        cost = self._round_cost()
        if st.batch == 1:
            n = [goodput.best_prefix(rnd.scores[0], cost)[0]]
        else:
            per = cost.per_draft
            n = goodput.batch_lengths([rnd.scores[b] if not st.done[b] else [] for b in range(st.batch)],
                                      lambda m: m * per + cost.target_time(m + 1))
        for b in range(st.batch):
            if not st.done[b]:
                st.stats.expected_tokens.append(float(goodput.expected_tokens(rnd.scores[b][: n[b]])[-1]))
        return n

    def _verify_round(self, st: _Decoding, rnd: _Round, n_sent: list[int]) -> None:
        """One target forward pass over every live sequence's window, then per-sequence verification and bookkeeping."""
        live = [b for b in range(st.batch) if not st.done[b]]
        if st.peek:  # the target has seen every drafted token but the last
            t_feed = [[d[-1]] if d else list(p) for d, p in zip(rnd.drafted, st.t_pending)]
        else:
            t_feed = [st.t_pending[b] + rnd.drafted[b][: n_sent[b]] for b in range(st.batch)]
        t_feed = [t_feed[b] if not st.done[b] else [] for b in range(st.batch)]
        keep = 1 if st.peek else max(n_sent[b] + 1 for b in live)  # the positions that score drafts or the bonus
        prompt = [b for b in live if st.prompt_pending[b] and not st.peek]
        t0 = clock(st.device)
        tl, _, tidx = st.tgt.forward(t_feed, left_pad=True, keep_logits=keep)  # [B, keep, V], windows right-aligned
        if prompt:  # the prompts' pass: the target's prefill, which verified the first drafts too
            st.stats.prefill_time += clock(st.device) - t0
        else:
            st.stats.target_time += clock(st.device) - t0
        for b in range(st.batch):
            rnd.t_idx[b] += tidx[b]
        for b in live:
            k = n_sent[b]
            if st.peek:
                logit_rows = rnd.peek_logits[b][:k] + [tl[b, -1]]
            else:
                logit_rows = [tl[b, keep - k - 1 + j] for j in range(k + 1)]
            emitted, n_acc, flags = self._verify(rnd.drafted[b][:k], rnd.q_rows[b][:k], logit_rows, st.gen)
            st.stats.verified += k
            st.stats.verified_lengths.append(k)
            if b in prompt:
                st.stats.prompt_passes += 1
                st.stats.prompt_pass_lengths.append(k)
            self.policy.update(RoundFeedback(n_drafted=k, n_accepted=n_acc, draft_probs=rnd.q_x[b][:k], accepted=flags))
            self._settle(st, rnd, b, emitted, n_acc)

    def _settle(self, st: _Decoding, rnd: _Round, b: int, emitted: list[int], n_acc: int) -> None:
        """Sequence b after verification: statistics, caches keep pending + accepted tokens, limits."""
        n_drafted = len(rnd.drafted[b])
        stats = st.stats
        stats.target_calls += 1  # one verification per sequence-round
        stats.rounds += 1
        stats.drafted += n_drafted
        stats.accepted += n_acc
        stats.wasted += n_drafted - n_acc
        stats.accepted_lengths.append(n_acc)
        stats.draft_lengths.append(n_drafted)
        st.tgt.discard(b, rnd.t_idx[b][len(st.t_pending[b]) + n_acc :])  # pending (the prompt at first) + accepted
        st.t_pending[b] = emitted[n_acc:]
        st.prompt_pending[b] = False
        if n_drafted:
            fed = n_drafted - 1  # the draft never fed its last drafted token
            keep_n = min(n_acc, fed)
            n_old = len(rnd.d_idx[b]) - fed
            for s in (st.drf, st.cmp):
                if s is not None:
                    s.discard(b, rnd.d_idx[b][n_old + keep_n :])
            st.d_pending[b] = emitted[keep_n:]
        else:
            st.d_pending[b] = st.d_pending[b] + emitted
        for j, t in enumerate(emitted):
            if t in st.eos:
                emitted = emitted[: j + 1]
                st.done[b] = True
                break
        emitted = emitted[: st.max_new_tokens - len(st.outputs[b])]
        st.outputs[b] += emitted
        if len(st.outputs[b]) >= st.max_new_tokens:
            st.done[b] = True

    def _verify(
        self, drafted: list[int], q_rows: list[Tensor], logit_rows: list[Tensor], gen: torch.Generator | None
    ) -> tuple[list[int], int, list[bool]]:
        """Verify one sequence's window. logit_rows[j] scores drafted[j]; logit_rows[k] scores the bonus position.

        Returns (emitted tokens, accepted draft tokens, per-token accepted flags).
        """
        k = len(drafted)
        flags: list[bool] = []
        if self.sequential and k > 0:
            # SPRINTER: tokens before the last are taken unverified; only the last is checked.
            flags = [True] * (k - 1)
            last_ok, corr = self._check(drafted[-1], q_rows[-1] if q_rows else None, logit_rows[k - 1], gen)
            if last_ok:
                return drafted + [self._pick_row(logit_rows[k], gen)], k, flags + [True]
            return drafted[:-1] + [corr], k - 1, flags + [False]
        for j in range(k):
            ok, corr = self._check(drafted[j], q_rows[j] if q_rows else None, logit_rows[j], gen)
            flags.append(ok)
            if not ok:
                return drafted[:j] + [corr], j, flags + [False] * (k - j - 1)
        return drafted + [self._pick_row(logit_rows[k], gen)], k, flags

    def _pick_row(self, logits: Tensor, gen: torch.Generator | None) -> int:
        return int(self._pick(logits.unsqueeze(0), gen)[0])

    def _check(self, x: int, q: Tensor | None, logits: Tensor, gen: torch.Generator | None) -> tuple[bool, int]:
        """Exact check of one draft token: (accepted, correction token if rejected)."""
        if self.temperature == 0:
            a = int(logits.argmax())
            return a == x, a
        p = self._probs(logits)
        u = float(torch.rand((), generator=gen, device=p.device))
        if u < float(p[x]) / max(float(q[x]), 1e-30):
            return True, -1
        resid = (p - q).clamp_min(0.0)
        if float(resid.sum()) <= 0:
            resid = p
        return False, self._sample(resid / resid.sum(), gen)
