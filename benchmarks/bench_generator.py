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

With ``--batches 8,auto`` (the default) the same prompts run once per rollout batch on the same loaded models, side by
side: ``auto`` is what the generator resolves on this host (``data_gen.batch_sizing``: its probe's step curve and
reason are printed), and the table gives each batch's records/s, its ratio to the first batch's, each stage's seconds,
and how many records have the same tokens and labels as the first batch's. The host's read bandwidth is printed too.

Usage:
    python benchmarks/bench_generator.py                                # configs/generate-default.yaml, 16 prompts
    python benchmarks/bench_generator.py --compute eager --n_prompts 8  # the same on torch's default kernels
    python benchmarks/bench_generator.py --config configs/generate-smoke.yaml --n_prompts 4
    python benchmarks/bench_generator.py --n_prompts 64 --batches 8,auto   # batch 8 against the host's choice
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
from compute.timing import read_bandwidth
from data_gen.batch_sizing import choose_batch
from data_gen.chunk import ChunkStats, produce_chunk
from data_gen.config import AUTO, GenerateConfig
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


@dataclasses.dataclass
class BatchRun:
    """The generator's passes over the benchmark's prompts at one rollout batch: records, stage accounting, seconds."""

    batch: int
    records: dict[str, list] = dataclasses.field(default_factory=dict)
    stats: ChunkStats = dataclasses.field(default_factory=ChunkStats)
    wall: float = 0.0
    write_s: float = 0.0

    @property
    def n(self) -> int:
        return len(self.records.get("draft_token", []))

    def add(self, recs: dict[str, list], st: ChunkStats, wall: float, write_s: float) -> None:
        """Count one chunk's records, accounting and seconds."""
        for k, v in recs.items():
            self.records.setdefault(k, []).extend(v)
        for f in dataclasses.fields(ChunkStats):
            a, b = getattr(self.stats, f.name), getattr(st, f.name)
            setattr(self.stats, f.name, a + b if isinstance(a, int) else _merged(a, b))
        self.wall += wall
        self.write_s += write_s


def run_batches(cfgs: list[GenerateConfig], models, tok, prompts: list, rendered: list[list[int]]) -> list[BatchRun]:
    """The generator's chunks over ``prompts`` at each config's batch, side by side: every batch runs a chunk before
    the next chunk starts, in turn forwards and backwards, so that the host's drift and other load fall on all alike
    (shards written to a temporary folder)."""
    runs = [BatchRun(int(c.gen_batch_size)) for c in cfgs]
    with tempfile.TemporaryDirectory() as tmp:
        hidden = models.draft.config.hidden_size if cfgs[0].store_hidden else None
        writer = ShardWriter(Path(tmp), features_schema(cfgs[0].top_k, hidden, models.companion is not None))
        per = cfgs[0].prompts_per_shard
        for c, start in enumerate(range(0, len(prompts), per)):
            idx = list(range(start, min(start + per, len(prompts))))
            order = list(range(len(cfgs)))
            for k in order if c % 2 == 0 else order[::-1]:
                t0 = time.perf_counter()
                recs, st = produce_chunk(cfgs[k], models, tok, prompts, rendered, idx, c)
                t1 = time.perf_counter()
                writer.write(c, recs)
                t2 = time.perf_counter()
                runs[k].add(recs, st, t2 - t0, t2 - t1)
    return runs


