"""Export / load round trips, fingerprint checks, the MLflow registry (embedded sqlite and a real `mlflow server`)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import numpy as np
import pytest
import requests
import torch
from mlflow.tracking import MlflowClient

from data_gen.shards import read_columns
from predictors.export import FingerprintMismatch, export_predictor, load_predictor, read_metadata, update_metadata
from predictors.policy_names import policy_kinds
from predictors.registry import (
    TrackingUnreachable,
    example_frame,
    frame_to_columns,
    load_reference,
    register_predictor,
    registry_name,
)
from predictors.training import DiscoConfig, SprinterConfig, SVTableConfig, fit_predictor
from tests.synthetic import make_records, write_shards

ROOT = Path(__file__).resolve().parents[1]
FP = {"name": "tiny:1", "vocab_size": 260, "hidden_size": 16, "vocab_sha": "abc"}
COLUMNS = ["draft_topk", "position", "draft_hidden", "companion_sim", "companion_accept", "draft_entropy",
           "draft_max_prob", "greedy_match"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(columns, {kind: export folder}) for the three learned predictors, briefly trained."""
    root = tmp_path_factory.mktemp("exp")
    write_shards(root / "shards", make_records(n_prompts=30, tokens_per_prompt=20, hidden_size=16))
    fast = dict(batch_size=128, max_epochs=2, patience=1)
    cfgs = {"disco": DiscoConfig(hidden_size=8, **fast), "sprinter": SprinterConfig(lam=1.5, **fast),
            "sv": SVTableConfig(s_bins=5, a_bins=5)}
    folders = {}
    for kind, cfg in cfgs.items():
        policy, metrics = fit_predictor(kind, cfg, root / "shards", root / kind)
        folders[kind] = export_predictor(policy, root / kind / "export", {"draft_fingerprint": FP, "data": "synthetic"})
        folders[kind + "_policy"] = policy
    cols = read_columns(root / "shards", COLUMNS)
    return cols, folders


@pytest.mark.parametrize("kind", ["disco", "sprinter", "sv"])
def test_export_load_same_predictions(trained, kind):
    cols, folders = trained
    policy = folders[kind + "_policy"]
    loaded = load_predictor(folders[kind], draft_fingerprint=FP)
    assert type(loaded) is type(policy)
    assert torch.equal(policy.score(cols), loaded.score(cols))
    meta = read_metadata(folders[kind])
    assert meta["kind"] == kind and meta["draft_fingerprint"] == FP and meta["data"] == "synthetic"
    assert meta["input_width"] == policy.spec.width and meta["columns"] == list(policy.spec.columns)
    assert meta["threshold"] == 0.5 and "val_auc" in meta["metrics"] and meta["config"]["seed"] == 0
    assert meta["label"]["family"] == {"disco": "greedy", "sprinter": "ratio", "sv": "soft"}[kind]
    assert (folders[kind] / "weights.safetensors").is_file()


def test_update_metadata_threshold(trained, tmp_path):
    folder = shutil.copytree(trained[1]["disco"], tmp_path / "d")
    update_metadata(folder, threshold=0.7, metrics={"speedup": 1.3})
    meta = read_metadata(folder)
    assert meta["metrics"]["speedup"] == 1.3 and "val_auc" in meta["metrics"]
    assert load_predictor(folder).threshold == 0.7


def test_fingerprint_mismatch_refused_unless_forced(trained):
    folder = trained[1]["sprinter"]
    other = {**FP, "name": "packaged:qwen2.5-coder-0.5b-instruct", "hidden_size": 896}
    with pytest.raises(FingerprintMismatch, match=r"tiny:1.*qwen2.5-coder-0.5b-instruct.*hidden_size: 16 vs 896"):
        load_predictor(folder, draft_fingerprint=other)
    assert load_predictor(folder, draft_fingerprint=other, force=True).kind == "sprinter"


