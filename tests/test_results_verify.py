"""``python -m pipelines.results --verify``: every stored summary's figures recomputed from its per-prompt records.
Stored files without records are expected to fail (strict: a re-measured file flips its test); a summary written by
the storing code from benchmark rows verifies, and a tampered copy is refused naming the figure."""
from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from benchmark.records import pass_adjusted
from benchmark.report import finish_rows
from benchmark.rows import Row
from pipelines import results as results_cli
from pipelines.results import verify_summary
from rendering.result_store import Summary, load_summaries, summarize_benchmark, write_summary
from runtimes.vllm.bench import TARGET_ALONE, RowRole, RowRun
from runtimes.vllm.bench_report import goals_of, table_entries, unit_records
from runtimes.vllm.results import VLLM_ROW_FIELDS, verify_vllm_summary
from runtimes.vllm.settings import BatchPick

ROOT = Path(__file__).resolve().parents[1]
STORED = sorted((ROOT / "results").glob("*.json"))


def has_records(data: dict) -> bool:
    rows = data.get("rows") or []
    return data["kind"] in ("benchmark", "vllm_benchmark") and bool(rows) and all(r.get("records") for r in rows)


def stored_case(path: Path):
    data = json.loads(path.read_text())
    if data["kind"] == "device_check" or has_records(data):
        return path
    if data["kind"] == "main_job" and path.with_suffix(".records.parquet").is_file():
        return path
    if data["kind"] == "main_job":
        return pytest.param(path, marks=pytest.mark.xfail(strict=True, reason="stored before a main job's "
                                                                              "records; re-measure"))
    return pytest.param(path, marks=pytest.mark.xfail(strict=True, reason="stored before per-prompt records; "
                                                                          "re-measure"))


@pytest.mark.parametrize("path", [stored_case(p) for p in STORED], ids=[p.name for p in STORED])
def test_every_stored_result_recomputes_from_its_records(path):
    (summary,) = [s for s in load_summaries(ROOT / "results") if s.path == path]
    assert verify_summary(summary) is None


