"""Export and load stop policies: a folder with ``predictor.json`` (and ``weights.safetensors`` for learned ones) that
loads with torch and safetensors alone, so evaluation and decoding load any policy, learned or training-free, one way.
The metadata names the draft model it was trained for, and a predictor for another draft is refused.

Usage::

    folder = export_predictor(policy, "runs/disco/export", {"draft_fingerprint": fp})
    policy = load_predictor(folder, draft_fingerprint=fp)
"""
from __future__ import annotations

import inspect
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from compute.precision import PRECISION_OPTIONS, precision_diffs
from predictors.base import StopPolicy
from predictors.disco import DiscoNet, DiscoPolicy
from predictors.inputs import FeatureSpec
from predictors.policy_names import policy_kinds
from predictors.sprinter import SprinterNet, SprinterPolicy
from predictors.sv import SVPolicy, SVTable

log = logging.getLogger(__name__)

__all__ = ["export_predictor", "load_predictor", "update_metadata", "read_metadata", "check_fingerprint",
           "METADATA_FILE", "WEIGHTS_FILE", "FingerprintMismatch"]

METADATA_FILE = "predictor.json"
WEIGHTS_FILE = "weights.safetensors"
FORMAT_VERSION = 1
REGISTRY_PREFIXES = ("models:/", "runs:/", "mlflow-artifacts:/")
"""References that name a model in MLflow rather than a folder."""
FINGERPRINT_KEYS = ("name", "vocab_size", "hidden_size")
"""Fields that must agree between the exported predictor's draft model and the draft in use."""


class FingerprintMismatch(ValueError):
    """The predictor was trained for another draft model."""


LEARNED: dict[str, tuple[type, type]] = {
    "disco": (DiscoNet, DiscoPolicy), "sprinter": (SprinterNet, SprinterPolicy), "sv": (SVTable, SVPolicy),
}
"""Learned kinds: kind -> (network class, policy class)."""


def _jsonable(x: Any) -> Any:
    """Make metrics / configs JSON-safe (tuples -> lists, NaN -> None, numpy / torch scalars -> Python)."""
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if hasattr(x, "item") and callable(x.item) and getattr(x, "ndim", 1) == 0:
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def baseline_params(policy: StopPolicy) -> dict[str, Any]:
    """Constructor parameters of a training-free policy, read back from the instance (initial values of online ones)."""
    params: dict[str, Any] = {}
    for name in list(inspect.signature(type(policy).__init__).parameters)[1:]:
        if name in ("threshold", "lam"):
            params[name] = float(policy.start_threshold)
        elif hasattr(policy, name):
            params[name] = getattr(policy, name)
        else:
            raise ValueError(f"cannot export {policy.kind}: constructor parameter {name!r} is not an attribute")
    return params