def same_records(a: BatchRun, b: BatchRun) -> str:
    """How many of ``b``'s records have ``a``'s key, tokens and labels (position, draw, drafted and next token, target
    argmax, greedy match), and the largest difference of p and q among them."""
    cols = ("seq_id", "prefix_len", "draw", "draft_token", "next_token", "target_argmax", "greedy_match")
    ka = {tuple(a.records[c][i] for c in cols): i for i in range(a.n)}
    hits = [(ka[k], i) for i in range(b.n) if (k := tuple(b.records[c][i] for c in cols)) in ka]
    dp = max((abs(a.records[c][i] - b.records[c][j]) for i, j in hits for c in ("p", "q")), default=0.0)
    return f"{len(hits)}/{b.n} (max |dp|, |dq| {dp:.1e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/generate-default.yaml", help="generate config YAML (its mix)")
    ap.add_argument("--n_prompts", type=int, default=16, help="prompts labelled (one chunk each of prompts_per_shard)")
    ap.add_argument("--compute", default=None, help="override models.compute (auto, packed, packed-bf16, eager)")
    ap.add_argument("--native_gemm", default=None, choices=["true", "false"],
                    help="override models.native_gemm (packed-bf16 on specstop's bf16 GEMM or oneDNN's)")
    ap.add_argument("--rows", type=int, default=512, help="rows of the floor's GEMMs (a labelling batch's size)")
    ap.add_argument("--batches", default="8,auto", help="rollout batches to run side by side: integers or auto")
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
    info = cpu_info()
    print(f"CPU {info['model_name']} ({info['torch_cpu_capability']}, {torch.get_num_threads()} threads); compute path "
          f"{compute_path_of(models.target)} on {gemm_of(models.target)}; models loaded in {load_s:.0f}s; "
          f"{len(prompts)} prompts of {args.config}; read bandwidth {read_bandwidth() / 1e9:.1f} GB/s")
    cfgs = []
    for spec in args.batches.split(","):
        batch = spec.strip() if spec.strip() == AUTO else int(spec)
        if batch == AUTO:
            t0 = time.perf_counter()
            choice = choose_batch(cfg, models)
            print(f"auto -> {choice.size} (probe {time.perf_counter() - t0:.1f}s): {choice.reason}")
            batch = choice.size
        cfgs.append(dataclasses.replace(cfg, gen_batch_size=batch))
    runs = run_batches(cfgs, models, tok, prompts, rendered)
    for run in runs:
        report(models, run, args.rows)
    compare(runs)


def report(models, run: BatchRun, rows: int) -> None:
    """One batch's records/s, fraction of the floor and seconds per stage."""
    total, wall, write_s = run.stats, run.wall, run.write_s
    lab_floor, per_model = label_floor(models, total, rows)
    seq_floor = sequential_floor(models, total, run.batch)
    floor = lab_floor + seq_floor
    print(f"gen_batch_size {run.batch}: records {run.n} in {wall:.1f}s: {run.n / wall:.2f} records/s; floor "
          f"{floor:.1f}s (labelling {lab_floor:.1f}s, sequential {seq_floor:.1f}s): {floor / wall:.0%} of the floor")
    print("| stage | seconds | share of wall |")
    print("|---|---|---|")
    for o, s in sorted(total.gen_seconds_by_origin.items()):
        print(f"| generation, {o} origin ({total.gen_tokens_by_origin[o]} tokens) | {s:.1f} | {s / wall:.0%} |")
    for role, s in total.label_seconds.items():
        print(f"| labelling, {role} (floor {per_model.get(role, 0):.1f}s) | {s:.1f} | {s / wall:.0%} |")
    print(f"| writing | {write_s:.1f} | {write_s / wall:.0%} |")
    print(f"tokens passed {total.tokens_passed}, positions labelled {total.positions}; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def compare(runs: list[BatchRun]) -> None:
    """The batches side by side: records/s, the ratio to the first batch's, generation and labelling seconds, and the
    records equal to the first batch's."""
    if len(runs) < 2:
        return
    first = runs[0]
    print("| gen_batch_size | records | wall s | records/s | vs first | generation s | labelling s | same records "
          "as first |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        gen, lab = sum(r.stats.gen_seconds_by_origin.values()), sum(r.stats.label_seconds.values())
        ratio = (r.n / r.wall) / (first.n / first.wall)
        print(f"| {r.batch} | {r.n} | {r.wall:.1f} | {r.n / r.wall:.2f} | {ratio:.2f}x | {gen:.1f} | {lab:.1f} "
              f"| {same_records(first, r)} |")


def _merged(a, b):
    out = type(a)() if not hasattr(a, "default_factory") else type(a)(a.default_factory)
    for d in (a, b):
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


if __name__ == "__main__":
    main()
