"""Serving traces as training data: DISCO learns from a trace folder's train requests beside the generator's data."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtimes.vllm.traces import TraceWriter, fit_splits, refit_calibration, trace_folder, trace_split

ROOT = Path(__file__).resolve().parents[1]


def _traces(folder: Path, fingerprint: dict, rows: list[dict], per_request: int = 4) -> Path:
    """A trace folder of ``rows`` (data records), ``per_request`` tokens a request, the last of each rejected."""
    w = TraceWriter(folder, {"runtime": "vllm", "precision": "bfloat16", "fingerprints": {"draft": fingerprint}})
    keep = ("draft_topk", "draft_max_prob", "draft_entropy", "q")
    for i in range(0, len(rows) - per_request, per_request):
        rid = f"req-{i}"
        w.sent(rid, [{k: rows[j][k] for k in keep} for j in range(i, i + per_request)], batch=1)
        w.verdicts(rid, accepted=per_request - 1, batch=1)
    w.close()
    return folder


def test_trace_splits_hold_train_val_and_test_requests() -> None:
    got = [trace_split(f"req-{i}") for i in range(500)]
    assert 0.5 < got.count("train") / 500 < 0.7 and got.count("val") > 60 and got.count("test") > 60


def test_a_folder_without_traces_or_of_another_draft_is_refused_in_one_line(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no serving traces here"):
        trace_folder(tmp_path / "empty", None)
    mine = {"name": "tiny:1", "vocab_size": 64, "vocab_sha": "aa"}
    folder = _traces(tmp_path / "t", {**mine, "name": "tiny:9"}, [{"draft_topk": [0.5], "draft_max_prob": 0.5,
                                                                   "draft_entropy": 1.0, "q": 0.5}] * 12)
    with pytest.raises(ValueError, match="traces of draft tiny:9.*the data's draft is tiny:1") as e:
        trace_folder(folder, mine)
    assert "\n" not in str(e.value)


def test_the_main_job_trains_disco_on_traces_and_the_refit_leaves_its_train_requests_out(tmp_path, monkeypatch):
    from data_gen.shards import load_records
    from pipelines.train import main

    monkeypatch.chdir(tmp_path)
    args = ["--config", str(ROOT / "configs/smoke.yaml"), "--data.out_dir", str(tmp_path / "data"),
            "--tracking_uri", f"sqlite:///{tmp_path}/mlflow.db", "--data.max_records", "1200", "--predictors",
            "[disco]", "--evaluate", "false", "--register", "false", "--crossval_folds", "0"]
    plain = main([*args, "--out_dir", str(tmp_path / "plain")])
    fp = json.loads((tmp_path / "data" / "config.json").read_text())["resolved"]["fingerprints"]["draft"]
    rows = load_records(tmp_path / "data").select(range(400)).to_list()
    traces = _traces(tmp_path / "traces", fp, rows)
    with_traces = main([*args, "--out_dir", str(tmp_path / "traced"), "--trace_data", f"[{traces}]"])
    n_plain, n_traced = plain["results"][0]["n_train"], with_traces["results"][0]["n_train"]
    assert n_plain < n_traced < n_plain + 400  # the traces' train requests joined, their val and test did not
    export = tmp_path / "traced" / "disco" / "export"
    assert str(traces) in json.loads((export / "predictor.json").read_text())["data_dir"]
    assert fit_splits(export, traces) == ["val"] and fit_splits(tmp_path / "plain" / "disco" / "export",
                                                                 traces) == ["train", "val"]
    refit = refit_calibration(traces, tmp_path / "plain" / "disco" / "export", tmp_path / "refit")
    first = json.loads((refit / "predictor.json").read_text())["vllm_first_acceptance"]
    assert first["share"] == 1.0 and 0 < first["tokens"] < 100  # every traced request's first token was accepted
    from pipelines.calibrate import main as calibrate

    calibrate(["--data_dir", str(tmp_path / "data"), "--predictor", str(refit)])  # in place, on labelled data
    assert json.loads((refit / "predictor.json").read_text())["vllm_first_acceptance"] is None  # no longer vLLM's


def test_the_first_drafted_token_s_traced_share_is_where_forecasts_start_without_an_acceptance_run(tmp_path) -> None:
    from compute.timing import CostModel
    from runtimes.vllm.proposer import prior_acceptance
    from runtimes.vllm.settings import ACCEPTANCE
    from runtimes.vllm.traces import FIRST_ACCEPTANCE, first_acceptance

    cols = {"position": [0, 1, 2, 0, 0, 1, 0], "greedy_match": [1, 1, 0, 0, 1, 0, 1]}
    assert first_acceptance(cols) == {"share": 0.75, "tokens": 4}
    assert first_acceptance({"position": [1, 2], "greedy_match": [1, 0]}) is None
    from decoding.policies import build_policy
    from predictors.calibration import Calibrator
    from predictors.goodput import GoodputPolicy

    export = build_policy("svip")  # as loaded from an export whose map was refitted on traces
    export.metadata = {FIRST_ACCEPTANCE: {"share": 0.84, "tokens": 75}}
    wrapped = GoodputPolicy(export, {"greedy": Calibrator("isotonic", [0.0, 1.0], [0.0, 1.0])})
    curve = CostModel(draft_s_per_token=0.02, target_s={1: 0.1, 2: 0.1})
    curve.to_json(tmp_path / "plain.json")
    curve.extra[ACCEPTANCE] = {"survival": [0.9, 0.8]}
    curve.to_json(tmp_path / "measured.json")
    assert prior_acceptance(str(tmp_path / "measured.json"), wrapped) == 0.9  # an acceptance run first
    assert prior_acceptance(str(tmp_path / "plain.json"), wrapped) == 0.84  # then vLLM's traced verdicts
    assert prior_acceptance(str(tmp_path / "plain.json"), export) == 0.84
    assert prior_acceptance(str(tmp_path / "plain.json"), build_policy("svip")) == 0.5
