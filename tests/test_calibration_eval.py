"""Calibration in the evaluation: maps fitted on val, or cross-fitted over the training prompts, for every predictor
and training-free score, ECE on test, the cost-aware (goodput) replay rows, the reliability and expected-vs-measured
plots, maps stored in the exports, the main job's rows, and ``python -m pipelines.calibrate`` on an existing export."""
from __future__ import annotations

import json

import numpy as np
import pytest

from decoding.policies import build_policy
from evaluation.evaluate import EvaluateConfig, cost_aware_rows, run_evaluation, store_calibrations
from pipelines.calibrate import main as calibrate_main
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
                         tune_thresholds=True, static_lengths=[1, 2, 3, 4], calibration_fit="val")
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


def test_learned_maps_are_cross_fitted_over_the_training_prompts_and_never_see_the_test_split(two_draws, tmp_path):
    """The main job fits a learned predictor's maps on its out-of-fold scores over the train and val prompts: every
    such row scored by a copy trained without its prompt, no test row scored, many more fit tokens than val holds."""
    from data_gen.shards import read_columns
    from evaluation.calibration import cross_fitted_scores
    from predictors.training import DiscoConfig, fit_predictor, make_datamodule

    cfg = DiscoConfig(hidden_size=8, max_epochs=2, patience=1, batch_size=64)
    cols = read_columns(two_draws, ["sample_id", "split", "draft_topk", "position", "draw"], optional=("domain",))
    scores = cross_fitted_scores("disco", cfg, two_draws, tmp_path / "cf", cols, folds=3)
    split = cols["split"].astype(str)
    assert np.isfinite(scores[split != "test"]).all() and np.isnan(scores[split == "test"]).all()
    import predictors.training as training

    def no_training(*a, **k):
        raise AssertionError("cross-fitted scores of the same data and config were trained again")

    with pytest.MonkeyPatch.context() as m:  # kept on disk: a second run trains nothing
        m.setattr(training, "fit_predictor", no_training)
        np.testing.assert_array_equal(cross_fitted_scores("disco", cfg, two_draws, tmp_path / "cf", cols, folds=3),
                                      scores)
    dm = make_datamodule("disco", cfg, two_draws, folds=(3, 0), fold_within=("train", "val"),
                         extra_columns=("sample_id",))
    dm.setup("fit")
    test_ids = set(cols["sample_id"][split == "test"].astype(str))
    for s in ("train", "val", "test"):  # the fold model and its held-out fold: training prompts only
        assert not test_ids & set(dm.raw[s]["sample_id"].astype(str))

    policy, _ = fit_predictor("disco", cfg, two_draws, tmp_path / "final")
    ecfg = EvaluateConfig(data_dir=str(two_draws), out_dir=str(tmp_path / "ev"), n_boot=0, tracking=False)
    res = run_evaluation(ecfg, {"disco": policy}, cross_fit={"disco": ("disco", cfg)}, cross_fit_folds=3)
    table = res["calibration"].table.set_index(["policy", "mode"])
    n_train_val = int(((split != "test") & (cols["draw"].astype(str) == "greedy")).sum())
    assert table.loc[("disco", "greedy"), "n_fit"] == n_train_val == table.loc[("max-prob", "greedy"), "n_fit"]
    assert any("out of fold" in n for n in res["notes"])
    val_only = run_evaluation(EvaluateConfig(data_dir=str(two_draws), out_dir=str(tmp_path / "ev2"), n_boot=0,
                                             tracking=False, calibration_fit="val"), {"disco": policy})
    assert val_only["calibration"].table.set_index(["policy", "mode"]).loc[("disco", "greedy"), "n_fit"] < n_train_val
