"""The benchmark's replay check on tiny models: in greedy mode on an exact path the replay follows the engine's own
trajectory (same rounds, drafted and accepted tokens) for static, thresholded, online and cost-aware policies; the
cost-aware row's interval against the best thresholded one; the standalone entry point and its bad input."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmark.tracking import metric_key
from pipelines.benchmark import main as benchmark_main
from pipelines.replay_check import main as check_main

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
SAME = ("mean_accepted", "mean_drafted", "rounds")


def calibrated_max_confidence(folder: Path) -> str:
    """An exported max-confidence score with identity maps (acceptance = top-1 probability), for goodput:."""
    from predictors.baselines import MaxConfidence
    from predictors.calibration import Calibrator
    from predictors.export import export_predictor, update_metadata

    out = export_predictor(MaxConfidence(0.4), folder, {})
    ident = Calibrator("isotonic", [0.0, 1.0], [0.0, 1.0], label="greedy match").to_dict()
    update_metadata(out, calibration={"greedy": ident})
    return str(out)


def random_sprinter(folder: Path, tiny_pair) -> str:
    """An exported SPRINTER verifier of random weights on the tiny draft's hidden state (approximate decoding)."""
    from compute.models import model_fingerprint
    from predictors.export import export_predictor
    from predictors.inputs import FeatureSpec
    from predictors.sprinter import SprinterNet, SprinterPolicy

    draft, _, tok = tiny_pair
    torch.manual_seed(0)
    h = draft.config.hidden_size
    pol = SprinterPolicy(SprinterNet(h), FeatureSpec.for_sprinter(h), threshold=0.45, max_draft_len=8)
    return str(export_predictor(pol, folder, {"draft_fingerprint": model_fingerprint(draft, tok)}))


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, tiny_pair):
    """One benchmark of the tiny pair that agrees on about 70% of tokens, on the exact eager path, with the check."""
    from tests.synthetic import make_records, write_shards

    tmp = tmp_path_factory.mktemp("replay_check")
    write_shards(tmp / "data", make_records(n_prompts=20, tokens_per_prompt=20, hidden_size=0, companion=False))
    policies = ["static:3", "svip:0.6", "max_confidence_fixed:0.1", "heuristic", "adaedl:tuned", "oracle",
                f"goodput:{calibrated_max_confidence(tmp / 'maxconf')}"]
    argv = [
        "--config", str(ROOT / "configs" / "benchmark-smoke.yaml"), "--out_dir", str(tmp / "bench"),
        "--models.target", "tiny:2:32:3", "--models.compute", "eager", "--reference_compute", "null",
        "--prompt_texts", json.dumps(["def add(a, b):", "Write a haiku about the sea.", "hello world"]),
        "--n_prompts", "3", "--max_new_tokens", "24", "--max_draft_len", "8", "--hf_rows", '["static:3"]',
        "--policies", json.dumps(policies), "--tune_data_dir", str(tmp / "data"),
        "--predictors", json.dumps([random_sprinter(tmp / "sprinter", tiny_pair)]),
        "--tracking_uri", f"sqlite:///{tmp / 'mlflow.db'}", "--replay_check", "true", "--hf_curve", "true",
    ]
    return tmp, benchmark_main(argv)


