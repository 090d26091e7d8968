"""Classification tables on synthetic columns with known answers: perfect and random scores, single-class splits,
missing
columns, soft-label weighting, DISCO's static F1, SPRINTER's theorems."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score
from torch import Tensor

from evaluation.classification import (
    score_table,
    sprinter_expected_tokens,
    sprinter_table,
    static_f1,
    weighted_ap,
    weighted_auc,
)
from predictors.base import StopPolicy


class ColumnScore(StopPolicy):
    kind = "column"

    def __init__(self, column: str, threshold: float = 0.5) -> None:
        super().__init__(threshold)
        self.column = column
        self.required_columns = (column,)  # type: ignore[misc]

    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        return features[self.column].float()


def make_columns(n: int = 4000, n_prompts: int = 40, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    greedy = rng.random(n) < 0.6
    q = rng.uniform(0.05, 1, n)
    p = np.where(greedy, q * rng.uniform(1.0, 2.0, n), q * rng.uniform(0.0, 0.9, n))
    prompt = np.sort(rng.integers(0, n_prompts, n))
    return {
        "sample_id": np.array([f"p{i}" for i in prompt]),
        "seq_id": np.array([f"p{i}:0" for i in prompt]),
        "offset": np.arange(n),
        "position": np.arange(n) % 8,
        "origin": np.array(["target", "prompt"])[prompt % 2],
        "domain": np.array(["code", "chat"])[(prompt // 2) % 2],
        "rollout": prompt % 2 == 1,
        "greedy_match": greedy,
        "q": q,
        "p": p,
        "accept_prob": np.minimum(1, p / q),
        "tv": rng.uniform(0, 0.5, n),
        "draft_entropy": rng.gamma(1, 1, n),
        "draft_max_prob": rng.uniform(0, 1, n),
        "perfect": greedy.astype(np.float64) + 0.01 * rng.random(n),
        "random": rng.random(n),
    }


def _row(df, policy, label="greedy match", group_by="all"):
    r = df[(df["policy"] == policy) & (df["label"] == label) & (df["group_by"] == group_by)]
    assert len(r) == 1, r
    return r.iloc[0]


def test_perfect_and_random_scores():
    cols = make_columns()
    df = score_table(cols, {"perfect": ColumnScore("perfect"), "random": ColumnScore("random")}, n_boot=30)
    perfect = _row(df, "perfect")
    assert perfect["auc"] == pytest.approx(1.0)
    assert perfect["pr_auc"] == pytest.approx(1.0)
    assert perfect["f1_opt"] == pytest.approx(1.0) and perfect["f1_own"] == pytest.approx(1.0)
    assert perfect["auc_lo"] == pytest.approx(1.0) and perfect["reason"] == ""
    rnd = _row(df, "random")
    assert abs(rnd["auc"] - 0.5) < 0.05
    assert rnd["auc_lo"] <= rnd["auc"] <= rnd["auc_hi"]
    assert rnd["pr_auc"] == pytest.approx(cols["greedy_match"].mean(), abs=0.05)
    # built-in scorers are there for every label family
    assert {"neg-entropy", "svip", "adaedl-bound", "max-prob"} <= set(df["policy"])
    assert set(df["label"]) == {"greedy match", "q/p<=1", "q/p<=1.2", "q/p<=1.5", "min(1,p/q)"}
    # per-origin and per-domain breakdown rows
    assert {"origin", "domain"} <= set(df["group_by"])
    br = df[(df["policy"] == "perfect") & (df["group_by"] == "origin") & (df["family"] == "greedy")]
    assert set(br["group"]) == {"target", "prompt"} and np.allclose(br["auc"], 1.0)


def test_single_class_gives_nan_with_reason():
    cols = make_columns(n=300)
    cols["greedy_match"] = np.ones(300, dtype=bool)
    df = score_table(cols, {"perfect": ColumnScore("perfect")}, label_specs=[("greedy", 1.0)], n_boot=10)
    r = _row(df, "perfect")
    assert np.isnan(r["auc"]) and "one class" in r["reason"]
    cols["greedy_match"] = np.zeros(300, dtype=bool)
    df = score_table(cols, {}, label_specs=[("greedy", 1.0)], n_boot=5)
    r = _row(df, "svip")
    assert np.isnan(r["auc"]) and np.isnan(r["pr_auc"]) and "no accepted" in r["reason"]


def test_missing_columns_and_unloaded_rows():
    cols = make_columns(n=200)
    df = score_table(cols, {"hid": ColumnScore("draft_hidden"), "gone": None}, label_specs=[("greedy", 1.0)], n_boot=0)
    assert "draft_hidden" in _row(df, "hid")["reason"] and np.isnan(_row(df, "hid")["auc"])
    assert _row(df, "gone")["reason"] == "policy not loaded"
    del cols["p"]
    df = score_table(cols, {}, label_specs=[("ratio", 1.2)], n_boot=0)
    assert "label columns missing" in _row(df, "svip", "q/p<=1.2")["reason"]


def test_soft_label_weighting_hand_computed():
    cols = {"draft_entropy": np.array([0.0, 1.0, 2.0]), "accept_prob": np.array([1.0, 0.5, 0.0])}
    df = score_table(cols, {}, label_specs=[("soft", 1.0)], n_boot=0, breakdown=())
    # positives weights [1, .5, 0], negatives [0, .5, 1], scores decreasing with entropy:
    # pairs: 1*.5 + 1*1 + .5*1 + tie(.5*.5)/2 = 2.125 over 1.5 * 1.5
    assert _row(df, "neg-entropy", "min(1,p/q)")["auc"] == pytest.approx(2.125 / 2.25)


def test_fast_metrics_match_sklearn():
    rng = np.random.default_rng(1)
    s = np.round(rng.normal(size=500), 1)  # ties
    y = rng.random(500)  # soft labels
    w = rng.integers(0, 3, 500).astype(float)  # bootstrap multiplicities
    levels, inv = np.unique(s, return_inverse=True)
    s2, y2, w2 = np.r_[s, s], np.r_[np.ones(500), np.zeros(500)], np.r_[w * y, w * (1 - y)]
    assert weighted_auc(inv, len(levels), w * y, w * (1 - y)) == pytest.approx(roc_auc_score(y2, s2, sample_weight=w2))
    assert weighted_ap(inv, len(levels), w * y, w * (1 - y)) == pytest.approx(
        average_precision_score(y2, s2, sample_weight=w2))


def test_static_f1_known_answer():
    cols = {"position": np.array([0, 1, 2, 0, 1, 2]), "greedy_match": np.array([1, 1, 0, 1, 1, 0], dtype=bool)}
    k, f1, f1s = static_f1(cols, "greedy", max_k=5)
    assert k == 2 and f1 == pytest.approx(1.0) and f1s[0] == pytest.approx(2 * 2 / (2 * 2 + 2))
    assert static_f1({"greedy_match": cols["greedy_match"]}, "greedy")[0] == 0  # no position: no static F1


def test_sprinter_theorem2_closed_form():
    for tpr, fpr, r in ((0.8, 0.3, 5), (0.5, 0.1, 1), (0.95, 0.5, 3)):
        brute = sum(i * tpr**i * (1 - tpr) for i in range(r)) + sum(
            i * tpr**r * fpr ** (i - r) * (1 - fpr) for i in range(r, 2000))
        assert sprinter_expected_tokens(tpr, fpr, r) == pytest.approx(brute)
        paper = (tpr - tpr**r) / (1 - tpr) + tpr**r / (1 - fpr)  # eq. 3 as printed
        assert sprinter_expected_tokens(tpr, fpr, r) == pytest.approx(paper)
    assert sprinter_expected_tokens(1.0, 0.0, 4) == pytest.approx(4.0)


def test_sprinter_table_perfect_verifier():
    cols = make_columns(n=1000)
    cols["ratio_ok"] = (cols["q"] <= 1.2 * cols["p"]).astype(float)
    df = sprinter_table(cols, {"ok": ColumnScore("ratio_ok")}, lams=(1.2,), builtins=False)
    r = df.iloc[0]
    assert r["tpr"] == 1.0 and r["fpr"] == 0.0 and r["tv_bound"] == 0.0
    assert r["e_tokens_theorem2"] == pytest.approx(r["e_tokens_replayed"])
    assert r["e_tokens_replayed"] == pytest.approx(r["mean_r"])
    assert r["accept_rate_thm1"] == pytest.approx(1 - cols["tv"][cols["rollout"]].mean())
