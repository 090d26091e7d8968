"""The generator end to end on tiny models: shards, summary, resume after a kill, budget, config guard, Fabric ranks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from compute import compute_path as cp
from compute import models as model_sources
from compute.compute_path import apply_compute_path
from compute.models import ModelSpec, load_model
from data_gen import chunk as chunk_module
from data_gen.config import GenerateConfig, ModelsConfig
from data_gen.continuation_labels import branch_offsets, draft_rollouts, label_continuation
from data_gen.continuations import continue_batch, speculative_trajectory
from data_gen.generate import attention_for_labelling, load_models, run_generation
from data_gen.labelling import LabelModels, LabelOptions, Segment, SequenceSpec, label_sequences, shared_prefix_len
from data_gen.planning import batches_from_longest, label_batches
from data_gen.prompts import PromptSourceConfig
from data_gen.shards import load_records
from pipelines.generate import generate, main
from pipelines.measure_costs import main as measure

ROOT = Path(__file__).resolve().parents[1]
KEY = ["seq_id", "prefix_len"]  # one record per position of a sequence


def tiny_cfg(out: Path, **kw) -> GenerateConfig:
    base = GenerateConfig(
        out_dir=str(out),
        models=ModelsConfig(draft="tiny:1", target="tiny:2:32:3"),
        prompts=[PromptSourceConfig("humaneval", limit=6)],
        max_prompt_tokens=48,
        origins={"prompt": 1.0, "draft": 1.0, "target": 1.0, "text": 1.0},
        sequences_per_prompt=1,
        prefix_tokens=(2, 6),
        rollout_len=6,
        prompts_per_shard=2,
        measure_costs=False,
    )
    return replace(base, **kw)


def frame(out: Path) -> pd.DataFrame:
    df = load_records(out).to_pandas()
    return df.sort_values(KEY).reset_index(drop=True)


def test_generate_writes_shards_and_summary(tmp_path):
    summary = generate(tiny_cfg(tmp_path / "d", origins={"prompt": 1, "draft": 1, "target": 1, "spec": 1, "text": 1}))
    df = frame(tmp_path / "d")
    assert len(df) == summary["overall"]["records"] > 0
    assert set(df["origin"]) <= {"prompt", "draft", "target", "spec", "text"}
    assert df.groupby("sample_id")["split"].nunique().max() == 1  # a prompt never reaches two splits
    assert len(df["draft_topk"].iloc[0]) == 10 and len(df["draft_hidden"].iloc[0]) == 32
    # Rollout tokens are the draft's own: drafted token == sequence token.
    roll = df[df["rollout"]]
    assert (roll["draft_token"] == roll["next_token"]).all()
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["data"]["models"]["draft"] == "tiny:1" and "fingerprints" in cfg["resolved"]
    assert "by_origin" in summary and "origin_cost" in summary["last_run"]


def test_greedy_spec_prefixes_are_the_target_continuation_made_in_batches(tmp_path, monkeypatch):
    """Exact speculative decoding emits the target's greedy tokens, so greedy spec prefixes come from the batched target
    continuation (no assisted generation call) and equal what assisted generation gives."""
    draft, tok = load_model(ModelSpec("tiny:1", compute="eager"))
    target, _ = load_model(ModelSpec("tiny:2:32:3", compute="eager"))
    for m in (draft, target):
        apply_compute_path(m, "packed", min_elements=0)
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=None)
    prompts = [[1, 5, 9, 33, 70, 2], [7, 8, 9]]
    with torch.no_grad():
        batched, _ = continue_batch(target, prompts, [12, 12], **kw)
        assert [speculative_trajectory(target, draft, p, 12, **kw)[0] for p in prompts] == batched

    def no_assisted_generation(*a, **k):
        raise AssertionError("greedy spec prefixes must not run assisted generation")

    monkeypatch.setattr(chunk_module, "speculative_trajectory", no_assisted_generation)
    generate(tiny_cfg(tmp_path / "s", origins={"spec": 1.0}))
    df = frame(tmp_path / "s")
    assert len(df) and set(df["origin"]) == {"spec"}


def test_progress_reports_each_shard_and_each_batch_inside_it(tmp_path):
    """After each shard the progress view gets the same keys as ever; while a shard runs, in-shard updates (marked
    ``in_shard``) after each batch count the shard's records so far; the records do not depend on the callback."""
    events: list[dict] = []
    cfg = tiny_cfg(tmp_path / "p", sample_draw=True)
    run_generation(cfg, progress=events.append)
    shards = [e for e in events if "in_shard" not in e]
    assert [set(e) for e in shards] == [{"chunk", "chunks", "records", "have", "budget", "new_records", "seconds"}] * 3
    assert [e["chunk"] for e in shards] == [0, 1, 2] and shards[-1]["new_records"] == len(frame(tmp_path / "p"))
    done = 0
    for shard in shards:
        inside = [e for e in events if "in_shard" in e and e["chunk"] == shard["chunk"]]
        assert {e["phase"] for e in inside} >= {"draft", "label"}  # target and feed with a target-origin sequence
        counts = [e["in_shard"] for e in inside]
        assert counts == sorted(counts) and counts[-1] == shard["records"]  # no budget: every record is kept
        assert all(e["new_records"] == done + e["in_shard"] == e["have"] for e in inside)
        done += shard["records"]
    assert {e["phase"] for e in events if "in_shard" in e} == {"target", "draft", "feed", "label"}
    generate(replace(cfg, out_dir=str(tmp_path / "q")))  # no progress view: the tqdm bar, same records
    pd.testing.assert_frame_equal(frame(tmp_path / "p"), frame(tmp_path / "q"))


