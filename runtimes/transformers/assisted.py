"""Use a stop policy inside transformers' assisted generation: ``target.generate(..., assistant_model=draft)``.

:class:`PolicyCandidateGenerator` subclasses transformers' ``AssistedCandidateGenerator``: each round it sets the draft
length cap to ``policy.draft_cap()``, and a stopping criterion on the assistant's ``generate`` computes the drafted
token's
features with ``data_gen.features.token_features`` (the same function as data generation; the draft's last hidden state
is captured by a hook on its output embedding when the policy needs it) plus ``position`` and stops drafting when
``policy.keep_drafting`` says so. After verification ``policy.update`` gets the round's outcome. transformers' own
confidence threshold and schedules are switched off: the policy alone decides. Verification is transformers' own
(exact).

Works for policies that need only the draft's scores (static, heuristic, max-confidence, SVIP, AdaEDL, DISCO, exported
baselines, and any of them under ``goodput:``); policies needing a companion (SV), the target (oracle) or approximate
verification (SPRINTER) are refused. The policy's round rule (``policy.round_rule``) decides as in the engine: a
cost-aware one (the ``goodput`` rule) needs the measured ``cost_model``, its stopping criterion asks the goodput rule
and the candidates are cut to the rule's best prefix before transformers verifies them.
transformers' assisted generation supports batch size 1 only.

Usage:
    from runtimes.transformers.assisted import generate_with_policy
    out, stats = generate_with_policy(target, draft, input_ids, load_predictor("export/disco"), max_new_tokens=128,
                                      do_sample=False)
"""
from __future__ import annotations

import time
import types
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.generation.candidate_generator import AssistedCandidateGenerator
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from data_gen.features import COMPANION_COLUMNS, TARGET_COLUMNS, token_features
from decoding.stats import DecodeStats
from predictors import goodput
from predictors.base import RoundFeedback, StopPolicy
from predictors.calibration import mode_of

__all__ = ["PolicyCandidateGenerator", "generate_with_policy", "check_hf_policy"]


def check_hf_policy(policy: StopPolicy, cost_model: Any = None) -> None:
    """Refuse policies that cannot run inside transformers' assisted generation (a goodput policy without a cost
    model included)."""
    bad = [c for c in policy.required_columns if c in COMPANION_COLUMNS or c in TARGET_COLUMNS]
    if bad:
        raise ValueError(
            f"policy {policy.kind!r} needs columns {bad} that transformers' assisted generation does not compute; use "
            f"decoding.engine.SpeculativeDecoder"
        )
    rule = policy.round_rule
    if rule.needs_cost_model and cost_model is None:
        raise ValueError(f"policy {policy.kind!r} is cost-aware: pass cost_model= (a compute.timing.CostModel, "
                         f"python -m pipelines.measure_costs)")
    if rule.drops_candidate:
        raise ValueError(f"policy {policy.kind!r} drops the drafted token that scored below its threshold "
                         f"(llama.cpp's rule), which transformers' candidate generator cannot do; use "
                         f"decoding.engine.SpeculativeDecoder, or transformers' own settings (python -m "
                         f"pipelines.recommend --runtime transformers)")
    if not policy.exact:
        raise ValueError(
            f"policy {policy.kind!r} is approximate (sequential verification); transformers verifies exactly, use "
            f"decoding.engine.SpeculativeDecoder"
        )


class _PolicyCriteria(StoppingCriteria):
    """Stopping criterion on the assistant's generate: stop when the policy says not to draft another token."""

    def __init__(self, gen: PolicyCandidateGenerator) -> None:
        self.gen = gen

    def __call__(self, input_ids: Tensor, scores: tuple[Tensor, ...] | None, **kwargs: Any) -> Tensor:
        return self.gen._stop(input_ids, scores)


