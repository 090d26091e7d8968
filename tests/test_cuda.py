"""The CUDA path on the tiny models (marker ``cuda``; skipped where torch sees no GPU): each predictor fits through
Lightning on the GPU; the engine's greedy output equals the target alone's and its sampling runs, seeded, for every
policy kind (static, SVIP, AdaEDL, exported DISCO / SPRINTER / SV predictors, goodput); exact speculative sampling
keeps the target's distribution; the generator's labels on CUDA equal the CPU's; the smoke benchmark runs on CUDA;
rows stepped side by side (``benchmark.interleave``) give the target's tokens.

Usage::

    python -m pytest -m cuda -q                              # on a GPU host (bash scripts/device_check.sh runs it)
    SPECSTOP_TEST_DEVICE=cpu python -m pytest -m cuda -q     # the same tests on the CPU: checks the tests themselves
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from compute.compute_path import compute_path_of
from compute.models import ModelSpec, load_model
from compute.timing import CostModel
from data_gen.config import GenerateConfig, ModelsConfig
from data_gen.features import probs_from_logits
from data_gen.generate import run_generation
from data_gen.prompts import PromptSourceConfig
from data_gen.shards import load_records
from decoding.engine import SpeculativeDecoder
from decoding.policies import build_policy
from predictors.calibration import Calibrator
from predictors.export import export_predictor, update_metadata
from predictors.training import DiscoConfig, SprinterConfig, SVTableConfig, fit_predictor
from tests.synthetic import make_records, write_shards
from tests.test_engine_sampling import chi2_pvalue
from tests.tiny_pairs import make_pair

DEVICE = os.environ.get("SPECSTOP_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "")
"""Where the tests run: cuda where torch sees a GPU; ``SPECSTOP_TEST_DEVICE`` overrides (cpu: the tests' own check)."""
ON_GPU = DEVICE.startswith("cuda")
ACCELERATOR = "gpu" if ON_GPU else "cpu"

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not DEVICE, reason="no CUDA GPU: torch.cuda.is_available() is false")]

ROOT = Path(__file__).resolve().parents[1]
PROMPT = torch.tensor([[67, 68, 69, 220, 69, 78, 78, 7, 87, 8, 25]])
POLICIES = ["static:4", "svip:0.3", "adaedl", "disco", "sprinter", "sv", "goodput"]
COST = CostModel(draft_s_per_token=0.05, target_s={1: 1.0, 4: 1.0, 5: 2.0, 9: 2.2})
"""A verification curve on which drafting pays (SV and goodput price their rounds with it)."""
KEY = ["seq_id", "prefix_len", "draw"]


@pytest.fixture(scope="module")
def pair():
    draft, target = make_pair()
    return draft.to(DEVICE), target.to(DEVICE)


