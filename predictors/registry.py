"""MLflow model registry for exported predictors: an export folder logged as a pyfunc model (``predict`` takes feature
columns, returns continue scores), registered per predictor kind and draft model, with the alias ``champion`` moved only
when the new version's validation metric beats it.

The tracking URI defaults to ``sqlite:///mlflow.db``; an unreachable server raises :class:`TrackingUnreachable` naming
it, and the export folder is never touched.

Usage::

    info = register_predictor(folder, registry_name("disco", draft_fp), metrics["val_auc"], run_id=run_id)
    policy = load_reference(f"models:/{info['name']}@champion")
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import mlflow
import mlflow.pyfunc
import numpy as np
import pandas as pd
import requests
from mlflow.exceptions import MlflowException
from mlflow.models import infer_signature
from mlflow.tracking import MlflowClient
from mlflow.tracking._model_registry import utils as reg_utils
from mlflow.tracking._tracking_service import utils as trk_utils

from predictors.base import StopPolicy
from predictors.export import REGISTRY_PREFIXES, load_predictor

try:  # MLflow's record of mlflow.set_tracking_uri; its place differs between MLflow versions
    from mlflow.tracking._tracking_service.utils import is_tracking_uri_set
except ImportError:  # pragma: no cover - older/newer MLflow layout
    is_tracking_uri_set = None

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TRACKING_URI",
    "CHAMPION",
    "registry_name",
    "register_predictor",
    "download_model",
    "load_reference",
    "resolve_tracking_uri",
    "check_reachable",
    "TrackingUnreachable",
    "RegistryError",
    "PredictorModel",
    "frame_to_columns",
    "example_frame",
]

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
CHAMPION = "champion"


class TrackingUnreachable(ConnectionError):
    """The MLflow tracking server cannot be reached."""


class RegistryError(RuntimeError):
    """Logging or registering the model failed (the export folder is kept)."""


def registry_name(kind: str, draft_fingerprint: Mapping | None) -> str:
    """Registered-model name per predictor kind and draft model, e.g. ``specstop-disco-qwen2.5-coder-0.5b-instruct``."""
    base = ""
    if draft_fingerprint and draft_fingerprint.get("name"):
        base = str(draft_fingerprint["name"]).rstrip("/").removeprefix("packaged:").split("/")[-1].removesuffix(".gguf")
        base = re.sub(r"[^a-z0-9._-]+", "-", base.lower()).strip("-.")
    kind = re.sub(r"[^a-z0-9._-]+", "-", kind.lower()).strip("-")
    return f"specstop-{kind}-{base}" if base else f"specstop-{kind}"


def resolve_tracking_uri(tracking_uri: str | None = None) -> str:
    """The given URI, else the configured one (MLFLOW_TRACKING_URI / mlflow.set_tracking_uri), else sqlite:///mlflow.db."""
    if tracking_uri:
        return tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if is_tracking_uri_set is not None and is_tracking_uri_set():
        return mlflow.get_tracking_uri()
    return DEFAULT_TRACKING_URI


def check_reachable(uri: str, timeout: float | None = None) -> None:
    """Raise TrackingUnreachable naming ``uri`` when an http(s) tracking server does not answer ``/health``."""
    if not uri.startswith(("http://", "https://")):
        if uri.startswith("sqlite:///"):
            Path(uri.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
        return
    timeout = timeout if timeout is not None else float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", 10))
    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout)
    except requests.RequestException as e:
        raise TrackingUnreachable(f"MLflow tracking server {uri} is unreachable ({type(e).__name__}: {e})") from e