def test_budget_stops_at_exact_count_and_resume_reaches_it(tmp_path):
    out = tmp_path / "b"
    prompts = [PromptSourceConfig("humaneval", limit=16)]
    generate(tiny_cfg(out, max_records=25, prompts=prompts))
    assert len(frame(out)) == 25
    summary = generate(tiny_cfg(out, max_records=60, prompts=prompts))  # a larger budget resumes: no duplicates
    df = frame(out)
    assert len(df) == 60
    assert not df.duplicated(KEY).any()
    # the cost accounting covers both runs: every shard's origin mix and seconds, added up
    cost = summary["cost"]
    assert cost["shards"] == len(list(out.glob("shard-*.parquet"))) and cost["shards_without_cost"] == 0
    assert cost["records"] == 60 and cost["wall_s"] > 0 and cost["records_per_s"] > 0
    assert sum(o["records"] for o in cost["origin"].values()) == 60  # the records kept, per origin
    assert cost["dropped_by_budget"] > 0  # labelled (and paid for), then cut by the budget
    assert set(cost["label_s_by_model"]) >= {"draft", "target"}


def test_budget_keeps_whole_positions_with_two_draws(tmp_path):
    """With two draws per position the budget keeps both or neither: an odd budget stops one record short, and a
    resumed run reaches a larger one with every position complete."""
    out = tmp_path / "two"
    prompts = [PromptSourceConfig("humaneval", limit=16)]
    generate(tiny_cfg(out, max_records=25, prompts=prompts, sample_draw=True))
    assert len(frame(out)) == 24
    generate(tiny_cfg(out, max_records=60, prompts=prompts, sample_draw=True))
    df = frame(out)
    assert len(df) == 60 and not df.duplicated([*KEY, "draw"]).any()
    draws = df.groupby(["seq_id", "prefix_len"])["draw"].agg(lambda d: tuple(sorted(d)))
    assert set(draws) == {("greedy", "sample")}


def test_config_mismatch_refused_unless_overwrite(tmp_path):
    out = tmp_path / "c"
    generate(tiny_cfg(out, max_records=10))
    with pytest.raises(FileExistsError, match="rollout_len"):
        generate(tiny_cfg(out, max_records=10, rollout_len=5))
    generate(tiny_cfg(out, max_records=10, rollout_len=5, overwrite=True))
    assert len(frame(out)) == 10