class Tokens:
    """A tokenizer stand-in: the ids as words (ROUGE-L reads them)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def engine_row(name: str, kind: str, rng: random.Random, ref: list[list[int]], **identity) -> Row:
    row = Row(name, "engine", kind=kind, **identity)
    for out in ref:
        own = out if rng.random() < 0.7 else out[:-1] + [99]
        rounds = rng.randint(2, 5)
        drafted = rng.randint(rounds, 4 * rounds)
        row.outputs.append(own)
        row.seconds.append(rng.uniform(0.5, 1.5) * len(own) / 20)
        row.count_prompt(rounds, drafted, rng.randint(0, drafted))
    row.rounds, row.draft_tokens, row.accepted = (sum(x) for x in (row.prompt_rounds, row.prompt_drafted,
                                                                   row.prompt_accepted))
    return row


def run_passes(rows: list[Row], passes: int, rng: random.Random) -> None:
    """Each prompt timed ``passes`` times a row, each pass at its own host speed and one run in ten a spike: every
    run's seconds stored (``pass_seconds``), the row's seconds their pass-adjusted value, as ``run_prompt`` sets
    them."""
    for j in range(len(rows[0].seconds)):
        speed = [rng.uniform(1.0, 1.4) for _ in range(passes)]
        runs = {r.name: [r.seconds[j] * v * (1.5 if rng.random() < 0.1 else 1.0) for v in speed] for r in rows}
        adjusted = pass_adjusted(runs)
        for r in rows:
            r.pass_seconds.append(runs[r.name])
            r.seconds[j] = adjusted[r.name]


def benchmark_folder(tmp_path: Path, n: int = 9, passes: int = 1) -> Path:
    """A finished benchmark's folder, its report entries computed by ``finish_rows`` from hand-made rows (each timed
    ``passes`` times a prompt)."""
    rng = random.Random(5)
    ref = [[rng.randrange(50) for _ in range(rng.randint(8, 16))] for _ in range(n)]
    base = Row("target-only", "target.generate", outputs=ref, seconds=[len(o) / 10 for o in ref])
    for _ in ref:
        base.count_prompt(0, 0, 0)
    rows = [base, engine_row("hf:default", "", rng, ref), engine_row("hf:recommended", "", rng, ref),
            engine_row("svip:0.3", "svip", rng, ref, verification="threshold", thresholded=True),
            engine_row("disco (val-tuned 0.4)", "disco", rng, ref, verification="threshold", thresholded=True),
            engine_row("goodput:disco", "goodput-disco", rng, ref, verification="goodput")]
    for r in rows[1:3]:
        r.method = "transformers assisted"
    if passes > 1:
        run_passes(rows, passes, rng)
    bench = SimpleNamespace(decoding=SimpleNamespace(temperature=0.0, seed=3, samples_per_prompt=1), prompts=[[1]] * n,
                            tokenizer=Tokens())
    table = finish_rows(rows, bench, n_boot=200, quiet=True)
    out = tmp_path / "bench"
    out.mkdir()
    (out / "benchmark.json").write_text(json.dumps({"rows": table, "prompt_ids": [[1]] * n, "prompts_of_run": n}))
    (out / "config.yaml").write_text(yaml.safe_dump({"models": {"draft": "tiny:1", "target": "tiny:2"}, "seed": 3,
                                                     "n_boot": 200, "max_new_tokens": 16, "temperature": 0.0}))
    (out / "cost_model.json").write_text(json.dumps({"machine": {"model_name": "x"}, "compute_path": "eager"}))
    return out


def test_a_stored_benchmark_verifies_and_a_tampered_copy_names_its_figure(tmp_path, capsys):
    summary = summarize_benchmark(benchmark_folder(tmp_path), "python -m pipelines.benchmark", "benchmark-x")
    assert all(r["records"]["output_sha1"] for r in summary["rows"]) and summary["rows"][2]["vs_defaults"]
    good = tmp_path / "good"
    path = write_summary(summary, good)
    assert verify_summary(Summary(path, summary)) is None
    assert results_cli.main(["--verify", "true", "--results_dir", str(good)]) == 0
    assert "ok, every figure recomputed" in capsys.readouterr().out

    bad = tmp_path / "bad"
    bad.mkdir()
    tampered = json.loads(path.read_text())
    tampered["rows"][4]["vs_best_entropy_hi"] += 0.01
    (bad / path.name).write_text(json.dumps(tampered))
    assert results_cli.main(["--verify", "true", "--results_dir", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "row 'disco (val-tuned 0.4)', field 'vs_best_entropy_hi': stored" in err

    tampered = json.loads(path.read_text())
    tampered["rows"][3]["records"]["output_sha1"][0] = "0" * 12  # an output that no longer equals target-only's
    assert "field 'identical_prompts'" in verify_summary(Summary(path, tampered))
    tampered = json.loads(path.read_text())
    tampered["rows"][0]["records"]["seconds"][1] *= 1.5  # the reference's time: every ratio moves
    assert "row 'target-only', field 'tokens_per_s'" in verify_summary(Summary(path, tampered))


def test_each_prompts_seconds_recompute_from_its_runs(tmp_path):
    """Rows timed three times a prompt store every run; --verify recomputes each prompt's seconds from them."""
    summary = summarize_benchmark(benchmark_folder(tmp_path, passes=3), "python -m pipelines.benchmark", "b")
    assert all(len(runs) == 3 for r in summary["rows"] for runs in r["records"]["pass_seconds"])
    path = tmp_path / "b.json"
    assert verify_summary(Summary(path, summary)) is None
    summary["rows"][3]["records"]["pass_seconds"][2] = [x * 2 for x in summary["rows"][3]["records"]["pass_seconds"][2]]
    assert "row 'svip:0.3', field 'seconds of entry 2': stored" in verify_summary(Summary(path, summary))


def test_a_passs_shared_slow_phase_cancels_and_one_rows_spike_is_outvoted():
    """Pass 2 ran every row 1.3x slower: no row's seconds move; a spike of one row in pass 3 leaves it at its pace."""
    runs = {"t": [2.0, 2.6, 2.0], "a": [1.0, 1.3, 1.0], "b": [1.5, 1.95, 4.0]}
    assert pass_adjusted(runs) == pytest.approx({"t": 2.0, "a": 1.0, "b": 1.5})
    assert pass_adjusted({"t": [2.0], "a": [1.0]}) == {"t": 2.0, "a": 1.0}  # one pass: as measured
    assert pass_adjusted({"t": [2.0, 1.0], "a": [1.0, None]}) == pytest.approx({"t": 1.0, "a": 0.5})


def test_a_summary_without_records_says_how_to_remeasure(tmp_path):
    summary = summarize_benchmark(benchmark_folder(tmp_path), "python -m pipelines.benchmark --config c.yaml", "b")
    for r in summary["rows"]:
        r.pop("records")
    problem = verify_summary(Summary(tmp_path / "b.json", summary))
    assert problem == "no per-prompt records: re-measure with python -m pipelines.benchmark --config c.yaml"


