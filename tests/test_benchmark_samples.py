"""Several seeded samples a prompt (``samples_per_prompt``): every row decodes sample s of prompt i with the same seed,
the records keep every sample, the intervals resample prompts with their samples (and ``--verify`` recomputes them),
a stopped run continues at its first unfinished (prompt, sample), and greedy decoding refuses more than one sample."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmark.bench import SAMPLE_SEED_STRIDE, Bench, DecodeSettings, RunOrder, decode_units
from benchmark.config import BenchmarkConfig
from benchmark.records import bootstrap_indices, paired_ratio, prompt_means, seconds_ratio
from benchmark.resume import PromptStore, run_identity
from benchmark.rows import Row
from compute.timing import CostModel
from decoding.engine import DecodeStats
from pipelines.benchmark import main

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
MACHINE = {"model_name": "CPU A", "simd_flags": ["avx2"], "bf16_chain": "none"}


def _curve() -> CostModel:
    return CostModel(draft_s_per_token=0.01, target_s={1: 0.1, 2: 0.11}, draft_name="d", target_name="t",
                     compute_path="eager", machine=MACHINE)


def test_a_greedy_run_refuses_several_samples_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", str(ROOT / "configs" / "benchmark-smoke.yaml"), "--samples_per_prompt", "2"])
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]  # after the usage lines
    assert e.value.code == 2 and len(errors) == 1 and "samples_per_prompt=2 with temperature 0" in errors[0], errors
    with pytest.raises(ValueError, match="samples_per_prompt=0"):
        BenchmarkConfig(samples_per_prompt=0, temperature=1.0)


def test_the_sampled_headline_config_runs_the_deciding_rows_with_several_samples():
    from pipelines.cli import parse_config

    cfg = parse_config(BenchmarkConfig, ["--config", str(ROOT / "configs" / "benchmark-full-t1.yaml")], "")
    assert cfg.temperature == 1.0 and cfg.samples_per_prompt > 1 and cfg.replay_check
    assert cfg.policies == ["svip:tuned", "adaedl:tuned"] and cfg.hf_rows == [] and len(cfg.predictors) == 2


def test_sample_zero_keeps_each_prompts_seed_and_every_row_shares_them():
    one = Bench(DecodeSettings.of(BenchmarkConfig(seed=7, temperature=1.0)), None, None, None, None,  # type: ignore[arg-type]
                prompts=[[1], [2], [3]], eos=[0])
    assert [one.seed_of(i) for i in range(3)] == [7, 8, 9] and decode_units(3, 1) is None
    cfg = BenchmarkConfig(seed=7, temperature=1.0, samples_per_prompt=2)
    two = Bench(DecodeSettings.of(cfg), None, None, None, None, prompts=[[1], [1], [2], [2]], eos=[0])  # type: ignore[arg-type]
    assert [two.seed_of(i) for i in range(4)] == [7, 7 + SAMPLE_SEED_STRIDE, 8, 8 + SAMPLE_SEED_STRIDE]
    assert decode_units(4, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    view = Bench(two.decoding, None, None, None, None, prompts=[[2]], eos=[0], offset=3)  # type: ignore[arg-type]
    assert view.unit(0) == (1, 1) and view.seed_of(0) == 8 + SAMPLE_SEED_STRIDE  # a per-decode view, as rows run


def test_the_cluster_bootstrap_narrows_as_samples_average_out_the_lengths():
    """Prompts with a small real effect, and per sample another text (its length, how well the draft guesses it): the
    rows' samples differ, so a sample's speed is noisy; resampling prompts with their samples, the interval shrinks
    about as 1/sqrt(samples); one sample a prompt is the plain paired bootstrap."""
    rng = np.random.default_rng(1)
    n = 23

    def interval(k: int) -> tuple[float, float, float]:
        tok, ref_tok = rng.integers(20, 129, n * k), rng.integers(20, 129, n * k)
        effect = np.repeat(rng.normal(1.04, 0.01, n), k)
        sec = tok / (30 * effect * rng.lognormal(0, 0.15, n * k))  # this sample's text: its own speed
        ref_sec = ref_tok / (30 * rng.lognormal(0, 0.15, n * k))
        prompts = np.repeat(np.arange(n), k).tolist() if k > 1 else None
        return paired_ratio(tok, sec, ref_tok, ref_sec, bootstrap_indices(0, 1000, n), prompts)

    wide, narrow = interval(1), interval(8)
    assert wide[2] - wide[1] > 1.8 * (narrow[2] - narrow[1]) and narrow[1] < 1.04 < narrow[2]
    tok, sec = [10, 20, 30], [1.0, 1.5, 2.0]
    boot = bootstrap_indices(0, 200, 3)
    assert paired_ratio(tok, sec, tok[::-1], sec, boot) == paired_ratio(tok, sec, tok[::-1], sec, boot, [0, 1, 2])


def test_a_ratio_of_seconds_resamples_the_units_in_pairs():
    rng = np.random.default_rng(2)
    sec, base = rng.uniform(1, 3, 12), rng.uniform(1, 3, 12)
    boot = bootstrap_indices(0, 500, 12)
    point, lo, hi = seconds_ratio(sec, base, boot)
    draws = sec[boot].sum(1) / base[boot].sum(1)
    assert point == pytest.approx(sec.sum() / base.sum())
    assert (lo, hi) == pytest.approx(tuple(np.percentile(draws, [2.5, 97.5])))


def test_quality_is_averaged_per_prompt_before_the_prompts():
    assert prompt_means([1.0, 0.0, 0.5, 0.5, 0.9], [0, 0, 1, 1, 1]) == pytest.approx([0.5, 0.6333333])
    assert prompt_means([True, False, None, None], [0, 0, 1, 1]) == [0.5, None]
    assert prompt_means([True, None], None) == [True, None]


def _plan(calls: list[tuple[int, int, str]], fail_at: int | None = None):
    def runner(name: str):
        def run(view: Bench) -> Row:
            if view.offset == fail_at:
                raise KeyboardInterrupt  # the run stopped during this decode
            calls.append((view.offset, view.seed_of(0), name))
            stats = DecodeStats(tokens=2, rounds=1, accepted_lengths=[1], draft_time=0.5, draft_forwards=2)
            return Row(name, "engine", seconds=[1.0 + view.offset], outputs=[[view.offset, 7]], rounds=1,
                       decode=stats)
        return run
    return [("target-only", runner("target-only")), ("a", runner("a"))]


def test_a_stopped_run_continues_at_its_first_unfinished_sample(tmp_path, monkeypatch):
    import benchmark.plan as plan

    probes: list[int] = []
    monkeypatch.setattr(plan, "measure_curve", lambda view, repeats: probes.append(view.offset) or _curve())
    cfg = BenchmarkConfig(repeats=1, n_prompts=2, temperature=1.0, samples_per_prompt=2)
    bench = Bench(DecodeSettings.of(cfg), None, None, None, None, prompts=[[1], [1], [2], [2]], eos=[0])  # type: ignore[arg-type]
    store = PromptStore(tmp_path / "prompts", cfg.samples_per_prompt)
    store.begin(run_identity(cfg, [[1], [2]]), _curve())
    first: list[tuple[int, int, str]] = []
    with pytest.raises(KeyboardInterrupt):
        plan.run_rows(_plan(first, fail_at=3), bench, RunOrder.of(cfg), store)
    assert store.done() == [0, 1, 2] and probes == [1]  # the curve probed once a prompt, after its last sample
    assert sorted(p.name for p in store.folder.glob("prompt-*")) == ["prompt-0000-s0.json", "prompt-0000-s1.json",
                                                                      "prompt-0001-s0.json"]
    again: list[tuple[int, int, str]] = []
    rows = {r.name: r for r in plan.run_rows(_plan(again), bench, RunOrder.of(cfg), store)}
    assert again == [(3, 1 + SAMPLE_SEED_STRIDE, "target-only"), (3, 1 + SAMPLE_SEED_STRIDE, "a")]
    assert [s for _, s, n in first if n == "a"] == [0, SAMPLE_SEED_STRIDE, 1]  # the same seeds in every row
    assert rows["a"].seconds == [1.0, 2.0, 3.0, 4.0] and probes == [1, 3]
    other = BenchmarkConfig(repeats=1, n_prompts=2, temperature=1.0, samples_per_prompt=3)
    with pytest.raises(ValueError, match="samples_per_prompt: stored 2, now 3"):
        store.resume(run_identity(other, [[1], [2]]), MACHINE, "d", "t", "eager")


ARGV = ["--config", str(ROOT / "configs" / "benchmark-smoke.yaml"), "--tracking", "false", "--n_prompts", "2",
        "--max_new_tokens", "5", "--policies", '["static:3", "svip:0.3", "adaedl"]', "--hf_rows", "[]",
        "--reference_compute", "null", "--repeats", "1", "--temperature", "1.0"]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """The smoke benchmark at temperature 1 with two samples a prompt (its replay check and stored summary), and the
    same run with one sample a prompt."""
    tmp = tmp_path_factory.mktemp("samples")
    argv = [*ARGV, "--out_dir", str(tmp / "two"), "--samples_per_prompt", "2", "--results_dir", str(tmp / "results")]
    two = main(argv)
    one = main([*ARGV, "--out_dir", str(tmp / "one"), "--replay_check", "false"])
    return argv, two, one, tmp


def test_every_sample_is_recorded_and_sample_zero_is_the_one_sample_run(sampled):
    argv, two, one, tmp = sampled
    for r in two["rows"]:
        rec = r["records"]
        assert rec["prompt"] == [0, 0, 1, 1] and rec["sample"] == [0, 1, 0, 1] and len(rec["tokens"]) == 4, r["row"]
    for r1, r2 in zip(one["rows"], two["rows"]):  # sample 0 decodes with the 1-sample run's seed: the same output
        first = [i for i, s in enumerate(r2["records"]["sample"]) if s == 0]
        for key in ("output_sha1", "tokens", "rounds", "drafted", "accepted"):
            assert r1["records"][key] == [r2["records"][key][i] for i in first], (r1["row"], key)
        assert "prompt" not in r1["records"]
    hashes = [r["records"]["output_sha1"] for r in two["rows"]]
    assert any(h[0] != h[1] or h[2] != h[3] for h in hashes)  # another seed, another sample
    names = sorted(p.name for p in (tmp / "two" / "prompts").glob("prompt-*"))
    assert names == ["prompt-0000-s0.json", "prompt-0000-s1.json", "prompt-0001-s0.json", "prompt-0001-s1.json"]
    report = json.loads((tmp / "two" / "benchmark.json").read_text())
    assert report["samples_per_prompt"] == 2 and len(report["prompt_ids"]) == 2 and len(report["prompts"]) == 2
    assert len(report["rows"][0]["output_ids"]) == 4
    assert "x 2 samples each" in (tmp / "two" / "benchmark.md").read_text()
    check = two["stats"]["replay_check"]
    assert check is not None and check["summary"]["rows_scored"] == 3  # target-only's 4 samples labelled, replayed


def test_the_intervals_resample_prompts_and_verify_recomputes_them(sampled):
    from pipelines.results import verify_summary
    from rendering.result_store import Summary, load_summaries

    argv, two, one, tmp = sampled
    (summary,) = load_summaries(tmp / "results")
    assert summary.data["n_prompts"] == 2 and verify_summary(summary) is None
    rows = {r["row"]: r for r in summary.data["rows"]}
    base, svip = rows["target-only"]["records"], rows["svip:0.3"]["records"]
    boot = bootstrap_indices(summary.data["seed"], summary.data["n_boot"], 2)  # 2 prompts, not 4 samples
    _, lo, hi = paired_ratio(svip["tokens"], svip["seconds"], base["tokens"], base["seconds"], boot, svip["prompt"])
    assert (round(lo, 3), round(hi, 3)) == (rows["svip:0.3"]["speedup_lo"], rows["svip:0.3"]["speedup_hi"])
    tampered = json.loads(summary.path.read_text())
    tampered["rows"][2]["speedup_hi"] = round(tampered["rows"][2]["speedup_hi"] + 0.01, 3)
    assert "field 'speedup_hi'" in verify_summary(Summary(summary.path, tampered))
    tampered = json.loads(summary.path.read_text())
    tampered["rows"][0]["records"]["seconds"][3] *= 1.5  # one sample's time: the figures move
    assert "row 'target-only', field 'tokens_per_s'" in verify_summary(Summary(summary.path, tampered))


def test_a_finished_sampled_run_reads_back_and_another_sample_count_is_refused(sampled, caplog, capsys):
    argv, two, one, tmp = sampled
    caplog.set_level("INFO")
    again = main([*argv[:-2], "--replay_check", "false"])  # every sample read back: the same rows
    assert "read back from an earlier run" in caplog.text
    keys = ("row", "tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "prompt_tokens", "records")
    assert [{k: r[k] for k in keys} for r in again["rows"]] == [{k: r[k] for k in keys} for r in two["rows"]]
    with pytest.raises(SystemExit):
        main([*argv[:-2], "--samples_per_prompt", "3"])
    assert "samples_per_prompt: stored 2, now 3" in capsys.readouterr().err
