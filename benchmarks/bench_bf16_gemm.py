"""specstop's bf16 GEMM (each kernel ISA this CPU runs) against oneDNN's, side by side in one run, at the linear shapes
of a model and its whole forward, each figure beside its memory floor (the bytes it reads over the read bandwidth
measured in the same run).

Part 1 (kernels): each linear shape of the model's layers (q/k/v fused, o, gate/up fused, down) with random weights,
every kernel at M = 1, 2, 4, 6, 8, 12, 16, 64 rows (``--rows``; the minimum of ``--repeats`` calls), the weights of
``--copies`` layers in turn so that they stream from memory as in a forward, then the sum over the model's layers.
Part 2 (the real model): the model loaded once per variant, a forward of L = 1, 2, 4, 8, 16 new tokens over a cached
300-token prefix, interleaved per repeat, with the ratio to L = 1 (the verification curve of
``pipelines.measure_costs``) and to the floor.

Variants (``--variants``): ``specstop`` (the process's kernel ISA, ``SPECSTOP_ISA``), ``specstop-avx512`` /
``specstop-avx2`` (that ISA's kernel), ``onednn-bf16`` (oneDNN's bf16 kernels, where it has them), ``packed``
(oneDNN fp32) and ``vllm-onednn`` (the oneDNN GEMM vLLM's CPU build runs its linears with, ``onednn_mm``; part 1
only, in ``.venv-vllm``). To time an AVX2 host's options on an AVX-512 one, run with ``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2``.

Usage:
    python benchmarks/bench_bf16_gemm.py                        # the 1.5B target's shapes and forward
    python benchmarks/bench_bf16_gemm.py --model packaged:qwen2.5-coder-0.5b-instruct --skip_model
    python benchmarks/bench_bf16_gemm.py --variants specstop-avx2,specstop-avx512,packed
    python benchmarks/bench_bf16_gemm.py --skip_model --rows 256,1024,3072 --repeats 3 --copies 1  # labelling's rows
    .venv-vllm/bin/python benchmarks/bench_bf16_gemm.py --skip_model --variants vllm-onednn,onednn-bf16 \\
        --rows 1,2,3,4,6,8
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig

from compute import bf16_gemm
from compute.compute_path import cpu_info, native_bf16
from compute.models import ModelSpec, load_model
from compute.packaged import ensure_packaged
from compute.timing import crop, forward_bytes, prefill, read_bandwidth

VARIANTS = ("specstop", "specstop-avx512", "specstop-avx2", "onednn-bf16", "packed", "vllm-onednn")


def _best(fn: Callable[[], object], repeats: int) -> float:
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


def _isa_of(variant: str) -> str | None:
    """The kernel ISA a specstop variant names (the process's for plain ``specstop``), None for oneDNN's."""
    if not variant.startswith("specstop"):
        return None
    return variant.partition("-")[2] or bf16_gemm.isa()


def _kernel_calls(variant: str, w: torch.Tensor) -> tuple[Callable[[torch.Tensor], object], int]:
    """(x -> the variant's GEMM of x with w, bytes of its pack)."""
    n = w.shape[0]
    isa = _isa_of(variant)
    if isa is not None:
        wp = bf16_gemm.pack(w, isa)
        return (lambda x: bf16_gemm.gemm(x, wp, n, which=isa)), wp.numel() * wp.element_size()
    if variant == "vllm-onednn":  # vLLM's CPU linear: a oneDNN handler made once per weight, as its dispatch makes it
        import vllm._custom_ops as ops

        handler = ops.create_onednn_mm(w.t(), 32)
        return (lambda x: ops.onednn_mm(handler, x, None)), w.numel() * w.element_size()
    dtype = torch.bfloat16 if variant == "onednn-bf16" else torch.float32
    wp = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None)

    def call(x: torch.Tensor) -> object:
        xd = torch.zeros(max(x.shape[0], 4), x.shape[1], dtype=dtype)  # padded as PackedLinear pads it
        xd[: x.shape[0]] = x
        return torch.ops.mkldnn._linear_pointwise(xd, wp, None, "none", [], "")

    return call, w.numel() * dtype.itemsize


def kernels(shapes: dict[str, tuple[int, int]], layers: int, rows: list[int], variants: list[str], repeats: int,
            copies: int, bandwidth: float) -> None:
    """Part 1: every variant per shape and row count (``copies`` weights in turn), beside the floor, and the sum
    over the layers."""
    total = {v: dict.fromkeys(rows, 0.0) for v in variants}
    floor_total = dict.fromkeys(variants, 0.0)
    with torch.inference_mode():
        for name, (n, k) in shapes.items():
            calls = {v: [_kernel_calls(v, torch.randn(n, k).to(torch.bfloat16)) for _ in range(copies)]
                     for v in variants}
            floors = {v: calls[v][0][1] / bandwidth * 1e3 for v in variants}
            for v in variants:
                floor_total[v] += floors[v] * layers
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                ms = {v: _best(lambda fns=calls[v], x=x: [call(x) for call, _ in fns], repeats) / copies
                      for v in variants}
                for v in variants:
                    total[v][m] += ms[v] * layers
                print(f"{name:8s} {n:6d} x {k:5d}  M={m:3d}  " + "  ".join(
                    f"{v} {ms[v]:7.3f} ms ({ms[v] / floors[v]:.2f}x floor)" for v in variants), flush=True)
    for v, t in total.items():
        print(f"{layers} layers, {v:16s} (floor {floor_total[v]:.1f} ms): "
              + "  ".join(f"M={m} {ms:.1f} ms ({ms / floor_total[v]:.2f}x)" for m, ms in t.items()))


def _load(name: str, variant: str) -> torch.nn.Module:
    """The model on a variant's path (a specstop variant packs on its ISA's kernel: SPECSTOP_ISA while it loads)."""
    isa, before = _isa_of(variant), os.environ.get("SPECSTOP_ISA")
    if isa is not None:
        os.environ["SPECSTOP_ISA"] = isa
    try:
        compute = "packed" if variant == "packed" else "packed-bf16"
        return load_model(ModelSpec(name, compute=compute, native_gemm=isa is not None))[0]
    finally:
        if before is None:
            os.environ.pop("SPECSTOP_ISA", None)
        else:
            os.environ["SPECSTOP_ISA"] = before


def forward_curve(name: str, variants: list[str], lengths: list[int], repeats: int) -> None:
    """Part 2: the real model on every variant, a forward of L new tokens over a cached prefix, beside its floor."""
    models = {v: _load(name, v) for v in variants if v != "vllm-onednn"}  # vLLM's GEMM runs in vLLM's engines
    bandwidth = read_bandwidth()
    floors = {v: forward_bytes(m) / bandwidth * 1e3 for v, m in models.items()}
    prefix = torch.randint(0, 1000, (1, 300))
    caches = {v: prefill(m, prefix) for v, m in models.items()}
    times = {v: {L: [] for L in lengths} for v in models}
    for _ in range(repeats):  # interleaved: the host's speed drifts within minutes
        for L in lengths:
            x = torch.randint(0, 1000, (1, L))
            for v, m in models.items():
                t0 = time.perf_counter()
                with torch.inference_mode():
                    m(input_ids=x, past_key_values=caches[v], use_cache=True)
                times[v][L].append(time.perf_counter() - t0)
                crop(caches[v], prefix.shape[1])
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (measured after loading)")
    for v, t in times.items():
        best = {L: min(ts) * 1e3 for L, ts in t.items()}
        print(f"{name} forward, {v:16s} (floor {floors[v]:.1f} ms): "
              + "  ".join(f"L={L} {ms:.1f} ms ({ms / best[1]:.2f}x L=1, {ms / floors[v]:.2f}x floor)"
                          for L, ms in best.items()))


def _variants(arg: str) -> list[str]:
    """The variants asked for that run here (each one left out is said why)."""
    out = []
    for v in arg.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
        isa = _isa_of(v)
        if isa is not None and not bf16_gemm.available(isa):
            print(f"{v} left out: {bf16_gemm.unavailable_reason(isa)}")
        elif v == "onednn-bf16" and not native_bf16():
            print(f"{v} left out: oneDNN has no bf16 kernels on this CPU")
        elif v == "vllm-onednn" and importlib.util.find_spec("vllm") is None:
            print(f"{v} left out: vLLM is not installed here (bash scripts/setup.sh --vllm; run in .venv-vllm)")
        else:
            out.append(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="packaged:qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--variants", default="specstop,onednn-bf16", help=f"comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--copies", type=int, default=4, help="weights per shape taken in turn (part 1)")
    ap.add_argument("--skip_model", action="store_true", help="only part 1 (no real model loaded)")
    ap.add_argument("--rows", default="1,2,4,6,8,12,16,64",
                    help="part 1's row counts, comma-separated (labelling passes run up to label_batch_tokens)")
    args = ap.parse_args()
    variants = _variants(args.variants)
    if not variants:
        raise SystemExit("no variant runs here")
    info = cpu_info()
    flags = [f for f in info["simd_flags"] if "bf16" in f or f in ("avx2", "avx512f")]
    print(f"CPU {info['model_name']!r}, torch {info['torch']}, {info['threads']} threads, bf16 chain "
          f"{info['bf16_chain']}, {', '.join(flags)}")
    path = (ensure_packaged(args.model.removeprefix("packaged:"), Path("~/.cache/specstop").expanduser())
            if args.model.startswith("packaged:") else args.model)
    config = AutoConfig.from_pretrained(path)
    bandwidth = read_bandwidth()
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = [int(m) for m in args.rows.split(",")]
    kernels(layer_shapes(config), config.num_hidden_layers, rows, variants, args.repeats, args.copies, bandwidth)
    if not args.skip_model:
        forward_curve(args.model, variants, [1, 2, 4, 8, 16], args.repeats)


if __name__ == "__main__":
    main()
