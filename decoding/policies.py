"""Build a stop policy from a name, a dict or a saved predictor, and a checked decoder around it.

Specs (``build_policy``):
- ``static:K`` (default 5), ``heuristic[:INITIAL]`` (transformers' +2 / -1 schedule), ``max_confidence[:THRESHOLD]``
  (transformers-style online ROC re-tuning, cost fpr + 3 fnr; ``max_confidence_fixed[:T]`` keeps T fixed),
  ``draft_prob[:T]`` (q(x), the drafted token's probability),
  ``svip[:H]``, ``adaedl[:LAMBDA]``, ``oracle`` (analysis only: the engine runs the target on every drafted token);
- a runtime's own rule (``predictors.runtime_rules``): ``llamacpp[:N_MAX,N_MIN,P_MIN]`` (llama.cpp's draft-simple),
  ``transformers[:N,SCHEDULE,THRESHOLD]`` (assisted generation), ``vllm[:K]``; omitted values take its defaults;
- a dict ``{"kind": "svip", "h": 0.4}`` (constructor parameters of ``predictors.baselines``);
- a learned predictor: an export folder or ``models:/<name>@champion`` (``predictors.registry.load_reference``), checked
  against the draft model's fingerprint (refused for another draft model unless ``force``);
- ``goodput:<spec>``: any of the above made cost-aware (``predictors.goodput.GoodputPolicy``): its calibrated acceptance
  and the measured verification curve (the decoder's ``cost_model``) choose the draft length. ``<spec>`` is an export
  folder or ``models:/`` URI whose ``predictor.json`` holds calibration maps (the main job writes them; for another
  export: ``python -m pipelines.calibrate``), or a training-free score name (``max_confidence``, ``draft_prob``,
  ``svip``, ``adaedl``) whose calibrated export is looked up as ``<calibration_dir>/<name>`` (the main job writes
  ``<out_dir>/calibrated/<name>``). Without a map: ``predictors.goodput.MissingCalibration`` naming the fix.

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
from predictors.baselines import BASELINES, SVIP, AdaEDL, DraftProb, HFHeuristic, MaxConfidence, Oracle, StaticLength
from predictors.goodput import MissingCalibration, goodput_policy
from predictors.runtime_rules import RUNTIMES, runtime_rule

__all__ = ["build_policy", "build_decoder", "policy_label", "needs_companion", "GOODPUT_PREFIX"]

GOODPUT_PREFIX = "goodput:"


def needs_companion(policy: StopPolicy) -> bool:
    """``policy.needs_companion`` (what the policy declares); a function for callers that map over policies."""
    return policy.needs_companion


_NAMED = ("static", "heuristic", "max_confidence", "max_confidence_fixed", "draft_prob", "svip", "adaedl", "oracle")


def _named(kind: str, arg: str | None, max_draft_len: int) -> StopPolicy:
    def num(default: float) -> float:
        if arg is None:
            return default
        try:
            return float(arg)
        except ValueError as e:
            raise ValueError(f"policy {kind}:{arg}: the parameter must be a number") from e

    if kind == "static":
        k = int(num(5))
        if k < 1:
            raise ValueError(f"static:{k}: the draft length must be >= 1")
        return StaticLength(k, max_draft_len=max_draft_len)
    if kind == "heuristic":
        return HFHeuristic(int(num(5)), max_draft_len=max_draft_len)
    if kind == "max_confidence":
        return MaxConfidence(num(0.4), max_draft_len=max_draft_len, online_roc=True)
    if kind == "max_confidence_fixed":
        return MaxConfidence(num(0.4), max_draft_len=max_draft_len, online_roc=False)
    if kind == "draft_prob":
        return DraftProb(num(0.4), max_draft_len=max_draft_len)
    if kind == "svip":
        return SVIP(num(0.3), max_draft_len=max_draft_len)
    if kind == "adaedl":
        return AdaEDL(num(0.6), max_draft_len=max_draft_len)
    if kind == "oracle":
        return Oracle(max_draft_len=max_draft_len)
    raise AssertionError(kind)


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
        if kind not in BASELINES:
            raise ValueError(f"policy dict {spec}: 'kind' must be one of {sorted(BASELINES)}")
        return BASELINES[kind](**params)
    if not isinstance(spec, str) or not spec:
        raise ValueError(
            f"policy spec {spec!r}: give a name like static:5, a dict, an export folder or models:/name@alias"
        )
    kind, _, arg = spec.partition(":")
    if kind in RUNTIMES:  # a runtime's own rule, capped by its own maximum
        return runtime_rule(kind, arg or None, max(max_draft_len, 64))
    if kind in _NAMED and not spec.startswith("models:/"):
        return _named(kind, arg or None, max_draft_len)
    if spec.startswith(("models:/", "runs:/")) or Path(spec).expanduser().is_dir():
        from predictors.registry import load_reference  # mlflow: loaded only for a learned predictor

        fp = None
        if draft is not None and draft_tokenizer is not None:
            fp = model_fingerprint(draft, draft_tokenizer)
        return load_reference(spec, draft_fingerprint=fp, force=force, tracking_uri=tracking_uri)
    raise ValueError(
        f"unknown policy {spec!r}: use one of {', '.join(k + '[:param]' for k in _NAMED)}, an export folder or "
        f"models:/<name>@<alias>"
    )


def _goodput(inner: str, draft: PreTrainedModel | None, draft_tokenizer: PreTrainedTokenizerBase | None, force: bool,
             tracking_uri: str | None, calibration_dir: str | Path | None) -> StopPolicy:
    """``goodput:<inner>``: the inner policy with the calibration maps of its export."""
    if not inner:
        raise ValueError(
            "policy goodput: needs a predictor or score after the colon, e.g. goodput:models:/name@champion"
        )
    kind = inner.partition(":")[0]
    if kind in _NAMED and not inner.startswith("models:/"):
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
    if isinstance(spec, str) and spec.partition(":")[0] in _NAMED:
        return spec
    if isinstance(spec, str) and spec.startswith(GOODPUT_PREFIX):
        inner = spec.removeprefix(GOODPUT_PREFIX)
        return spec if inner in _NAMED else f"{policy.kind} ({inner.rstrip('/').split('/')[-1]})"
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