def vllm_row(role: RowRole, batch: int, rng: random.Random, ref: list[list[int]]) -> RowRun:
    name = role.name
    row = RowRun(name=name, batch=batch, spec=name, role=role)
    for i in range(0, len(ref), batch):
        outs = [o if rng.random() < 0.8 or name == TARGET_ALONE else o[:-1] for o in ref[i:i + batch]]
        row.add_unit((outs, rng.uniform(0.5, 1.0) * batch, [], {"drafts": 3.0, "draft_tokens": 9.0, "accepted": 5.0},
                      [], (1, 4), {"1": [3.0, 2.1, 2.0]}))
    return row


def test_a_vllm_summary_recomputes_from_its_unit_records():
    rng = random.Random(2)
    ref = [[rng.randrange(50) for _ in range(12)] for _ in range(8)]
    roles = (RowRole("target"), RowRole("static", k=3), RowRole("policy", spec="disco"))
    rows = [vllm_row(role, b, rng, ref) for b in (1, 4) for role in roles]
    table = table_entries(rows, [1, 4], 0, 300, [])
    picks = [BatchPick(1, 3, 1.2, 1.1, 3), BatchPick(4, 3, 1.1, 1.0, 3)]
    data = {"batch_sizes": [1, 4], "seed": 0, "n_boot": 300, "picks": [p.to_dict() for p in picks],
            "rows": json.loads(json.dumps([{k: t[k] for k in VLLM_ROW_FIELDS if k in t} for t in table])),
            "goals": json.loads(json.dumps(goals_of(table, picks, [1, 4], [])))}
    assert all(t["records"] == unit_records(r) for t, r in zip(table, rows))
    assert data["goals"]["batch_1"]["recommended_row"] == "vllm:3" and verify_vllm_summary(data) is None
    data["goals"]["batch_4"]["recommended_vs_fastest"] += 0.01
    assert verify_vllm_summary(data).field == "batch_4.recommended_vs_fastest"
    data["rows"][5]["vs_fastest_fixed"][1] -= 0.01
    first = verify_vllm_summary(data)
    assert (first.row, first.field) == ("disco at batch 4", "vs_fastest_fixed")


def test_an_estimated_time_is_marked_in_every_table():
    from rendering.result_runtimes import rows_table
    from rendering.result_store import ESTIMATED_NOTE
    from rendering.result_tables import _verdicts, benchmark_table

    rows = [{"row": "target-only", "tokens_per_s": 15.3, "note": "reference"},
            {"row": "oracle", "kind": "oracle", "tokens_per_s": 31.13, "speedup": 2.03, "estimated": True}]
    s = Summary(Path("x.json"), {"rows": rows, "n_prompts": 2, "temperature": 1.0, "max_new_tokens": 8})
    assert "| oracle | 31.13* |" in benchmark_table(s) and _verdicts(s).endswith(ESTIMATED_NOTE)
    assert "| `oracle` | 31.13* |" in rows_table(s) and ESTIMATED_NOTE in rows_table(s)
    rows[1]["estimated"] = False
    assert "| oracle | 31.13 |" in benchmark_table(s) and ESTIMATED_NOTE not in _verdicts(s)


def test_the_gpu_checks_summary_reads_each_steps_line_from_its_json(tmp_path, monkeypatch):
    """scripts/device_check.py writes each step's details line into device-check.json; the summary reads it there
    (no Markdown is read back)."""
    import time

    from rendering.device_results import summarize_device_check

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import device_check as dc

    monkeypatch.setattr(dc, "out_dir", lambda: tmp_path)
    monkeypatch.setattr(dc, "commit_facts", lambda: {"commit": "abc", "dirty": False})
    step = dc.Step(name="pytest", cap=10, argv=["x"], status="pass", seconds=3.0, returncode=0, tail="",
                   details={"passed": 21, "failures": 0, "errors": 0, "skipped": 0})
    dc.write_summary([step], {"gpu": "H200", "torch": "2", "python": "3.12"}, "cuda", 600, time.monotonic(),
                     "2026-11-30T15:00:00Z")
    (tmp_path / "device-check.md").unlink()
    summary = summarize_device_check(tmp_path / "device-check.json")
    (st,) = summary["steps"]
    assert st["details"] == "21 passed, 0 failed, 0 errors, 0 skipped"
    assert (summary["started"], summary["date"], summary["code_recorded"]) == ("2026-11-30T15:00:00Z", "2026-11-30",
                                                                               "at start")
    assert summary["ended"].endswith("Z") and summary["duration_s"] is not None


