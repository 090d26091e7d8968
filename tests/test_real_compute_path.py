"""The CPU compute path on the real Qwen2.5-Coder pair (opt in: pytest --real -m real; needs scripts/setup.sh --real).

At the same dtype the packed path leaves target-only output unchanged, and every exact policy's greedy output equals
target-only's on the same path (the default one: bf16 weights where the CPU has them, the draft's in int8).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.real

DRAFT, TARGET = "packaged:qwen2.5-coder-0.5b-instruct", "packaged:qwen2.5-coder-1.5b-instruct"
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Four held-out benchmark prompts (2 HumanEval, 2 MT-Bench) as token ids."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from benchmark.bench import load_benchmark_prompts
    from benchmark.config import BenchmarkConfig
    from compute.packaged import ensure_packaged

    folder = ensure_packaged(TARGET.removeprefix("packaged:"), Path("~/.cache/specstop").expanduser())
    ids, _, _ = load_benchmark_prompts(BenchmarkConfig(n_prompts=4), AutoTokenizer.from_pretrained(folder))
    return ids


def _greedy(model, ids: list[int]) -> list[int]:
    x = torch.tensor([ids])
    eos = model.generation_config.eos_token_id
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                         temperature=None, top_p=None, top_k=None, eos_token_id=eos)
    return out[0, len(ids):].tolist()


def test_packed_fp32_target_decodes_what_eager_fp32_decodes(prompts):
    from compute.models import ModelSpec, load_model

    eager, _ = load_model(ModelSpec(TARGET, compute="eager"))
    ref = [_greedy(eager, p) for p in prompts]
    del eager
    packed, _ = load_model(ModelSpec(TARGET, compute="packed"))
    assert [_greedy(packed, p) for p in prompts] == ref


def test_exact_policies_match_target_only_on_the_default_path(prompts):
    """Each model at the precision the pipelines load its role with (``ModelsConfig.spec``: the draft's head in
    bf16 and its weights in int8 where the CPU has AVX512-BF16)."""
    from compute.models import load_model
    from data_gen.config import ModelsConfig
    from decoding.engine import SpeculativeDecoder
    from decoding.policies import build_policy

    models = ModelsConfig()
    draft, tok = load_model(models.spec(DRAFT, "draft"))
    target, _ = load_model(models.spec(TARGET, "target"))
    for p in prompts[:2]:
        ref = _greedy(target, p)
        for spec in ("static:5", "svip:0.3", "static:12"):
            dec = SpeculativeDecoder(draft, target, build_policy(spec))
            eos = target.generation_config.eos_token_id
            out, _ = dec.generate(torch.tensor([p]), None, NEW_TOKENS, eos if isinstance(eos, list) else [eos], 0)
            assert out[0, len(p):].tolist()[: len(ref)] == ref, spec
