"""Speculative decoding engine with a pluggable stop policy (exact greedy / sampling verification, batches, KV caches).

One round: the draft proposes tokens one at a time; after each drafted token its features are computed with
``data_gen.features.token_features`` (the same function data generation uses) plus ``position`` (index of the token in
the current draft window) and the policy decides whether to draft another; then the target verifies the window in one
forward pass (exact: greedy match or min(1, p/q) with a correction from norm(max(0, p - q)) and a bonus token), the
policy is told the outcome (``policy.update``) and both KV caches (transformers ``DynamicCache``) are cropped.

Policy kinds with special decoding:
- ``sv``: drafts while the predicted acceptance is useful, then verifies the goodput-best prefix
  (``predictors.goodput.goodput_length`` with the latency table of ``decoding.latency``); needs a companion model.
- ``sprinter`` (``policy.exact`` False): approximate sequential verification; drafted tokens before the last one are taken
  unverified, the target checks only the last token (min(1, p/q) or a resample from norm(max(0, p - q))).
- policies needing target columns (``oracle``): analysis only; the target runs one step per drafted token to give
  ``greedy_match``; that time is reported apart (``DecodeStats.analysis_time``).

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

from data_gen.features import COMPANION_COLUMNS, TARGET_COLUMNS, probs_from_logits, token_features
from decoding.companion import needs_companion
from predictors.base import RoundFeedback, StopPolicy

__all__ = ["DecodeStats", "SpeculativeDecoder"]


@dataclass
class DecodeStats:
    """Counters and timings of one or more ``generate`` calls (add them with ``+``)."""

    new_tokens: int = 0
    """Tokens emitted (all sequences)."""
    target_calls: int = 0
    """Target forward passes (verification rounds; prefill not counted)."""
    draft_tokens: int = 0
    """Tokens the draft proposed (all sequences)."""
    accepted: int = 0
    """Draft tokens accepted by verification (or taken unverified by SPRINTER)."""
    wasted: int = 0
    """Draft tokens proposed but not emitted (rejected or cut by SV's goodput length)."""
    rounds: int = 0
    """Per-sequence verification rounds."""
    accepted_lengths: list[int] = field(default_factory=list)
    """Accepted draft tokens per sequence-round."""
    draft_lengths: list[int] = field(default_factory=list)
    """Drafted tokens per sequence-round."""
    draft_forwards: int = 0
    """Draft forward passes (batched steps)."""
    draft_time: float = 0.0
    """Seconds in draft (and companion) forward passes."""
    target_time: float = 0.0
    """Seconds in target verification forward passes (prefill excluded)."""
    stop_decisions: int = 0
    """Batched stop decisions taken (one per draft step)."""
    stop_time: float = 0.0
    """Seconds computing features and policy decisions."""
    analysis_time: float = 0.0
    """Seconds in analysis-only target look-ahead (oracle); included in wall_time."""
    wall_time: float = 0.0
    """Seconds of the whole call(s)."""

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def target_calls_per_token(self) -> float:
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

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
            "new_tokens": self.new_tokens,
            "tokens_per_s": self.tokens_per_s,
            "mean_accepted": self.mean_accepted,
            "target_calls_per_token": self.target_calls_per_token,
            "draft_tokens": self.draft_tokens,
            "wasted": self.wasted,
            "stop_overhead": self.stop_overhead,
            "wall_time": self.wall_time,
            "analysis_time": self.analysis_time,
        }