def test_loaded_policy_refuses_bad_features(trained):
    cols, folders = trained
    policy = load_predictor(folders["sprinter"])
    with pytest.raises(ValueError, match="width mismatch"):
        policy.score({"draft_hidden": torch.zeros(3, 8)})
    with pytest.raises(ValueError, match="NaN"):
        policy.score({"draft_hidden": torch.full((3, 16), float("nan"))})


def test_export_loads_with_torch_and_safetensors_alone(trained):
    folder = trained[1]["disco"]
    code = (
        "import sys\n"
        "for m in ('mlflow', 'pytorch_lightning', 'lightning', 'sklearn', 'datasets', 'transformers'):\n"
        "    sys.modules[m] = None\n"
        "import torch\n"
        "from predictors.export import load_predictor\n"
        f"p = load_predictor({str(folder)!r})\n"
        "print(p.score({'draft_topk': torch.full((2, 10), 0.05), 'position': torch.tensor([0, 3])}).shape)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "torch.Size([2])" in out.stdout


@pytest.mark.parametrize("kind", sorted(policy_kinds()))
def test_baselines_export_and_load(kind, tmp_path):
    policy = policy_kinds()[kind]()
    folder = export_predictor(policy, tmp_path / kind, {})
    loaded = load_predictor(folder, draft_fingerprint=FP)
    assert type(loaded) is type(policy) and loaded.threshold == policy.threshold
    assert loaded.draft_cap() == policy.draft_cap()
    assert read_metadata(folder)["weights"] is None
    feats = {"draft_entropy": torch.tensor([0.1, 2.0]), "draft_max_prob": torch.tensor([0.9, 0.2]),
             "greedy_match": torch.tensor([True, False]), "q": torch.tensor([0.9, 0.1])}
    assert torch.equal(policy.score(feats), loaded.score(feats))


def test_registry_name():
    fp = {"name": "packaged:qwen2.5-coder-0.5b-instruct"}
    assert registry_name("disco", fp) == "specstop-disco-qwen2.5-coder-0.5b-instruct"
    assert registry_name("sv", {"name": "Qwen/Qwen2.5 Coder:0.5B"}) == "specstop-sv-qwen2.5-coder-0.5b"
    assert registry_name("sprinter", None) == "specstop-sprinter"


def _round_trip(trained, uri: str) -> None:
    """Register three versions; champion moves only on improvement; load by alias gives the same predictions."""
    cols, folders = trained
    name = "specstop-disco-test"
    first = register_predictor(folders["disco"], name, 0.80, tracking_uri=uri)
    assert first["champion"] and first["version"] == 1
    worse = register_predictor(folders["sv"], name, 0.70, tracking_uri=uri)
    assert not worse["champion"] and worse["champion_version"] == 1 and worse["previous_champion"] == 1
    champ = load_reference(f"models:/{name}@champion", draft_fingerprint=FP, tracking_uri=uri)
    assert champ.kind == "disco"
    assert torch.equal(champ.score(cols), folders["disco_policy"].score(cols))
    better = register_predictor(folders["sprinter"], name, 0.95, tracking_uri=uri)
    assert better["champion"] and better["version"] == 3
    champ = load_reference(f"models:/{name}@champion", tracking_uri=uri)
    assert champ.kind == "sprinter" and torch.equal(champ.score(cols), folders["sprinter_policy"].score(cols))
    v2 = load_reference(f"models:/{name}/2", tracking_uri=uri)
    assert v2.kind == "sv"
    client = MlflowClient(uri, uri)
    tags = client.get_model_version(name, "3").tags
    assert tags["val_auc"] == "0.95" and tags["kind"] == "sprinter" and tags["draft"] == "tiny:1"
    assert tags["label"] == "q/p<=1.5"
    # the pyfunc flavour predicts the same scores from a flattened feature frame
    mlflow.set_tracking_uri(uri)
    try:
        model = mlflow.pyfunc.load_model(f"models:/{name}/1")
        frame = example_frame(folders["disco_policy"], n=4)
        expected = folders["disco_policy"].score(frame_to_columns(frame, folders["disco_policy"])).numpy()
        assert np.allclose(np.asarray(model.predict(frame)).reshape(-1), expected, atol=1e-6)
    finally:
        mlflow.set_tracking_uri(None)


def test_register_and_load_by_alias_sqlite(trained, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the embedded store keeps artifacts in ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _round_trip(trained, uri)
    # into an existing run (the main job passes MLFlowLogger.run_id)
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("train-job"))
    info = register_predictor(trained[1]["sv"], "specstop-sv-test", 0.5, run_id=run.info.run_id, tracking_uri=uri)
    assert info["run_id"] == run.info.run_id and info["champion"]


def test_unreachable_tracking_server_keeps_export(trained, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    folder = trained[1]["disco"]
    with pytest.raises(TrackingUnreachable, match=r"http://127\.0\.0\.1:9.*unreachable"):
        register_predictor(folder, "specstop-disco-x", 0.9, tracking_uri="http://127.0.0.1:9")
    with pytest.raises(TrackingUnreachable, match=r"http://127\.0\.0\.1:9"):
        load_reference("models:/specstop-disco-x@champion", tracking_uri="http://127.0.0.1:9")
    assert (folder / "weights.safetensors").is_file() and (folder / "predictor.json").is_file()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def _server_process(tmp_path_factory):
    """Start a real `mlflow server` (loopback, sqlite backend, artifacts in a temp folder) when the module starts, so
    its
    slow start-up overlaps with the other tests; killed at the end of the module. None when it cannot start."""
    exe = shutil.which("mlflow", path=str(Path(sys.executable).parent)) or shutil.which("mlflow")
    if exe is None:
        yield None
        return
    root = tmp_path_factory.mktemp("mlflow-server")
    port = _free_port()
    log = open(root / "server.log", "w")  # noqa: SIM115 - the server writes to it until the module ends
    cmd = [exe, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{root / 'server.db'}", "--artifacts-destination", str(root / "artifacts")]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)
    try:
        yield {"proc": proc, "uri": f"http://127.0.0.1:{port}", "root": root}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)  # the server and its uvicorn worker, started by this fixture
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        log.close()


@pytest.fixture
def mlflow_server(_server_process):
    """The server's URI once it answers on /health; skipped with the reason when it cannot start."""
    if _server_process is None:
        pytest.skip("the `mlflow` command is not installed")
    proc, uri, root = _server_process["proc"], _server_process["uri"], _server_process["root"]
    deadline = time.monotonic() + float(os.environ.get("SPECSTOP_MLFLOW_SERVER_WAIT", 180))
    while True:
        if proc.poll() is not None:
            pytest.skip(f"`mlflow server` exited with {proc.returncode}: {(root / 'server.log').read_text()[-500:]}")
        try:
            if requests.get(uri + "/health", timeout=2).ok:
                return {"uri": uri, "root": root}
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            pytest.skip("`mlflow server` did not answer on /health in time (machine too busy?)")
        time.sleep(1)


@pytest.mark.slow
def test_register_and_load_against_real_mlflow_server(trained, mlflow_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cols, folders = trained
    uri, name = mlflow_server["uri"], "specstop-sprinter-test"
    info = register_predictor(folders["sprinter"], name, 0.9, tracking_uri=uri)
    assert info["champion"] and info["version"] == 1 and info["tracking_uri"] == uri
    loaded = load_reference(f"models:/{name}@champion", draft_fingerprint=FP, tracking_uri=uri)
    assert torch.equal(loaded.score(cols), folders["sprinter_policy"].score(cols))
    assert not register_predictor(folders["sprinter"], name, 0.85, tracking_uri=uri)["champion"]
    assert list((mlflow_server["root"] / "artifacts").rglob("predictor.json"))  # artifacts went through the server
    assert not list(tmp_path.rglob("predictor.json"))  # nothing was written to a local store
