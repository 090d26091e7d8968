"""Cross-validation over prompts (folds, out-of-fold scores, paired bootstrap) and predictors that start from a
prior."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import roc_auc_score

from data_gen.prompts import fold_splits
from evaluation.crossval import summarise
from predictors.disco import DiscoNet
from predictors.sprinter import SprinterNet
from predictors.training import DiscoConfig, SprinterConfig, SVTableConfig, fit_predictor
from tests.synthetic import make_records, with_sample_draw, write_shards

FAST = dict(batch_size=128, patience=2, max_epochs=6)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cv-shards")
    write_shards(folder, with_sample_draw(make_records(n_prompts=40, tokens_per_prompt=25, hidden_size=16)))
    return folder


def test_fold_splits_test_every_prompt_once_stratified():
    ids = np.repeat([f"p{i}" for i in range(30)], 4)
    domain = np.repeat(["code" if i < 10 else "chat" for i in range(30)], 4)
    tested = []
    for fold in range(5):
        split = fold_splits(ids, domain, 5, fold)
        for pid in np.unique(ids):
            assert len(set(split[ids == pid])) == 1  # a prompt lands in one split
        test_ids = set(ids[split == "test"])
        assert set(ids[split == "val"]).isdisjoint(test_ids)
        assert len({i for i in test_ids if int(i[1:]) < 10}) == 2  # 10 code prompts over 5 folds: 2 each
        tested += sorted(test_ids)
    assert sorted(tested) == sorted(set(ids))  # each prompt tested exactly once
    assert (fold_splits(ids, domain, 5, 0, seed=1) != fold_splits(ids, domain, 5, 0)).any()
    # learning curve: a share of the training prompts, nested, the same test and val folds, the rest unused
    full, half, quarter = (fold_splits(ids, domain, 5, 0, train_fraction=f) for f in (1.0, 0.5, 0.25))
    for part in (half, quarter):
        np.testing.assert_array_equal(part == "test", full == "test")
        np.testing.assert_array_equal(part == "val", full == "val")
    train_ids = lambda split: set(ids[split == "train"])  # noqa: E731
    assert train_ids(quarter) < train_ids(half) < train_ids(full)
    assert len(train_ids(half)) == 3 + 6  # 6 code and 12 chat training prompts: half of each stratum
    assert set(ids[half == "unused"]) == train_ids(full) - train_ids(half)
    with pytest.raises(ValueError, match="train_fraction=0"):
        fold_splits(ids, domain, 5, 0, train_fraction=0)
    with pytest.raises(ValueError, match="at least 3 folds"):
        fold_splits(ids, domain, 2, 0)
    with pytest.raises(ValueError, match="fold=5"):
        fold_splits(ids, None, 5, 5)


def test_untrained_prior_net_ranks_as_its_prior():
    """With a prior the learned part starts at zero: the untrained net's logit is logit(prior column) exactly."""
    torch.manual_seed(0)
    x = torch.rand(200, 6) * 0.98 + 0.01
    for net in (DiscoNet(6, 8, prior_index=3), DiscoNet(6, 8, tv_head=True, prior_index=3),
                DiscoNet(6, 8, hidden_dim=2, hidden_rank=2, prior_index=3), SprinterNet(6, prior_index=3)):
        net.norm.fit(torch.randn(50, 6))
        torch.testing.assert_close(net(x), torch.logit(x[:, 3]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prior_index=6"):
        DiscoNet(6, 8, prior_index=6)


def test_prior_configs_name_the_field():
    with pytest.raises(ValueError, match="prior='p'"):
        DiscoConfig(prior="p")
    with pytest.raises(ValueError, match="add it to extra_features"):
        DiscoConfig(prior="q", extra_features=("draft_max_prob",))
    with pytest.raises(ValueError, match="disco_features"):
        SprinterConfig(prior="q", extra_features=("q",))
    with pytest.raises(ValueError, match="SV table has no prior"):
        SVTableConfig(prior="q")
    with pytest.raises(ValueError, match="monitor='auc'"):
        DiscoConfig(monitor="auc")


def test_prior_predictor_trains_exports_and_keeps_its_prior_when_nothing_beats_it(shards, tmp_path):
    from predictors.export import export_predictor, load_predictor

    cfg = DiscoConfig(hidden_size=8, extra_features=("draft_max_prob", "q"), prior="draft_max_prob", monitor="val_auc",
                      **FAST)
    policy, m = fit_predictor("disco", cfg, shards, tmp_path / "d")
    assert m["kept_prior"] in (0.0, 1.0) and m["val_auc"] >= m["val_auc_max_prob"] - 1e-9  # never below its start
    back = load_predictor(export_predictor(policy, tmp_path / "export", {}))
    assert back.net.prior_index == policy.net.prior_index == 10 + 2
    from data_gen.shards import read_columns

    cols = read_columns(shards, ["draft_topk", "position", "draft_max_prob", "q"])
    np.testing.assert_allclose(back.score(cols).numpy(), policy.score(cols).numpy(), rtol=1e-6)
    # a learning rate that only does harm: no epoch beats the prior, the predictor keeps its initial weights
    bad = DiscoConfig(hidden_size=8, extra_features=("draft_max_prob",), prior="draft_max_prob", monitor="val_auc",
                      lr=5.0, **FAST)
    policy, m = fit_predictor("disco", bad, shards, tmp_path / "bad")
    if m["kept_prior"]:
        assert m["val_auc"] == pytest.approx(m["val_auc_max_prob"], abs=1e-9)


def test_summarise_known_answer():
    """A learned score that separates perfectly against a random training-free one: difference about 0.5, every
    bootstrap resample and every fold a win; per-domain rows."""
    rng = np.random.default_rng(0)
    n = 600
    y = rng.random(n) < 0.5
    frame = pd.DataFrame(
        {
            "predictor": "p",
            "label": "greedy match",
            "draw": "greedy",
            "fold": np.arange(n) % 3,
            "sample_id": [f"s{i // 10}" for i in range(n)],
            "domain": np.where(np.arange(n) < 300, "code", "chat"),
            "y": y.astype(float),
            "score": y + rng.normal(0, 0.01, n),
            "draft_max_prob": rng.random(n),
            "q": rng.random(n),
            "draft_entropy": rng.random(n),
        }
    )
    table = summarise(frame, n_boot=50)
    assert list(table["group"]) == ["all", "chat", "code"]
    top = table.iloc[0]
    assert top["auc"] == pytest.approx(1.0) and 0.4 < top["diff"] < 0.6
    assert top["diff_lo"] > 0.3 and top["p_win"] == 1.0 and (top["folds_won"], top["folds"]) == (3, 3)
    fold_aucs = [roc_auc_score(g["y"], g[top["best_free"] if top["best_free"] != "draft-prob" else "q"])
                 for _, g in frame.groupby("fold")] if top["best_free"] != "neg-entropy" else None
    if fold_aucs:  # the training-free AUC is the mean of its within-fold AUCs (folds of equal size here)
        assert top["auc_best_free"] == pytest.approx(np.mean(fold_aucs), abs=1e-9)


def test_crossval_end_to_end_finds_the_planted_hidden_signal(tmp_path):
    """SPRINTER reads log(p/q) planted in the hidden state: cross-validated it beats q(x) on q/p <= 1.2, with an
    interval above zero; every prompt is scored once; the files and plot are written."""
    from evaluation.crossval import CrossValConfig, CrossValRun, run_crossval

    shards = tmp_path / "greedy-only"  # the planted log(p/q) is on these rows (with_sample_draw's are random)
    write_shards(shards, make_records(n_prompts=40, tokens_per_prompt=25, hidden_size=16, noise=1.0))  # q sees z only
    cfg = CrossValConfig(data_dir=str(shards), out_dir=str(tmp_path / "cv"), folds=4, n_boot=50,
                         train_fractions=[0.5, 1.0], runs=[
        CrossValRun("disco", "disco", disco=DiscoConfig(hidden_size=8, extra_features=("q",), prior="q", **FAST)),
        CrossValRun("sprinter", "sprinter", sprinter=SprinterConfig(lam=1.2, **FAST)),
    ])
    result = run_crossval(cfg)
    table = result["table"]
    oof = pd.read_parquet(tmp_path / "cv" / "oof.parquet")
    for _, g in oof.groupby(["predictor", "train_fraction"]):
        assert g["sample_id"].nunique() == 40 and len(g) == 40 * 25  # every prompt tested once
    all_rows = table[(table["predictor"] == "sprinter") & (table["group"] == "all")].set_index("train_fraction")
    assert all_rows.loc[0.5, "n_train"] == pytest.approx(all_rows.loc[1.0, "n_train"] / 2, rel=0.2)  # 10 of 20 prompts
    sp = all_rows.loc[1.0]
    assert sp["label"] == "q/p<=1.2" and sp["draw"] == "greedy"  # one-draw data: every family reads its rows
    assert sp["diff"] > 0.1 and sp["diff_lo"] > 0 and sp["folds_won"] == 4
    assert set(table["group"]) == {"all", "code", "chat"}
    for f in ("crossval.md", "crossval.csv", "crossval.png", "learning_curve.png", "crossval_config.json",
              "calibration.csv"):
        assert (tmp_path / "cv" / f).is_file()
    # calibrated out of fold: maps fitted on each fold's validation prompts, ECE over every prompt once
    cal = pd.read_csv(tmp_path / "cv" / "calibration.csv")
    assert {"disco", "sprinter", "max-prob", "draft-prob", "neg-entropy"} <= set(cal["score"])
    assert set(cal["mode"]) == {"greedy"} and (cal["n"] == 40 * 25).all() and (cal["prompts"] == 40).all()
    assert cal["ece"].between(0, 0.2).all() and (cal["ece_floor"] > 0).all()
    assert "Calibrated acceptance, out of fold" in (tmp_path / "cv" / "crossval.md").read_text()
    assert re.search(r"\| sprinter \| q/p<=1.2 \(greedy\) \| \d+ \| all \|", result["markdown"])
    with pytest.raises(ValueError, match="distinct names"):
        CrossValConfig(runs=[CrossValRun("a"), CrossValRun("a")])
    with pytest.raises(ValueError, match="kind='sv'"):
        CrossValRun("a", "sv")


def test_forest_plot_draws_an_interval_that_misses_its_point(tmp_path):
    """A percentile bootstrap over a few prompts can leave the point estimate outside its interval; the plot still
    draws (matplotlib refuses negative error bars)."""
    from evaluation.plots import plot_crossval

    table = pd.DataFrame([{"predictor": "p", "label": "greedy match", "group": "all", "best_free": "max-prob",
                           "train_fraction": 1.0, "diff": 0.02, "diff_lo": 0.025, "diff_hi": 0.05}])
    assert plot_crossval(table, tmp_path / "cv.png").is_file()