def test_killed_run_resumes_without_loss_or_duplicates(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "killed"
    generate(tiny_cfg(ref))
    cfg_file = tmp_path / "k.json"
    args = ["--out_dir", str(out), "--models.draft", "tiny:1", "--models.target", "tiny:2:32:3",
            "--prompts", json.dumps([{"name": "humaneval", "limit": 6}]), "--max_prompt_tokens", "48",
            "--origins", json.dumps({"prompt": 1.0, "draft": 1.0, "target": 1.0, "text": 1.0}),
            "--sequences_per_prompt", "1", "--prefix_tokens", "[2, 6]", "--rollout_len", "6",
            "--prompts_per_shard", "2", "--measure_costs", "false"]
    cfg_file.write_text(json.dumps(args))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.generate", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (out / "shard-00000.parquet").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "shard-00000.parquet").exists()
    (out / "shard-00002.parquet.tmp").write_bytes(b"partial")  # a shard the kill cut in half
    main(args)
    assert not list(out.glob("*.tmp"))
    a, b = frame(ref), frame(out)
    assert len(a) == len(b)
    pd.testing.assert_frame_equal(a.drop(columns=["draft_hidden"]), b.drop(columns=["draft_hidden"]))


def test_two_fabric_processes_write_their_own_shards(tmp_path):
    out = tmp_path / "f"
    summary = generate(tiny_cfg(out, devices=2))
    ref = tmp_path / "single"
    generate(tiny_cfg(ref))
    assert len(list(out.glob("shard-*.parquet"))) == 3
    assert summary["overall"]["records"] == len(frame(ref))
    pd.testing.assert_frame_equal(frame(ref).drop(columns=["draft_hidden"]), frame(out).drop(columns=["draft_hidden"]))


def test_bad_origin_named_in_error():
    with pytest.raises(ValueError, match="--origins"):
        GenerateConfig(origins={"bogus": 1.0})


def test_measure_costs_rewrites_cost_model(tmp_path):
    out = tmp_path / "m"
    generate(tiny_cfg(out, max_records=5))
    assert not (out / "cost_model.json").exists()
    cm = measure(["--data_dir", str(out), "--repeats", "1"])
    assert cm["draft_s_per_token"] > 0 and all(v > 0 for v in cm["target_s"].values())
    assert json.loads((out / "cost_model.json").read_text())["draft_name"] == "tiny:1"


def test_label_batches_group_a_prompts_sequences_within_budget():
    """Sequences of one prompt share a pass (their prompt is passed once); the padded cost stays within the budget."""
    def seq(pid: str, prompt: list[int], n: int, k: int) -> SequenceSpec:
        toks = prompt + list(range(1000 + k, 1000 + k + n))
        segments = [Segment(len(prompt), len(toks), "text", False)]
        return SequenceSpec(pid, "t", "code", "train", f"{pid}#{k}", toks, segments)

    a, b = list(range(1, 101)), list(range(201, 251))
    seqs = [seq("a", a, 20, k) for k in range(6)] + [seq("b", b, 10, k) for k in range(2)] + [seq("c", [7, 8, 9], 5, 0)]
    batches = label_batches(seqs, budget_tokens=200)
    assert sorted(s.seq_id for bt in batches for s in bt) == sorted(s.seq_id for s in seqs)
    for bt in batches:
        if len({s.sample_id for s in bt}) == 1 and len(bt) > 1:
            shared = shared_prefix_len([s.tokens for s in bt])
            assert shared >= 50 and shared + len(bt) * (max(len(s.tokens) for s in bt) - shared) <= 200
        else:
            assert len(bt) * max(len(s.tokens) for s in bt) <= 200 or len(bt) == 1
    assert any(len(bt) == 5 and {s.sample_id for s in bt} == {"a"} for bt in batches)  # 100 + 5 x 20 <= 200


# ------------------------------------------------------------------------------------------- a given continuation
EOS_PROMPT = [197, 215, 20, 132, 248, 207, 155, 244]
"""tiny:1's greedy continuation of these tokens emits its end of sequence (257) as the 38th token."""


def test_draft_rollouts_draft_on_past_an_end_of_sequence(tiny_pair):
    draft, _, _ = tiny_pair
    stopped, _ = continue_batch(draft, [EOS_PROMPT], [45], pad_token_id=256, eos_token_id=257)
    assert len(stopped[0]) == 38 and stopped[0][-1] == 257
    (rollout,) = draft_rollouts(draft, [EOS_PROMPT], 45, pad_token_id=256)
    assert len(rollout) == 45 and rollout[:38] == stopped[0]


def test_label_continuation_labels_the_given_tokens_and_the_drafts_rollouts(tiny_pair):
    """The teacher-forced rows are the generator's own (label_sequences on a target-origin segment); a rollout starts
    at every offset where greedy match fails and at the end, with the draft's own token there."""
    draft, target, _ = tiny_pair
    prompt = [60, 61, 62, 10, 70, 71, 72]
    cont = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, pad_token_id=256,
                           eos_token_id=257)[0, len(prompt):].tolist()
    models, opts = LabelModels(draft, target), LabelOptions(store_hidden=False, pad_token_id=256)
    recs, st = label_continuation(models, prompt, cont, opts, sample_id="p", rollout_len=5, gen_batch_size=3)
    cols = {k: np.asarray(v) for k, v in recs.items()}
    main = ~cols["rollout"]
    ref, _ = label_sequences(models, [SequenceSpec("p", "given", "chat", "test", "p#0", prompt + cont,
                                                   [Segment(len(prompt), len(prompt) + len(cont), "target", False)])],
                             opts)
    assert cols["offset"][main].tolist() == list(range(len(cont))) and set(cols["origin"]) == {"target"}
    assert np.allclose(cols["q"][main], ref["q"]) and cols["greedy_match"][main].tolist() == ref["greedy_match"]
    offsets = branch_offsets(recs)
    mismatches = [j for j, m in enumerate(ref["greedy_match"]) if not m]
    assert offsets == [*mismatches, len(cont)] and 0 < len(mismatches) < len(cont)
    assert st.rollouts == len(offsets) and st.records == len(cont) + 5 * len(offsets)
    starts = cols["prefix_len"][cols["rollout"] & (cols["offset"] == 0)] - len(prompt)
    assert sorted(starts.tolist()) == offsets and set(cols["seq_id"]) == {"p#0"}
    first = dict(zip(starts.tolist(), cols["draft_token"][cols["rollout"] & (cols["offset"] == 0)].tolist()))
    for j in mismatches:  # the rollout's first token is the draft's token that failed there
        assert first[j] == cols["draft_token"][main][j]
    expect = draft_rollouts(draft, [prompt + cont], 5, pad_token_id=256)[0]
    end = cols["rollout"] & (cols["prefix_len"] - cols["offset"] == len(prompt) + len(cont))
    assert cols["draft_token"][end].tolist() == expect
    with pytest.raises(ValueError, match="greedy"):
        label_continuation(models, prompt, cont, LabelOptions(temperature=1.0), sample_id="p", rollout_len=5)


