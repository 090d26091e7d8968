"""The generator's rollout batch: ``gen_batch_size: auto`` from the host's step curve, capped by memory, recorded for a
resume, lowered when a batch does not fit; the records and their labels the same at every batch."""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_generate import KEY, frame, tiny_cfg

from data_gen import batch_sizing
from data_gen import generate as generate_module
from data_gen.batch_sizing import (
    choose_batch,
    out_of_memory,
    pick_batch,
    read_bandwidth_note,
    recorded_gen_batch,
    resolve_gen_batch,
)
from data_gen.config import GenerateConfig
from data_gen.generate import attention_for_labelling, load_models
from data_gen.prompts import PromptSourceConfig, load_prompts, render_prompt
from pipelines.generate import generate

LABELS = ["draft_token", "next_token", "target_argmax", "greedy_match", "oracle_len"]


def test_pick_batch_takes_the_largest_cheap_step_at_least_eight_under_the_cap():
    amx = {1: 1.0, 8: 1.01, 16: 1.117, 32: 2.0}  # the Xeon: flat to 8 rows, nearly so at 16
    assert pick_batch(amx) == 16
    assert pick_batch({1: 1.0, 8: 3.0, 16: 6.0, 32: 12.0}) == 8  # compute-bound: never under the fixed 8
    assert pick_batch({1: 1.0, 8: 1.0, 16: 1.0, 32: 1.05}) == 32  # flat (a GPU)
    assert pick_batch(amx, cap=12) == 12 and pick_batch(amx, cap=4) == 4  # memory caps it, below 8 too
    with pytest.raises(ValueError, match="step curve"):
        pick_batch({})


def test_gen_batch_size_is_auto_or_a_positive_integer():
    assert GenerateConfig().gen_batch_size == "auto"
    assert "gen_batch_size" not in GenerateConfig().data_config()  # the batch is not part of what the records are
    for bad in (0, -8, "big"):
        with pytest.raises(ValueError, match="--gen_batch_size"):
            GenerateConfig(gen_batch_size=bad)


def test_auto_probes_the_models_and_logs_the_choice_once(tmp_path, caplog, monkeypatch):
    cfg = tiny_cfg(tmp_path, prompts_per_shard=8, sequences_per_prompt=2)
    models, _ = load_models(cfg)
    attention_for_labelling(models)
    choice = choose_batch(cfg, models)
    assert set(choice.curve) == {1, 8, 16} and 8 <= choice.size <= 16  # a chunk holds 16 sequences
    assert all(s > 0 for s in choice.curve.values()) and "memory allows" in choice.reason
    monkeypatch.setattr(batch_sizing, "available_bytes", lambda device: 3 * batch_sizing.row_bytes(models.draft, 70))
    assert choose_batch(cfg, models).size <= 2  # half of what three short rows need: at most two rows fit
    with caplog.at_level(logging.INFO, logger="data_gen.batch_sizing"):
        assert resolve_gen_batch(replace(cfg, gen_batch_size=5), models).gen_batch_size == 5  # an integer overrides
        assert resolve_gen_batch(cfg, models, recorded=12).gen_batch_size == 12  # a resume keeps the folder's value
    assert [r.message for r in caplog.records if r.name == "data_gen.batch_sizing"] == [  # the kernels' background
        "gen_batch_size auto -> 12: the value this folder was generated with (config.json)"]  # build logs apart


def test_labels_are_the_same_and_correct_at_every_batch(tmp_path):
    """The same sequences, tokens and labels at 1, 3 and 16 rows a batch (probabilities up to float rounding), and each
    greedy record's target argmax and probability are the target's own on its whole sequence alone."""
    base = tiny_cfg(tmp_path, sample_draw=True, sequences_per_prompt=3, prompts=[PromptSourceConfig("humaneval",
                                                                                                   limit=4)])
    frames = {}
    for b in (1, 3, 16):
        generate(replace(base, out_dir=str(tmp_path / str(b)), gen_batch_size=b))
        frames[b] = frame(tmp_path / str(b))
    ref = frames[1]
    assert len(ref) and set(ref["origin"]) >= {"draft", "target"}
    for df in frames.values():
        assert df[[*KEY, "draw", "origin", "sample_id"]].equals(ref[[*KEY, "draw", "origin", "sample_id"]])
        assert df[LABELS].equals(ref[LABELS])
        np.testing.assert_allclose(df[["p", "q", "accept_prob"]], ref[["p", "q", "accept_prob"]], atol=1e-5)
    _check_against_unbatched_target(base, frames[16])


