"""The main job stopped in any stage and started again: finished shards and exports are kept and only what was cut is
redone; a second run does not generate; a shard that no longer reads is named, moved aside and generated again; the
progress view says each stage's time and the ETA at the first shard; the console table fits 100 columns."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data_gen.shards import finished_chunks
from main_job.train import TRAIN_STATE
from pipelines import train
from rendering.train_results import RESULTS_MD

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--config", str(ROOT / "configs/smoke.yaml")]


class Killed(Exception):
    """Stands for the job being killed at that point."""


def _argv(tmp_path: Path, *extra: str) -> list[str]:
    return [*SMOKE, "--data.out_dir", str(tmp_path / "data"), "--out_dir", str(tmp_path / "train"),
            "--tracking_uri", f"sqlite:///{tmp_path}/mlflow.db", "--data.max_records", "1800", "--n_boot", "5",
            "--crossval_folds", "0", *extra]


def _mtimes(folder: Path, pattern: str) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.glob(pattern))}


def test_killed_in_generation_then_in_training_resumes_and_a_second_run_reuses_all(
    tmp_path, monkeypatch, caplog, capsys
):
    from data_gen.shards import ShardWriter
    from predictors import training

    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO)
    data, out = tmp_path / "data", tmp_path / "train"

    # 1. Killed while writing the second shard.
    write = ShardWriter.write
    calls = []

    def write_then_die(self, chunk, records, cost=None):
        calls.append(chunk)
        if len(calls) == 2:
            raise Killed("killed during generation")
        return write(self, chunk, records, cost)

    monkeypatch.setattr(ShardWriter, "write", write_then_die)
    with pytest.raises(Killed):
        train.main(_argv(tmp_path))
    monkeypatch.setattr(ShardWriter, "write", write)
    first = _mtimes(data, "shard-*.parquet")
    assert list(first) == ["shard-00000.parquet"]
    assert "generate: first shard:" in caplog.text and "ETA" in caplog.text  # the ETA shows at the first shard
    assert "stage generate cut after" in caplog.text

    # 2. Killed while training the second predictor: generation resumes after shard 0, DISCO is exported.
    fit = training.fit_predictor

    def fit_or_die(kind, *a, **k):
        if kind == "sprinter":
            raise Killed("killed during training")
        return fit(kind, *a, **k)

    monkeypatch.setattr(training, "fit_predictor", fit_or_die)
    caplog.clear()
    with pytest.raises(Killed):
        train.main(_argv(tmp_path))
    monkeypatch.setattr(training, "fit_predictor", fit)
    shards = _mtimes(data, "shard-*.parquet")
    assert len(shards) > 1 and shards["shard-00000.parquet"] == first["shard-00000.parquet"]  # kept, not redone
    assert sum(finished_chunks(data).values()) == 1800
    disco_weights = out / "disco" / "export" / "weights.safetensors"
    disco_mtime = disco_weights.stat().st_mtime_ns
    assert "stage generate:" in caplog.text and "stage train disco:" in caplog.text
    assert not (out / "sprinter" / TRAIN_STATE).exists()

    # 3. Started again: no generation, DISCO reused, SPRINTER and SV trained, the chain completes.
    calls.clear()
    caplog.clear()
    capsys.readouterr()
    result = train.main(_argv(tmp_path))
    assert not calls, "a complete data folder was generated again"
    assert _mtimes(data, "shard-*.parquet") == shards
    assert disco_weights.stat().st_mtime_ns == disco_mtime
    assert "stage generate: 1,800 records in 1 folder reused" in caplog.text
    assert "stage train disco: reused export" in caplog.text
    rows = {r["predictor"]: r for r in result["results"]}
    kinds = ("disco", "sprinter", "sv")
    assert [rows[k]["status"] for k in kinds] == ["trained"] * 3
    assert all(rows[k]["registry_version"] == 1 for k in kinds)
    console = capsys.readouterr().out.splitlines()
    assert console[-1].startswith("total ") and "train sprinter" in console[-1]
    table = console[: next(i for i, line in enumerate(console) if line.startswith("test AUC:"))]
    assert len(table) >= 5 and max(len(line) for line in table) <= 100
    assert (out / RESULTS_MD).exists() and "cv_auc" not in (out / RESULTS_MD).read_text()

    # 4. A second run of a finished job: nothing generated, trained or registered again; the same table.
    def no_more(*a, **k):
        raise AssertionError("a finished job trained again")

    monkeypatch.setattr(training, "fit_predictor", no_more)
    weights = {k: (out / k / "export" / "weights.safetensors").stat().st_mtime_ns for k in kinds}
    again = {r["predictor"]: r for r in train.main(_argv(tmp_path))["results"]}
    assert not calls
    assert {k: (out / k / "export" / "weights.safetensors").stat().st_mtime_ns for k in kinds} == weights
    for k in kinds:
        assert again[k]["test_auc"] == rows[k]["test_auc"]
        assert again[k]["registry_version"] == rows[k]["registry_version"]  # kept, not a new version

    # 5. A data folder made by another config is refused before any model loads.
    with pytest.raises(SystemExit) as e:
        train.main([*_argv(tmp_path), "--data.rollout_len", "10"])
    assert e.value.code == 2 and "different data config" in capsys.readouterr().err


def test_unreadable_shard_is_named_moved_aside_and_generated_again(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    argv = _argv(tmp_path, "--predictors", "[disco]", "--evaluate", "false", "--register", "false")
    train.main(argv)
    data = tmp_path / "data"
    before = _mtimes(data, "shard-*.parquet")
    rows0 = pq.ParquetFile(data / "shard-00000.parquet").metadata.num_rows
    bad = data / "shard-00000.parquet"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # cut to half its size

    caplog.set_level(logging.INFO)
    result = train.main(argv)  # the same command again
    assert "shard " + str(bad) + " does not read" in caplog.text and "moved aside" in caplog.text
    assert (data / "shard-00000.parquet.corrupt").exists()
    assert pq.ParquetFile(bad).metadata.num_rows == rows0  # generated again, the same records
    after = _mtimes(data, "shard-*.parquet")
    assert {k: v for k, v in after.items() if k != bad.name} == {k: v for k, v in before.items() if k != bad.name}
    assert result["results"][0]["status"] == "trained"


def test_killed_process_resumes_keeping_its_shards(tmp_path):
    """A real kill (SIGKILL) of the main job during generation, as a user's Ctrl-C or a lost session would be."""
    argv = _argv(tmp_path, "--data.prompts_per_shard", "2", "--predictors", "[disco]", "--evaluate", "false",
                 "--register", "false")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.train", *argv], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    data = tmp_path / "data"
    deadline = time.time() + 240
    while not (data / "shard-00000.parquet").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    kept = _mtimes(data, "shard-*.parquet")
    assert "shard-00000.parquet" in kept
    result = train.main(argv)
    after = _mtimes(data, "shard-*.parquet")
    assert {k: after[k] for k in kept} == kept  # every shard finished before the kill is reused
    assert sum(finished_chunks(data).values()) == 1800 and not list(data.glob("*.tmp"))
    assert result["results"][0]["status"] == "trained"