@contextlib.contextmanager
def _uris(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API at ``uri`` (tracking and registry) and restore the previous setting afterwards."""
    old_t, old_r = getattr(trk_utils, "_tracking_uri", None), getattr(reg_utils, "_registry_uri", None)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        yield
    finally:
        trk_utils._tracking_uri = old_t
        reg_utils._registry_uri = old_r


# ---- the pyfunc wrapper ---------------------------------------------------------------------------------------------
def frame_to_columns(frame: pd.DataFrame, policy: StopPolicy) -> dict[str, Any]:
    """Record columns for ``policy`` from a DataFrame: scalar columns as is, a vector column list-valued or flattened
    into ``<name>_0 .. <name>_{w-1}``."""
    vectors = policy.vector_columns
    cols: dict[str, Any] = {}
    for c in policy.required_columns:
        if c in frame.columns:
            v = frame[c].to_numpy()
            if v.dtype == object:
                cols[c] = np.stack([np.asarray(x, dtype=np.float32) for x in v])
            else:
                cols[c] = v.astype(np.float32)
        elif c in vectors:
            names = [f"{c}_{i}" for i in range(vectors[c])]
            missing = [n for n in names if n not in frame.columns]
            if missing:
                raise KeyError(f"input frame lacks {c!r} (list-valued) or its flattened columns, e.g. {missing[:3]}")
            cols[c] = frame[names].to_numpy(dtype=np.float32)
        else:
            raise KeyError(f"{policy.kind} needs the column {c!r}; the input frame has {list(frame.columns)[:20]}")
    return cols


def example_frame(policy: StopPolicy, n: int = 2) -> pd.DataFrame:
    """A small valid flattened input frame for ``policy`` (used to infer the model signature)."""
    vectors = policy.vector_columns
    data: dict[str, np.ndarray] = {}
    for c in policy.required_columns:
        if c in vectors:
            w = vectors[c]
            vec = np.full(w, 1.0 / (w + 1)) if c == "draft_topk" else np.zeros(w)
            for i in range(w):
                data[f"{c}_{i}"] = np.full(n, vec[i], dtype=np.float64)
        else:
            data[c] = np.linspace(0.2, 0.8, n) if c != "position" else np.arange(n, dtype=np.float64)
    return pd.DataFrame(data)


class PredictorModel(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: loads the export folder artifact; ``predict(frame)`` returns the continue scores."""

    def load_context(self, context: Any) -> None:
        self.policy = load_predictor(context.artifacts["predictor"])

    def predict(self, context: Any, model_input: pd.DataFrame, params: dict | None = None) -> np.ndarray:
        return self.policy.score(frame_to_columns(model_input, self.policy)).numpy()


# ---- register / download
# ----------------------------------------------------------------------------------------------
def _better(new: float, old: float | None, higher_is_better: bool) -> bool:
    if old is None or (isinstance(old, float) and math.isnan(old)):
        return True
    if isinstance(new, float) and math.isnan(new):
        return False
    return new > old if higher_is_better else new < old


def register_predictor(
    folder: Path,
    name: str,
    val_metric: float,
    metric_name: str = "val_auc",
    higher_is_better: bool = True,
    run_id: str | None = None,
    tracking_uri: str | None = None,
) -> dict:
    """Log the export ``folder`` as a pyfunc model, register it under ``name`` and move ``champion`` to it when
    ``val_metric`` strictly beats the champion's (by ``higher_is_better``).

    The metric is stored as the version tag ``metric_name``; ``run_id`` logs into that run (None: a new one). Returns
    the name, version, champion state, model URI, run id and tracking URI. Raises :class:`TrackingUnreachable` (the
    folder stays on disk) or :class:`RegistryError`.
    """
    folder = Path(folder)
    uri = resolve_tracking_uri(tracking_uri)
    policy = load_predictor(folder)  # validates the folder before anything is logged
    check_reachable(uri)
    example = example_frame(policy)
    signature = infer_signature(example, policy.score(frame_to_columns(example, policy)).numpy().astype(np.float64))
    try:
        info, used_run = _log_model(uri, folder, name, signature, run_id)
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        version = str(info.registered_model_version)
        for k, v in _version_tags(policy, metric_name, val_metric, higher_is_better).items():
            client.set_model_version_tag(name, version, k, v)
        previous, promoted = _maybe_promote(client, name, version, metric_name, float(val_metric), higher_is_better)
    except MlflowException as e:
        raise RegistryError(
            f"MLflow at {uri} failed to register {name!r} from {folder}: {e}; the export stays at {folder}"
        ) from e
    except OSError as e:  # connection errors surfacing from requests / sqlite
        raise TrackingUnreachable(f"MLflow tracking at {uri} failed ({e}); the export stays at {folder}") from e
    log.info("registered %s version %s (%s=%s)%s",
             name, version, metric_name, val_metric, " as champion" if promoted else "")
    return {
        "name": name,
        "version": int(version),
        "champion": promoted,
        "champion_version": int(version) if promoted else (int(previous) if previous else None),
        "previous_champion": int(previous) if previous else None,
        "model_uri": f"models:/{name}/{version}",
        "run_id": used_run,
        "tracking_uri": uri,
    }


def _log_model(uri: str, folder: Path, name: str, signature: Any, run_id: str | None) -> tuple[Any, str]:
    """Log ``folder`` as a pyfunc model registered under ``name`` into run ``run_id`` (resumed, or the caller's active
    one) or a new run; returns (model info, run id)."""
    with _uris(uri):
        active = mlflow.active_run()
        if run_id and active is not None and active.info.run_id == run_id:
            run_ctx = contextlib.nullcontext(active)  # the caller's active run: log into it, leave it open
        elif run_id:
            run_ctx = mlflow.start_run(run_id=run_id, nested=active is not None)
        else:
            run_ctx = mlflow.start_run(run_name=f"register-{name}", nested=active is not None)
        with run_ctx as run:
            info = mlflow.pyfunc.log_model(
                name="predictor",
                python_model=PredictorModel(),
                artifacts={"predictor": str(folder)},
                signature=signature,
                pip_requirements=["torch", "safetensors", "numpy", "pandas"],
                registered_model_name=name,
                await_registration_for=120,
            )
            return info, run.info.run_id


def _version_tags(policy: StopPolicy, metric_name: str, val_metric: float, higher_is_better: bool) -> dict[str, str]:
    """The version's tags: its metric, the policy's kind, the direction, the draft model and the label."""
    meta = policy.metadata
    label = (meta.get("label") or {}).get("name", "") if isinstance(meta.get("label"), dict) else ""
    return {metric_name: repr(float(val_metric)), "kind": str(policy.kind), "higher_is_better": str(higher_is_better),
            "draft": str((meta.get("draft_fingerprint") or {}).get("name", "")), "label": str(label)}


def _maybe_promote(client: MlflowClient, name: str, version: str, metric_name: str, val_metric: float,
                   higher_is_better: bool) -> tuple[str | None, bool]:
    """Move ``champion`` to ``version`` when its metric beats the current champion's (or there is none); returns
    (previous champion or None, moved)."""
    previous: str | None = None
    old_metric: float | None = None
    try:
        champ = client.get_model_version_by_alias(name, CHAMPION)
        previous = str(champ.version)
        raw = champ.tags.get(metric_name)
        old_metric = float(raw) if raw is not None else None
    except MlflowException:
        pass  # no champion yet
    promoted = _better(val_metric, old_metric, higher_is_better)
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, version)
    return previous, promoted


