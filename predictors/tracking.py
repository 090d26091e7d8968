"""The MLflow fields of the entry-point configs, declared once, and the one way an entry point opens its MLflow run.

Each field is a small keyword-only dataclass an entry point's config inherits, so the fields stay flat on the command
line and in the YAML files (``--tracking``, ``--tracking_uri``, ``--experiment``) and an entry point takes only those
it uses: :class:`TrackingConfig` (all three: evaluate, crossval, benchmark), :class:`TrackingURI` with
:class:`Experiment` (the main job, which always tracks), :class:`TrackingURI` with :class:`TrackingSwitch` (the
replay check, which logs into the benchmark's experiment), :class:`TrackingURI` alone (calibrate, for ``models:/``
references). An entry point whose default differs restates that default only
(``experiment: str = field(default="specstop-evaluate", kw_only=True)``).

Usage::

    @dataclass
    class EvaluateConfig(TrackingConfig):
        data_dir: str

    with mlflow_run(cfg.tracking_uri, cfg.experiment, "evaluate") as mlflow:
        mlflow.log_metric("x", 1.0)
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

__all__ = ["TrackingSwitch", "TrackingURI", "Experiment", "TrackingConfig", "mlflow_api", "mlflow_run"]


@dataclass(kw_only=True)
class TrackingSwitch:
    tracking: bool = True
    """Log the run's parameters, metrics and files to MLflow (into the active run when a caller started one)."""


@dataclass(kw_only=True)
class TrackingURI:
    tracking_uri: str | None = None
    """MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db; a remote server works too); also
    where ``models:/`` references are read."""


@dataclass(kw_only=True)
class Experiment:
    experiment: str = "specstop"
    """MLflow experiment of the runs the entry point starts."""


@dataclass(kw_only=True)
class TrackingConfig(Experiment, TrackingURI, TrackingSwitch):
    """``tracking``, ``tracking_uri`` and ``experiment``, in that order."""


def mlflow_api() -> ModuleType:
    """The ``mlflow`` module, imported on first use: it takes seconds to import, so an entry point that does not log
    (``--tracking false``, a config error) never pays for it."""
    import mlflow  # heavy: on first use only

    return mlflow


@contextmanager
def mlflow_run(tracking_uri: str | None, experiment: str, run_name: str) -> Iterator[ModuleType]:
    """Point MLflow at ``tracking_uri`` (resolved by ``predictors.registry.resolve_tracking_uri``) and ``experiment``,
    and run the body inside a new run named ``run_name``; yields the ``mlflow`` module to log with."""
    from predictors.registry import resolve_tracking_uri  # imports mlflow: only when a run is logged

    mlflow = mlflow_api()
    mlflow.set_tracking_uri(resolve_tracking_uri(tracking_uri))
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name):
        yield mlflow