def _check_against_unbatched_target(cfg: GenerateConfig, df) -> None:
    """Every greedy record of ``df``: its target argmax and p(x) from one forward of the target over its sequence
    alone, and greedy_match == (draft token == target argmax)."""
    models, tok = load_models(cfg)
    attention_for_labelling(models)
    prompts, _ = load_prompts(cfg.prompts, seed=cfg.seed)
    ids = {p.id: render_prompt(p, tok, cfg.use_chat_template, cfg.max_prompt_tokens)[0] for p in prompts}
    greedy = df[df["draw"] == "greedy"]
    assert (greedy["greedy_match"] == (greedy["draft_token"] == greedy["target_argmax"])).all()
    for _, seq in greedy.groupby("seq_id"):
        seq = seq.sort_values("prefix_len")
        prompt = ids[seq["sample_id"].iloc[0]]
        assert seq["prefix_len"].iloc[0] == len(prompt)
        labelled = np.where(seq["rollout"], seq["draft_token"], seq["next_token"]).tolist()  # the sequence's tokens
        with torch.no_grad():
            logits = models.target(input_ids=torch.tensor([prompt + labelled])).logits[0].float()
        at = torch.tensor(seq["prefix_len"].to_numpy() - 1)
        assert logits[at].argmax(-1).tolist() == seq["target_argmax"].tolist()
        p = logits[at].softmax(-1)[torch.arange(len(at)), torch.tensor(seq["draft_token"].to_numpy())]
        np.testing.assert_allclose(p.numpy(), seq["p"].to_numpy(), atol=1e-4)


def test_a_resume_reads_the_recorded_batch_instead_of_probing(tmp_path, monkeypatch):
    out = tmp_path / "r"
    prompts = [PromptSourceConfig("humaneval", limit=8)]
    generate(tiny_cfg(out, max_records=20, prompts=prompts))
    cfg = tiny_cfg(out, max_records=50, prompts=prompts)
    recorded = recorded_gen_batch(out, cfg.data_config())
    assert recorded == json.loads((out / "config.json").read_text())["resolved"]["gen_batch_size"] == 2

    def no_probe(*a, **k):
        raise AssertionError("a resume must reuse the folder's batch, not probe again")

    monkeypatch.setattr(batch_sizing, "choose_batch", no_probe)
    assert generate(cfg)["last_run"]["gen_batch_size"] == recorded
    assert len(frame(out)) == 50 and not frame(out).duplicated(KEY).any()
    assert recorded_gen_batch(out, replace(cfg, rollout_len=5).data_config()) is None  # another data config


def test_a_batch_that_does_not_fit_is_halved_in_one_line_and_no_shard_is_lost(tmp_path, monkeypatch, caplog):
    ref, out = tmp_path / "ref", tmp_path / "oom"
    cfg = tiny_cfg(ref, gen_batch_size=8, prompts_per_shard=3)
    generate(cfg)
    produce = generate_module.produce_chunk

    def small_memory(c: GenerateConfig, *args, **kw):
        if args[-1] == 1 and c.gen_batch_size > 1:  # chunk 1 fits one sequence at a time only
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 10 GB")
        return produce(c, *args, **kw)

    monkeypatch.setattr(generate_module, "produce_chunk", small_memory)
    with caplog.at_level(logging.WARNING, logger="data_gen.batch_sizing"):
        generate(replace(cfg, out_dir=str(out)))
    lines = [r.message for r in caplog.records if "did not fit in memory" in r.message]
    assert len(lines) == 3 and "gen_batch_size 8 -> 4" in lines[0] and "gen_batch_size 2 -> 1" in lines[-1]
    assert json.loads((out / "config.json").read_text())["resolved"]["gen_batch_size"] == 1
    a, b = frame(ref), frame(out)
    assert a[[*KEY, *LABELS]].equals(b[[*KEY, *LABELS]])
    with pytest.raises(RuntimeError, match="device-side assert"):  # anything else is no memory failure: raised
        batch_sizing.fitting(cfg, lambda c: (_ for _ in ()).throw(RuntimeError("device-side assert")), "x")


def test_out_of_memory_and_the_slow_memory_line():
    assert out_of_memory(MemoryError()) and out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate"))
    assert not out_of_memory(RuntimeError("shape mismatch")) and not out_of_memory(ValueError("out of memory"))
    note = read_bandwidth_note(19.2e9)
    assert note is not None and "19.2 GB/s" in note and "memory, not the code" in note
    assert read_bandwidth_note(26.9e9) is None and read_bandwidth_note(None) is None


def test_configs_default_to_auto():
    root = Path(__file__).resolve().parents[1] / "configs"
    for name in ("generate-default.yaml", "generate-code.yaml", "generate-smoke.yaml"):
        assert "gen_batch_size: auto" in (root / name).read_text(), name
