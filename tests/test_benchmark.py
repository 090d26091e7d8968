"""Benchmark smoke test: main() on tiny models in tmp_path writes the table, the plot, the config and MLflow metrics."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from benchmark.config import BenchmarkConfig
from pipelines.benchmark import main

pytestmark = pytest.mark.usefixtures("one_thread")


ROOT = Path(__file__).resolve().parents[1]


def test_configs_parse():
    from pipelines.cli import parse_config

    for name in ("benchmark.yaml", "benchmark-smoke.yaml", "benchmark-full.yaml", "benchmark-transformers.yaml"):
        cfg = parse_config(BenchmarkConfig, ["--config", str(ROOT / "configs" / name)], "")
        assert cfg.max_new_tokens > 0


def test_bad_config(tmp_path):
    with pytest.raises(ValueError, match="hf_rows"):
        BenchmarkConfig(hf_rows=["fancy"])
    with pytest.raises(ValueError, match="n_prompts"):
        BenchmarkConfig(n_prompts=0)
    with pytest.raises(ValueError, match="--tune_data_dir"):
        BenchmarkConfig(policies=["svip:tuned"])
    with pytest.raises(ValueError, match="--tune_data_dir"):
        BenchmarkConfig(hf_rows=["recommended"])  # transformers' settings are tuned on validation data
    with pytest.raises(ValueError, match="pipelines.measure_costs --out"):
        BenchmarkConfig(cost_file=str(tmp_path / "nope.json"))


def test_a_missing_tuning_folder_is_named_when_the_run_needs_it(tmp_path):
    from benchmark.bench import Bench, DecodeSettings
    from benchmark.tuning import tune_on_validation

    cfg = BenchmarkConfig(policies=["static:best"], tune_data_dir=str(tmp_path / "none"))  # parses: may come later
    bench = Bench(DecodeSettings.of(cfg), None, None, None, None, [], [], cost_model=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="run the main job first"):
        tune_on_validation(cfg.policies, bench, cfg.tune_data_dir)


@pytest.mark.parametrize("temperature, draw", [(0.0, "greedy"), (0.8, "sample")])
def test_thresholds_are_tuned_on_one_draw_per_position(tmp_path, monkeypatch, temperature, draw):
    """Validation data holding a greedy and a sampled record per position: the benchmark tunes on the draw its
    decoding mode makes (both draws replayed as one sequence would read two tokens per position)."""
    import numpy as np

    import benchmark.tuning as tuning
    from benchmark.bench import Bench, DecodeSettings

    (tmp_path / "data").mkdir()
    cols = {"draw": np.array(["greedy", "sample"] * 3), "seq_id": np.zeros(6, dtype=np.int64)}
    seen = []
    monkeypatch.setattr(tuning, "load_columns", lambda *a, **k: cols)
    monkeypatch.setattr(tuning, "tune_threshold", lambda pol, c, *a, **k: (seen.append(c) or (0.5, 1.0)))
    cfg = BenchmarkConfig(policies=["svip:tuned"], tune_data_dir=str(tmp_path / "data"), temperature=temperature)
    bench = Bench(DecodeSettings.of(cfg), None, None, None, None, [], [], cost_model=object())  # type: ignore[arg-type]
    tuning.tune_on_validation(cfg.policies, bench, cfg.tune_data_dir)
    assert len(seen) == 1 and list(seen[0]["draw"]) == [draw] * 3


def test_the_drafted_tokens_probability_is_tuned_like_the_other_baselines(tmp_path, monkeypatch):
    """draft_prob:tuned (q(x), transformers' confidence criterion under sampling) is tuned on val as the others are."""
    import numpy as np

    import benchmark.tuning as tuning
    from benchmark.bench import Bench, DecodeSettings

    (tmp_path / "data").mkdir()
    monkeypatch.setattr(tuning, "load_columns", lambda *a, **k: {"draw": np.array(["sample"] * 2),
                                                                    "seq_id": np.zeros(2, dtype=np.int64)})
    monkeypatch.setattr(tuning, "tune_threshold", lambda pol, c, *a, **k: (0.25, 1.3))
    cfg = BenchmarkConfig(policies=["draft_prob:tuned"], tune_data_dir=str(tmp_path / "data"), temperature=1.0)
    bench = Bench(DecodeSettings.of(cfg), None, None, None, None, [], [], cost_model=object())  # type: ignore[arg-type]
    pol, label, rebuild = tuning.tune_on_validation(cfg.policies, bench, cfg.tune_data_dir)["draft_prob:tuned"]
    assert pol.kind == "draft_prob" and pol.threshold == 0.25 and label == "draft_prob:0.25 (val-tuned)"
    assert rebuild == {"spec": "draft_prob", "threshold": 0.25}


def test_bad_options_through_the_command_line(capsys, tmp_path):
    """What a user types: one line naming the option and the fix, exit code 2, no traceback."""
    for argv, words in (
        (["--n_prompts", "0"], "n_prompts=0"),
        (["--policies", '["static:best"]'], "--tune_data_dir"),
        (["--cost_file", str(tmp_path / "x.json")], "pipelines.measure_costs"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["--config", str(ROOT / "configs" / "benchmark-smoke.yaml"), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and "Traceback" not in err, err


def test_fewer_prompts_than_asked_are_named(caplog):
    """A config asking for more prompts than its sources hold in the split runs those and says how many."""
    from benchmark.bench import load_benchmark_prompts
    from compute.models import ModelSpec, load_model

    _, tok = load_model(ModelSpec("tiny:1"))
    cfg = BenchmarkConfig(prompt_texts=["def f():", "hello"], n_prompts=5, split=None)
    with caplog.at_level("WARNING"):
        ids, names, _ = load_benchmark_prompts(cfg, tok)
    assert len(ids) == 2 and "n_prompts=5 asked, but the sources hold 2 prompts" in caplog.text


def test_paired_bootstrap_interval_brackets_the_ratio():
    import numpy as np

    from benchmark.rows import Row, ratio_ci

    base = Row("t", "m", seconds=[1.0, 2.0, 1.0, 3.0], outputs=[[0] * 10, [0] * 20, [0] * 10, [0] * 30])
    fast = Row("f", "m", seconds=[0.5, 1.0, 0.6, 1.4], outputs=base.outputs)
    boot = np.random.default_rng(0).integers(0, 4, (500, 4))
    point, lo, hi = ratio_ci(fast, base, boot)
    assert point == pytest.approx(7.0 / 3.5) and lo <= point <= hi and lo > 1.5
    same, lo, hi = ratio_ci(base, base, boot)
    assert same == lo == hi == pytest.approx(1.0)


def test_rows_repeat_in_shuffled_order_and_take_out_each_passs_slow_phase():
    """repeats = 2: every row twice a prompt, each pass in its seeded order; per prompt every run's seconds are kept and
    each row's seconds are their pass-adjusted median (a pass all rows ran slower in counts as the fast one); the
    fastest run's outputs are kept, the first's when they differ (that run's seconds dropped); the reference row runs
    once."""
    from benchmark.bench import Bench, DecodeSettings, RunOrder
    from benchmark.plan import run_rows
    from benchmark.rows import Row

    calls: list[tuple[int, str]] = []
    times = {("target-only", 0): [2.0, 1.0], ("a", 0): [4.0, 2.0], ("a", 1): [1.0, 2.0], ("b", 0): [2.0, 1.0],
             ("b", 1): [1.0, 1.0]}

    def runner(name: str, reference: bool = False, outputs: Callable[[int], list[int]] = lambda k: [1, 2]):
        def run(view: Bench) -> Row:
            k = sum(1 for j, n in calls if j == view.offset and n == name)
            calls.append((view.offset, name))
            secs = times.get((name, view.offset), [1.0, 1.0])[k]
            return Row(name, "engine", seconds=[secs], outputs=[outputs(k)], reference=reference)
        return run

    plan = [("target-only", runner("target-only")), ("a", runner("a")),
            ("b", runner("b", outputs=lambda k: [k])), ("ref", runner("ref", reference=True))]
    cfg = BenchmarkConfig(repeats=2, curve_probes=False, n_prompts=2)
    bench = Bench(DecodeSettings.of(cfg), None, None, None, None, prompts=[[1], [2]], eos=[0])  # type: ignore[arg-type]
    rows = {r.name: r for r in run_rows(plan, bench, RunOrder.of(cfg))}
    first = [n for j, n in calls if j == 0]
    assert first[0] == "target-only" and sorted(first[:4]) == ["a", "b", "ref", "target-only"]
    assert sorted(first[4:]) == ["a", "b", "target-only"]  # the reference row runs once
    assert rows["a"].pass_seconds == [[4.0, 2.0], [1.0, 2.0]] and rows["ref"].pass_seconds == [[1.0], [1.0]]
    assert rows["b"].pass_seconds == [[2.0, None], [1.0, None]] and rows["b"].outputs == [[0], [0]]  # outputs differ
    # prompt 0: target-only and a ran twice as slow in pass 1 as in pass 2; every row is priced at pass 2's pace, the
    # rows that ran once in pass 1 (b, whose second output differed, and the reference) too
    got = [rows[n].seconds[0] for n in ("target-only", "a", "b", "ref")]
    assert got == pytest.approx([1.0, 2.0, 1.0, 0.5])
    assert "2 runs" in rows["target-only"].note and "slow phase" in rows["target-only"].note


def test_pass_order_is_seeded_puts_target_only_first_and_never_runs_a_row_twice_in_a_row():
    """Each pass is a shuffle seeded by its decode and pass (a resumed run repeats it), target-only first in the
    first pass, the previous pass's last row never first; over many decodes every row opens a pass."""
    from benchmark.plan import pass_order

    rows = [(n, None) for n in ("target-only", "svip", "adaedl", "disco", "goodput")]
    openers = set()
    for decode in range(40):
        last = None
        for r in range(3):
            order = [n for n, _ in pass_order(rows, decode, r, last)]  # type: ignore[arg-type]
            assert sorted(order) == sorted(n for n, _ in rows) and order[0] != last
            assert order == [n for n, _ in pass_order(rows, decode, r, last)]  # type: ignore[arg-type]
            if r == 0:
                assert order[0] == "target-only"
            else:
                openers.add(order[0])
            last = order[-1]
    assert openers == {n for n, _ in rows}


def test_smoke_run(tmp_path, tiny_pair):
    from compute.models import model_fingerprint
    from predictors.baselines import SVIP
    from predictors.export import export_predictor
    from predictors.inputs import FeatureSpec
    from predictors.sprinter import SprinterNet, SprinterPolicy
    from tests.synthetic import make_records, write_shards

    draft, _, tok = tiny_pair
    write_shards(tmp_path / "data", make_records(n_prompts=20, tokens_per_prompt=20, hidden_size=0, companion=False))
    sprinter = SprinterPolicy(SprinterNet(draft.config.hidden_size), FeatureSpec.for_sprinter(draft.config.hidden_size),
                              threshold=0.5, max_draft_len=6)
    export_predictor(sprinter, tmp_path / "sprinter", {"draft_fingerprint": model_fingerprint(draft, tok)})
    export_predictor(SVIP(0.99), tmp_path / "svip-export", {"draft_fingerprint": model_fingerprint(draft, tok)})
    out = tmp_path / "bench"
    argv = [
        "--config", str(ROOT / "configs" / "benchmark-smoke.yaml"),
        "--out_dir", str(out),
        "--tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--n_prompts", "2",
        "--max_new_tokens", "6",
        "--reference_max_new_tokens", "3",
        "--policies", '["static:3", "svip:0.3", "oracle", "hfp:svip:0.3", "static:best", "adaedl:tuned", "svip:tuned"]',
        "--tune_data_dir", str(tmp_path / "data"), "--max_static", "4",
        "--predictors", json.dumps([str(tmp_path / "sprinter"), str(tmp_path / "svip-export")]),
        "--hf_rows", '["static:3", "recommended"]',
        "--results_dir", str(tmp_path / "results"),
    ]
    result = main(argv)
    from rendering.result_store import load_summaries  # the run's summary, as pipelines.results renders it

    (stored,) = load_summaries(tmp_path / "results")
    assert stored.kind == "benchmark" and stored.data["n_prompts"] == 2 and len(stored.data["rows"]) == len(
        result["rows"])
    names = [r["row"] for r in result["rows"]]
    assert names[:3] == ["target-only", "hf:static:3", "hf:recommended"] and names[-1] == "target-only (eager)"
    assert {"static:3", "svip:0.3", "oracle", "hfp:svip:0.3"} <= set(names)
    tuned = [n for n in names if n.endswith(("(val-best)", "(val-tuned)"))]
    assert len(tuned) == 3 and tuned[0].startswith("static:") and tuned[1].startswith("adaedl:"), names
    assert tuned[2].startswith("svip:"), names
    rows = {r["row"]: r for r in result["rows"]}
    assert rows["hf:recommended"]["exact"] is True and "num_assistant_tokens=" in rows["hf:recommended"]["note"]
    from decoding.policies import build_policy

    for name in tuned[1:]:  # a tuned row's label is the spec that builds it again (svip's takes h = 1 - threshold)
        assert build_policy(name.split(" ")[0]).threshold == pytest.approx(rows[name]["threshold"], abs=2e-3), name
    for name in ("hf:static:3", "static:3", "svip:0.3", "oracle", "hfp:svip:0.3", *tuned):
        assert rows[name]["exact"] is True and rows[name]["tokens_per_s"] > 0, name
        assert rows[name]["speedup_lo"] <= rows[name]["speedup"] <= rows[name]["speedup_hi"]
        assert len(rows[name]["prompt_seconds"]) == 2  # rows side by side, one prompt at a time, merged
    ref = rows["target-only (eager)"]
    assert ref["exact"] is None and ref["prompt_tokens"] == [3, 3] and "3 new tokens" in ref["note"]
    assert "look-ahead read from target-only's output" in rows["oracle"]["note"]  # greedy oracle: measured time
    assert len(rows["static:3"]["prefill_seconds"]) == 2
    assert "2 runs" in rows["target-only"]["note"]  # repeats 2: before and after the other rows
    assert len(rows["static:3"]["records"]["pass_seconds"]) == 2  # each prompt's runs stored
    assert rows["hf:static:3"]["mean_accepted"] is not None and rows["hf:static:3"]["wasted_per_token"] >= 0
    assert rows["static:3"]["vs_best_entropy"] is not None and rows["target-only"]["vs_best_entropy"] is None
    spr = [r for r in result["rows"] if r["row"].startswith("sprinter")][0]
    assert spr["rouge_l"] is not None and "approximate" in spr["note"]
    assert "val-tuned" not in spr["row"] and spr["threshold"] is None  # no draft_hidden to tune on: the export's
    exported = [r for r in result["rows"] if r["row"].startswith("svip (svip-export, val-tuned")]
    assert len(exported) == 1 and exported[0]["threshold"] is not None  # a thresholded export, tuned on val here
    assert "target verification curve" in (out / "benchmark.md").read_text()
    for f in ("benchmark.md", "benchmark.json", "speedup.png", "config.yaml", "cost_model.json"):
        assert (out / f).is_file(), f
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["max_new_tokens"] == 6
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["specstop-benchmark"])
    assert len(runs) == 1 and "metrics.static_3/speedup" in runs.columns


def test_the_settings_read_the_configs_fields_of_their_names():
    """DecodeSettings and RunOrder are built only from the benchmark config: each field is the config's field of the
    same name, with no default of its own."""
    from dataclasses import MISSING, fields

    from benchmark.bench import DecodeSettings, RunOrder

    cfg = BenchmarkConfig(max_new_tokens=7, temperature=0.5, top_p=0.9, seed=3, max_draft_len=5, top_k_features=4,
                          batch_size=2, order="row", force=True, repeats=3, curve_probes=False)
    for cls in (DecodeSettings, RunOrder):
        missing = [f.name for f in fields(cls) if f.name not in BenchmarkConfig.__dataclass_fields__]
        assert not missing, f"{cls.__name__} reads {missing}, which BenchmarkConfig does not have"
        assert all(getattr(cls.of(cfg), f.name) == getattr(cfg, f.name) for f in fields(cls))
        assert all(f.default is MISSING and f.default_factory is MISSING for f in fields(cls)), cls