def _clock(device: torch.device) -> float:
    """perf_counter after the device finished its queued work (CUDA kernels are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    @torch.no_grad()
    def forward(
        self, tokens: list[list[int]], left_pad: bool, all_logits: bool, hidden: bool = False
    ) -> tuple[Tensor, Tensor | None, list[list[int]]]:
        """Feed each sequence its tokens (possibly none); returns (logits [B, n or 1, V], last hidden, cache indices)."""
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
        out = self.model(
            input_ids=ids,
            attention_mask=self.mask,
            position_ids=pos,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=hidden,
            logits_to_keep=0 if all_logits else 1,
        )
        h = out.hidden_states[-1][:, -1] if hidden else None
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


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``draft`` proposals, drafting lengths chosen by ``policy``.

    Args:
        draft, target: causal LMs sharing one tokenizer (check it with ``data_gen.models.check_same_tokenizer``).
        policy: the stop policy (``predictors.base.StopPolicy``).
        companion: companion LM for SV-type policies (run alongside the draft on the same tokens).
        temperature: 0 for greedy decoding, > 0 for exact speculative sampling.
        top_p: nucleus mass of the sampling distributions (draft and target alike).
        max_draft_len: hard cap on draft tokens per round (on top of ``policy.draft_cap()``).
        top_k_features: top-k draft probabilities in the features (must match the predictor's training data).
        latency: ``decoding.latency.LatencyTable`` (needed by SV; profiled on the fly when missing).
        sv_patience: SV stops drafting once this many drafted tokens lie beyond the goodput-best prefix (drafting
            further is unlikely to lengthen it: the expected acceptance of a longer prefix only falls).
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
        latency=None,
        sv_patience: int = 2,
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
        reads_companion = needs_companion(policy)
        if reads_companion and companion is None:
            cols = [c for c in policy.required_columns if c in COMPANION_COLUMNS]
            raise ValueError(
                f"policy {policy.kind!r} needs a companion model (columns {cols}); none is configured "
                f"(pass companion=... / --companion)"
            )
        # A companion the policy does not read is not run: it would only slow the draft loop down.
        self.draft, self.target, self.policy = draft, target, policy
        self.companion = companion if reads_companion else None
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.max_draft_len, self.top_k_features = int(max_draft_len), int(top_k_features)
        self.latency = latency
        self.needs_hidden = "draft_hidden" in policy.required_columns
        self.analysis = any(c in TARGET_COLUMNS for c in policy.required_columns)
        self.sequential = policy.kind == "sprinter" or not policy.exact
        self.is_sv = policy.kind == "sv"
        if sv_patience < 1:
            raise ValueError(f"sv_patience={sv_patience}: must be >= 1")
        self.sv_patience = int(sv_patience)

    # ------------------------------------------------------------------ helpers
    def _probs(self, logits: Tensor) -> Tensor:
        return probs_from_logits(logits, self.temperature, self.top_p)

    def _pick(self, logits: Tensor, gen: torch.Generator | None) -> Tensor:
        """[B, V] logits -> [B] token: argmax (greedy) or a sample from the sampling distribution."""
        if self.temperature == 0:
            return logits.argmax(-1)
        return torch.multinomial(self._probs(logits), 1, generator=gen).squeeze(-1)

    def _sample(self, probs: Tensor, gen: torch.Generator | None) -> int:
        return int(torch.multinomial(probs, 1, generator=gen))

    def _sv_latency(self):
        if self.latency is None:
            from decoding.latency import profile_latency

            self.latency, _ = profile_latency(self.draft, self.target, self.companion)
        return self.latency.round_latency

    # ------------------------------------------------------------------ main loop
    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        max_new_tokens: int = 64,
        eos_token_id: int | list[int] | None = None,
        seed: int | None = None,
    ) -> tuple[Tensor, DecodeStats]:
        """Decode up to ``max_new_tokens`` per sequence.

        Args:
            input_ids: [B, T] prompt ids, left-padded when B > 1.
            attention_mask: [B, T] 1 for prompt tokens, 0 for left padding (None: all ones).
            max_new_tokens: most new tokens per sequence (> 0).
            eos_token_id: token id(s) ending a sequence (kept in the output).
            seed: seed of the sampling generator (sampling only).
        Returns:
            ([B, T + N] prompt + new tokens, right-padded with the pad / eos id), stats.
        """
        t_start = time.perf_counter()
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
        eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        gen = None
        if self.temperature > 0:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed if seed is not None else torch.seed() % 2**63)

        batch = input_ids.shape[0]
        stats = DecodeStats()
        self.policy.reset()
        tgt = _Stream(self.target, batch, device)
        drf = _Stream(self.draft, batch, device)
        cmp = _Stream(self.companion, batch, device) if self.companion is not None else None
        prompts = [input_ids[b][mask[b].bool()].tolist() for b in range(batch)]
        # Prefill all but the last prompt token (it is each model's first pending input).
        if input_ids.shape[1] > 1:
            pre = [p[:-1] for p in prompts]
            for s in (tgt, drf, cmp):
                if s is not None:
                    s.forward(pre, left_pad=True, all_logits=False)
        t_pending = [[p[-1]] for p in prompts]  # tokens the target has not processed yet
        d_pending = [[p[-1]] for p in prompts]  # same for the draft (and companion)
        outputs: list[list[int]] = [[] for _ in range(batch)]
        done = [False] * batch

        while not all(done):
            live = [b for b in range(batch) if not done[b]]
            # ---------------------------------------------------------- drafting
            caps = [0] * batch
            for b in live:
                caps[b] = max(0, min(self.policy.draft_cap(), self.max_draft_len, max_new_tokens - len(outputs[b]) - 1))
            drafted: list[list[int]] = [[] for _ in range(batch)]
            q_rows: list[list[Tensor]] = [[] for _ in range(batch)]  # sampling distributions of drafted tokens
            scores: list[list[float]] = [[] for _ in range(batch)]
            q_x: list[list[float]] = [[] for _ in range(batch)]  # q(x) of drafted tokens (policy feedback)
            peek_logits: list[list[Tensor]] = [[] for _ in range(batch)]  # analysis: target logits per draft token
            t_idx: list[list[int]] = [[] for _ in range(batch)]  # target cache index of pending + drafted tokens
            d_idx: list[list[int]] = [[] for _ in range(batch)]
            active = [caps[b] > 0 for b in range(batch)]
            step = 0
            while any(active):
                feed = [
                    (d_pending[b] if step == 0 else [drafted[b][-1]]) if active[b] else [] for b in range(batch)
                ]
                t0 = _clock(device)
                logits, hid, idx = drf.forward(feed, left_pad=True, all_logits=False, hidden=self.needs_hidden)
                c_logits = cmp.forward(feed, left_pad=True, all_logits=False)[0][:, -1] if cmp is not None else None
                stats.draft_time += _clock(device) - t0
                stats.draft_forwards += 1
                logits = logits[:, -1]
                for b in range(batch):
                    d_idx[b] += idx[b]
                tok = self._pick(logits, gen)  # [B]
                t_logits = None
                if self.analysis:
                    t0 = _clock(device)
                    t_feed = [
                        (t_pending[b] if step == 0 else [drafted[b][-1]]) if active[b] else [] for b in range(batch)
                    ]
                    tl, _, tidx = tgt.forward(t_feed, left_pad=True, all_logits=False)
                    t_logits = tl[:, -1]
                    for b in range(batch):
                        t_idx[b] += tidx[b]
                    stats.analysis_time += _clock(device) - t0
                t0 = _clock(device)
                with _one_thread(device):
                    feats = token_features(
                        logits,
                        tok,
                        target_logits=t_logits,
                        companion_logits=c_logits,
                        draft_hidden=hid,
                        top_k=self.top_k_features,
                        temperature=self.temperature,
                        top_p=self.top_p,
                    )
                    feats["position"] = torch.full((batch,), step, dtype=torch.long, device=device)
                    keep = self.policy.keep_drafting(feats).tolist()
                    sc = self.policy.score(feats).tolist() if self.is_sv else None
                    if sc is not None:  # SV: stop once the goodput-best prefix has not grown for sv_patience tokens
                        lat = self._sv_latency()
                        for b in range(batch):
                            if active[b]:
                                s_b = [*scores[b], float(sc[b])]
                                keep[b] = keep[b] and len(s_b) - goodput_prefix(s_b, lat) < self.sv_patience
                stats.stop_time += _clock(device) - t0
                stats.stop_decisions += 1
                q_all = self._probs(logits) if self.temperature > 0 else None
                toks, qs = tok.tolist(), feats["q"].tolist()
                for b in range(batch):
                    if not active[b]:
                        continue
                    drafted[b].append(toks[b])
                    q_x[b].append(qs[b])
                    if q_all is not None:
                        q_rows[b].append(q_all[b])
                    if t_logits is not None:
                        peek_logits[b].append(t_logits[b])
                    if sc is not None:
                        scores[b].append(float(sc[b]))
                    if len(drafted[b]) >= caps[b] or not keep[b]:
                        active[b] = False
                step += 1

            # SV: verify only the goodput-best prefix of what was drafted.
            n_sent = [len(d) for d in drafted]
            if self.is_sv:
                lat = self._sv_latency()
                if batch == 1:
                    n_sent[0] = goodput_prefix(scores[0], lat) if drafted[0] else 0
                else:
                    n_sent = sv_batch_lengths([scores[b] if b in live else [] for b in range(batch)], lat)

            # ---------------------------------------------------------- verification
            if self.analysis:
                t_feed = [[drafted[b][-1]] if drafted[b] else list(t_pending[b]) for b in range(batch)]
                t_feed = [t_feed[b] if not done[b] else [] for b in range(batch)]
            else:
                t_feed = [t_pending[b] + drafted[b][: n_sent[b]] if not done[b] else [] for b in range(batch)]
            t0 = _clock(device)
            tl, _, tidx = tgt.forward(t_feed, left_pad=False, all_logits=True)
            stats.target_time += _clock(device) - t0
            for b in range(batch):
                t_idx[b] += tidx[b]

            for b in live:
                stats.target_calls += 1  # one verification per sequence-round
                k = n_sent[b]
                if self.analysis:
                    logit_rows = peek_logits[b][:k] + [tl[b, 0]]
                else:
                    logit_rows = [tl[b, j] for j in range(k + 1)]
                emitted, n_acc, acc_flags = self._verify(drafted[b][:k], q_rows[b][:k], logit_rows, gen)
                # Feedback to the policy.
                self.policy.update(
                    RoundFeedback(n_drafted=k, n_accepted=n_acc, draft_probs=q_x[b][:k], accepted=acc_flags)
                )
                stats.rounds += 1
                stats.draft_tokens += len(drafted[b])
                stats.accepted += n_acc
                stats.wasted += len(drafted[b]) - n_acc
                stats.accepted_lengths.append(n_acc)
                stats.draft_lengths.append(len(drafted[b]))
                # Cache bookkeeping: keep pending + accepted drafted tokens.
                tgt.discard(b, t_idx[b][1 + n_acc :])
                t_pending[b] = emitted[n_acc:]
                if drafted[b]:
                    fed = len(drafted[b]) - 1  # the draft never fed its last drafted token
                    keep_n = min(n_acc, fed)
                    n_old = len(d_idx[b]) - fed
                    drf.discard(b, d_idx[b][n_old + keep_n :])
                    if cmp is not None:
                        cmp.discard(b, d_idx[b][n_old + keep_n :])
                    d_pending[b] = emitted[keep_n:]
                else:
                    d_pending[b] = d_pending[b] + emitted
                # Limits.
                for j, t in enumerate(emitted):
                    if t in eos:
                        emitted = emitted[: j + 1]
                        done[b] = True
                        break
                emitted = emitted[: max_new_tokens - len(outputs[b])]
                outputs[b] += emitted
                if len(outputs[b]) >= max_new_tokens:
                    done[b] = True
            for s in (tgt, drf, cmp):
                if s is not None:
                    s.crop()

        stats.new_tokens = sum(len(o) for o in outputs)
        pad = self.target.config.pad_token_id
        if pad is None:
            pad = next(iter(eos)) if eos else 0
        width = max(len(o) for o in outputs)
        new = torch.full((batch, width), int(pad), dtype=torch.long, device=device)
        for b, o in enumerate(outputs):
            if o:
                new[b, : len(o)] = torch.tensor(o, device=device)
        stats.wall_time = _clock(device) - t_start
        return torch.cat([input_ids, new], dim=1), stats

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
        if self.temperature == 0:
            return int(logits.argmax())
        return self._sample(self._probs(logits), gen)

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


def goodput_prefix(accept_probs: list[float], latency) -> int:
    """SV: the verification length maximising goodput (predictors.goodput.goodput_length)."""
    from predictors.goodput import goodput_length

    best, _ = goodput_length(accept_probs, latency)
    return best


def sv_batch_lengths(accept_probs: list[list[float]], latency) -> list[int]:
    """SV across a batch: greedily add the draft token with the largest gain in expected accepted length while the
    batch goodput (sum of expected tokens) / latency(total verified tokens) improves.

    Args:
        accept_probs: per sequence, the estimated acceptance of each drafted token, in order.
        latency: seconds of a round verifying n tokens in all (``LatencyTable.round_latency``).
    Returns:
        per sequence, how many of its drafted tokens to verify.
    """
    n_seq = len(accept_probs)
    lengths = [0] * n_seq
    surv = [1.0] * n_seq  # P(all verified tokens so far accepted), per sequence
    expected = float(sum(1 for a in accept_probs if a is not None))  # each sequence emits one target token
    best = expected / max(latency(0), 1e-12)
    while True:
        gains = [
            (surv[b] * accept_probs[b][lengths[b]], b) for b in range(n_seq) if lengths[b] < len(accept_probs[b])
        ]
        if not gains:
            return lengths
        gain, b = max(gains)
        goodput = (expected + gain) / max(latency(sum(lengths) + 1), 1e-12)
        if goodput <= best:
            return lengths
        best, expected = goodput, expected + gain
        surv[b] *= accept_probs[b][lengths[b]]
        lengths[b] += 1