class PolicyCandidateGenerator(AssistedCandidateGenerator):
    """``AssistedCandidateGenerator`` whose draft length is decided by a :class:`predictors.base.StopPolicy`.

    Args:
        policy: the stop policy (draft-only features).
        top_k_features: top-k draft probabilities in the features (as in the predictor's training data).
        cost_model: the measured verification curve (cost-aware policies only).
        other arguments: those of ``AssistedCandidateGenerator``.
    Attributes:
        stats: the rounds' counts (``decoding.stats.DecodeStats``: rounds, drafted, sent, accepted, their per-round
            lengths, and ``stop_time``, the seconds in feature computation and policy decisions).
    """

    def __init__(self, *args: Any, policy: StopPolicy, top_k_features: int = 10, cost_model: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_hf_policy(policy, cost_model)
        self.policy = policy
        self.rule = policy.round_rule
        self.cost = goodput.RoundCost.from_cost_model(cost_model) if self.rule.needs_cost_model else None
        self._scores: list[float] = []
        self.top_k_features = top_k_features
        # The policy alone decides: no transformers confidence criterion (0 disables it; None would be replaced by the
        # global default 0.4), no schedule.
        self.generation_config.assistant_confidence_threshold = 0.0
        self.assistant_generation_config.assistant_confidence_threshold = 0.0
        self.assistant_generation_config.num_assistant_tokens_schedule = "constant"
        self.stats = DecodeStats()
        self._q: list[float] = []
        self._hidden: Tensor | None = None
        self._hook = None
        if "draft_hidden" in policy.required_columns:
            head = self.assistant_model.get_output_embeddings()
            self._hook = head.register_forward_pre_hook(self._capture_hidden)

    def _capture_hidden(self, module: torch.nn.Module, inputs: tuple[Tensor, ...]) -> None:
        self._hidden = inputs[0][:, -1]

    def close(self) -> None:
        """Remove the hidden-state hook from the assistant."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs: Any) -> tuple[torch.LongTensor, Tensor | None]:
        self.num_assistant_tokens = max(1, min(self.policy.draft_cap(), self.policy.max_draft_len))
        self._start = input_ids.shape[-1]
        self._q, self._scores = [], []
        ids, logits = super().get_candidates(input_ids, **kwargs)
        drafted = ids.shape[-1] - self._start
        self.stats.drafted += drafted
        self.stats.drafted_lengths.append(drafted)
        n = self.rule.sent(self.policy, self._scores[:drafted], drafted, self.cost)
        if n < drafted:  # the rule verifies a prefix only (the goodput rule's best prefix)
            ids = ids[:, : self._start + n]
            logits = logits[:, :n] if logits is not None else None
        return ids, logits

    def _generate_candidates(self, generation_args: dict) -> tuple[torch.LongTensor, Tensor | None]:
        generation_args = dict(generation_args)
        generation_args["stopping_criteria"] = StoppingCriteriaList([_PolicyCriteria(self)])
        return super()._generate_candidates(generation_args)

    def _stop(self, input_ids: Tensor, scores: tuple[Tensor, ...] | None) -> Tensor:
        t0 = time.perf_counter()
        logits = scores[-1]  # [B, V] processed draft logits (temperature / top-p already applied)
        tok = input_ids[:, -1]
        hidden = self._hidden if self._hook is not None else None
        feats = token_features(logits, tok, draft_hidden=hidden, top_k=self.top_k_features, temperature=1.0)
        feats["position"] = torch.full_like(tok, len(scores) - 1)
        self._q.extend(feats["q"].tolist())
        cap = max(1, min(self.policy.draft_cap(), self.policy.max_draft_len))
        keep, scores = self.rule.decide(self.policy, feats, [self._scores], [cap], [True], self.cost)
        if scores is not None:
            self._scores.extend(scores)
        stop = ~torch.tensor(keep, dtype=torch.bool, device=input_ids.device)
        self.stats.stop_time += time.perf_counter() - t0
        self.stats.stop_decisions += 1
        return stop

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: Tensor, num_matches: int) -> None:
        n = scores.shape[1] - 1  # candidates verified this round
        n_acc = int(num_matches)
        st = self.stats
        st.rounds, st.sent, st.accepted = st.rounds + 1, st.sent + n, st.accepted + n_acc
        st.sent_lengths.append(n)
        st.accepted_lengths.append(n_acc)
        self.policy.update(
            RoundFeedback(
                n_drafted=n, n_accepted=n_acc, draft_probs=self._q[:n], accepted=[i < n_acc for i in range(n)]
            )
        )


def generate_with_policy(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    input_ids: Tensor,
    policy: StopPolicy,
    top_k_features: int = 10,
    cost_model: Any = None,
    **generate_kwargs: Any,
) -> tuple[Tensor, DecodeStats]:
    """``target.generate(input_ids, assistant_model=draft, **generate_kwargs)`` with drafting stopped by ``policy``.

    The candidate generator is swapped in for this call only (``target._get_candidate_generator`` is overridden on the
    instance and restored afterwards); everything else, verification included, is transformers' own.

    Args:
        target, draft: models sharing one tokenizer.
        input_ids: [1, T] prompt (transformers' assisted generation runs batch size 1).
        policy: a stop policy needing only draft features; ``reset()`` is called first.
        top_k_features: top-k draft probabilities in the features.
        cost_model: the measured verification curve (``compute.timing.CostModel``), needed by cost-aware policies.
        generate_kwargs: passed to ``generate`` (``max_new_tokens``, ``do_sample``, ``attention_mask``...).
    Returns:
        (generate's output, the rounds' ``DecodeStats``: rounds, drafted, sent, accepted, their per-round lengths,
        ``stop_time``; the other fields are the engine's).
    """
    check_hf_policy(policy, cost_model)
    if input_ids.shape[0] != 1:
        raise ValueError(
            "transformers' assisted generation supports batch size 1 only; use SpeculativeDecoder for B > 1"
        )
    policy.use_mode(mode_of(1.0 if generate_kwargs.get("do_sample") else 0.0))
    policy.reset()
    made: list[PolicyCandidateGenerator] = []

    def factory(self_: PreTrainedModel, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs,
                assistant_model=None, target_tokenizer=None, assistant_tokenizer=None):
        gen = PolicyCandidateGenerator(
            input_ids=input_ids,
            assistant_model=assistant_model,
            generation_config=generation_config,
            model_kwargs=model_kwargs,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            policy=policy,
            top_k_features=top_k_features,
            cost_model=cost_model,
        )
        made.append(gen)
        return gen

    target._get_candidate_generator = types.MethodType(factory, target)
    try:
        out = target.generate(input_ids, assistant_model=draft, **generate_kwargs)
    finally:
        del target._get_candidate_generator
        for g in made:
            g.close()
    return out, made[0].stats if made else DecodeStats()
