"""Stored results name their code: a new summary records the git commit and whether the tracked tree was dirty (None
outside a checkout, never an error), the renderer prints the short commit beside the date, an older summary without
one renders "commit unknown", and a commit outside this checkout's history renders with a warning."""
from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest

from compute.code_version import (
    RUN_RECORD,
    PartClock,
    check_resume,
    code_version,
    in_history,
    new_run,
    record_end,
    record_start,
    recorded_command,
    run_code,
)
from rendering import result_store
from rendering.result_store import Summary, dated, summarize_main_job
from rendering.result_tables import render_docs, render_readme
from tests.test_results import main_summary

ROOT = Path(__file__).resolve().parents[1]


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git checkout with one commit on main and one on a side branch (checked out: main)."""
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.email", "t@example.com")
    git(root, "config", "user.name", "t")
    (root / "a.py").write_text("x = 1\n")
    git(root, "add", "a.py")
    git(root, "commit", "-q", "-m", "one")
    git(root, "checkout", "-q", "-b", "side")
    (root / "b.py").write_text("y = 2\n")
    git(root, "add", "b.py")
    git(root, "commit", "-q", "-m", "side")
    git(root, "checkout", "-q", "main")
    return root


def test_code_version_records_commit_and_dirty(repo, tmp_path):
    head = git(repo, "rev-parse", "HEAD")
    assert code_version(repo) == {"commit": head, "dirty": False}
    (repo / "scratch.txt").write_text("untracked files do not count\n")
    assert code_version(repo)["dirty"] is False
    (repo / "a.py").write_text("x = 2\n")
    assert code_version(repo) == {"commit": head, "dirty": True}
    outside = tmp_path / "not-a-checkout"
    outside.mkdir()
    assert code_version(outside) == {"commit": None, "dirty": None}
    inner = repo / "sub"
    inner.mkdir()
    assert code_version(inner) == {"commit": None, "dirty": None}  # a folder inside another checkout is not one


def test_in_history_tells_ancestors_from_other_branches(repo, tmp_path):
    head, side = git(repo, "rev-parse", "HEAD"), git(repo, "rev-parse", "side")
    assert in_history(head, repo) is True and in_history(head[:7], repo) is True
    assert in_history(side, repo) is False
    assert in_history("0" * 40, repo) is False
    (tmp_path / "plain").mkdir()
    assert in_history(head, tmp_path / "plain") is None


def test_a_main_job_summary_records_the_commit(tmp_path):
    out = tmp_path / "train"
    (out / "report").mkdir(parents=True)
    (out / "results.json").write_text(json.dumps({"records": 10, "results": [{"predictor": "disco", "test_auc": 0.8}]}))
    (out / "resolved_config.json").write_text(json.dumps({"data": {"models": {"draft": "tiny:1", "target": "t"}}}))
    (out / "report" / "cost_model.json").write_text(json.dumps({"machine": {}, "compute_path": "eager"}))
    summary = summarize_main_job(out, command="python -m pipelines.train")
    assert summary["commit"] == code_version()["commit"] and summary["dirty"] == code_version()["dirty"]
    keys = list(summary)
    assert keys.index("commit") == keys.index("date") + 1


def test_commit_rendered_beside_the_date():
    head = code_version()["commit"]
    if head is None:
        pytest.skip("not a git checkout")
    assert dated({"date": "2026-11-27", "commit": head, "dirty": False}) == f"2026-11-27, commit {head[:7]}"
    assert dated({"date": "2026-11-27", "commit": head, "dirty": True}).endswith(" + uncommitted changes")
    text = render_readme([Summary(Path("m.json"), main_summary(commit=head, dirty=False))])
    assert f"2026-11-25, commit {head[:7]};" in text


def test_a_summary_without_commit_renders_commit_unknown():
    old = main_summary()
    assert "commit" not in old
    for text in (render_readme([Summary(Path("m.json"), old)]), render_docs([Summary(Path("m.json"), old)])):
        assert "2026-11-25, commit unknown;" in text


def test_a_commit_outside_the_history_renders_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(result_store, "in_history", lambda commit: False)
    data = main_summary(commit="f" * 40, dirty=False)
    with caplog.at_level(logging.WARNING, logger="rendering.result_store"):
        text = render_readme([Summary(Path("m.json"), data)])
    assert "commit fffffff (warning: not in this checkout's history)" in text
    assert any("not in this checkout's history" in r.getMessage() for r in caplog.records)


def test_every_stored_result_names_its_commit():
    for path in sorted((ROOT / "results").glob("*.json")):
        data = json.loads(path.read_text())
        assert "commit" in data and "dirty" in data, path.name


def test_a_run_names_the_code_of_its_start_not_of_storing(repo, tmp_path):
    """record_start at a run's start, record_end at its end, run_code when its summary is stored: a commit made in
    between, or a later resume at other code, does not rename the run; the resume is named beside it; every start is
    kept with its time and host."""
    out = tmp_path / "run"
    first = git(repo, "rev-parse", "HEAD")
    record_start(out, repo)
    record_start(out, repo)  # a plain resume at the same code: a second start, the same commit
    starts = json.loads((out / RUN_RECORD).read_text())["starts"]
    assert len(starts) == 2 and starts[0]["date"].endswith("Z") and "model_name" in starts[0]["host"]
    (repo / "a.py").write_text("x = 3\n")
    git(repo, "commit", "-qam", "two")
    code = run_code(out, repo)
    assert (code["commit"], code["dirty"], code["code_recorded"]) == (first, False, "at start")
    assert code["duration_s"] is None  # no end recorded yet
    assert "resumed_at" not in code
    record_start(out, repo)
    record_end(out, 12.34)
    second = git(repo, "rev-parse", "HEAD")
    code = run_code(out, repo)
    assert code["resumed_at"] == [second] and code["duration_s"] == 12.3 and code["ended"].endswith("Z")
    assert code["started"] == starts[0]["date"]
    assert f"commit {first[:7]} (resumed at {second[:7]})" in dated({"date": "2026-11-27", **code})
    never = run_code(tmp_path / "never-recorded", repo)
    assert never == {**code_version(repo), "code_recorded": "at storing"}
    assert "(read when stored, not at the run's start)" in dated({"date": "2026-11-27", **never})


def test_a_new_run_in_an_old_folder_names_its_own_start(repo, tmp_path):
    out = tmp_path / "run"
    record_start(out, repo)
    (repo / "a.py").write_text("x = 5\n")
    git(repo, "commit", "-qam", "three")
    record_start(out, repo)
    new_run(out)  # the run starts over: the earlier run's start is not its own
    assert run_code(out, repo)["commit"] == git(repo, "rev-parse", "HEAD")
    assert len(json.loads((out / RUN_RECORD).read_text())["starts"]) == 1


def test_a_resumed_run_adds_the_seconds_of_the_parts_it_read_back(repo, tmp_path):
    """A part's seconds are kept when it finishes; a later start that reads it back adds them to its own, and a new
    run in the folder keeps them (its parts may be read back); a part read back without seconds leaves no duration."""
    out = tmp_path / "run"
    record_start(out, repo)
    first = PartClock(out)
    first.ran("curve", 100.0)
    first.ran("engine a", 50.04)
    record_start(out, repo)  # stopped, started again
    new_run(out)
    again = PartClock(out)
    again.read_back("curve")
    again.read_back("engine a")
    again.ran("engine b", 20.0)
    assert again.duration(30.0) == pytest.approx(180.0)
    record_end(out, again.duration(30.0))
    assert run_code(out, repo)["duration_s"] == 180.0
    old = PartClock(out)
    old.read_back("engine written before parts were kept")
    assert old.duration(30.0) is None


def test_a_benchmark_continues_only_on_the_code_and_host_kind_it_started_on(repo, tmp_path, monkeypatch):
    """check_resume: the same commit on the same host continues; another commit, a dirty tree over a clean start or
    another host kind is refused in one line naming both, and the refused start leaves no trace."""
    from compute import code_version as cv

    out = tmp_path / "run"
    first = git(repo, "rev-parse", "HEAD")
    record_start(out, repo)
    record_start(out, repo)
    check_resume(out)  # the same code and host: continues
    (repo / "a.py").write_text("x = 4\n")
    record_start(out, repo)
    with pytest.raises(ValueError, match="clean tree .* uncommitted changes"):
        check_resume(out)
    git(repo, "commit", "-qam", "four")
    record_start(out, repo)
    head = git(repo, "rev-parse", "HEAD")
    with pytest.raises(ValueError, match=f"started at commit {first[:7]}, this is {head[:7]}"):
        check_resume(out)
    git(repo, "checkout", "-q", first)
    other = {**cv.host_facts(), "model_name": "AMD EPYC 9B45", "family": "26", "simd_flags": ["avx2", "avx512f"]}
    monkeypatch.setattr(cv, "host_facts", lambda: other)
    record_start(out, repo)
    with pytest.raises(ValueError, match=r"this is AMD EPYC 9B45 \(family 26 .*AVX-512\).*another --out_dir"):
        check_resume(out)
    starts = json.loads((out / RUN_RECORD).read_text())["starts"]
    assert len(starts) == 2 and {s["commit"] for s in starts} == {first}  # the refused starts were not kept


def test_the_command_a_run_started_with_is_stored_with_it(tmp_path, monkeypatch):
    """start_run records prog and the arguments; pipelines.results stores that command unless --command is given."""
    from dataclasses import dataclass

    from pipelines.cli import start_run

    @dataclass
    class Cfg:
        out_dir: str

    out = tmp_path / "run"
    start_run(Cfg(str(out)), "python -m pipelines.vllm_bench", ["--config", "c.yaml", "--max_new_tokens", "64"])
    assert recorded_command(out) == "python -m pipelines.vllm_bench --config c.yaml --max_new_tokens 64"
    monkeypatch.setattr("sys.argv", ["x", "--n_prompts", "2"])
    start_run(Cfg(str(tmp_path / "other")), "python -m pipelines.benchmark")  # the command line's arguments
    assert recorded_command(tmp_path / "other") == "python -m pipelines.benchmark --n_prompts 2"
    assert recorded_command(tmp_path / "never") is None


def test_a_dirty_start_is_named_dirty(repo, tmp_path):
    out = tmp_path / "run"
    (repo / "a.py").write_text("x = 4\n")  # an uncommitted change to a tracked file
    record_start(out, repo)
    code = run_code(out, repo)
    assert code["dirty"] is True
    assert " + uncommitted changes" in dated({"date": "2026-11-27", **code})


def test_provenance_written_afterwards_is_not_trusted():
    """A ``commit_source`` field (provenance set by hand after the run) renders as not recorded by the run."""
    text = dated({"date": "2026-11-26", "commit": "a" * 40, "dirty": None, "commit_source": "inferred from history"})
    assert "provenance not recorded by the run" in text and "inferred" not in text


def test_a_broken_code_record_is_named(tmp_path):
    (tmp_path / RUN_RECORD).write_text("{not json")
    with pytest.raises(ValueError, match="code_version.json: not a code record"):
        run_code(tmp_path)
