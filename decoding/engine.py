"""Speculative decoding engine with a pluggable stop policy (exact greedy / sampling verification, batches, KV caches).

One round: the draft proposes tokens one at a time; after each drafted token its features are computed with
``data_gen.features.token_features`` (the same function data generation uses) plus ``position`` (index of the token in
the current draft window) and the policy decides whether to draft another; then the target verifies the window in one
forward pass (exact: greedy match or min(1, p/q) with a correction from norm(max(0, p - q)) and a bonus token), the
policy is told the outcome (``policy.update``) and both KV caches (transformers ``DynamicCache``) are cropped.

How a round runs follows the round rule the policy supplies (``policy.round_rule``, ``predictors.round_rules``),
never its kind:
- the ``goodput`` rule (SV, any ``goodput:`` policy): the score is a calibrated acceptance; the round drafts
  while the expected tokens/s of the lengths still reachable improves and verifies the best prefix (the one rule of
  ``predictors.goodput``, priced by the measured ``compute.timing.CostModel``, the same call as the offline replay).
- the ``sequential`` rule (SPRINTER, ``policy.exact`` False): approximate sequential verification; drafted tokens
  before the last one are taken unverified, the target checks only the last token (min(1, p/q) or a resample from
  norm(max(0, p - q))).
- ``policy.needs_target`` (the oracle): analysis only; the target runs one step per drafted token to give
  ``greedy_match``; that time is reported apart (``DecodeStats.analysis_time``). In greedy decoding, given each
  sequence's target-only output (``generate(..., reference=...)``), ``greedy_match`` is read from it instead (exact
  greedy decoding emits that output token for token) and the oracle's rounds verify like any other's: measured time.

Phases of ``SpeculativeDecoder.generate`` (in the manner of gpt-fast's generate.py): prefill; then per round
``_draft_batch`` (draft steps, each ``_draft_step`` with the stop decision ``_decide``), ``_verification_lengths``,
``Verifier.verify_round`` (one target pass, per-sequence ``Verifier.verify``, ``decoding.verification``) and
``Decoding.settle`` (statistics, cache bookkeeping, limits; ``decoding.state``). The counters are
``decoding.stats.DecodeStats``, the caches ``decoding.streams.Stream``, token choice ``decoding.sampling``.

Batches (B > 1): prompts left-padded; each sequence drafts its own length; a sequence that stopped drafting feeds masked
dummy tokens while the others continue; rejected positions become masked holes in the caches (positions come from the
attention mask), and the caches are cropped to the longest live sequence after every round.

Usage:
    dec = SpeculativeDecoder(draft, target, StaticLength(5))
    out, stats = dec.generate(input_ids, attention_mask=None, max_new_tokens=64, eos_token_id=tok.eos_token_id, seed=0)
    steps = dec.decode_steps(input_ids, ...)   # the same a round at a time (next(steps): new tokens so far)
"""
from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import contextmanager

import torch
from torch import Tensor
from transformers import PreTrainedModel

from compute.compute_path import compute_path_of, cpu_info
from compute.draft_stats import greedy_draft_stats, native_available, pair_stats
from compute.models import shared_depth
from compute.timing import CostModel, clock, measure_cost_model
from data_gen.features import COMPANION_COLUMNS, token_features
from decoding.sampling import TokenSampler
from decoding.state import BatchRound, Decoding
from decoding.stats import DecodeStats
from decoding.streams import Stream
from decoding.verification import Verifier
from predictors import goodput
from predictors.base import StopPolicy
from predictors.calibration import mode_of

__all__ = ["DecodeStats", "SpeculativeDecoder"]


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


