"""The command line as users meet it: each entry point's likely mistakes, through the real parser, end in one line
``error: ...`` that names the option and the fix, with exit code 2 (no traceback)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import crossval, evaluate, generate, train

ROOT = Path(__file__).resolve().parents[1]
GEN = ["--config", str(ROOT / "configs/generate-smoke.yaml")]
TRAIN = ["--config", str(ROOT / "configs/smoke.yaml")]
CV = ["--config", str(ROOT / "configs/crossval.yaml")]


def _error(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip()


@pytest.mark.parametrize(
    ("main", "argv", "wanted"),
    [
        (generate.main, [*GEN, "--max_recrds", "5"], ["unrecognized arguments", "--max_recrds"]),
        (generate.main, [*GEN, "--max_records", "many"], ["max_records", "many"]),
        (generate.main, [*GEN, "--max_records", "-5"], ["--max_records", "positive"]),
        (generate.main, ["--config", "configs/missing.yaml"], ["config", "does not exist"]),
        (train.main, [*TRAIN, "--predictors", "[disco, svm]"], ["predictors", "svm"]),
        (train.main, [*TRAIN, "--n_boot", "lots"], ["n_boot", "lots"]),
        (train.main, [*TRAIN, "--data.max_records", "-5"], ["--max_records", "positive"]),
        (evaluate.main, ["--data_dir", "/nonexistent/data"], ["/nonexistent/data", "pipelines.generate"]),
        (evaluate.main, ["--data_dir", "x", "--n_boot", "-1"], ["--n_boot", ">= 0"]),
        (evaluate.main, ["--data_dir", "x", "--split", "7", "--replay_modes", "[fast]"], ["replay_modes", "fast"]),
        (crossval.main, [*CV, "--folds", "1"], ["folds=1", "at least 3"]),
        (crossval.main, [*CV, "--foldz", "5"], ["unrecognized arguments", "--foldz"]),
        (crossval.main, [*CV, "--data_dirs", "[/nonexistent/cv]"], ["/nonexistent/cv"]),
    ],
)
def test_mistakes_end_in_one_error_line(main, argv, wanted, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    line = _error(main, argv, capsys)  # jsonargparse's type errors list what it expected over a few lines
    assert "error:" in line
    for w in wanted:
        assert w in line, (w, line)


def test_generate_value_out_of_range_as_typed():
    """What the issue showed: ``--max_records -5`` printed a traceback; now one line and exit code 2."""
    proc = subprocess.run([sys.executable, "-m", "pipelines.generate", *GEN, "--max_records", "-5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "error: --max_records must be positive or null, got -5"


@pytest.mark.parametrize("uri, wanted", [
    ("/proc/nope/mlflow", "retired file store; pass sqlite:////proc/nope/mlflow.db"),
    ("file:///tmp/mlruns", "retired file store"),
    ("ftp://host/x", "scheme 'ftp' is not a tracking store"),
    ("sqlite:////proc/nope/mlflow.db", "cannot create its folder /proc/nope"),
])
def test_tracking_uri_refused_before_any_work(uri, wanted, capsys):
    """A tracking URI MLflow would refuse after the work ends in one line at parse time, saying what to pass."""
    from pipelines.train import main

    with pytest.raises(SystemExit) as e:
        main([*TRAIN, "--tracking_uri", uri])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert wanted in err and "Traceback" not in err


def test_tracking_uri_accepted_forms(tmp_path):
    from pipelines.cli import check_tracking_uri

    for uri in (f"sqlite:///{tmp_path}/m.db", "http://127.0.0.1:5000", "postgresql+psycopg2://u@h/db"):
        check_tracking_uri(uri)