def test_replay_follows_the_engine_for_static_thresholded_and_cost_aware_policies(bench_run):
    tmp, result = bench_run
    out = tmp / "bench"
    report = json.loads((out / "benchmark.json").read_text())
    check = report["replay_check"]
    rows = {r["row"]: r for r in check["rows"]}
    engine = [r["row"] for r in report["rows"] if r["method"] == "engine"]
    assert sorted(rows) == sorted([*engine, "hf:static:3"]) and "target-only" not in rows
    assert check["mode"] == "greedy" and check["rollouts"] > 0 and check["rollout_len"] == 32  # transformers' cap
    followed = [name for name, r in rows.items() if not r["note"]]
    assert len(followed) == 9 and any(n.endswith("(val-tuned)") for n in followed) and "oracle" in followed
    assert any(n.startswith("goodput") for n in followed)
    for name in followed:  # the same trajectory: same rounds, drafted and accepted tokens
        r = rows[name]
        for k in SAME:
            assert r[f"predicted_{k}"] == pytest.approx(r[f"measured_{k}"], abs=1e-3), (name, k)
        assert r["ratio"] == pytest.approx(r["predicted_tokens_per_s"] / r["measured_tokens_per_s"], rel=1e-2)
        assert r["predicted_tokens_per_s"] > 0 and r["curve_tokens_per_s"] > 0
    # priced with the curve probed between the prompts (one probe a prompt), not the one measured before the rows;
    # the transformers row with transformers' own curve, measured before the rows
    assert check["cost_model"] == str(out / "cost_model_rows.json")
    hf = json.loads((out / "cost_model.transformers.json").read_text())
    assert check["hf_cost_model"] == str(out / "cost_model.transformers.json") and hf["runtime"] == "transformers"
    assert next(r for r in report["rows"] if r["row"] == "hf:static:3")["spec"] == "transformers:3,constant,0.0"
    pooled = json.loads((out / "cost_model_rows.json").read_text())
    assert pooled["extra"]["pooled_measurements"] == 3 and pooled["extra"]["statistic"] == "mean"
    assert len({rows[n]["measured_mean_drafted"] for n in followed}) > 2  # policies that draft differently
    s = check["summary"]
    assert s["rows_scored"] == len(rows) and s["worst_row"] in rows and 0 <= s["within_band"] <= len(rows)
    # the same rounds priced by the curve, against the best entropy bound (SVIP, AdaEDL) by that measure
    kinds = {r["row"]: r["kind"] for r in report["rows"]}
    entropy = [r["curve_vs_best_entropy"] for n, r in rows.items() if kinds[n] in ("svip", "adaedl")]
    assert max(entropy) == 1.0 and all(r["curve_vs_best_entropy"] > 0 for r in rows.values())
    best = max((r for n, r in rows.items() if n != "oracle"), key=lambda r: r["curve_vs_best_entropy"])
    assert s["best_curve_row"] == best["row"] and s["best_curve_vs_best_entropy"] == best["curve_vs_best_entropy"]
    md = (out / "replay_check.md").read_text()
    assert md.count("## Replay check") == 1 and "replay check: worst |predicted/measured - 1|" in md
    assert "## Replay check" not in (out / "benchmark.md").read_text()
    assert (out / "replay_check.png").is_file() and result["stats"]["replay_check"]["summary"] == s


def test_an_approximate_row_is_replayed_along_its_own_output(bench_run):
    """SPRINTER takes a round's drafts unverified, so its output leaves target-only's; labelled along its own output
    (kept in benchmark.json), the replay follows its rounds exactly."""
    tmp, _ = bench_run
    out = tmp / "bench"
    report = json.loads((out / "benchmark.json").read_text())
    bench = {r["row"]: r for r in report["rows"]}
    name = next(n for n in bench if n.startswith("sprinter"))
    assert bench[name]["exact"] is False and bench[name]["output_ids"] != bench["target-only"]["output_ids"]
    assert all("output_ids" not in r for n, r in bench.items() if n not in (name, "target-only"))
    r = next(r for r in report["replay_check"]["rows"] if r["row"] == name)
    assert not r["note"] and r["measured_rounds"] > 3
    for k in SAME:
        assert r[f"predicted_{k}"] == pytest.approx(r[f"measured_{k}"], abs=1e-3), k
    assert list(out.glob("replay_check_records-sprinter*.npz"))


