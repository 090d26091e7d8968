"""Generator throughput against the floor of the same work, measured side by side in one run.

The generator (``data_gen.chunk.produce_chunk``, the function every shard runs) labels the chunks of a generate
config; the benchmark then measures, on the same models and compute path, what that work cannot go below:

- labelling passes: every token passed costs one forward of each model's linear layers, and every labelled position
  one more of its LM head. The floor times each model's own linear layers (the compute path's modules) on
  ``--rows`` rows at once, the GEMM shapes of a labelling batch: seconds per token = sum over layers / rows;
- sequential steps (continuations, rollouts, speculative trajectories): one step per generated token and batch,
  memory-bound; the floor times the same layers on ``gen_batch_size`` rows (the target's at 6 rows for spec steps).

Attention, norms, the prompt prefill of sequential generation and writing are outside the floor, so the fraction of
the floor is an upper bound on how well the generator uses the machine. Prints records/s, the fraction, seconds per
stage (continuations per origin, rollouts, labelling per model, writing) and peak memory.

Usage:
    python benchmarks/bench_generator.py                                # configs/generate-default.yaml, 16 prompts
    python benchmarks/bench_generator.py --compute eager --n_prompts 8  # the same on torch's default kernels
    python benchmarks/bench_generator.py --config configs/generate-smoke.yaml --n_prompts 4
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import tempfile
import time
from pathlib import Path

import torch
import yaml
from jsonargparse import ArgumentParser
from torch import nn

from compute.compute_path import PackedLinear, compute_path_of, cpu_info, gemm_of
from data_gen.chunk import ChunkStats, produce_chunk
from data_gen.config import GenerateConfig
from data_gen.generate import attention_for_labelling, load_models
from data_gen.prompts import load_prompts, render_prompt
from data_gen.schema import features_schema
from data_gen.shards import ShardWriter


def linear_layers(model: nn.Module) -> tuple[list[nn.Module], nn.Module]:
    """The model's linear layers inside its decoder, and its LM head (eager or packed alike)."""
    head = model.get_output_embeddings()
    body = [m for m in model.get_decoder().modules() if isinstance(m, (nn.Linear, PackedLinear))]
    return body, head


@torch.no_grad()
def seconds_per_row(layers: list[nn.Module], rows: int, repeats: int = 3) -> float:
    """Seconds of one forward of ``layers`` on ``rows`` rows, divided by rows (min over repeats)."""
    xs = {m.in_features: torch.randn(rows, m.in_features) for m in layers}
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for m in layers:
            m(xs[m.in_features])
        best = min(best, time.perf_counter() - t0)
    return best / rows


def label_floor(models, st: ChunkStats, rows: int) -> tuple[float, dict[str, float]]:
    """Seconds the labelling passes cannot go below: tokens passed x body + positions x head, per model."""
    per = {}
    for role in ("draft", "target", "companion"):
        model = getattr(models, role)
        if model is None:
            continue
        body, head = linear_layers(model)
        per[role] = st.tokens_passed * seconds_per_row(body, rows) + st.positions * seconds_per_row([head], rows)
    return sum(per.values()), per


