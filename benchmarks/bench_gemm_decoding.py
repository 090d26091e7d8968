"""Decoding end to end on specstop's bf16 GEMM against oneDNN's: target-only and engine policies, the two kernels'
model pairs side by side in one process, interleaved per prompt (the host's speed drifts within minutes).

Both pairs are loaded (``--models.native_gemm`` true and false; about 10 GB together), the benchmark's held-out
prompts are decoded greedily with ``target.generate`` and with the engine under each policy spec, and tokens/s and
the speedup over the same kernel's target-only are printed per kernel.

Usage:
    python benchmarks/bench_gemm_decoding.py outputs/default/train/disco/export \\
        goodput:outputs/default/train/disco/export --n_prompts 4 --new_tokens 96
"""
from __future__ import annotations

import argparse
import time

import torch

from data_gen.compute_path import cpu_info
from data_gen.models import ModelSpec, load_model
from data_gen.timing import CostModel
from decoding.policies import build_decoder
from pipelines.benchmark import BenchmarkConfig, load_benchmark_prompts

KERNELS = ("specstop", "onednn")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("policies", nargs="+", help="engine policy specs (export folders, goodput:<spec>, static:5, ...)")
    ap.add_argument("--draft", default="packaged:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--target", default="packaged:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--cost_file", default=None, help="cost model for goodput policies (else measured on the fly)")
    ap.add_argument("--n_prompts", type=int, default=4)
    ap.add_argument("--new_tokens", type=int, default=96)
    args = ap.parse_args()
    info = cpu_info()
    print(f"CPU {info['model_name']!r}, torch {info['torch']}, {info['threads']} threads")
    pairs, tok = {}, None
    for kernel in KERNELS:
        native = kernel == "specstop"
        draft, tok = load_model(ModelSpec(args.draft, bf16_head=True, native_gemm=native))
        target, _ = load_model(ModelSpec(args.target, native_gemm=native))
        pairs[kernel] = (draft, target)
    cost = CostModel.from_json(args.cost_file) if args.cost_file else None
    decoders = {k: {s: build_decoder(d, t, s, draft_tokenizer=tok, target_tokenizer=tok, cost_model=cost)
                    for s in args.policies} for k, (d, t) in pairs.items()}
    prompts, _, _ = load_benchmark_prompts(BenchmarkConfig(), tok)
    eos = [tok.eos_token_id]
    warm = torch.tensor([prompts[0]])
    for kernel, (_, target) in pairs.items():  # first calls pay one-time set-up (kernel builds, allocations)
        with torch.no_grad():
            target.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False,
                            eos_token_id=eos, pad_token_id=eos[0])
        for dec in decoders[kernel].values():
            dec.generate(warm, None, 4, eos, 0)
    rows = ["target-only", *args.policies]
    seconds = {k: dict.fromkeys(rows, 0.0) for k in KERNELS}
    tokens = {k: dict.fromkeys(rows, 0) for k in KERNELS}
    for i, p in enumerate(prompts[: args.n_prompts]):
        x = torch.tensor([p])
        for kernel, (_, target) in pairs.items():
            t0 = time.perf_counter()
            with torch.no_grad():
                out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens,
                                      do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
            seconds[kernel]["target-only"] += time.perf_counter() - t0
            tokens[kernel]["target-only"] += out.shape[1] - x.shape[1]
            for spec, dec in decoders[kernel].items():
                t0 = time.perf_counter()
                out, _ = dec.generate(x, None, args.new_tokens, eos, i)
                seconds[kernel][spec] += time.perf_counter() - t0
                tokens[kernel][spec] += out.shape[1] - x.shape[1]
        print(f"prompt {i + 1}/{args.n_prompts} done", flush=True)
    for kernel in KERNELS:
        base = tokens[kernel]["target-only"] / seconds[kernel]["target-only"]
        cells = [f"{r}: {tokens[kernel][r] / seconds[kernel][r]:.2f} tok/s "
                 f"({tokens[kernel][r] / seconds[kernel][r] / base:.2f}x)" for r in rows]
        print(f"{kernel:8s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
