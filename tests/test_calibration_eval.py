"""Calibration in the evaluation: maps fitted on val for every predictor and training-free score, ECE on test, the
cost-aware (goodput) replay rows, the reliability and expected-vs-measured plots, maps stored in the exports, the main
job's rows, and ``python -m pipelines.calibrate`` on an existing export."""
from __future__ import annotations

import json

import numpy as np
import pytest

from decoding.policies import build_policy
from pipelines.calibrate import main as calibrate_main
from pipelines.evaluate import EvaluateConfig, cost_aware_rows, run_evaluation, store_calibrations
from predictors.export import export_predictor, read_metadata
from predictors.goodput import GoodputPolicy, MissingCalibration
from tests.synthetic import make_records, with_sample_draw, write_shards
from tests.test_report import TopProb


@pytest.fixture(scope="module")
def two_draws(tmp_path_factory):
    folder = tmp_path_factory.mktemp("two")
    recs = make_records(n_prompts=60, tokens_per_prompt=30, hidden_size=0, companion=False)
    recs["origin"] = np.array(["target"] * len(recs["origin"]))
    recs["rollout"] = np.zeros(len(recs["rollout"]), dtype=bool)
    write_shards(folder, with_sample_draw(recs))
    (folder / "cost_model.json").write_text(json.dumps({
        "draft_s_per_token": 0.02, "target_s": {"1": 0.1, "4": 0.1, "5": 0.2, "8": 0.2, "9": 0.4}}))
    return folder


def test_evaluation_calibrates_and_replays_goodput_rows(two_draws, tmp_path):
    cfg = EvaluateConfig(data_dir=str(two_draws), out_dir=str(tmp_path / "ev"), n_boot=0, tracking=False,
                         tune_thresholds=True, static_lengths=[1, 2, 3, 4])
    res = run_evaluation(cfg, policies={"top": TopProb(0.6)})
    table = res["calibration"].table
    assert {"top", "max-prob", "draft-prob", "svip", "adaedl-bound"} <= set(table["policy"])
    assert set(table["mode"]) == {"greedy", "sampling"}
    assert (table["ece"] < 0.08).all()  # small synthetic test split; the maps are fitted on val
    top = table[(table["policy"] == "top") & (table["mode"] == "greedy")]
    assert float(top["ece"].iloc[0]) < float(top["ece_raw"].iloc[0])  # the raw top-1 probability is miscalibrated
    rep = res["replay"]
    gp = rep[rep["policy"] == "top (goodput)"]
    assert set(gp["mode"]) == {"greedy", "sampling"} and (gp["speedup"] > 0).all() and (gp["reason"] == "").all()
    assert (gp["expected_per_round"] > 1).all()
    plots = tmp_path / "ev" / "plots"
    assert (plots / "reliability.png").is_file() and (plots / "expected_vs_measured.png").is_file()
    md = res["report"].read_text()
    assert "## Calibrated acceptance" in md and "expected_vs_measured.png" in md
    assert any(k.startswith("ece/greedy/") for k in res["metrics"])

    # maps into the exports and the training-free scores exported calibrated; goodput: loads them
    export = export_predictor(StopPolicyExportable(), tmp_path / "svip-export", {})
    written = store_calibrations(res, {"svip": export}, tmp_path / "calibrated")
    assert set(read_metadata(export)["calibration"]) == {"greedy", "sampling"}
    assert (tmp_path / "calibrated" / "max_confidence" / "predictor.json").is_file() and "max-prob" in written
    pol = build_policy("goodput:max_confidence", calibration_dir=tmp_path / "calibrated")
    assert isinstance(pol, GoodputPolicy)
    pol.use_mode("sampling")

    rows = cost_aware_rows(res, ["top"])
    assert rows["top (goodput)"]["label"] == "cost-aware" and rows["top (goodput)"]["test_speedup"] > 0
    assert "ece_greedy" in rows["top"] and any("best training-free" in r.get("label", "") for r in rows.values())


def StopPolicyExportable():  # noqa: N802  (an exportable training-free policy)
    from predictors.baselines import SVIP

    return SVIP(0.3)


def test_calibrate_command_on_an_existing_export(two_draws, tmp_path, capsys):
    from predictors.baselines import MaxConfidence

    folder = export_predictor(MaxConfidence(0.4), tmp_path / "mc", {})
    with pytest.raises(MissingCalibration, match="pipelines.calibrate"):
        build_policy(f"goodput:{folder}")
    out = calibrate_main(["--data_dir", str(two_draws), "--predictor", str(folder)])
    assert set(out["maps"]) == {"greedy", "sampling"} and (out["table"]["ece"] < 0.08).all()
    assert "goodput:" in capsys.readouterr().out
    assert isinstance(build_policy(f"goodput:{folder}"), GoodputPolicy)
    named = calibrate_main(["--data_dir", str(two_draws), "--predictor", "svip", "--out_dir", str(tmp_path / "sv"),
                            "--method", "platt"])
    assert read_metadata(named["folder"])["calibration"]["greedy"]["method"] == "platt"
