"""The draft-length rules of the runtimes users deploy, as stop policies the replay and the engine run exactly.

- llama.cpp (draft-simple, ``common/speculative.cpp``): each draft step's top-1 probability among the draft's top 10
  (its draft sampler keeps the 10 best tokens and renormalises) must be ``>= --spec-draft-p-min`` for the token to
  be taken; the step that scored one below is paid and its token dropped; at most ``--spec-draft-n-max`` tokens; a
  draft of fewer than ``--spec-draft-n-min`` is not sent (the round is a target-only step). Defaults 3, 0, 0.0.
- transformers (assisted generation): at most ``num_assistant_tokens`` (its ``heuristic`` schedule +2 after a fully
  accepted round, else -1, never below 1); a drafted token whose probability is below
  ``assistant_confidence_threshold`` ends the round and is sent (``ConfidenceCriteria``); while that threshold is set
  (and scikit-learn importable) it is re-tuned after every round from the ROC curve of the probabilities seen and
  whether they matched, at the threshold minimising fpr + 3 fnr (``AssistedCandidateGenerator``). Defaults 20,
  ``constant``, 0.4.
- vLLM (a draft model in ``speculative_config``): exactly ``num_speculative_tokens`` per round.

Each rule prints its settings as the runtime takes them (:meth:`RuntimeRule.paste`). The replay resets a rule per
sequence: transformers' schedule and threshold persist across ``generate`` calls on one assistant model, which the
replay (and the benchmark, which sets them per prompt) leaves out.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
from torch import Tensor

from predictors.base import RoundFeedback, StopPolicy
from predictors.baselines import StaticLength
from predictors.round_rules import PrefixRule

__all__ = ["RUNTIMES", "RuntimeRule", "LlamaCppRule", "TransformersRule", "VllmRule", "runtime_rule", "roc_threshold"]

RUNTIMES = ("llamacpp", "transformers", "vllm")
"""The runtimes a rule models (the names ``pipelines.recommend --runtime`` takes)."""

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


class RuntimeRule(StopPolicy):
    """A runtime's own draft-length rule: its settings, its defaults, and how they are written for that runtime."""

    runtime: ClassVar[str] = ""
    DEFAULTS: ClassVar[dict[str, Any]] = {}

    def settings(self) -> dict[str, Any]:
        """The rule's settings under the runtime's own names."""
        raise NotImplementedError

    def paste(self, draft: str = "DRAFT") -> str:
        """The settings as the runtime takes them (``draft``: the draft model's path or name)."""
        raise NotImplementedError

    def spec(self) -> str:
        """The policy spec that builds this rule again (``decoding.policies.build_policy``)."""
        return f"{self.kind}:" + ",".join(str(v) for v in self.settings().values())


class LlamaCppRule(RuntimeRule):
    """llama.cpp's draft-simple rule (``--spec-draft-n-max``, ``--spec-draft-n-min``, ``--spec-draft-p-min``)."""

    kind = "llamacpp"
    runtime = "llamacpp"
    required_columns = ("draft_topk",)
    DEFAULTS = {"n_max": 3, "n_min": 0, "p_min": 0.0}
    TOP_K = 10
    """Tokens llama.cpp's draft sampler keeps (top-k 10) before the probability it compares with p_min."""

    def __init__(self, n_max: int = 3, n_min: int = 0, p_min: float = 0.0, max_draft_len: int = 64) -> None:
        if n_max < 0 or n_min < 0 or not 0.0 <= p_min <= 1.0:
            raise ValueError(f"llamacpp:{n_max},{n_min},{p_min}: n_max and n_min must be >= 0 and p_min in [0, 1]")
        super().__init__(threshold=p_min, max_draft_len=max_draft_len)
        self.n_max, self.n_min = int(n_max), int(n_min)

    @property
    def p_min(self) -> float:
        return self.threshold

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        """The top-1 probability renormalised over the top 10 (what llama.cpp's draft sampler reports)."""
        top = features["draft_topk"].float()[..., : self.TOP_K]
        if top.shape[-1] < self.TOP_K:
            raise KeyError(f"llamacpp needs the draft's top {self.TOP_K} probabilities; the data keeps "
                           f"{top.shape[-1]} (generate with data.top_k >= {self.TOP_K})")
        return top[..., 0] / top.sum(-1).clamp_min(1e-30)

    def draft_cap(self) -> int:
        return min(self.n_max, self.max_draft_len)

    @property
    def round_rule(self) -> PrefixRule:  # type: ignore[override]
        """llama.cpp's prefix rule with this rule's ``n_min``."""
        return PrefixRule(minimum=self.n_min)

    def settings(self) -> dict[str, Any]:
        return {"n_max": self.n_max, "n_min": self.n_min, "p_min": round(self.p_min, 4)}

    def paste(self, draft: str = "DRAFT.gguf") -> str:
        return (f"-md {draft} --spec-type draft-simple --spec-draft-n-max {self.n_max} --spec-draft-n-min "
                f"{self.n_min} --spec-draft-p-min {self.p_min:.2f}")