def download_model(ref: str, tracking_uri: str | None = None, dst: str | Path | None = None) -> Path:
    """Download a registered model's artifacts (``models:/<name>@<alias>`` or ``/<version>``) and return the export
    folder inside."""
    uri = resolve_tracking_uri(tracking_uri)
    check_reachable(uri)
    dst = Path(dst) if dst else Path(tempfile.mkdtemp(prefix="specstop-model-"))
    try:
        path = mlflow.artifacts.download_artifacts(
            artifact_uri=ref, dst_path=str(dst), tracking_uri=uri, registry_uri=uri
        )
    except MlflowException as e:
        raise RegistryError(f"cannot download {ref} from MLflow at {uri}: {e}") from e
    found = sorted(Path(path).rglob("predictor.json"))
    if not found:
        raise RegistryError(f"{ref} (MLflow at {uri}) holds no predictor.json; not a specstop predictor")
    return found[0].parent


def load_reference(
    ref: str | Path, draft_fingerprint: dict | None = None, force: bool = False, tracking_uri: str | None = None
) -> StopPolicy:
    """Load a policy from an export folder or a ``models:/`` URI (downloaded first), as
    ``predictors.export.load_predictor`` with ``draft_fingerprint`` and ``force``."""
    if isinstance(ref, str) and ref.startswith(REGISTRY_PREFIXES):
        return load_predictor(download_model(ref, tracking_uri=tracking_uri), draft_fingerprint, force)
    return load_predictor(ref, draft_fingerprint, force)
