"""Generator throughput against the floor of the same work, measured side by side in one run.

The floor for N prompts with draft rollouts of L tokens is what the work cannot avoid: the draft's L autoregressive
steps per rollout (a plain KV-cached loop, batch 1) plus one target forward over prefix + rollout. The generator does
the same work through ``data_gen.generate.produce_chunk`` (batched generate, one labelling pass per model) and is
reported as labelled tokens per second and as a ratio to the floor (goal: >= 0.8). A second row measures the
teacher-forced path (dataset text, no sequential generation). Peak RSS is reported.

Usage:
    python benchmarks/bench_generator.py                               # real Qwen pair, 8 HumanEval prompts, L = 16
    python benchmarks/bench_generator.py --draft tiny:1 --target tiny:2:32:3 --n_prompts 4
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import time

import torch
from transformers import DynamicCache

from data_gen.generate import GenerateConfig, ModelsConfig, load_models, produce_chunk
from data_gen.prompts import PromptSourceConfig, load_prompts, render_prompt


@torch.no_grad()
def floor_seconds(models, rendered: list[list[int]], L: int, eos: int) -> tuple[float, int]:
    """Draft L KV-cached greedy steps per prompt (batch 1) + one target forward over prefix + rollout."""
    t0 = time.perf_counter()
    tokens = 0
    for ids in rendered:
        x = torch.tensor([ids])
        cache = DynamicCache()
        out = models.draft(input_ids=x, past_key_values=cache, use_cache=True)
        seq = list(ids)
        for _ in range(L):
            nxt = int(out.logits[0, -1].argmax())
            seq.append(nxt)
            tokens += 1
            if nxt == eos:
                break
            out = models.draft(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
        models.target(input_ids=torch.tensor([seq]))
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="packaged:qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--target", default="packaged:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--n_prompts", type=int, default=8)
    ap.add_argument("--rollout_len", type=int, default=16)
    ap.add_argument("--text_tokens", type=int, default=128)
    ap.add_argument("--gen_batch_size", type=int, default=8)
    ap.add_argument("--max_prompt_tokens", type=int, default=256)
    args = ap.parse_args()
    cfg = GenerateConfig(
        models=ModelsConfig(draft=args.draft, target=args.target), prompts=[PromptSourceConfig("humaneval", limit=args.n_prompts)],
        max_prompt_tokens=args.max_prompt_tokens, origins={"prompt": 1.0}, sequences_per_prompt=1,
        rollout_len=args.rollout_len, gen_batch_size=args.gen_batch_size, measure_costs=False,
    )
    t0 = time.perf_counter()
    models, tok = load_models(cfg)
    print(f"models loaded in {time.perf_counter() - t0:.1f}s; torch threads {torch.get_num_threads()}")
    prompts, _ = load_prompts(cfg.prompts)
    rendered = [render_prompt(p, tok, True, cfg.max_prompt_tokens)[0] for p in prompts]
    idx = list(range(len(prompts)))

    fl_s, fl_tok = floor_seconds(models, rendered, cfg.rollout_len, tok.eos_token_id)
    t0 = time.perf_counter()
    recs, _ = produce_chunk(cfg, models, tok, prompts, rendered, idx, 0)
    gen_s = time.perf_counter() - t0
    n = len(recs["draft_token"])
    text_cfg = dataclasses.replace(cfg, origins={"text": 1.0}, prefix_tokens=(args.text_tokens, args.text_tokens),
                                   rollout_len=1)
    t0 = time.perf_counter()
    trecs, _ = produce_chunk(text_cfg, models, tok, prompts, rendered, idx, 1)
    text_s = time.perf_counter() - t0
    tn = len(trecs["draft_token"])
    floor_rate = fl_tok / fl_s
    print("| path | labelled tokens | seconds | tokens/s | ratio to floor |")
    print("|---|---|---|---|---|")
    print(f"| floor: draft steps + 1 target pass per rollout | {fl_tok} | {fl_s:.1f} | {floor_rate:.2f} | 1.00 |")
    print(f"| generator, prompt rollouts (L={cfg.rollout_len}) | {n} | {gen_s:.1f} | {n / gen_s:.2f} | {n / gen_s / floor_rate:.2f} |")
    print(f"| generator, teacher-forced text ({args.text_tokens} tokens) + 1-token rollout | {tn} | {text_s:.1f} | {tn / text_s:.2f} | {tn / text_s / floor_rate:.2f} |")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
