"""Benchmark smoke test: main() on tiny models in tmp_path writes the table, the plot, the config and MLflow metrics."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipelines.benchmark import BenchmarkConfig, main


pytestmark = pytest.mark.usefixtures("one_thread")


ROOT = Path(__file__).resolve().parents[1]


def test_configs_parse():
    from pipelines.cli import parse_config

    for name in ("benchmark.yaml", "benchmark-smoke.yaml"):
        cfg = parse_config(BenchmarkConfig, ["--config", str(ROOT / "configs" / name)], "")
        assert cfg.max_new_tokens > 0


def test_bad_config():
    with pytest.raises(ValueError, match="hf_rows"):
        BenchmarkConfig(hf_rows=["fancy"])
    with pytest.raises(ValueError, match="n_prompts"):
        BenchmarkConfig(n_prompts=0)


def test_smoke_run(tmp_path, tiny_pair):
    from data_gen.models import model_fingerprint
    from predictors.export import export_predictor
    from predictors.inputs import FeatureSpec
    from predictors.sprinter import SprinterNet, SprinterPolicy

    draft, _, tok = tiny_pair
    sprinter = SprinterPolicy(SprinterNet(draft.config.hidden_size), FeatureSpec.for_sprinter(draft.config.hidden_size),
                              threshold=0.5, max_draft_len=6)
    export_predictor(sprinter, tmp_path / "sprinter", {"draft_fingerprint": model_fingerprint(draft, tok)})
    out = tmp_path / "bench"
    argv = [
        "--config", str(ROOT / "configs" / "benchmark-smoke.yaml"),
        "--out_dir", str(out),
        "--tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--n_prompts", "1",
        "--max_new_tokens", "6",
        "--policies", '["static:3", "svip:0.3", "oracle", "hfp:svip:0.3"]',
        "--predictors", json.dumps([str(tmp_path / "sprinter")]),
        "--hf_rows", '["static:3"]',
    ]
    result = main(argv)
    names = [r["row"] for r in result["rows"]]
    assert names[:2] == ["target-only", "hf:static:3"]
    assert {"static:3", "svip:0.3", "oracle", "hfp:svip:0.3"} <= set(names)
    rows = {r["row"]: r for r in result["rows"]}
    for name in ("hf:static:3", "static:3", "svip:0.3", "oracle", "hfp:svip:0.3"):
        assert rows[name]["exact"] is True and rows[name]["tokens_per_s"] > 0
    spr = [r for r in result["rows"] if r["row"].startswith("sprinter")][0]
    assert spr["rouge_l"] is not None and "approximate" in spr["note"]
    for f in ("benchmark.md", "benchmark.json", "speedup.png", "config.yaml", "latency.json"):
        assert (out / f).is_file(), f
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["max_new_tokens"] == 6
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["specstop-benchmark"])
    assert len(runs) == 1 and "metrics.static_3/speedup" in runs.columns