def test_cost_aware_rows_get_the_interval_against_the_best_thresholded_row(bench_run, capsys):
    tmp, result = bench_run
    rows = {r["row"]: r for r in result["rows"]}
    thresholded = [n for n, r in rows.items() if r["thresholded"]]
    assert thresholded and not any(rows[n]["kind"] in ("static", "heuristic", "oracle") for n in thresholded)
    best = max(thresholded, key=lambda n: rows[n]["tokens_per_s"])
    (goodput,) = [r for r in result["rows"] if r["verification"] == "goodput"]
    assert goodput["vs_best_thresholded_lo"] <= goodput["vs_best_thresholded"] <= goodput["vs_best_thresholded_hi"]
    assert goodput["vs_best_thresholded"] == pytest.approx(goodput["tokens_per_s"] / rows[best]["tokens_per_s"],
                                                           rel=1e-2)
    assert all(r["vs_best_thresholded"] is None for r in result["rows"] if r["verification"] != "goodput")
    md = (tmp / "bench" / "benchmark.md").read_text()
    assert "vs_best_thresholded" in md and f"best thresholded {best}" in md
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["specstop-benchmark"])
    assert "metrics.static_3/replay_ratio" in runs.columns
    assert f"metrics.{metric_key(goodput['row'])}/vs_best_thresholded" in runs.columns
    art = mlflow.artifacts.list_artifacts(run_id=runs["run_id"].iloc[0])
    assert "replay_check.png" in {Path(a.path).name for a in art}


def test_prediction_adds_each_rows_prefill_to_the_curves_decoding_time():
    from benchmark.check import predicted_tokens_per_s

    row = {"tokens": 100, "prefill_seconds": [1.5, 1.5]}
    # 100 tokens at 0.05 s each under the curve -> 5 s, plus the row's 3 s of prefill
    assert predicted_tokens_per_s(row, 0.05) == pytest.approx(100 / 8.0)
    assert predicted_tokens_per_s({"tokens": 100}, 0.05) == pytest.approx(20.0)  # a row without prefill times


def test_the_check_sets_realised_step_costs_beside_the_curve():
    from benchmark.check import compare_row
    from compute.timing import CostModel

    cm = CostModel(draft_s_per_token=0.05, target_s={1: 0.1, 8: 0.2})
    row = {"row": "static:5", "rounds": 10, "accepted": 30, "draft_tokens": 50, "tokens_per_s": 5.0,
           "draft_ms_per_step": 60.0, "verify_ms_per_pass": 180.0, "verify_mean_tokens": 6.0,
           "verify_lengths": {"6": 4}}
    out = compare_row(row, None, "", cm)
    assert out["measured_draft_ms"] == 60.0 and out["curve_draft_ms"] == 50.0
    assert out["measured_verify_ms"] == 180.0
    assert out["curve_verify_ms"] == pytest.approx(1000 * cm.target_time(6.0), abs=0.01)


def test_console_table_fits_100_columns():
    from benchmark.report import console_table

    row = {"row": "goodput-disco (a very long export folder name, calibrated)", "tokens_per_s": 8.317,
           "identical_prompts": 8}
    for c in ("speedup", "vs_best_entropy", "vs_best_thresholded"):
        row.update({c: 1.791, f"{c}_lo": 1.531, f"{c}_hi": 2.114})
    text = console_table([row, {**row, "row": "target-only"}], 8)
    assert max(len(x) for x in text.splitlines()) <= 100 and "~" in text and "8/8" in text


def test_standalone_check_on_a_finished_benchmark(bench_run, capsys):
    tmp, _ = bench_run
    before = json.loads((tmp / "bench" / "benchmark.json").read_text())["replay_check"]
    again = check_main(["--bench_dir", str(tmp / "bench"), "--tracking", "false"])
    assert [r["row"] for r in again["rows"]] == [r["row"] for r in before["rows"]]
    for a, b in zip(again["rows"], before["rows"]):  # the same records and replay: the same predictions
        assert (a["predicted_tokens_per_s"], a["predicted_mean_drafted"]) == (
            b["predicted_tokens_per_s"], b["predicted_mean_drafted"])
    out = capsys.readouterr().out
    assert "replay check: worst" in out and max(len(x) for x in out.splitlines()) <= 100
    assert (tmp / "bench" / "replay_check.md").read_text().count("## Replay check") == 1
    assert (tmp / "bench" / "replay_check_records.npz").is_file()  # the second check reused the first's records
    # the pooled probes' curve is their mean; --statistic resummarises its raw timings
    fastest = check_main(["--bench_dir", str(tmp / "bench"), "--tracking", "false", "--statistic", "min"])
    assert fastest["statistic"] == "min" and again["statistic"] == "mean"
    assert [r["measured_tokens_per_s"] for r in fastest["rows"]] == [r["measured_tokens_per_s"] for r in again["rows"]]


