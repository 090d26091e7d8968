"""Report and the evaluation (``evaluation.evaluate``, ``python -m pipelines.evaluate``): the Markdown report and
PNG plots appear, the CLI (YAML config + MLflow logging) runs on synthetic shards, thresholds are tuned on val, and a
predictor for another draft model is refused."""
from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
import pytest
from torch import Tensor

from compute.timing import CostModel
from evaluation.classification import score_table, sprinter_table
from evaluation.data import draft_fingerprint, load_columns
from evaluation.evaluate import EvaluateConfig, run_evaluation
from evaluation.replay import ReplayConfig, replay_table
from evaluation.report import ReportInputs, write_report
from pipelines.evaluate import main
from predictors.base import StopPolicy
from tests.synthetic import make_records, write_shards

PNGS = ("roc.png", "threshold_speedup.png", "oracle_len_hist.png", "accept_vs_entropy.png")


class TopProb(StopPolicy):
    """A hand-written 'learned' policy: keep drafting while the top-1 draft probability is high."""

    kind = "top_prob"
    required_columns = ("draft_max_prob",)

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features["draft_max_prob"].float()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    write_shards(folder, make_records(n_prompts=40, tokens_per_prompt=20, hidden_size=8))
    (folder / "config.json").write_text(json.dumps(
        {"resolved": {"fingerprints": {"draft": {"name": "tiny:1", "vocab_size": 260, "hidden_size": 32}}}}))
    return folder


def test_write_report(tmp_path):
    cols = make_records(n_prompts=12, tokens_per_prompt=20, hidden_size=0, companion=False)
    pols = {"top": TopProb(0.6)}
    cm = CostModel(draft_s_per_token=0.02, target_s={1: 0.1, 41: 0.2})
    cls = score_table(cols, pols, n_boot=5)
    rep, sw = replay_table(cols, pols, cm, ReplayConfig(origins=None))
    sw.insert(1, "mode", "greedy")
    path = write_report(tmp_path / "r", ReportInputs(classification=cls, replay=rep, sweep=sw,
                                                     sprinter=sprinter_table(cols, pols), cost_model=cm, columns=cols,
                                                     policies=pols, command="python -m x"), tracking=False)
    text = path.read_text()
    for heading in ("## Classification", "## SPRINTER", "## Offline replay", "## Plots", "python -m x",
                    "label: greedy match"):
        assert heading in text
    assert "| top |" in text and "oracle" in text
    for png in PNGS:
        f = tmp_path / "r" / "plots" / png
        assert f.is_file() and f.stat().st_size > 1000 and f"plots/{png}" in text
    for csv in ("classification.csv", "replay.csv", "sweep.csv", "sprinter.csv", "cost_model.json"):
        assert (tmp_path / "r" / csv).is_file()
    # no cost model: the report says speedups are unavailable
    text = write_report(tmp_path / "n", ReportInputs(classification=cls, cost_model=None, columns=cols),
                        tracking=False).read_text()
    assert "speedups unavailable" in text


def test_load_columns_and_fingerprint(shards):
    cols = load_columns(shards, ["test"], extra_columns=("draft_hidden",))
    assert set(np.unique(cols["split"])) == {"test"}
    assert cols["draft_topk"].ndim == 2 and cols["draft_hidden"].shape[1] == 8
    assert draft_fingerprint(shards)["name"] == "tiny:1"


def test_run_evaluation_with_policies_and_tuning(shards, tmp_path):
    cfg = EvaluateConfig(data_dir=str(shards), out_dir=str(tmp_path / "ev"), n_boot=5, tracking=False,
                         tune_thresholds=True, assume_cost_model=True, static_lengths=[1, 2, 3])
    res = run_evaluation(cfg, policies={"top": TopProb(0.6)})
    assert res["report"].is_file()
    assert "top" in res["tuned"] and res["tuned"]["top"][1] > 0
    assert "top (val-tuned)" in set(res["replay"]["policy"])
    assert set(res["replay"]["mode"]) == {"greedy", "sampling"}
    assert any("ASSUMED" in n for n in res["notes"])
    assert "auc/greedy match/top" in res["metrics"]
    assert (tmp_path / "ev" / "evaluate_config.json").is_file()