@pytest.fixture(scope="module")
def companion():
    return make_pair(noise=0.3, seed=0)[1].to(DEVICE)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{kind: (export folder, metrics, GPU bytes the fit allocated)} for DISCO, SPRINTER and SV fitted through Lightning
    on ``DEVICE`` (synthetic shards, the tiny pair's hidden width), and ``goodput``: the DISCO export with acceptance
    maps. Lightning's deterministic mode is switched back off after the fits (it is global, and decoding on CUDA
    follows)."""
    root = tmp_path_factory.mktemp("cuda-exports")
    write_shards(root / "shards", make_records(n_prompts=60, tokens_per_prompt=30, hidden_size=32))
    fast = dict(batch_size=128, max_epochs=4, patience=2, accelerator=ACCELERATOR)
    cfgs = {"disco": DiscoConfig(hidden_size=16, lr=5e-3, **fast), "sprinter": SprinterConfig(lam=1.5, **fast),
            "sv": SVTableConfig(s_bins=5, a_bins=5, accelerator=ACCELERATOR)}
    deterministic = torch.are_deterministic_algorithms_enabled()
    out = {}
    try:
        for kind, cfg in cfgs.items():
            if ON_GPU:
                torch.cuda.reset_peak_memory_stats()
            policy, metrics = fit_predictor(kind, cfg, root / "shards", root / kind)
            used = torch.cuda.max_memory_allocated() if ON_GPU else 0
            out[kind] = (export_predictor(policy, root / kind / "export", {"data": "synthetic"}), metrics, used)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    goodput = Path(shutil.copytree(out["disco"][0], root / "goodput"))
    ident = Calibrator("isotonic", [0.0, 1.0], [0.05, 0.95], label="greedy match").to_dict()
    update_metadata(goodput, calibration={"greedy": ident, "sampling": ident})
    out["goodput"] = (goodput, {}, 0)
    return out


def policy_for(name: str, exports: dict):
    """The policy of a test row: a named baseline, an exported predictor, or goodput over the calibrated DISCO."""
    if name == "goodput":
        return build_policy(f"goodput:{exports['goodput'][0]}")
    if name in exports:
        return build_policy(str(exports[name][0]))
    return build_policy(name)


def decoder(pair, companion, policy, **kwargs) -> SpeculativeDecoder:
    draft, target = pair
    return SpeculativeDecoder(draft, target, policy, companion=companion if policy.needs_companion else None,
                              cost_model=COST, max_draft_len=8, **kwargs)


def test_models_load_on_the_device_on_the_eager_path():
    """``load_model`` puts a model on the device; there the compute path ``auto`` is eager (the packed CPU paths are
    refused on another device, naming the option that works)."""
    model, _ = load_model(ModelSpec("tiny:1", device=DEVICE))
    assert next(model.parameters()).device.type == torch.device(DEVICE).type
    if ON_GPU:
        assert compute_path_of(model) == "eager"
        with pytest.raises(ValueError, match="--models.compute eager"):
            load_model(ModelSpec("tiny:1", device=DEVICE, compute="packed-bf16"))


@pytest.mark.parametrize("kind", ["disco", "sprinter", "sv"])
def test_each_predictor_fits_through_lightning_on_the_device(exports, kind):
    """The fit ran on the GPU (Lightning's gpu accelerator, memory allocated there) and learned the planted signal."""
    folder, metrics, used = exports[kind]
    assert metrics["val_auc"] > 0.75 and np.isfinite(metrics["val_loss"]), metrics
    assert (folder / "predictor.json").is_file()
    if ON_GPU:
        assert used > 0, f"{kind}: nothing was allocated on the GPU during its fit"


@pytest.mark.parametrize("name", POLICIES)
def test_greedy_output_is_the_target_alones(pair, companion, exports, name):
    """Greedy decoding on the device emits the target's greedy tokens for every policy kind (SPRINTER stopping after
    every token, where its one drafted token is verified: at its own threshold it is approximate)."""
    draft, target = pair
    policy = policy_for(name, exports)
    if name == "sprinter":
        policy.threshold = 2.0
    out, stats = decoder(pair, companion, policy).generate(PROMPT, None, 24, None, 0)
    ref = target.generate(PROMPT.to(DEVICE), do_sample=False, max_new_tokens=24, pad_token_id=256, eos_token_id=None)
    assert out.device.type == torch.device(DEVICE).type
    assert out.tolist() == ref.tolist()
    assert stats.tokens == 24 and stats.accepted + stats.rounds == stats.tokens
    assert stats.accepted + stats.wasted == stats.drafted


@pytest.mark.parametrize("name", POLICIES)
def test_sampling_runs_and_a_seed_repeats(pair, companion, exports, name):
    """Speculative sampling on the device, a batch of two prompts: every token counted, a seed gives the same output
    (the device's generator), another seed another one."""
    dec = decoder(pair, companion, policy_for(name, exports), temperature=1.0)
    ids = torch.cat([PROMPT, PROMPT.flip(1)])
    a, stats = dec.generate(ids, None, 16, None, seed=5)
    b, _ = dec.generate(ids, None, 16, None, seed=5)
    c, _ = dec.generate(ids, None, 16, None, seed=6)
    assert a.device.type == torch.device(DEVICE).type and a.shape == (2, PROMPT.shape[1] + 16)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert stats.tokens == 32 and stats.rounds > 0 and stats.accepted <= stats.drafted
    assert int(a.min()) >= 0 and int(a.max()) < 260


@pytest.mark.parametrize("spec,temperature,top_p", [("static:2", 1.0, 1.0), ("svip:0.3", 0.7, 0.9)])
def test_exact_sampling_keeps_the_targets_distribution(pair, spec, temperature, top_p):
    """The first sampled token's distribution is the target's (chi-square over 2,000 draws), and the test can tell
    the draft's apart."""
    draft, target = pair
    prompt = PROMPT[:, :8].to(DEVICE)
    with torch.no_grad():
        p1 = probs_from_logits(target(prompt).logits[0, -1], temperature, top_p).double().cpu().numpy()
        q1 = probs_from_logits(draft(prompt).logits[0, -1], temperature, top_p).double().cpu().numpy()
    dec = SpeculativeDecoder(draft, target, build_policy(spec), temperature=temperature, top_p=top_p)
    counts = np.zeros(p1.shape[0])
    for seed in range(4):
        out, stats = dec.generate(prompt.repeat(500, 1), None, 3, None, seed)
        counts += np.bincount(out[:, prompt.shape[1]].cpu().numpy(), minlength=p1.shape[0])
        assert 0 < stats.accepted < stats.drafted  # both the accept and the reject path ran
    assert chi2_pvalue(counts, p1) > 1e-3
    if 0.5 * np.abs(q1 - p1).sum() > 0.15:
        assert chi2_pvalue(counts, q1) < 1e-3


def _frame(folder: Path) -> pd.DataFrame:
    return load_records(folder).to_pandas().sort_values(KEY).reset_index(drop=True)


def test_generator_labels_on_the_device_equal_the_cpus(tmp_path):
    """The generator end to end (continuations, speculative prefixes, rollouts, one-pass labels, a companion sharing
    the draft's first layer) on the device with its default compute path, and on the CPU eager: the same records,
    token for token, and the same probabilities, entropies and hidden states within float32 tolerance."""
    cfg = GenerateConfig(
        models=ModelsConfig(draft="tiny:1", target="tiny:2:32:3", companion="truncated:1:tiny:1"),
        prompts=[PromptSourceConfig("humaneval", limit=4)], max_prompt_tokens=48, sequences_per_prompt=1,
        origins={"prompt": 1.0, "draft": 1.0, "target": 1.0, "spec": 1.0, "text": 1.0}, prefix_tokens=(2, 6),
        rollout_len=6, prompts_per_shard=2, sample_draw=True, measure_costs=False)
    frames = []
    for name, models in (("cpu", replace(cfg.models, device="cpu", compute="eager")),
                         ("device", replace(cfg.models, device=DEVICE))):
        run_generation(replace(cfg, out_dir=str(tmp_path / name), models=models))
        frames.append(_frame(tmp_path / name))
    cpu, dev = frames
    assert len(cpu) == len(dev) > 0 and list(cpu.columns) == list(dev.columns)
    greedy = (cpu["draw"] == "greedy").to_numpy()  # a sampled draw comes from the device's own generator
    for col in cpu.columns:
        a, b = cpu[col].to_numpy(), dev[col].to_numpy()
        if col in ("draft_topk", "draft_hidden"):
            a, b = np.stack(a).astype(np.float64), np.stack(b).astype(np.float64)
        rows = slice(None) if col in KEY or col in ("sample_id", "split", "origin") else greedy
        if np.issubdtype(np.asarray(a).dtype, np.floating):
            atol = 2e-3 if col == "draft_hidden" else 1e-4  # the hidden state is stored as float16
            np.testing.assert_allclose(a[rows], b[rows], rtol=1e-3, atol=atol, err_msg=col)
        else:
            assert (a[rows] == b[rows]).all(), col


def test_the_smoke_benchmark_runs_on_the_device(tmp_path):
    """``python -m pipelines.benchmark`` on configs/benchmark-smoke.yaml with ``--models.device``: every exact row's
    outputs equal target-only's, every row has a speed, and the report names the device."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "pipelines.benchmark", "--config", str(ROOT / "configs" / "benchmark-smoke.yaml"),
           "--models.device", DEVICE, "--out_dir", str(out), "--tracking", "false"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((out / "benchmark.json").read_text())["rows"]
    assert len(rows) >= 8
    for row in rows:
        assert row["tokens_per_s"] > 0, row["row"]
        assert row["exact"] in (True, None), row["row"]  # None: the reference rows themselves
    assert f"device {DEVICE}" in (out / "benchmark.md").read_text()


def test_interleaved_rows_on_the_device_give_the_target_alones_tokens():
    """``benchmark.interleave`` on the device: target-only's forward loop and an engine row stepped side by side give
    ``generate``'s greedy tokens, each row timed."""
    from benchmark.bench import Bench, DecodeSettings
    from benchmark.config import BenchmarkConfig
    from benchmark.interleave import interleave
    from benchmark.runners import engine_lane, target_only_lane

    draft, tok = load_model(ModelSpec("tiny:1"))
    target, _ = load_model(ModelSpec("tiny:2:32:3"))
    draft, target = draft.to(DEVICE), target.to(DEVICE)
    ids = tok("def add(a, b):")["input_ids"]
    view = Bench(DecodeSettings.of(BenchmarkConfig(max_new_tokens=16, n_prompts=1)), draft, target, None, tok,
                 prompts=[ids], eos=[tok.eos_token_id])
    lanes = [target_only_lane(view), engine_lane(view, "static:4")]
    rows = interleave([lane for lane in lanes if lane is not None], torch.device(DEVICE))
    x = torch.tensor([ids], device=DEVICE)
    ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[0, len(ids):].tolist()
    cut = ref[: ref.index(tok.eos_token_id) + 1] if tok.eos_token_id in ref else ref
    assert [r.outputs for r in rows.values()] == [[cut], [cut]]
    assert all(r.seconds[0] > 0 for r in rows.values())