class TransformersRule(RuntimeRule):
    """transformers' assisted generation (``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
    ``assistant_confidence_threshold`` with its online ROC re-tuning)."""

    kind = "transformers"
    runtime = "transformers"
    required_columns = ("q",)
    DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.4}

    def __init__(self, num_assistant_tokens: int = 20, num_assistant_tokens_schedule: str = "constant",
                 assistant_confidence_threshold: float = 0.4, max_draft_len: int = 64) -> None:
        if num_assistant_tokens < 1 or num_assistant_tokens_schedule not in SCHEDULES:
            raise ValueError(f"transformers:{num_assistant_tokens},{num_assistant_tokens_schedule}: "
                             f"num_assistant_tokens must be >= 1 and the schedule one of {', '.join(SCHEDULES)}")
        if not 0.0 <= assistant_confidence_threshold <= 1.0:
            raise ValueError(f"assistant_confidence_threshold={assistant_confidence_threshold}: use a value in [0, 1]")
        super().__init__(threshold=assistant_confidence_threshold, max_draft_len=max_draft_len)
        self.initial_tokens, self.schedule = int(num_assistant_tokens), num_assistant_tokens_schedule
        self.initial_threshold = float(assistant_confidence_threshold)
        self.k = self.initial_tokens
        self._probs: list[float] = []
        self._matches: list[int] = []

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        """The drafted token's probability (``ConfidenceCriteria`` reads it from the assistant's scores)."""
        return features["q"].float()

    def draft_cap(self) -> int:
        return min(self.k, self.max_draft_len)

    def update(self, feedback: RoundFeedback) -> None:
        """After a round: the schedule's +2 / -1 and, with a threshold, its ROC re-tuning (transformers'
        ``update_candidate_strategy``: the probabilities of the matched tokens and of the first rejected one)."""
        if self.schedule != "constant":
            full = feedback.n_drafted > 0 and feedback.n_accepted == feedback.n_drafted
            self.k = self.k + 2 if full else max(1, self.k - 1)
        if self.initial_threshold <= 0.0 or not feedback.draft_probs:
            return
        kept = min(feedback.n_accepted + 1, feedback.n_drafted)
        self._probs.extend(feedback.draft_probs[:kept])
        self._matches.extend([1] * feedback.n_accepted + [0] * (kept - feedback.n_accepted))
        best = roc_threshold(self._probs, self._matches)
        if best is not None:
            self.threshold = best

    def reset(self) -> None:
        self.k, self.threshold = self.initial_tokens, self.initial_threshold
        self._probs.clear()
        self._matches.clear()

    def settings(self) -> dict[str, Any]:
        return {"num_assistant_tokens": self.initial_tokens, "num_assistant_tokens_schedule": self.schedule,
                "assistant_confidence_threshold": round(self.initial_threshold, 4)}

    def paste(self, draft: str = "assistant_model") -> str:
        s = self.settings()
        return (f"model.generate(..., assistant_model={draft}, num_assistant_tokens={s['num_assistant_tokens']}, "
                f"num_assistant_tokens_schedule={s['num_assistant_tokens_schedule']!r}, "
                f"assistant_confidence_threshold={s['assistant_confidence_threshold']})")


def roc_threshold(probs: Sequence[float], matches: Sequence[int]) -> float | None:
    """transformers' re-tuned confidence threshold: over more than 5 (probability, matched) pairs of both classes,
    the ROC threshold minimising fpr + 3 fnr; None while there are too few."""
    if len(probs) <= 5 or not {0, 1}.issubset(matches):
        return None
    from sklearn.metrics import roc_curve  # heavy; only the online re-tuning reads it

    fpr, tpr, thresholds = roc_curve(np.asarray(matches), np.asarray(probs))
    return float(min(thresholds[int(np.argmin(fpr + 3 * (1 - tpr)))], 1.0))


class VllmRule(StaticLength, RuntimeRule):
    """vLLM's draft-model speculation: ``num_speculative_tokens`` every round (a static length)."""

    kind = "vllm"
    runtime = "vllm"
    DEFAULTS = {"num_speculative_tokens": 5}
    """vLLM has no default (the config requires it); 5 is the value its documentation's examples use."""

    def __init__(self, num_speculative_tokens: int = 5, max_draft_len: int = 64) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"vllm:{num_speculative_tokens}: num_speculative_tokens must be >= 1")
        super().__init__(num_speculative_tokens, max_draft_len=max_draft_len)

    def settings(self) -> dict[str, Any]:
        return {"num_speculative_tokens": self.k}

    def paste(self, draft: str = "DRAFT") -> str:
        return f'speculative_config={{"model": "{draft}", "num_speculative_tokens": {self.k}}}'


_RULES: dict[str, type[RuntimeRule]] = {"llamacpp": LlamaCppRule, "transformers": TransformersRule,
                                        "vllm": VllmRule}


def runtime_rule(kind: str, arg: str | None = None, max_draft_len: int = 64) -> RuntimeRule:
    """A rule from its spec: ``llamacpp[:N_MAX,N_MIN,P_MIN]``, ``transformers[:N,SCHEDULE,THRESHOLD]``,
    ``vllm[:K]``; omitted values take the runtime's defaults."""
    cls = _RULES[kind]
    names = list(cls.DEFAULTS)
    parts = [p.strip() for p in arg.split(",")] if arg else []
    if len(parts) > len(names):
        raise ValueError(f"{kind}:{arg}: at most {len(names)} values ({', '.join(names)})")
    values: dict[str, Any] = dict(cls.DEFAULTS)
    for name, text in zip(names, parts):
        default = cls.DEFAULTS[name]
        try:
            values[name] = text if isinstance(default, str) else type(default)(float(text))
        except ValueError as e:
            raise ValueError(f"{kind}:{arg}: {name}={text!r} is not a number") from e
    return cls(**values, max_draft_len=max_draft_len)
