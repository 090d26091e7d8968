"""specstop's bf16 GEMM against oneDNN's, side by side in one run, at the linear shapes of a model and its whole
forward.

Part 1 (warm kernels): each linear shape of the model's layers (q/k/v fused, o, gate/up fused, down) with random
weights, both kernels at M = 1, 2, 4, 6, 8, 12, 16, 64 rows (the minimum of ``--repeats`` calls), then the sum over
the model's layers. Part 2 (the real model, weights streamed from memory as in decoding): the model loaded twice,
``--models.native_gemm`` true and false, a forward of L = 1, 2, 4, 8, 16 new tokens over a cached 300-token prefix,
interleaved per repeat, with the ratio to L = 1 (the verification curve of ``pipelines.measure_costs``).

Usage:
    python benchmarks/bench_bf16_gemm.py                        # the 1.5B target's shapes and forward
    python benchmarks/bench_bf16_gemm.py --model packaged:qwen2.5-coder-0.5b-instruct --skip_model
"""
from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch

from compute import bf16_gemm
from compute.compute_path import cpu_info
from compute.models import ModelSpec, load_model
from compute.timing import _crop, _prefill


def _best(fn, repeats: int) -> float:
    """Minimum wall time of ``fn()`` in ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def layer_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of the fused linears of one decoder layer of a Llama / Qwen-style config."""
    h, i = config.hidden_size, config.intermediate_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    kv = config.num_key_value_heads * d
    return {"qkv": (config.num_attention_heads * d + 2 * kv, h), "o": (h, config.num_attention_heads * d),
            "gate_up": (2 * i, h), "down": (h, i)}


def kernels(shapes: dict[str, tuple[int, int]], layers: int, rows: list[int], repeats: int) -> None:
    """Part 1: both kernels per shape and row count, and the sum over the layers."""
    total = {"specstop": dict.fromkeys(rows, 0.0), "onednn": dict.fromkeys(rows, 0.0)}
    with torch.inference_mode():
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k).to(torch.bfloat16)
            ours, theirs = bf16_gemm.pack(w), torch.ops.mkldnn._reorder_linear_weight(w, None)
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                xd = torch.zeros(max(m, 4), k, dtype=torch.bfloat16)  # oneDNN padded as PackedLinear pads it
                xd[:m] = x
                a = _best(functools.partial(bf16_gemm.gemm, x, ours, n), repeats)
                b = _best(functools.partial(torch.ops.mkldnn._linear_pointwise, xd, theirs, None, "none", [], ""),
                          repeats)
                total["specstop"][m] += a * layers
                total["onednn"][m] += b * layers
                print(f"{name:8s} {n:6d} x {k:5d}  M={m:3d}  specstop {a:7.3f} ms  onednn {b:7.3f} ms  "
                      f"ratio {a / b:.2f}", flush=True)
    for kernel, t in total.items():
        print(f"{layers} layers, {kernel:8s}: " + "  ".join(f"M={m} {v:.1f} ms" for m, v in t.items()))


def forward_curve(name: str, lengths: list[int], repeats: int) -> None:
    """Part 2: the real model on both kernels, a forward of L new tokens over a cached prefix."""
    models = {k: load_model(ModelSpec(name, native_gemm=(k == "specstop")))[0] for k in ("specstop", "onednn")}
    prefix = torch.randint(0, 1000, (1, 300))
    caches = {k: _prefill(m, prefix) for k, m in models.items()}
    times = {k: {L: [] for L in lengths} for k in models}
    for _ in range(repeats):  # interleaved: the host's speed drifts within minutes
        for L in lengths:
            x = torch.randint(0, 1000, (1, L))
            for k, m in models.items():
                t0 = time.perf_counter()
                with torch.inference_mode():
                    m(input_ids=x, past_key_values=caches[k], use_cache=True)
                times[k][L].append(time.perf_counter() - t0)
                _crop(caches[k], prefix.shape[1])
    for k, t in times.items():
        best = {L: min(v) * 1e3 for L, v in t.items()}
        print(f"{name} forward, {k:8s}: " + "  ".join(f"L={L} {v:.1f} ms ({v / best[1]:.2f}x)"
                                                        for L, v in best.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="packaged:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--skip_model", action="store_true", help="only part 1 (no real model loaded)")
    args = ap.parse_args()
    if not bf16_gemm.available():
        raise SystemExit("specstop's bf16 GEMM is unavailable here (no AVX512-BF16, no compiler or SPECSTOP_NATIVE=0)")
    info = cpu_info()
    print(f"CPU {info['model_name']!r}, torch {info['torch']}, {info['threads']} threads, "
          f"{', '.join(f for f in info['simd_flags'] if 'bf16' in f or f == 'avx512f')}")
    from transformers import AutoConfig

    from compute.packaged import ensure_packaged

    path = (ensure_packaged(args.model.removeprefix("packaged:"), Path("~/.cache/specstop").expanduser())
            if args.model.startswith("packaged:") else args.model)
    config = AutoConfig.from_pretrained(path)
    kernels(layer_shapes(config), config.num_hidden_layers, [1, 2, 4, 6, 8, 12, 16, 64], args.repeats)
    if not args.skip_model:
        forward_curve(args.model, [1, 2, 4, 8, 16], args.repeats)


if __name__ == "__main__":
    main()
