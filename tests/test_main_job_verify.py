"""A stored main job's figures recomputed from its records (``main_job.verify``): the smoke job stored with
``--results_dir`` verifies; a tampered figure or record is named; a summary without its sidecar gets the re-measure
line. One smoke run serves the module."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.results import ResultsConfig, store_runs, verify_summary
from pipelines.results import main as results_main
from rendering.result_store import Summary, load_summaries, sidecar_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Summary:
    """The smoke main job run as ``tests/test_pipelines.py`` runs it, its summary stored with ``--results_dir``."""
    from pipelines.train import main

    tmp = tmp_path_factory.mktemp("smoke")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        main(["--config", str(ROOT / "configs/smoke.yaml"), "--data.out_dir", str(tmp / "data"),
              "--out_dir", str(tmp / "train"), "--tracking_uri", f"sqlite:///{tmp}/mlflow.db",
              "--data.max_records", "1800", "--n_boot", "5", "--results_dir", str(tmp / "results")])
    (summary,) = load_summaries(tmp / "results")
    return summary


def copy_of(summary: Summary, folder: Path, data: dict | None = None, sidecar: bool = True) -> Summary:
    """The stored summary (``data`` in its place when given) and its sidecar copied into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / summary.path.name
    body = summary.data if data is None else data
    path.write_text(json.dumps(body))
    if sidecar:
        shutil.copyfile(sidecar_path(summary.path), sidecar_path(path))
    return Summary(path, body)


def test_stored_main_job_recomputes_from_its_records(stored, capsys):
    side = sidecar_path(stored.path)
    assert side.is_file() and side.name == stored.path.stem + ".records.parquet"
    sections = set(pq.read_table(side).column("section").to_pylist())
    assert sections == {"test", "cv", "replay"}
    print(f"smoke sidecar: {side.stat().st_size} bytes")
    assert side.stat().st_size < 300_000
    assert verify_summary(stored) is None
    assert results_main(["--verify", "true", "--results_dir", str(stored.path.parent)]) == 0
    assert "ok, every figure recomputed" in capsys.readouterr().out


@pytest.mark.parametrize(("where", "key"), [("predictors", "test_auc"), ("predictors", "test_auc_best_free"),
                                            ("predictors", "cv_diff_hi"), ("predictors", "test_speedup"),
                                            ("recommendations", "default_speedup"),
                                            ("recommendations", "oracle_speedup")])
def test_a_tampered_figure_is_named(stored, tmp_path, where, key):
    data = json.loads(json.dumps(stored.data))
    entry = next(e for e in data[where] if e.get(key) is not None)
    entry[key] = entry[key] * 1.001
    name = entry.get("predictor") or entry.get("runtime")
    problem = verify_summary(copy_of(stored, tmp_path, data))
    assert problem is not None and f"row {name!r}, field {key!r}" in problem, problem


def test_a_tampered_best_free_score_is_named(stored, tmp_path):
    data = json.loads(json.dumps(stored.data))
    entry = next(e for e in data["predictors"] if e.get("best_free"))
    entry["best_free"] = next(n for n in ("max-prob", "draft-prob", "neg-entropy") if n != entry["best_free"])
    problem = verify_summary(copy_of(stored, tmp_path, data))
    assert problem is not None and "field 'best_free'" in problem


@pytest.mark.parametrize(("column", "field"), [("score:disco", "test_auc"), ("score", "cv_diff"),
                                               ("seconds", "test_speedup")])
def test_a_tampered_record_is_named(stored, tmp_path, column, field):
    copy = copy_of(stored, tmp_path)
    side = sidecar_path(copy.path)
    table = pq.read_table(side)
    i = table.schema.get_field_index(column)
    values = table.column(column).to_numpy(zero_copy_only=False).copy()  # nulls (other sections' rows) read as NaN
    half = np.flatnonzero(~np.isnan(values))[: int((~np.isnan(values)).sum()) // 2]
    values[half] = values[half][::-1] * 1.5
    table = table.set_column(i, table.schema.field(i), pa.array(values, type=table.schema.field(i).type,
                                                                 from_pandas=True))
    pq.write_table(table, side)
    problem = verify_summary(copy)
    assert problem is not None and f"field {field!r}" in problem, problem


def test_a_summary_without_its_sidecar_says_how_to_remeasure(stored, tmp_path):
    problem = verify_summary(copy_of(stored, tmp_path, sidecar=False))
    assert problem == f"no per-prompt records: re-measure with {stored.data['command']}"
    assert "\n" not in problem


def test_storing_a_finished_job_writes_the_summary_and_its_records(stored, tmp_path):
    out_dir = stored.path.parent.parent / "train"
    store_runs(ResultsConfig(results_dir=str(tmp_path), main_job=str(out_dir), config_name="smoke"))
    (again,) = load_summaries(tmp_path)
    assert sidecar_path(again.path).read_bytes() == sidecar_path(stored.path).read_bytes()
    assert verify_summary(again) is None