def test_pooled_probes_give_the_mean_of_their_raw_timings():
    """The mean (a row's total time is a sum of steps: its expectation on a host whose speed moves), or another
    statistic when asked."""
    from compute.timing import CostModel, pool_cost_models

    def probe(scale: float) -> CostModel:
        raw = {"draft_raw_s": [0.010 * scale], "target_raw_s_L1": [0.050 * scale], "target_raw_s_L2": [0.060 * scale]}
        return CostModel(draft_s_per_token=0.010 * scale, target_s={1: 0.050 * scale, 2: 0.060 * scale}, extra=raw)

    probes = [probe(1.0), probe(1.5), probe(1.2)]
    pooled = pool_cost_models(probes)
    assert pooled.draft_s_per_token == pytest.approx(0.037 / 3) and pooled.target_s[1] == pytest.approx(0.185 / 3)
    assert pooled.target_s[2] == pytest.approx(0.074) and pooled.extra["pooled_measurements"] == 3
    assert pooled.extra["statistic"] == "mean"
    assert pool_cost_models(probes, "median").target_s[1] == pytest.approx(0.060)
    with pytest.raises(ValueError, match="no cost models"):
        pool_cost_models([])
    with pytest.raises(ValueError, match="no raw timings"):
        pool_cost_models([CostModel(draft_s_per_token=0.01, target_s={1: 0.05, 2: 0.06})])


def test_cost_model_summarised_by_another_statistic():
    from compute.timing import CostModel

    raw = {"draft_raw_s": [0.05, 0.07, 0.06], "target_raw_s_L1": [0.1, 0.3, 0.2], "target_raw_s_L2": [0.1, 0.12, 0.5]}
    cm = CostModel(draft_s_per_token=0.05, target_s={1: 0.1, 2: 0.1}, extra=raw)
    med = cm.with_statistic("median")
    assert med.draft_s_per_token == pytest.approx(0.06) and med.extra["statistic"] == "median"
    assert med.target_s == {1: pytest.approx(0.12), 2: pytest.approx(0.12)}  # made non-decreasing in L again
    assert cm.with_statistic("mean").target_s == {1: pytest.approx(0.2), 2: pytest.approx(0.24)}
    with pytest.raises(ValueError, match="no raw timings"):
        CostModel(draft_s_per_token=0.05, target_s={1: 0.1, 2: 0.1}).with_statistic("median")
    with pytest.raises(ValueError, match="min, median, mean"):
        cm.with_statistic("p90")


def test_bad_bench_dir_is_named(tmp_path, capsys):
    """A folder without benchmark.json, or whose benchmark.json has no target-only row: one line naming it."""
    (tmp_path / "empty").mkdir()
    no_base = tmp_path / "no_base"
    no_base.mkdir()
    (no_base / "benchmark.json").write_text(json.dumps({"rows": [{"row": "static:3", "method": "engine"}]}))
    for folder, words in ((tmp_path / "empty", "benchmark.json: no such file"), (no_base, "no 'target-only' row"),
                          (tmp_path / "nowhere", "no such folder")):
        with pytest.raises(SystemExit) as e:
            check_main(["--bench_dir", str(folder), "--tracking", "false"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err and str(folder) in err and "Traceback" not in err, err


def test_a_failing_check_keeps_the_benchmarks_results(tmp_path, caplog):
    """Inside the benchmark the check is a last, optional phase: a failure is logged with the command that reruns it."""
    from benchmark.bench import Bench, DecodeSettings
    from benchmark.config import BenchmarkConfig
    from benchmark.run import run_replay_check

    bench = Bench(DecodeSettings.of(BenchmarkConfig()), None, None, None, None, [[1, 2]], [0])  # type: ignore[arg-type]
    assert run_replay_check(bench, tmp_path, BenchmarkConfig()) is None
    assert f"python -m pipelines.replay_check --bench_dir {tmp_path}" in caplog.text