def _check_models(draft: PreTrainedModel, target: PreTrainedModel, policy: StopPolicy,
                  companion: PreTrainedModel | None) -> None:
    """Refuse models of different vocabulary sizes, and a policy that reads a companion when none is given."""
    widths = {n: m.get_output_embeddings().weight.shape[0] for n, m in (("draft", draft), ("target", target))}
    if companion is not None:
        widths["companion"] = companion.get_output_embeddings().weight.shape[0]
    if len(set(widths.values())) > 1:
        raise ValueError(f"draft / target / companion vocabulary sizes differ: {widths}")
    if policy.needs_companion and companion is None:
        cols = [c for c in policy.required_columns if c in COMPANION_COLUMNS]
        raise ValueError(
            f"policy {policy.kind!r} needs a companion model (columns {cols}); none is configured "
            f"(pass companion=... to SpeculativeDecoder, or --models.companion on the command line)"
        )


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
        _check_models(draft, target, policy, companion)
        # A companion the policy does not read is not run: it would only slow the draft loop down.
        self.draft, self.target, self.policy = draft, target, policy
        self.companion = companion if policy.needs_companion else None
        self.companion_depth = shared_depth(self.companion, draft)
        """N when the companion's layers are the draft's first N (``compute.models.share_truncated_layers``, as
        ``load_models`` loads a ``truncated:N:<draft>`` companion): its states come from the draft's step and only its
        final norm and LM head run."""
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.sampler = TokenSampler(self.temperature, self.top_p)
        # (builds / loads the native statistics now, not inside the first timed decision)
        self._fused_greedy = (next(draft.parameters()).device.type == "cpu" and native_available()
                              and self.temperature == 0 and self.top_p >= 1.0)
        """Greedy on a CPU with the native statistics: each draft step's argmax and stop features in one call
        (``compute.draft_stats.greedy_draft_stats``)."""
        self.max_draft_len, self.top_k_features = int(max_draft_len), int(top_k_features)
        self.cost_model = cost_model
        self.needs_hidden = "draft_hidden" in policy.required_columns
        self.analysis = policy.needs_target
        self.rule = policy.round_rule
        self.verifier = Verifier(self.sampler, policy, self.rule.sequential)
        policy.use_mode(mode_of(self.temperature))  # a goodput policy picks its calibration map (or names the fix)
        self._cost: goodput.RoundCost | None = None
        if self.rule.needs_cost_model and cost_model is not None:
            self._cost = self._round_cost()

    def _rule_cost(self) -> goodput.RoundCost | None:
        """The round cost the rule prices with (cost-aware rules), else None."""
        return self._round_cost() if self.rule.needs_cost_model else None

    def _round_cost(self) -> goodput.RoundCost:
        """The goodput rule's round cost (draft and companion steps, the target curve), checked against this run."""
        if self._cost is not None:
            return self._cost
        if self.cost_model is None:
            self.cost_model = measure_cost_model(self.draft, self.target, self.companion,
                                                 lengths=(1, 2, 4, 8, 16, 24, 32, 41), repeats=1)
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
        steps = self.decode_steps(input_ids, attention_mask, max_new_tokens, eos_token_id, seed, reference)
        while True:
            try:
                next(steps)
            except StopIteration as end:
                return end.value

    @torch.inference_mode()
    def decode_steps(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 64,
        eos_token_id: int | list[int] | None = None,
        seed: int | None = None,
        reference: list[list[int]] | None = None,
    ) -> Generator[int, None, tuple[Tensor, DecodeStats]]:
        """:meth:`generate` a step at a time: yields the fewest new tokens of any sequence so far after the prefill
        and after every round, and returns what ``generate`` returns. Decodes stepped in turn share the host's slow
        phases (the benchmark's ``interleave``); ``stats.wall_time`` then spans the others' steps too."""
        t_start = time.perf_counter()
        input_ids, mask = self._check_prompt(input_ids, attention_mask, max_new_tokens)
        st = self._prefill(input_ids, mask, max_new_tokens, eos_token_id, seed)
        st.stats.prefill_time = clock(st.device) - t_start
        self._use_reference(st, reference)
        yield 0
        while not all(st.done):
            rnd = self._draft_batch(st)
            n_sent = self._verification_lengths(st, rnd)
            self.verifier.verify_round(st, rnd, n_sent)
            for s in st.streams():
                s.crop()
            yield min(len(o) for o in st.outputs)
        st.stats.wall_time = clock(st.device) - t_start
        return torch.cat([input_ids, self._padded_outputs(st)], dim=1), st.stats

    def _use_reference(self, st: Decoding, reference: list[list[int]] | None) -> None:
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
                 seed: int | None) -> Decoding:
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
        cmp = Stream(self.companion, batch, device) if own_pass else None
        st = Decoding(
            tgt=Stream(self.target, batch, device), drf=Stream(self.draft, batch, device), cmp=cmp,
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

    def _padded_outputs(self, st: Decoding) -> Tensor:
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
    def _draft_batch(self, st: Decoding) -> BatchRound:
        """Draft step by step until every live sequence stopped (policy decision or cap)."""
        caps = [0] * st.batch
        for b in range(st.batch):
            if not st.done[b]:
                caps[b] = self.policy.round_cap(self.max_draft_len, st.max_new_tokens - len(st.outputs[b]) - 1)
        cost = self._rule_cost()
        caps = [self.rule.affordable(self.policy, c, cost) for c in caps]  # 0: no round could pay on this curve
        rnd = BatchRound.start(caps)
        step = 0
        while any(rnd.active):
            self._draft_step(st, rnd, step)
            step += 1
        return rnd

    def _draft_step(self, st: Decoding, rnd: BatchRound, step: int) -> None:
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
        tok = None if self._fused_greedy else self.sampler.pick(logits, st.gen)  # [B]
        t_logits = self._peek_target(st, rnd, step) if st.peek else None  # [B, V]
        t0 = clock(st.device)
        stats = None
        if tok is None:  # greedy on a CPU: the argmax the features' native pass finds, one call on all threads
            fused = greedy_draft_stats(logits, max(1, self.top_k_features))
            tok, stats = fused or (self.sampler.pick(logits, st.gen), None)
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
                feats["greedy_match"] = st.reference_match(rnd, tok)
            keep, sc = self._decide(feats, rnd)
        st.stats.stop_time += clock(st.device) - t0
        st.stats.stop_decisions += 1
        q_all = self.sampler.probs(logits) if self.temperature > 0 else None  # [B, V]
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

    def _peek_target(self, st: Decoding, rnd: BatchRound, step: int) -> Tensor:
        """Analysis only: the target's [B, V] logits at the token each active sequence feeds (one step)."""
        t0 = clock(st.device)
        tl, _, tidx = st.tgt.forward(rnd.feed(st.t_pending, step), left_pad=True)
        for b in range(st.batch):
            rnd.t_idx[b] += tidx[b]
        st.stats.analysis_time += clock(st.device) - t0
        return tl[:, -1]

    def _decide(self, feats: dict[str, Tensor], rnd: BatchRound) -> tuple[list[bool], list[float] | None]:
        """[B] draft another token after this one, and the [B] scores the round rule keeps (goodput: calibrated
        acceptances; prefix: the scores that choose the tokens sent), as the replay and the hooks decide."""
        return self.rule.decide(self.policy, feats, rnd.scores, rnd.caps, rnd.active, self._rule_cost())

    # ------------------------------------------------------------------ verification
    def _verification_lengths(self, st: Decoding, rnd: BatchRound) -> list[int]:
        """[B] drafted tokens sent to the target, as the round rule says: all of them, the goodput rule's best prefix
        (across a batch sharing one target pass, ``predictors.goodput.batch_lengths``), or the prefix rule's."""
        n = self.rule.sent_batch(self.policy, rnd.scores, [len(d) for d in rnd.drafted],
                                 [not d for d in st.done], self._rule_cost())
        if not self.rule.cost_aware:
            return n
        for b in range(st.batch):
            if not st.done[b]:
                st.stats.expected_tokens.append(float(goodput.expected_tokens(rnd.scores[b][: n[b]])[-1]))
        return n