def test_loaded_models_keep_row_invariant_attention_and_only_labelling_turns_it_off(monkeypatch):
    """load_models serves the benchmark, measure_costs and the replay check too: they must decode exactly, so only
    the generator (after measuring its cost model) switches its models to SDPA."""
    monkeypatch.setattr(model_sources, "apply_compute_path",
                        lambda m, path, **kw: cp.apply_compute_path(m, path, min_elements=0, **kw))  # tiny layers too
    models, _ = load_models(GenerateConfig(models=ModelsConfig(draft="tiny:1", target="tiny:2:32:3",
                                                               compute="packed")))
    loaded = [models.draft, models.target]
    assert all(m.config._attn_implementation == cp.ROW_INVARIANT_ATTENTION for m in loaded)
    attention_for_labelling(models)
    assert all(m.config._attn_implementation == "sdpa" for m in loaded)


def test_continuation_batches_are_cut_from_the_longest_so_the_short_batch_holds_the_shortest():
    m = [25, 31, 31, 32, 34, 36, 44, 48, 52, 53, 53, 70, 72, 75, 76, 85, 90, 92, 94, 96]
    batches = list(batches_from_longest(m, 8))
    assert [len(b) for b in batches] == [4, 8, 8] and sum(batches, []) == m
    assert sum(max(b) for b in batches) == 198  # 229 when cut from the shortest
    assert list(batches_from_longest([], 8)) == [] and list(batches_from_longest([1, 2], 8)) == [[1, 2]]
