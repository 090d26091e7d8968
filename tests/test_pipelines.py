"""Every YAML in configs/ parses against its entry point; the smoke main job runs end to end in tmp_path."""
from __future__ import annotations

import dataclasses
import importlib
import json
import re
from pathlib import Path

import pytest

from pipelines.cli import parse_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
ENTRY_CLASSES = {
    "pipelines.generate": ("data_gen.generate", "GenerateConfig"),
    "pipelines.train": ("main_job.train", "TrainJobConfig"),
    "pipelines.evaluate": ("evaluation.evaluate", "EvaluateConfig"),
    "pipelines.benchmark": ("benchmark.config", "BenchmarkConfig"),
    "pipelines.crossval": ("evaluation.crossval", "CrossValConfig"),
    "pipelines.llamacpp_bench": ("runtimes.llamacpp.measure", "LlamaCppBenchConfig"),
    "pipelines.vllm_bench": ("runtimes.vllm.bench", "VllmBenchConfig"),
}


def entry_of(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    m = re.match(r"#\s*python -m (pipelines\.\w+) --config (\S+)", first)
    assert m, f"{path.name} must open with the command that runs it: '# python -m pipelines.X --config {path.name}'"
    assert m.group(2) == f"configs/{path.name}", f"{path.name}: its first line runs another file ({m.group(2)})"
    return m.group(1)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_parses_against_its_entry_point(path: Path) -> None:
    module, cls_name = ENTRY_CLASSES[entry_of(path)]
    cls = getattr(importlib.import_module(module), cls_name)
    cfg = parse_config(cls, ["--config", str(path)], "test")
    import yaml

    for key, value in yaml.safe_load(path.read_text()).items():  # every scalar in the file reached the config
        scalar = value is None or isinstance(value, (str, int, float, bool))
        if not dataclasses.is_dataclass(getattr(cfg, key)) and scalar:
            assert getattr(cfg, key) == value, f"{path.name}: {key} is {getattr(cfg, key)!r}, the file says {value!r}"


def test_smoke_main_job_end_to_end(tmp_path, monkeypatch):
    from pipelines.train import main

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = main(["--config", str(ROOT / "configs/smoke.yaml"), "--data.out_dir", str(tmp_path / "data"),
                   "--out_dir", str(tmp_path / "train"), "--tracking_uri", uri, "--data.max_records", "1800",
                   "--n_boot", "5", "--results_dir", str(tmp_path / "results")])
    rows = {r["predictor"]: r for r in result["results"]}
    from rendering.result_store import load_summaries  # the run's summary, as pipelines.results renders it

    (stored,) = load_summaries(tmp_path / "results")
    assert stored.kind == "main_job" and stored.data["config"] == "smoke" and "--results_dir" not in stored.data[
        "command"] and {p["predictor"] for p in stored.data["predictors"]} >= {"disco", "sprinter", "sv"}
    kinds = ("disco", "sprinter", "sv")
    assert set(kinds) <= set(rows)  # the cost-aware (goodput) rows come beside them
    labels = (rows["disco"]["label"], rows["sprinter"]["label"], rows["sv"]["label"])
    assert labels == ("greedy match", "q/p<=1", "greedy match")
    for kind, row in ((k, rows[k]) for k in kinds):
        assert row["status"] == "trained"
        assert 0.0 <= row["val_auc"] <= 1.0
        assert row["registry_name"].startswith(f"specstop-{kind}-tiny-1") and row["registry_version"] >= 1
        # each predictor is compared with the best training-free score on its own label
        assert 0.0 <= row["test_auc"] <= 1.0 and row["best_free"] in ("max-prob", "draft-prob", "neg-entropy")
        if kind != "sv":  # cross-validated over 3 folds of prompts: the difference to the best training-free score
            assert row["cv_diff_lo"] <= row["cv_diff_hi"]
            assert row["cv_diff"] == pytest.approx(row["cv_auc"] - row["cv_auc_best_free"])
        meta = json.loads((tmp_path / "train" / kind / "export" / "predictor.json").read_text())
        assert meta["draft_fingerprint"]["name"] == "tiny:1"
    assert (tmp_path / "data" / "summary.json").exists() and (tmp_path / "data" / "cost_model.json").exists()
    assert (tmp_path / "train" / "resolved_config.json").exists()
    # transformers' and vLLM's settings tuned on the data's own curve (no llama.cpp curve in it), stored and summarised
    recs = result["recommendations"]
    assert set(recs) == {"transformers", "vllm"} and recs["transformers"][0].startswith("transformers: ")
    assert any("the runtime's defaults (transformers:20,constant,0.4)" in line for line in recs["transformers"])
    assert {r["runtime"] for r in stored.data["recommendations"]} == {"transformers", "vllm"}
    assert (tmp_path / "train" / "recommend.json").exists()
    from pipelines.recommend import main as recommend_main  # the same tuning from the command line, llama.cpp refused

    assert set(recommend_main(["--data_dir", str(tmp_path / "data"), "--runtime", "vllm"])) == {"vllm"}
    with pytest.raises(SystemExit):
        recommend_main(["--data_dir", str(tmp_path / "data"), "--runtime", "llamacpp"])
    report = Path(result["report"])
    assert report.exists() and list(report.parent.rglob("*.png"))

    # A registered predictor loads by alias and scores like the exported one.
    import numpy as np

    from data_gen.shards import load_records
    from predictors.base import as_tensor_dict
    from predictors.export import load_predictor
    from predictors.registry import load_reference, registry_name

    name = registry_name("disco", {"name": "tiny:1"})
    a = load_reference(f"models:/{name}@champion", tracking_uri=uri)
    b = load_predictor(tmp_path / "train" / "disco" / "export")
    cols = load_records(tmp_path / "data").select(range(50)).to_dict()
    feats = as_tensor_dict(cols)
    np.testing.assert_allclose(a.score(feats).numpy(), b.score(feats).numpy(), rtol=1e-6)
