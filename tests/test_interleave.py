"""Rows decoding one prompt together a step at a time (benchmark.interleave): the step order, each row's seconds, and
target-only's and the engine's lanes giving the tokens their whole-prompt runs give."""
from __future__ import annotations

import json
from collections.abc import Generator
from pathlib import Path

import pytest
import torch

from benchmark.interleave import Lane, interleave
from benchmark.rows import Row

ROOT = Path(__file__).resolve().parents[1]


def _counting(name: str, per_step: int, n: int, log: list[str]) -> Lane:
    def steps() -> Generator[int, None, list[int]]:
        done = 0
        while done < n:
            log.append(name)
            done = min(n, done + per_step)
            if done < n:
                yield done
        return list(range(n))

    return Lane(name, steps(), lambda out, s: Row(name, "m", seconds=[s], outputs=[out]))


def test_the_lane_with_fewest_tokens_steps_next_and_each_row_keeps_its_own_seconds():
    """A 1-token-a-step lane takes about four steps for each of a 4-token-a-step lane's: they move through their
    outputs side by side; every lane ends with its whole output, its seconds the sum of its own steps."""
    log: list[str] = []
    rows = interleave([_counting("t", 1, 8, log), _counting("e", 4, 8, log)], torch.device("cpu"))
    assert log == ["t", "e", "t", "t", "t", "t", "e", "t", "t", "t"]
    assert rows["t"].outputs == [list(range(8))] and rows["e"].outputs == [list(range(8))]
    assert all(r.seconds[0] >= 0 for r in rows.values())


@pytest.fixture(scope="module")
def view(tiny_pair):
    from benchmark.bench import Bench, DecodeSettings
    from benchmark.config import BenchmarkConfig

    draft, target, tok = tiny_pair
    cfg = BenchmarkConfig(max_new_tokens=12, n_prompts=1)
    ids = tok("def add(a, b):")["input_ids"]
    return Bench(DecodeSettings.of(cfg), draft, target, None, tok, prompts=[ids], eos=[tok.eos_token_id])


def test_target_only_and_engine_lanes_give_the_tokens_their_whole_runs_give(view):
    """Greedy: target-only's forward loop gives generate's tokens, and an engine row stepped beside it gives its own
    whole-prompt run's tokens and counters (which equal target-only's: exact decoding)."""
    from benchmark.runners import engine_lane, run_engine, run_target_only, target_only_lane

    whole = run_target_only(view)
    engine = run_engine(view, "static:3")
    lanes = [target_only_lane(view), engine_lane(view, "static:3")]
    rows = interleave([lane for lane in lanes if lane is not None], view.target.device)
    assert rows["target-only"].outputs == whole.outputs
    assert rows["target-only"].method == "target forward loop" and rows["target-only"].target_calls == whole.tokens
    got = rows[lanes[1].name]
    assert got.outputs == engine.outputs == whole.outputs
    assert (got.rounds, got.accepted, got.prompt_drafted) == (engine.rounds, engine.accepted, engine.prompt_drafted)
    assert got.seconds[0] > 0 and len(got.prefill_seconds) == 1


def test_a_policy_that_reads_target_only_first_gets_no_lane(view):
    from benchmark.runners import engine_lane

    assert engine_lane(view, "oracle") is None


def test_an_interleaved_benchmark_runs_every_row_exactly(tmp_path):
    """The smoke benchmark with interleave: the engine rows and target-only step together, the others (transformers'
    rows, the oracle) after them; every exact row's outputs equal target-only's."""
    from pipelines.benchmark import main

    out = tmp_path / "bench"
    result = main(["--config", str(ROOT / "configs" / "benchmark-smoke.yaml"), "--out_dir", str(out),
                   "--tracking", "false", "--n_prompts", "2", "--max_new_tokens", "8", "--reference_compute", "null",
                   "--policies", json.dumps(["static:3", "svip:0.3", "oracle"]), "--predictors", "[]",
                   "--hf_rows", '["static:3"]', "--interleave", "true", "--repeats", "2",
                   "--results_dir", str(tmp_path / "results")])
    rows = {r["row"]: r for r in result["rows"]}
    assert rows["target-only"]["method"] == "target forward loop"
    for name in ("static:3", "svip:0.3", "oracle", "hf:static:3"):
        assert rows[name]["exact"] is True and rows[name]["identical_prompts"] == 2, name
    assert len(rows["static:3"]["records"]["pass_seconds"]) == 2
    assert "each step timed alone" in (out / "benchmark.md").read_text()


def test_interleave_needs_order_prompt():
    from benchmark.config import BenchmarkConfig

    with pytest.raises(ValueError, match="interleave=true .* use order prompt"):
        BenchmarkConfig(interleave=True, order="row")


def test_sampled_lanes_repeat_under_their_seed(view):
    """Temperature 1: target-only's loop and an engine lane draw from their own seeded generators, so a second
    interleaved run of the same decode gives the same tokens (the rows' seeds, not the step order, decide them)."""
    from dataclasses import replace

    from benchmark.runners import engine_lane, target_only_lane

    sampled = replace(view, decoding=replace(view.decoding, temperature=1.0))
    runs = [interleave([target_only_lane(sampled), engine_lane(sampled, "static:3")], sampled.target.device)
            for _ in range(2)]
    assert [r.outputs for r in runs[0].values()] == [r.outputs for r in runs[1].values()]
    assert all(len(r.outputs[0]) > 0 for r in runs[0].values())
