"""The MLflow fields of the entry points' configs, declared once as keyword-only dataclasses a config inherits (flat on
the command line: ``--tracking``, ``--tracking_uri``, ``--experiment``), and the one way an entry point opens its run.

Usage::

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
    """MLflow tracking URI (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db); also where ``models:/`` refs are
    read."""


@dataclass(kw_only=True)
class Experiment:
    experiment: str = "specstop"
    """MLflow experiment of the runs the entry point starts."""


@dataclass(kw_only=True)
class TrackingConfig(Experiment, TrackingURI, TrackingSwitch):
    """``tracking``, ``tracking_uri`` and ``experiment``, in that order."""


def mlflow_api() -> ModuleType:
    """The ``mlflow`` module, imported on first use: its import takes seconds an entry point that does not log never
    pays."""
    import mlflow  # heavy: on first use only

    return mlflow


@contextmanager
def mlflow_run(tracking_uri: str | None, experiment: str, run_name: str) -> Iterator[ModuleType]:
    """Run the body in a new MLflow run ``run_name`` at ``tracking_uri`` and ``experiment``; yields the ``mlflow``
    module."""
    from predictors.registry import resolve_tracking_uri  # imports mlflow: only when a run is logged

    mlflow = mlflow_api()
    mlflow.set_tracking_uri(resolve_tracking_uri(tracking_uri))
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name):
        yield mlflow
