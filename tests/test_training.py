"""Training through Lightning on synthetic shards: planted signals are learned; bad data gives clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from pytorch_lightning.loggers import MLFlowLogger
from sklearn.metrics import roc_auc_score

from data_gen.shards import read_columns
from predictors.datamodule import ShardDataModule
from predictors.export import export_predictor, load_predictor
from predictors.labels import derive_label
from predictors.training import DiscoConfig, SprinterConfig, SVTableConfig, fit_predictor
from tests.synthetic import make_records, with_sample_draw, write_shards

FAST = dict(batch_size=128, patience=2, max_epochs=6)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shards")
    write_shards(folder, make_records(n_prompts=60, tokens_per_prompt=30, hidden_size=16))
    return folder


def test_datamodule_splits_by_prompt(shards):
    dm = ShardDataModule(shards, "sprinter", "ratio", lam=1.2, batch_size=64)
    dm.setup("fit")
    sizes = {s: dm.tensors[s][0].shape[0] for s in ("train", "val", "test")}
    assert sizes == {"train": 1260, "val": 360, "test": 180}
    assert dm.spec.width == 16
    x, y, tv = next(iter(dm.train_dataloader()))
    assert x.shape == (64, 16) and y.shape == (64,) and set(y.unique().tolist()) <= {0.0, 1.0}


def test_disco_learns_planted_signal(shards, tmp_path):
    cfg = DiscoConfig(hidden_size=16, lr=5e-3, tv_weight=0.5, **FAST)
    policy, m = fit_predictor("disco", cfg, shards, tmp_path)
    assert m["val_auc"] > 0.9
    assert np.isfinite(m["val_loss"]) and m["n_train"] == 1260 and m["pos_weight"] > 0
    assert 0.5 < m["val_auc_max_prob"] <= 1 and "val_auc_neg_entropy" in m  # training-free bars on the same labels
    assert (tmp_path / "checkpoints" / "disco-best.ckpt").is_file()
    assert list((tmp_path / "logs").rglob("metrics.csv"))  # per-epoch metrics (CSV without a logger)
    resolved = json.loads((tmp_path / "resolved_config.json").read_text())
    assert resolved["config"]["hidden_size"] == 16 and resolved["feature_spec"]["width"] == 12
    assert policy.kind == "disco" and policy.threshold == 0.5
    assert policy.train_info["label"]["family"] == "greedy" and policy.train_info["config"]["hidden_size"] == 16


def test_sprinter_learns_planted_signal(shards, tmp_path):
    policy, m = fit_predictor("sprinter", SprinterConfig(lam=1.2, **FAST), shards, tmp_path)
    assert m["val_auc"] > 0.9
    assert policy.kind == "sprinter" and not policy.exact
    assert policy.train_info["label"] == {"family": "ratio", "lam": 1.2, "name": "q/p<=1.2"}


def test_sv_table_fitted_through_lightning(shards, tmp_path):
    policy, m = fit_predictor("sv", SVTableConfig(s_bins=10, a_bins=10), shards, tmp_path)
    assert m["train_information_gain_bits"] > 0.1 and m["val_information_gain_bits"] > 0.1
    assert m["val_auc"] > 0.85  # cell values rank greedy matches (both driven by the latent z)
    assert m["val_mse"] < 0.05 and (tmp_path / "checkpoints" / "sv-table.ckpt").is_file()
    assert policy.net.table.shape == (m["s_bins"], m["a_bins"])


def test_mlflow_logger_gets_per_epoch_metrics(shards, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="specstop-test", tracking_uri=uri)
    fit_predictor("disco", DiscoConfig(hidden_size=8, batch_size=256, max_epochs=3, patience=5), shards,
                  tmp_path / "out", logger=logger)
    client = MlflowClient(uri)
    history = client.get_metric_history(logger.run_id, "val_loss")
    assert len(history) == 3
    assert client.get_metric_history(logger.run_id, "final_val_auc")
    assert client.get_run(logger.run_id).data.params["hidden_size"] == "8"


def test_single_class_labels_named(shards, tmp_path):
    with pytest.raises(ValueError, match=r"single-class.*'ratio'.*lambda=1e-06.*0 positive and 1260 negative"):
        fit_predictor("sprinter", SprinterConfig(lam=1e-6, **FAST), shards, tmp_path)


def test_empty_val_split_and_missing_data(tmp_path):
    rec = make_records(n_prompts=10, tokens_per_prompt=5, hidden_size=4)
    rec["split"] = np.full(len(rec["split"]), "train")
    write_shards(tmp_path / "s", rec)
    with pytest.raises(ValueError, match="val split is empty"):
        fit_predictor("disco", DiscoConfig(**FAST), tmp_path / "s", tmp_path / "o")
    with pytest.raises(FileNotFoundError, match="no Parquet shards"):
        fit_predictor("disco", DiscoConfig(**FAST), tmp_path / "o", tmp_path / "o2")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fit_predictor("disco", DiscoConfig(**FAST), tmp_path / "nowhere", tmp_path / "o2")


def test_missing_column_and_prompt_leak(tmp_path):
    rec = make_records(n_prompts=10, tokens_per_prompt=5, hidden_size=0)
    write_shards(tmp_path / "nohidden", rec)
    with pytest.raises(KeyError, match="draft_hidden"):
        fit_predictor("sprinter", SprinterConfig(**FAST), tmp_path / "nohidden", tmp_path / "o")
    rec["split"][0] = "val" if rec["split"][0] == "train" else "train"  # one token of a prompt in another split
    write_shards(tmp_path / "leak", rec)
    with pytest.raises(ValueError, match="appear in both"):
        ShardDataModule(tmp_path / "leak", "disco", "greedy").setup("fit")


def test_width_mismatch_against_config(shards, tmp_path):
    with pytest.raises(ValueError, match="top_k=5.*width 10"):
        fit_predictor("disco", DiscoConfig(top_k=5, **FAST), shards, tmp_path)


def test_config_checks_name_the_field():
    with pytest.raises(ValueError, match="lr="):
        DiscoConfig(lr=0)
    with pytest.raises(ValueError, match="label_family="):
        SprinterConfig(label_family="nope")
    with pytest.raises(ValueError, match="max_epochs="):
        SVTableConfig(max_epochs=3)
    with pytest.raises(ValueError, match="extra_features"):
        DiscoConfig(extra_features=("p",))
    with pytest.raises(TypeError, match="SprinterConfig"):
        fit_predictor("sprinter", DiscoConfig(), "x", "y")


def test_hybrid_heads_train_export_and_reload(shards, tmp_path):
    """DISCO with the hidden state (hybrid head) and SPRINTER with the DISCO features: widths, learning, round trip."""
    disco, m = fit_predictor(
        "disco", DiscoConfig(hidden_size=16, lr=5e-3, hidden_rank=4, **FAST), shards, tmp_path / "d"
    )
    assert disco.spec.parts == ("disco", "hidden") and disco.spec.width == 12 + 16 and m["val_auc"] > 0.9
    assert "draft_hidden" in disco.required_columns  # the engine then passes the hidden state
    sprinter, m = fit_predictor(
        "sprinter", SprinterConfig(lam=1.2, disco_features=True, **FAST), shards, tmp_path / "s"
    )
    assert sprinter.spec.parts == ("hidden", "disco") and sprinter.spec.width == 16 + 12 + 2 and m["val_auc"] > 0.9
    cols = read_columns(shards, ["draft_topk", "position", "draft_max_prob", "draft_entropy", "draft_hidden"])
    for policy in (disco, sprinter):
        back = load_predictor(export_predictor(policy, tmp_path / f"export-{policy.kind}", {}))
        assert back.spec == policy.spec
        np.testing.assert_allclose(back.score(cols).numpy(), policy.score(cols).numpy(), rtol=1e-6)


def test_two_folders_read_as_one(shards, tmp_path):
    """A list of data folders is one data set: the splits and counts add up (pipelines.train's extra_data)."""
    other = tmp_path / "more"
    write_shards(other, make_records(n_prompts=20, tokens_per_prompt=30, hidden_size=16, seed=7))
    one = ShardDataModule(shards, "disco", "greedy")
    both = ShardDataModule([shards, other], "disco", "greedy")
    one.setup("fit"), both.setup("fit")
    total = lambda dm: sum(dm.tensors[s][0].shape[0] for s in ("train", "val", "test"))  # noqa: E731
    assert total(both) == total(one) + 20 * 30


def test_each_label_family_reads_its_draw(tmp_path):
    """With two draws per position, greedy labels come from the argmax rows, ratio labels from the sampled rows."""
    recs = make_records(n_prompts=20, tokens_per_prompt=20, hidden_size=16)
    both = with_sample_draw(recs)
    write_shards(tmp_path / "two", both)
    greedy = ShardDataModule(tmp_path / "two", "disco", "greedy")
    ratio = ShardDataModule(tmp_path / "two", "sprinter", "ratio", lam=1.2)
    greedy.setup("fit"), ratio.setup("fit")
    assert (greedy.draw, ratio.draw) == ("greedy", "sample")
    train = both["split"] == "train"
    for dm, draw, fam in ((greedy, "greedy", "greedy"), (ratio, "sample", "ratio")):
        rows = {k: v[train & (both["draw"] == draw)] for k, v in both.items()}
        np.testing.assert_array_equal(dm.tensors["train"][1].numpy(), derive_label(rows, fam, 1.2))
    # the draw can be forced; greedy-only data serves every family
    forced = ShardDataModule(tmp_path / "two", "disco", "greedy", draw="sample")
    forced.setup("fit")
    assert forced.tensors["train"][1].numpy().mean() < greedy.tensors["train"][1].numpy().mean()


def test_sv_greedy_auc_reads_the_argmax_rows(tmp_path):
    """The SV table is fitted on the sampled draws (min(1, p/q)); its greedy-match val AUC is taken on the argmax rows,
    as the evaluation takes it, and so are the training-free bars beside it."""
    both = with_sample_draw(make_records(n_prompts=30, tokens_per_prompt=20, hidden_size=0))
    write_shards(tmp_path / "two", both)
    policy, m = fit_predictor("sv", SVTableConfig(s_bins=5, a_bins=5), tmp_path / "two", tmp_path / "sv")
    rows = (both["split"] == "val") & (both["draw"] == "greedy")
    x = torch.from_numpy(np.stack([both["companion_sim"][rows], both["companion_accept"][rows]], 1))
    y = both["greedy_match"][rows]
    assert m["val_auc"] == pytest.approx(roc_auc_score(y, policy.net(x).numpy()))
    assert m["val_auc_max_prob"] == pytest.approx(roc_auc_score(y, both["draft_max_prob"][rows]))


def test_sv_information_gain_reads_the_sampled_draws(tmp_path):
    """The greedy-match AUC reads the argmax rows, but the information gain pairs the sampled rows' (S, A_c) with
    their own min(1, p/q): swapping in the argmax rows' inputs (the old bug) gives another number."""
    both = with_sample_draw(make_records(n_prompts=30, tokens_per_prompt=20, hidden_size=0))
    sampled = both["draw"] == "sample"
    rng = np.random.default_rng(3)
    both["companion_accept"][sampled] = rng.uniform(0, 1, int(sampled.sum())).astype(np.float32)  # own A_c per draw
    write_shards(tmp_path / "two", both)
    policy, m = fit_predictor("sv", SVTableConfig(s_bins=5, a_bins=5), tmp_path / "two", tmp_path / "sv")
    rows = (both["split"] == "val") & sampled
    s, a = (torch.from_numpy(both[c][rows]) for c in ("companion_sim", "companion_accept"))
    want = policy.net.information_gain(s, a, torch.from_numpy(both["accept_prob"][rows]))
    assert m["val_information_gain_bits"] == pytest.approx(want["information_gain_bits"])
    greedy_rows = (both["split"] == "val") & ~sampled
    s_g, a_g = (torch.from_numpy(both[c][greedy_rows]) for c in ("companion_sim", "companion_accept"))
    wrong = policy.net.information_gain(s_g, a_g, torch.from_numpy(both["accept_prob"][rows]))
    assert wrong["information_gain_bits"] != pytest.approx(want["information_gain_bits"])
