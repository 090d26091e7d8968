"""Decoding end to end on two variants of the compute path, side by side in one process, interleaved per prompt
(the host's speed drifts within minutes): target-only and engine policies.

``--compare native_gemm`` (default): specstop's bf16 GEMM against oneDNN's, two model pairs (``--models.native_gemm``
true and false, both drafts in bf16; about 10 GB together). ``--compare int8_draft``: one target, the draft with int8
weights against bf16 (``--models.int8_draft`` true and false). ``--compare target_head``: one draft, the target's LM
head in bf16 with fp32 logits against fp32 (``--models.bf16_target_head`` true and false). The benchmark's held-out
prompts are decoded greedily with ``target.generate`` and with the engine under each policy spec, and tokens/s and the
speedup over the same variant's target-only are printed per variant, with how far the variants' target-only outputs
agree (another target precision may emit other tokens).

Usage:
    python benchmarks/bench_gemm_decoding.py outputs/default/train/disco/export \\
        goodput:outputs/default/train/disco/export --n_prompts 4 --new_tokens 96
    python benchmarks/bench_gemm_decoding.py static:5 svip --compare int8_draft
    python benchmarks/bench_gemm_decoding.py static:4 svip --compare target_head
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmark.bench import load_benchmark_prompts
from benchmark.config import BenchmarkConfig
from compute.compute_path import cpu_info
from compute.models import load_model
from compute.timing import CostModel
from data_gen.config import ModelsConfig
from decoding.policies import build_decoder

VARIANTS = {"native_gemm": {"specstop": {"native_gemm": True, "int8_draft": False},
                             "onednn": {"native_gemm": False, "int8_draft": False}},
            "int8_draft": {"int8": {"int8_draft": True}, "bf16": {"int8_draft": False}},
            "target_head": {"bf16-head": {"bf16_target_head": True}, "fp32-head": {"bf16_target_head": False}}}
"""Per comparison, the ModelsConfig fields of each variant."""
SHARED = {"int8_draft": "target", "target_head": "draft"}
"""The model a comparison loads once for both variants (the other one differs)."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policies", nargs="+", help="engine policy specs (export folders, goodput:<spec>, static:5, ...)")
    ap.add_argument("--draft", default="packaged:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--target", default="packaged:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--cost_file", default=None, help="cost model for goodput policies (else measured on the fly)")
    ap.add_argument("--n_prompts", type=int, default=4)
    ap.add_argument("--new_tokens", type=int, default=96)
    ap.add_argument("--compare", choices=sorted(VARIANTS), default="native_gemm")
    args = ap.parse_args()
    info = cpu_info()
    print(f"CPU {info['model_name']!r}, torch {info['torch']}, {info['threads']} threads")
    pairs, tok, draft, target = {}, None, None, None
    variants, shared = VARIANTS[args.compare], SHARED.get(args.compare)
    for name, fields in variants.items():
        models = ModelsConfig(**fields)
        if draft is None or shared != "draft":
            draft, tok = load_model(models.spec(args.draft, "draft"))
        if target is None or shared != "target":
            target, _ = load_model(models.spec(args.target, "target"))
        pairs[name] = (draft, target)
    cost = CostModel.from_json(args.cost_file) if args.cost_file else None
    decoders = {k: {s: build_decoder(d, t, s, draft_tokenizer=tok, target_tokenizer=tok, cost_model=cost)
                    for s in args.policies} for k, (d, t) in pairs.items()}
    prompts, _, _ = load_benchmark_prompts(BenchmarkConfig(), tok)
    eos = [tok.eos_token_id]
    warm = torch.tensor([prompts[0]])
    for variant, (_, target) in pairs.items():  # first calls pay one-time set-up (kernel builds, allocations)
        with torch.no_grad():
            target.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False,
                            eos_token_id=eos, pad_token_id=eos[0])
        for dec in decoders[variant].values():
            dec.generate(warm, None, 4, eos, 0)
    rows = ["target-only", *args.policies]
    seconds = {k: dict.fromkeys(rows, 0.0) for k in variants}
    tokens = {k: dict.fromkeys(rows, 0) for k in variants}
    stats = {k: {} for k in variants}  # policy -> DecodeStats summed over prompts
    outputs = {k: [] for k in variants}  # target-only tokens per prompt
    for i, p in enumerate(prompts[: args.n_prompts]):
        x = torch.tensor([p])
        for variant, (_, target) in pairs.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                                      do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
            seconds[variant]["target-only"] += time.perf_counter() - t0
            tokens[variant]["target-only"] += out.shape[1] - x.shape[1]
            outputs[variant].append(out[0, x.shape[1]:].tolist())
            for spec, dec in decoders[variant].items():
                t0 = time.perf_counter()
                out, st = dec.generate(x, None, args.new_tokens, eos, i)
                seconds[variant][spec] += time.perf_counter() - t0
                stats[variant][spec] = stats[variant][spec] + st if spec in stats[variant] else st
                tokens[variant][spec] += out.shape[1] - x.shape[1]
        print(f"prompt {i + 1}/{args.n_prompts} done", flush=True)
    for variant in variants:
        base = tokens[variant]["target-only"] / seconds[variant]["target-only"]
        cells = [f"{r}: {tokens[variant][r] / seconds[variant][r]:.2f} tok/s "
                 f"({tokens[variant][r] / seconds[variant][r] / base:.2f}x"
                 + (f", {stats[variant][r].mean_accepted:.2f} accepted/round)" if r in stats[variant] else ")")
                 for r in rows]
        print(f"{variant:8s} " + "  ".join(cells))
    a, b = outputs.values()
    same = [next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))) for x, y in zip(a, b)]
    print(f"target-only outputs identical on {sum(x == y for x, y in zip(a, b))} of {len(a)} prompts; tokens before "
          f"the first difference: {same}")


if __name__ == "__main__":
    main()