def sequential_floor(models, st: ChunkStats, batch: int) -> float:
    """Seconds of the sequential steps at their batch, memory-bound: every generated token is one step of a batch."""
    draft_step = seconds_per_row([*linear_layers(models.draft)[0], linear_layers(models.draft)[1]], batch) * batch
    target_layers = [*linear_layers(models.target)[0], linear_layers(models.target)[1]]
    target_step = seconds_per_row(target_layers, batch) * batch
    spec_round = seconds_per_row(target_layers, 6) * 6 + 5 * seconds_per_row(linear_layers(models.draft)[0], 1)
    tok = st.gen_tokens_by_origin
    draft_tokens = sum(v for k, v in tok.items() if k not in ("target", "spec"))
    return (draft_tokens / batch * draft_step + tok.get("target", 0) / batch * target_step
            + tok.get("spec", 0) / 2.5 * spec_round)  # about 2.5 tokens per round of 5 drafts on this pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/generate-default.yaml", help="generate config YAML (its mix)")
    ap.add_argument("--n_prompts", type=int, default=16, help="prompts labelled (one chunk each of prompts_per_shard)")
    ap.add_argument("--compute", default=None, help="override models.compute (auto, packed, packed-bf16, eager)")
    ap.add_argument("--native_gemm", default=None, choices=["true", "false"],
                    help="override models.native_gemm (packed-bf16 on specstop's bf16 GEMM or oneDNN's)")
    ap.add_argument("--rows", type=int, default=512, help="rows of the floor's GEMMs (a labelling batch's size)")
    args = ap.parse_args()
    raw = yaml.safe_load(Path(args.config).read_text())
    parser = ArgumentParser()
    parser.add_class_arguments(GenerateConfig, as_group=False)
    cfg = GenerateConfig(**vars(parser.instantiate(parser.parse_object(raw))))
    if args.compute:
        cfg = dataclasses.replace(cfg, models=dataclasses.replace(cfg.models, compute=args.compute))
    if args.native_gemm:
        cfg = dataclasses.replace(cfg, models=dataclasses.replace(cfg.models, native_gemm=args.native_gemm == "true"))
    t0 = time.perf_counter()
    models, tok = load_models(cfg)
    attention_for_labelling(models)  # as run_generation runs them
    load_s = time.perf_counter() - t0
    prompts, _ = load_prompts(cfg.prompts, seed=cfg.seed)
    prompts = prompts[: args.n_prompts]
    rendered = [render_prompt(p, tok, cfg.use_chat_template, cfg.max_prompt_tokens)[0] for p in prompts]
    total, write_s, n = ChunkStats(), 0.0, 0
    t_run = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter(Path(tmp), features_schema(cfg.top_k, models.draft.config.hidden_size if cfg.store_hidden
                                                        else None, models.companion is not None))
        for c, start in enumerate(range(0, len(prompts), cfg.prompts_per_shard)):
            idx = list(range(start, min(start + cfg.prompts_per_shard, len(prompts))))
            recs, st = produce_chunk(cfg, models, tok, prompts, rendered, idx, c)
            n += len(recs.get("draft_token", []))
            t0 = time.perf_counter()
            writer.write(c, recs)
            write_s += time.perf_counter() - t0
            for f in dataclasses.fields(ChunkStats):
                a, b = getattr(total, f.name), getattr(st, f.name)
                setattr(total, f.name, a + b if isinstance(a, int) else _merged(a, b))
    wall = time.perf_counter() - t_run
    lab_floor, per_model = label_floor(models, total, args.rows)
    seq_floor = sequential_floor(models, total, cfg.gen_batch_size)
    floor = lab_floor + seq_floor
    info = cpu_info()
    print(f"CPU {info['model_name']} ({info['torch_cpu_capability']}, {torch.get_num_threads()} threads); compute path "
          f"{compute_path_of(models.target)} on {gemm_of(models.target)}; models loaded in {load_s:.0f}s; "
          f"{len(prompts)} prompts of {args.config}")
    print(f"records {n} in {wall:.1f}s: {n / wall:.2f} records/s; floor {floor:.1f}s (labelling {lab_floor:.1f}s, "
          f"sequential {seq_floor:.1f}s): {floor / wall:.0%} of the floor")
    print("| stage | seconds | share of wall |")
    print("|---|---|---|")
    for o, s in sorted(total.gen_seconds_by_origin.items()):
        print(f"| generation, {o} origin ({total.gen_tokens_by_origin[o]} tokens) | {s:.1f} | {s / wall:.0%} |")
    for role, s in total.label_seconds.items():
        print(f"| labelling, {role} (floor {per_model.get(role, 0):.1f}s) | {s:.1f} | {s / wall:.0%} |")
    print(f"| writing | {write_s:.1f} | {write_s / wall:.0%} |")
    print(f"tokens passed {total.tokens_passed}, positions labelled {total.positions}; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def _merged(a, b):
    out = type(a)() if not hasattr(a, "default_factory") else type(a)(a.default_factory)
    for d in (a, b):
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


if __name__ == "__main__":
    main()
