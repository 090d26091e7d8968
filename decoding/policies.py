"""Policy specs to stop policies (:func:`build_policy`) and a checked decoder around one (:func:`build_decoder`).

A spec is a name of the one registry (``predictors.policy_names.POLICIES``: a training-free policy, e.g.
``svip:0.3``, or a runtime's own rule, ``vllm:3``), a dict of constructor arguments, an export folder or
``models:/<name>@<alias>`` (checked against the draft model), or ``goodput:<spec>``: that policy's calibrated
acceptance priced by the measured curve.

Usage:
    policy = build_policy("svip:0.3")
    policy = build_policy("goodput:outputs/default/train/disco/export")      # cost-aware DISCO
    policy = build_policy("goodput:svip", calibration_dir="outputs/default/train/calibrated")
    decoder = build_decoder(draft, target, "models:/disco@champion", draft_tokenizer=tok, target_tokenizer=tok)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.models import check_same_tokenizer, model_fingerprint
from decoding.engine import SpeculativeDecoder
from predictors.base import StopPolicy
from predictors.goodput import MissingCalibration, goodput_policy
from predictors.policy_names import build_named, known_names, named, policy_kinds

__all__ = ["build_policy", "build_decoder", "policy_label", "needs_companion", "GOODPUT_PREFIX"]

GOODPUT_PREFIX = "goodput:"


def needs_companion(policy: StopPolicy) -> bool:
    """``policy.needs_companion`` (what the policy declares); a function for callers that map over policies."""
    return policy.needs_companion


def known_policies() -> str:
    """The policy specs ``build_policy`` takes, in one line (for errors)."""
    return f"{known_names()}, {GOODPUT_PREFIX}<spec>, an export folder or models:/<name>@<alias>"


def _training_free(spec: str) -> bool:
    """``spec`` names a training-free policy of the registry (not a runtime's rule)."""
    entry = named(spec)
    return entry is not None and entry.training_free


def build_policy(
    spec: str | dict[str, Any] | StopPolicy,
    *,
    draft: PreTrainedModel | None = None,
    draft_tokenizer: PreTrainedTokenizerBase | None = None,
    max_draft_len: int = 40,
    force: bool = False,
    tracking_uri: str | None = None,
    calibration_dir: str | Path | None = None,
) -> StopPolicy:
    """A stop policy from a spec (see the module docstring).

    Args:
        spec: name[:param], a dict with ``kind`` and constructor parameters, an export folder, a ``models:/`` URI, or a
            ready policy (returned as is).
        draft, draft_tokenizer: the draft in use; with both given, a learned predictor must have been trained for it.
        max_draft_len: cap for the named baselines.
        force: load a learned predictor despite a draft-fingerprint mismatch.
        tracking_uri: MLflow URI for ``models:/`` refs.
        calibration_dir: folder of calibrated training-free exports for ``goodput:<score name>``.
    """
    if isinstance(spec, StopPolicy):
        return spec
    if isinstance(spec, str) and spec.startswith(GOODPUT_PREFIX):
        return _goodput(spec.removeprefix(GOODPUT_PREFIX), draft, draft_tokenizer, force, tracking_uri, calibration_dir)
    if isinstance(spec, dict):
        params = dict(spec)
        kind = params.pop("kind", None)
        kinds = policy_kinds()
        if kind not in kinds:
            raise ValueError(f"policy dict {spec}: 'kind' must be one of {sorted(kinds)}")
        return kinds[kind](**params)
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"policy spec {spec!r}: give a dict or one of {known_policies()}"
        )
    if named(spec) is not None:
        return build_named(spec, max_draft_len)
    if spec.startswith(("models:/", "runs:/")) or Path(spec).expanduser().is_dir():
        from predictors.registry import load_reference  # mlflow: loaded only for a learned predictor

        fp = None
        if draft is not None and draft_tokenizer is not None:
            fp = model_fingerprint(draft, draft_tokenizer)
        return load_reference(spec, draft_fingerprint=fp, force=force, tracking_uri=tracking_uri)
    raise ValueError(f"unknown policy {spec!r}: use one of {known_policies()}")


def _goodput(inner: str, draft: PreTrainedModel | None, draft_tokenizer: PreTrainedTokenizerBase | None, force: bool,
             tracking_uri: str | None, calibration_dir: str | Path | None) -> StopPolicy:
    """``goodput:<inner>``: the inner policy with the calibration maps of its export."""
    if not inner:
        raise ValueError(
            "policy goodput: needs a predictor or score after the colon, e.g. goodput:models:/name@champion"
        )
    kind = inner.partition(":")[0]
    if _training_free(inner):
        if calibration_dir is None or not (Path(calibration_dir) / kind).is_dir():
            where = f"{calibration_dir}/{kind}" if calibration_dir is not None else "calibration_dir (not given)"
            raise MissingCalibration(
                f"goodput:{inner}: no calibrated export of the training-free score {kind!r} in {where}; the main job "
                f"writes them to <out_dir>/calibrated/<name> (pass calibration_dir or use goodput:<that folder>), "
                f"or fit one: python -m pipelines.calibrate --data_dir DATA_DIR --predictor {kind} --out_dir DIR")
        inner = str(Path(calibration_dir) / kind)
    pol = build_policy(inner, draft=draft, draft_tokenizer=draft_tokenizer, force=force, tracking_uri=tracking_uri)
    return goodput_policy(pol, inner)


def policy_label(spec: str | dict | StopPolicy, policy: StopPolicy) -> str:
    """A short row label: the spec string for named policies, else the policy kind (+ the ref's last part)."""
    if isinstance(spec, str) and _training_free(spec):
        return spec
    if isinstance(spec, str) and spec.startswith(GOODPUT_PREFIX):
        inner = spec.removeprefix(GOODPUT_PREFIX)
        if ":" not in inner and _training_free(inner):
            return spec
        return f"{policy.kind} ({inner.rstrip('/').split('/')[-1]})"
    if isinstance(spec, str):
        return f"{policy.kind} ({spec.rstrip('/').split('/')[-1]})"
    return policy.kind


def build_decoder(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    policy: str | dict | StopPolicy,
    *,
    draft_tokenizer: PreTrainedTokenizerBase,
    target_tokenizer: PreTrainedTokenizerBase,
    companion: PreTrainedModel | None = None,
    companion_tokenizer: PreTrainedTokenizerBase | None = None,
    force: bool = False,
    **decoder_kwargs: Any,
) -> SpeculativeDecoder:
    """A ``SpeculativeDecoder`` after the checks: one tokenizer for all models, the predictor made for this draft, a
    companion present when the policy needs one.

    Args:
        decoder_kwargs: ``temperature``, ``top_p``, ``max_draft_len``, ``top_k_features``, ``cost_model``.
    """
    toks = {"draft": draft_tokenizer, "target": target_tokenizer}
    models = {"draft": draft, "target": target}
    if companion is not None:
        toks["companion"] = companion_tokenizer or draft_tokenizer
        models["companion"] = companion
    check_same_tokenizer(toks, models)
    pol = build_policy(
        policy,
        draft=draft,
        draft_tokenizer=draft_tokenizer,
        max_draft_len=decoder_kwargs.get("max_draft_len", 40),
        force=force,
    )
    if pol.needs_companion and companion is None:
        raise ValueError(f"policy {pol.kind!r} needs a companion model; none is configured (set --models.companion, "
                         "e.g. truncated:12:<draft>)")
    return SpeculativeDecoder(draft, target, pol, companion=companion, **decoder_kwargs)
