"""The one registry of policies built by name: the training-free policies' ``name[:value]`` specs, the runtimes' own
rules (``name[:values]``), and the policy kinds that dict specs and exported baselines name.

``decoding.policies.build_policy`` builds every named spec through :func:`build_named` (exports, ``models:/`` refs
and ``goodput:<spec>`` it handles itself); ``predictors.export`` rebuilds exported baselines with
:func:`policy_class`. A name no entry holds gets one line listing the known ones (:func:`known_names`).

Usage::

    build_named("svip:0.3", max_draft_len=40)    # SVIP(h=0.3)
    build_named("llamacpp:5,0,0.7")              # llama.cpp's rule with its settings
    policy_class("adaedl")(lam=0.5)
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from predictors.base import StopPolicy
from predictors.baselines import SVIP, AdaEDL, DraftProb, HFHeuristic, MaxConfidence, Oracle, StaticLength
from predictors.runtime_rules import LlamaCppRule, TransformersRule, VllmRule, runtime_rule

__all__ = ["NamedPolicy", "POLICIES", "build_named", "policy_class", "policy_kinds", "known_names"]


@dataclass(frozen=True)
class NamedPolicy:
    """How ``name[:value]`` builds its policy: the class, the constructor argument a number sets (None: it takes
    none), fixed arguments and the least value allowed; a runtime's rule (``runtime``) reads comma-separated values
    in its settings' order (``predictors.runtime_rules.runtime_rule``)."""

    cls: type[StopPolicy]
    param: str | None = None
    fixed: Mapping[str, Any] = field(default_factory=dict)
    minimum: float | None = None
    runtime: bool = False

    @property
    def training_free(self) -> bool:
        """A training-free score or length (not a runtime's rule)."""
        return not self.runtime

    def usage(self, name: str) -> str:
        """How the name is written, e.g. ``svip[:value]``."""
        return name + ("[:values]" if self.runtime else "[:value]" if self.param else "")

    def build(self, name: str, arg: str | None, max_draft_len: int) -> StopPolicy:
        """The policy of ``name:arg`` (``arg`` None: the constructor's defaults); a runtime's rule is capped by its
        own maximum (at least 64)."""
        if self.runtime:
            return runtime_rule(name, arg, max(max_draft_len, 64))
        kwargs = dict(self.fixed)
        if arg is not None and self.param is not None:
            try:
                value = float(arg)
            except ValueError as e:
                raise ValueError(f"policy {name}:{arg}: the parameter must be a number") from e
            if self.minimum is not None and value < self.minimum:
                raise ValueError(f"{name}:{value:g}: the value must be >= {self.minimum:g}")
            kwargs[self.param] = value
        return self.cls(**kwargs, max_draft_len=max_draft_len)


POLICIES: dict[str, NamedPolicy] = {
    "static": NamedPolicy(StaticLength, "k", minimum=0),  # static:0 never drafts (the target alone)
    "heuristic": NamedPolicy(HFHeuristic, "initial"),
    "max_confidence": NamedPolicy(MaxConfidence, "threshold", {"online_roc": True}),
    "max_confidence_fixed": NamedPolicy(MaxConfidence, "threshold", {"online_roc": False}),
    "draft_prob": NamedPolicy(DraftProb, "threshold"),
    "svip": NamedPolicy(SVIP, "h"),
    "adaedl": NamedPolicy(AdaEDL, "lam"),
    "oracle": NamedPolicy(Oracle),
    "llamacpp": NamedPolicy(LlamaCppRule, runtime=True),
    "transformers": NamedPolicy(TransformersRule, runtime=True),
    "vllm": NamedPolicy(VllmRule, runtime=True),
}
"""Spec name -> how ``name[:value]`` builds its policy."""


def named(spec: str) -> NamedPolicy | None:
    """The registry entry a spec ``name[:value]`` names (None: no entry)."""
    return POLICIES.get(spec.partition(":")[0])


def build_named(spec: str, max_draft_len: int = 40) -> StopPolicy:
    """The policy of a spec ``name[:value]``; ValueError listing the known names when no entry holds ``name``."""
    name, _, arg = spec.partition(":")
    if name not in POLICIES:
        raise ValueError(f"unknown policy {spec!r}: use one of {known_names()}")
    return POLICIES[name].build(name, arg or None, max_draft_len)


def policy_kinds() -> dict[str, type[StopPolicy]]:
    """Policy kind -> class of the training-free policies (what dict specs and exported baselines name)."""
    return {n.cls.kind: n.cls for n in POLICIES.values() if n.training_free}


def policy_class(kind: str) -> type[StopPolicy]:
    """The training-free class of ``kind``; ValueError listing the kinds."""
    kinds = policy_kinds()
    if kind not in kinds:
        raise ValueError(f"policy kind {kind!r}: use one of {', '.join(sorted(kinds))}")
    return kinds[kind]


def known_names() -> str:
    """The named specs, in one line (for errors)."""
    return ", ".join(n.usage(name) for name, n in POLICIES.items())