def test_cli_with_yaml_and_mlflow(shards, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    (tmp_path / "cm.json").write_text(CostModel(0.02, {1: 0.1, 41: 0.2}).to_json())
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(f"data_dir: {shards}\nout_dir: {tmp_path / 'out'}\nn_boot: 3\nreplay_modes: [greedy]\n"
                   f"static_lengths: [1, 2]\ncost_model: {tmp_path / 'cm.json'}\n")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    res = main(["--config", str(cfg), "--tracking_uri", uri, "--experiment", "test-eval"])
    assert (tmp_path / "out" / "report.md").is_file()
    assert "cost model from" in " ".join(res["notes"])
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=["test-eval"], output_format="list")
    assert len(runs) == 1
    arts = [a.path for a in mlflow.artifacts.list_artifacts(run_id=runs[0].info.run_id, artifact_path="evaluation")]
    assert "evaluation/report.md" in arts
    assert any(k.startswith("eval/speedup/") for k in runs[0].data.metrics)


def test_predictor_for_other_draft_is_refused(shards, tmp_path):
    from predictors.baselines import StaticLength
    from predictors.export import export_predictor

    folder = export_predictor(StaticLength(3), tmp_path / "pred",
                              {"draft_fingerprint": {"name": "other-draft", "vocab_size": 999, "hidden_size": 7}})
    cfg = EvaluateConfig(data_dir=str(shards), out_dir=str(tmp_path / "ev"), predictors=[str(folder)], n_boot=0,
                         tracking=False, replay_modes=["greedy"])
    with pytest.raises(ValueError, match="other-draft"):
        run_evaluation(cfg)
    cfg.skip_refused = True
    res = run_evaluation(cfg)
    assert any("NOT evaluated" in n for n in res["notes"])
    table = res["classification"]
    row = table[(table["policy"] == "pred") & (table["group_by"] == "all")]
    assert (row["reason"] == "policy not loaded").all()


def test_evaluation_scores_each_label_on_its_draw(tmp_path):
    """Greedy match is scored on the argmax draws, q/p <= lambda and min(1, p/q) on the sampled ones; replay follows the
    greedy rollouts; draft-prob (q(x)) differs from max-prob only on sampled draws."""
    from tests.synthetic import with_sample_draw

    both = with_sample_draw(make_records(n_prompts=30, tokens_per_prompt=20, hidden_size=0))
    write_shards(tmp_path / "two", both)
    cfg = EvaluateConfig(data_dir=str(tmp_path / "two"), out_dir=str(tmp_path / "eval"), n_boot=0, tracking=False,
                         label_specs=[("greedy", 1.0), ("ratio", 1.2)], assume_cost_model=True)
    res = run_evaluation(cfg)
    head = res["classification"][res["classification"]["group_by"] == "all"]
    n_test = int(((both["split"] == "test") & (both["draw"] == "greedy")).sum())
    by_label = {lab: g for lab, g in head.groupby("label")}
    assert set(by_label["greedy match"]["draw"]) == {"greedy"} and set(by_label["q/p<=1.2"]["draw"]) == {"sample"}
    assert set(by_label["greedy match"]["n"]) == {n_test} and set(by_label["q/p<=1.2"]["n"]) == {n_test}
    g, s = by_label["greedy match"].set_index("policy"), by_label["q/p<=1.2"].set_index("policy")
    assert g.loc["draft-prob", "auc"] == pytest.approx(g.loc["max-prob", "auc"])
    assert s.loc["draft-prob", "auc"] != pytest.approx(s.loc["max-prob", "auc"])
    assert any("two draws" in n for n in res["notes"])
