"""Shared fixtures: tiny random-init models (nothing downloads), seeds, and the --real opt-in for the Qwen pair."""
from __future__ import annotations

import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--real", action="store_true", help="run tests marked 'real' on the packaged Qwen pair")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--real"):
        return
    skip = pytest.mark.skip(reason="real-model test: pass --real (needs the packaged Qwen pair, see README)")
    for item in items:
        if "real" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _mlflow_isolation():
    """No MLflow global state (active run, experiment, tracking URI) leaks from one test into another (nothing to
    clear while no test has imported mlflow: a host without it runs the tests that do not need it)."""
    yield
    if "mlflow" not in sys.modules:
        return
    import mlflow
    from mlflow.tracking import fluent

    while mlflow.active_run() is not None:
        mlflow.end_run()
    fluent._active_experiment_id = None
    os.environ.pop("MLFLOW_EXPERIMENT_ID", None)  # mlflow.set_experiment exports it
    mlflow.set_tracking_uri(None)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run far faster on one thread when the CPU is shared (no OpenMP spin-waits); restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_pair():
    """(draft, target, tokenizer): tiny random-init Qwen2 models sharing the byte-level tokenizer."""
    from compute.models import ModelSpec, load_model

    draft, tok = load_model(ModelSpec("tiny:1"))
    target, _ = load_model(ModelSpec("tiny:2:32:3"))
    return draft, target, tok


@pytest.fixture(scope="session")
def tiny_companion():
    from compute.models import ModelSpec, load_model

    model, _ = load_model(ModelSpec("tiny:3"))
    return model