def test_the_pace_with_a_group_in_flight_leaves_its_tail_out_and_recomputes_from_the_records():
    from runtimes.vllm.engine import StepLog

    rng = random.Random(3)
    ref = [[rng.randrange(50) for _ in range(12)] for _ in range(8)]
    rows = []
    for role in (RowRole("target"), RowRole("static", k=3), RowRole("policy", spec="disco")):
        row = RowRun(name=role.name, batch=4, spec=role.name, role=role)
        for i in range(0, 8, 4):
            step = rng.uniform(0.5, 1.0)  # two decode steps with all 4 requests in flight, then one with 1 left
            steps = [StepLog(0.4, 4, False, 4), StepLog(step, 4, True, 10), StepLog(step, 4, True, 10),
                     StepLog(5.0, 1, True, 2)]
            row.add_unit((ref[i:i + 4], 0.4 + 2 * step + 5.0, steps, {}, [], (0, 0), {}))
        rows.append(row)
    assert [t for t, _ in rows[2].in_flight()] == [20, 20]  # the tail's step and the prefill left out
    assert RowRun(name="x", batch=4, spec="x", steps=[[StepLog(1.0, 4, True)]], outputs=[ref[:4]]).in_flight() is None
    table = table_entries(rows, [4], 0, 300, [])
    policy = table[2]
    assert policy["fastest_fixed_in_flight"] in ("vLLM target alone", "vllm:3")
    lo, hi = policy["vs_fastest_fixed_in_flight"][1:]
    assert lo <= policy["vs_fastest_fixed_in_flight"][0] <= hi
    data = {"batch_sizes": [4], "seed": 0, "n_boot": 300, "picks": [],
            "rows": json.loads(json.dumps([{k: t[k] for k in VLLM_ROW_FIELDS if k in t} for t in table])),
            "goals": json.loads(json.dumps(goals_of(table, [], [4], [])))}
    assert data["goals"]["batch_4"]["policies_vs_fastest_fixed_in_flight"] and verify_vllm_summary(data) is None
    data["rows"][2]["records"]["in_flight_seconds"][0] *= 1.5
    first = verify_vllm_summary(data)
    assert (first.row, first.field) == ("disco at batch 4", "in_flight_tokens_per_s")


def test_the_fixed_bar_chosen_on_the_other_groups_is_not_raised_by_the_groups_compared():
    """Two fixed settings each fast on one group: the fastest-measured bar takes the better total, the fair bar takes
    on each group the setting fastest on the other one; both figures recompute from the records."""
    from runtimes.vllm.bench_report import chosen_elsewhere

    assert chosen_elsewhere([[(10, 1.0), (10, 2.0)], [(10, 1.9), (10, 1.2)]]) == [1, 0]
    assert chosen_elsewhere([[(10, 1.0)], [(10, 2.0)]]) is None  # one group: nothing else to choose on
    outs = [[[1] * 10], [[2] * 10]]
    rows = []
    for role, seconds in ((RowRole("target"), [1.0, 2.0]), (RowRole("static", k=3), [1.9, 1.2]),
                          (RowRole("policy", spec="disco"), [1.5, 1.5])):
        row = RowRun(name=role.name, batch=1, spec=role.name, role=role)
        for unit, s in zip(outs, seconds):
            row.add_unit((unit, s, [], {}, [], (0, 0), {}))
        rows.append(row)
    table = table_entries(rows, [1], 0, 200, [])
    policy = table[2]
    assert policy["vs_fastest_fixed"][0] == 1.0 and policy["fastest_fixed"] == TARGET_ALONE
    assert policy["vs_fixed_chosen_elsewhere"][0] == 1.3
    assert policy["fixed_chosen_elsewhere"] == ["vllm:3", TARGET_ALONE]
    assert "vs_fixed_chosen_elsewhere_in_flight" not in policy  # steps without tokens counted
    data = {"batch_sizes": [1], "seed": 0, "n_boot": 200, "picks": [],
            "rows": json.loads(json.dumps([{k: t[k] for k in VLLM_ROW_FIELDS if k in t} for t in table])),
            "goals": json.loads(json.dumps(goals_of(table, [], [1], [])))}
    assert data["goals"]["batch_1"]["policies_vs_fixed_chosen_elsewhere"]["disco"][0] == 1.3
    from runtimes.vllm.results import _goal_lines, _rows_table

    shown = Summary(Path("x.json"), data)
    assert "| vs fixed setting fastest on the other groups [95% CI] |" in _rows_table(shown, 1)[0]
    assert any("ran 1.30x" in line and "(`vllm:3` for 1 group, `vLLM target alone` for 1 group)" in line
               for line in _goal_lines(shown))
    assert verify_vllm_summary(data) is None
    data["rows"][2]["vs_fixed_chosen_elsewhere"][0] = 1.0
    first = verify_vllm_summary(data)
    assert (first.row, first.field) == ("disco at batch 1", "vs_fixed_chosen_elsewhere")
