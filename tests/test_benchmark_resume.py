"""A stopped benchmark continues at its first unfinished prompt: the finished prompts' rows are read back, not run
again, and a run of another config, other prompts or another machine is refused with what differs named."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmark.bench import Bench, DecodeSettings, RunOrder
from benchmark.config import BenchmarkConfig
from benchmark.plan import run_rows
from benchmark.resume import PromptStore, row_from_dict, row_to_dict, run_identity
from benchmark.rows import Row
from compute.timing import CostModel
from decoding.engine import DecodeStats
from pipelines.benchmark import main

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
MACHINE = {"model_name": "CPU A", "simd_flags": ["avx2"], "bf16_chain": "none"}


def _curve(machine: dict | None = None) -> CostModel:
    return CostModel(draft_s_per_token=0.01, target_s={1: 0.1, 2: 0.11}, draft_name="d", target_name="t",
                     compute_path="eager", machine=machine or MACHINE)


def _plan(calls: list[tuple[int, str]], fail_at: int | None = None):
    def runner(name: str):
        def run(view: Bench) -> Row:
            if view.offset == fail_at:
                raise KeyboardInterrupt  # the run stopped during this prompt
            calls.append((view.offset, name))
            stats = DecodeStats(tokens=2, rounds=1, accepted_lengths=[1], draft_time=0.5, draft_forwards=2)
            return Row(name, "engine", seconds=[1.0 + view.offset], outputs=[[view.offset, 7]], rounds=1,
                       decode=stats)
        return run
    return [("target-only", runner("target-only")), ("a", runner("a"))]


def test_a_row_survives_the_round_trip_through_json():
    row = Row("a", "engine", kind="svip", seconds=[1.5], outputs=[[1, 2]], threshold=0.3,
              decode=DecodeStats(tokens=2, sent_lengths=[3, 1], stop_time=0.01))
    import json

    again = row_from_dict(json.loads(json.dumps(row_to_dict(row))))
    assert again == row and isinstance(again.decode, DecodeStats)


def test_a_stopped_run_continues_at_its_first_unfinished_prompt(tmp_path):
    cfg = BenchmarkConfig(repeats=1, curve_probes=False, n_prompts=3)
    bench = Bench(DecodeSettings.of(cfg), None, None, None, None, prompts=[[1], [2], [3]], eos=[0])  # type: ignore[arg-type]
    store = PromptStore(tmp_path / "prompts")
    store.begin(run_identity(cfg, bench.prompts), _curve())
    first: list[tuple[int, str]] = []
    reports: list[int] = []
    with pytest.raises(KeyboardInterrupt):
        run_rows(_plan(first, fail_at=2), bench, RunOrder.of(cfg), store, lambda rows, k: reports.append(k))
    assert store.done() == [0, 1] and reports == [1, 2]  # whole prompts saved, a report after each
    assert not list((tmp_path / "prompts").glob("*.tmp"))
    again: list[tuple[int, str]] = []
    rows = {r.name: r for r in run_rows(_plan(again), bench, RunOrder.of(cfg), store)}
    assert again == [(2, "target-only"), (2, "a")]  # only the unfinished prompt runs
    assert rows["a"].seconds == [1.0, 2.0, 3.0] and rows["a"].outputs == [[0, 7], [1, 7], [2, 7]]
    assert rows["a"].rounds == 3 and rows["a"].decode is not None and rows["a"].decode.tokens == 6
    assert store.done() == [0, 1, 2]
    assert store.wall_seconds() is not None and store.wall_seconds() >= 0  # each saved prompt records its wall time
    store.save(2, rows, None)  # a prompt saved without one (an older run): the whole run's wall time is unknown
    assert store.wall_seconds() is None


def test_another_config_prompts_or_machine_is_refused_with_what_differs(tmp_path):
    cfg = BenchmarkConfig(n_prompts=2)
    store = PromptStore(tmp_path / "prompts")
    assert store.resume(run_identity(cfg, [[1], [2]]), MACHINE, "d", "t", "eager") is None  # nothing stored yet
    store.begin(run_identity(cfg, [[1], [2]]), _curve())
    got = store.resume(run_identity(cfg, [[1], [2], [3]]), MACHINE, "d", "t", "eager")  # more prompts: extends
    assert got is not None and got.target_s == {1: 0.1, 2: 0.11}
    with pytest.raises(ValueError, match=r"max_new_tokens: stored 96, now 64.*--resume false"):
        store.resume(run_identity(BenchmarkConfig(max_new_tokens=64), [[1], [2]]), MACHINE, "d", "t", "eager")
    with pytest.raises(ValueError, match="prompt 2 has other token ids"):
        store.resume(run_identity(cfg, [[1], [5]]), MACHINE, "d", "t", "eager")
    with pytest.raises(ValueError, match="CPU model_name: measured on 'CPU A', run on 'CPU B'"):
        store.resume(run_identity(cfg, [[1], [2]]), {**MACHINE, "model_name": "CPU B"}, "d", "t", "eager")
    store.check_rows(["target-only", "svip:0.3 (val-tuned)"])
    store.check_rows(["target-only", "svip:0.3 (val-tuned)"])
    with pytest.raises(ValueError, match="plans the rows"):
        store.check_rows(["target-only", "svip:0.4 (val-tuned)"])
    moved = store.set_aside()
    assert moved is not None and (moved / "run.json").is_file() and not store.folder.exists()
    store.folder.mkdir()
    (store.folder / "prompt-0000.json").write_text("{}")  # a prompt of an unknown run: never read as this one's
    store.begin(run_identity(cfg, [[1], [2]]), _curve())
    assert store.done() == [] and len(list(tmp_path.glob("prompts.old-*"))) == 2


def test_the_benchmark_resumes_on_tiny_models(tmp_path, caplog, capsys):
    out = tmp_path / "bench"
    argv = ["--config", str(ROOT / "configs" / "benchmark-smoke.yaml"), "--out_dir", str(out), "--tracking", "false",
            "--n_prompts", "2", "--max_new_tokens", "4", "--policies", '["static:3", "svip:0.3"]', "--hf_rows", "[]",
            "--reference_compute", "null", "--replay_check", "false", "--repeats", "1"]
    first = main(argv)
    assert sorted(p.name for p in (out / "prompts").iterdir()) == ["prompt-0000.json", "prompt-0001.json",
                                                                    "run.json"]
    caplog.set_level("INFO")
    again = main(argv)  # every prompt read back: the same rows, nothing decoded again
    assert "read back from an earlier run" in caplog.text
    keys = ("row", "tokens_per_s", "speedup", "prompt_tokens", "prompt_seconds", "mean_accepted")
    assert [{k: r[k] for k in keys} for r in again["rows"]] == [{k: r[k] for k in keys} for r in first["rows"]]
    with pytest.raises(SystemExit):  # another config in the same folder: refused, the error names the field
        main([*argv, "--max_new_tokens", "5"])
    main([*argv, "--max_new_tokens", "5", "--resume", "false"])  # starting over moves the earlier prompts aside
    assert len(list(out.glob("prompts.old-*"))) == 1
    from compute import code_version as cv

    other = {"commit": "f" * 40, "dirty": False}
    with pytest.MonkeyPatch.context() as mp:  # the same run continued on other code: refused, nothing moved
        mp.setattr(cv, "code_version", lambda root=cv.ROOT: other)
        with pytest.raises(SystemExit):
            main([*argv, "--max_new_tokens", "5"])
    assert "this is fffffff" in capsys.readouterr().err and len(list(out.glob("prompts.old-*"))) == 1