def export_predictor(policy: StopPolicy, folder: str | Path, metadata: dict) -> Path:
    """Write ``policy`` to ``folder``: ``predictor.json`` and, for learned kinds, ``weights.safetensors``; ``metadata``
    (draft fingerprint, metrics, config, ...) overrides what the policy's ``train_info`` supplies. Returns the folder.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "kind": policy.kind,
        "threshold": float(policy.threshold),
        "max_draft_len": int(policy.max_draft_len),
        "exact": bool(policy.exact),
        "draft_fingerprint": None,
    }
    if policy.kind in LEARNED:
        net = policy.net  # type: ignore[attr-defined]
        info = dict(policy.train_info)
        meta.update({
            "learned": True,
            "weights": WEIGHTS_FILE,
            "net": {"class": type(net).__name__, "config": net.config()},
            "feature_spec": policy.spec.to_dict(),  # type: ignore[attr-defined]
            "input_width": policy.spec.width,  # type: ignore[attr-defined]
            "columns": list(policy.spec.columns),  # type: ignore[attr-defined]
            "label": info.get("label"),
            "metrics": info.get("metrics", {}),
            "config": info.get("config", {}),
            "checkpoint": info.get("checkpoint"),
        })
        state = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
        save_file(
            state, str(folder / WEIGHTS_FILE), metadata={"kind": policy.kind, "format_version": str(FORMAT_VERSION)}
        )
    elif policy.kind in policy_kinds():
        meta.update({
            "learned": False,
            "weights": None,
            "params": baseline_params(policy),
            "columns": list(policy.required_columns),
            "label": None,
            "metrics": {},
            "config": {},
        })
    else:
        known = sorted(LEARNED) + sorted(policy_kinds())
        raise ValueError(f"cannot export policy kind {policy.kind!r}; known: {known}")
    meta.update(metadata or {})
    (folder / METADATA_FILE).write_text(json.dumps(_jsonable(meta), indent=2, sort_keys=True))
    return folder


def read_metadata(folder: str | Path) -> dict[str, Any]:
    """The ``predictor.json`` of an export folder (FileNotFoundError naming the folder when absent)."""
    path = Path(folder) / METADATA_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {folder} is not a predictor export folder")
    return json.loads(path.read_text())


def update_metadata(folder: str | Path, **fields: Any) -> dict[str, Any]:
    """Update top-level fields of ``predictor.json`` (e.g. ``threshold=0.62``, ``metrics={...}``; dicts are merged)."""
    meta = read_metadata(folder)
    for k, v in fields.items():
        if isinstance(v, Mapping) and isinstance(meta.get(k), dict):
            meta[k] = {**meta[k], **v}
        else:
            meta[k] = v
    (Path(folder) / METADATA_FILE).write_text(json.dumps(_jsonable(meta), indent=2, sort_keys=True))
    return meta


def check_fingerprint(stored: Mapping | None, current: Mapping | None, force: bool = False, where: str = "") -> None:
    """Refuse (FingerprintMismatch) a predictor trained for another draft model (name, vocab_size or hidden_size);
    nothing is checked when a fingerprint is missing, and ``force`` only warns."""
    if not stored or not current:
        return
    diffs = [f"{k}: {stored.get(k)!r} vs {current.get(k)!r}" for k in FINGERPRINT_KEYS
             if k in stored and k in current and stored.get(k) != current.get(k)]
    if stored.get("vocab_sha") and current.get("vocab_sha") and stored["vocab_sha"] != current["vocab_sha"]:
        log.warning("predictor %s: draft vocabulary hash differs (%s vs %s)",
                    where, stored["vocab_sha"], current["vocab_sha"])
    pdiffs = precision_diffs(dict(stored), dict(current))
    precision = [f"{k} {was!r} (its data) vs {now!r} (in use)" for k, (was, now) in pdiffs.items()]
    if precision:  # same model, other numerics: q and p shift slightly, the predictor still applies
        options = ", ".join(PRECISION_OPTIONS[k] for k in pdiffs if k in PRECISION_OPTIONS) or "--models.dtype"
        log.warning("predictor %s was trained on data labelled with another precision: %s; its scores may be slightly "
                    "off (load the models with %s as its data was, or re-label)", where, "; ".join(precision), options)
    if not diffs:
        return
    msg = (f"predictor {where} was trained for draft model {dict(stored)} but the draft in use is {dict(current)} "
           f"({'; '.join(diffs)} (predictor vs draft in use))")
    if force:
        log.warning("%s; loading anyway (force=True)", msg)
        return
    raise FingerprintMismatch(msg + "; pass force=True (on the command line: --force true) to load it anyway")


def load_predictor(folder: str | Path, draft_fingerprint: dict | None = None, force: bool = False) -> StopPolicy:
    """Load a policy from an export folder, refusing one trained for another draft than ``draft_fingerprint`` unless
    ``force`` (``models:/`` refs: ``predictors.registry.load_reference``)."""
    ref = folder
    if isinstance(folder, str) and folder.startswith(REGISTRY_PREFIXES):
        raise ValueError(f"{folder} is a registry reference: load it with predictors.registry.load_reference")
    folder = Path(folder).expanduser()
    meta = read_metadata(folder)
    kind = meta.get("kind")
    check_fingerprint(meta.get("draft_fingerprint"), draft_fingerprint, force, where=f"{kind} at {ref}")
    if meta.get("learned"):
        if kind not in LEARNED:
            raise ValueError(f"{folder}: unknown learned predictor kind {kind!r}; known: {sorted(LEARNED)}")
        net_cls, policy_cls = LEARNED[kind]
        net = net_cls(**meta["net"]["config"])
        state = load_file(str(folder / meta.get("weights", WEIGHTS_FILE)))
        net.load_state_dict(state)
        policy = policy_cls(net, FeatureSpec.from_dict(meta["feature_spec"]), float(meta["threshold"]),
                            int(meta.get("max_draft_len", 40)))
        policy.train_info = {k: meta.get(k) for k in ("label", "metrics", "config", "checkpoint")}
    else:
        kinds = policy_kinds()
        if kind not in kinds:
            raise ValueError(f"{folder}: unknown policy kind {kind!r}; known: {sorted(LEARNED) + sorted(kinds)}")
        params = dict(meta.get("params", {}))
        policy = kinds[kind](**params)
        if "threshold" in meta:  # a threshold tuned after export (update_metadata) wins over the constructor's
            policy.start_at(float(meta["threshold"]))  # online policies reset() to it
    policy.metadata = meta
    return policy