def test_console_table_fits_100_columns():
    long = {"predictor": "sprinter-hybrid", "status": "trained", "label": "min(1,p/q)", "test_auc": 0.61234,
            "best_free": "neg-entropy", "test_auc_best_free": 0.60123, "cv_diff": -0.01234, "cv_diff_lo": -0.03456,
            "cv_diff_hi": 0.01234, "test_speedup": 1.2345,
            "registry_name": "specstop-sprinter-qwen2.5-coder-0.5b-instruct", "registry_version": 12,
            "champion": True, "val_auc": 0.6, "threshold": 0.5}
    skipped = {"predictor": "sv", "status": "skipped: data has no ('companion_sim', 'companion_accept') columns "
               "(configure data.models.companion) and a long tail " * 2}
    from rendering import train_results

    text = train_results.format_summary([long, skipped])
    assert max(map(len, text.splitlines())) <= 100
    assert "v12*" in text and "-0.0123 [-0.0346,+0.0123]" in text and "1.23x" in text and "skipped: data" in text
    assert len(train_results.format_table([long]).splitlines()[0].split("|")) > 12  # the full table keeps every column


def test_library_noise_filtered_once_and_actionable_warnings_kept():
    code = """
import logging, warnings
from pipelines.cli import setup_logging
setup_logging()
import pytorch_lightning  # installs its own warning filters after ours
warnings.warn("The 'train_dataloader' does not have many workers which may be a bottleneck.", UserWarning)
warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated", DeprecationWarning,
                       "/x/site-packages/pytorch_lightning/utilities/_pytree.py", 21)
logging.getLogger("pytorch_lightning.utilities.rank_zero").info("GPU available: False, used: False")
logging.getLogger("mlflow.pyfunc").warning("Passing a Python object as `python_model` causes it ...")
warnings.warn("24 prompts were left-truncated: raise --max_prompt_tokens", UserWarning)
logging.getLogger("data_gen.generate").warning("skipping sv: data has no companion columns")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    for noise in ("many workers", "LeafSpec", "GPU available", "CloudPickle"):
        assert noise not in err
    assert "left-truncated" in err and "skipping sv" in err
