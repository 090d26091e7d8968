"""vLLM's dtype on this CPU: the target alone and draft-model speculation in bfloat16 and in float32, side by side.

vLLM's CPU build runs bfloat16 matmuls on its fast kernels where the CPU has AVX-512 BF16 or AMX; on a CPU without
them (AVX2) its bf16 path costs about as much for every row a step carries, where float32's matmuls cost about the
same for 1 row as for 8. Which dtype serves faster then depends on the load: this script tells it for the host.
Engines are named ``DTYPE:K`` (K = 0: the target alone, else vLLM's own draft loop at K), built in the order given
and stepped in turns, one step each, on the same prompts (``run_rounds`` of ``bench_idle_step.py``). Printed per engine:
its prefill seconds, its decode seconds over the first engine's with a 95% paired bootstrap interval over units,
whole-request seconds (prefill included) likewise, and whether its outputs equal the first's (two dtypes round apart:
a greedy output may part at a near tie).

Usage (in ``.venv-vllm``, after ``bash scripts/setup.sh --vllm --real``):
    .venv-vllm/bin/python benchmarks/bench_vllm_dtype.py --engines bfloat16:0,float32:3 --batch 4

Memory (resident, a 1 GB KV cache each): the 1.5B target alone about 5 GB in bfloat16 and 11 GB in float32, with the
0.5B draft about 6.5 and 14.5 GB. Name at most what fits (an engine that does not is refused before it loads): in
24 GB, two of them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtimes.vllm.engine import prepare_env, reexec_with_iomp  # noqa: E402

if __name__ == "__main__":  # a 1 GB KV cache an engine (several live at once), Intel OpenMP
    prepare_env(1)
    reexec_with_iomp(sys.argv)

import numpy as np  # noqa: E402
from bench_idle_step import run_rounds  # noqa: E402
from vllm_probe import add_pair_args, pair_and_prompts  # noqa: E402

from benchmark.records import bootstrap_indices, seconds_ratio  # noqa: E402
from runtimes.vllm import proposer as vllm_proposer  # noqa: E402
from runtimes.vllm.engine import EngineSpec, build_engine, check_dtype, generate  # noqa: E402


def parse_engine(item: str) -> tuple[str, int]:
    """``DTYPE:K`` as (dtype, K); SystemExit in one line for anything else."""
    dtype, _, k = item.partition(":")
    try:
        check_dtype(dtype, "--engines")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not k.isdigit():
        raise SystemExit(f"--engines {item!r}: name each engine DTYPE:K, K = 0 (the target alone) or vLLM's K >= 1")
    return dtype, int(k)


def build(dtype: str, k: int, target: str, draft: str, batch: int) -> Any:
    """The target alone (``k`` = 0) or vLLM's own draft-model speculation at ``k``, in ``dtype``."""
    vllm_proposer.uninstall()  # vLLM's own proposer: K drafts every step
    return build_engine(EngineSpec(target=target, draft=draft if k else None, k=k, max_num_seqs=max(2, batch),
                                   dtype=dtype))


def interval(values: np.ndarray, base: np.ndarray, boot: np.ndarray) -> str:
    """Sum of ``values`` over sum of ``base`` with its 95% paired bootstrap interval over units."""
    point, lo, hi = seconds_ratio(values, base, boot)
    return f"{point:.3f}x [{lo:.3f}, {hi:.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(ap)
    ap.add_argument("--engines", default="bfloat16:0,float32:3",
                    help="DTYPE:K in build order, comma-separated (K = 0: the target alone)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    args = ap.parse_args()
    specs = [parse_engine(e) for e in args.engines.split(",")]
    target, draft, prompts = pair_and_prompts(args)
    engines = []
    for dtype, k in specs:
        llm = build(dtype, k, target, draft, args.batch)
        generate(llm, prompts[: args.batch], 4)  # a batch size's first steps run slower
        engines.append((f"{dtype}:{k}", llm, {}))
    names = [n for n, _, _ in engines]
    got = run_rounds(engines, prompts, args.batch, args.new_tokens, args.rounds)
    print(f"{len(prompts)} prompts x {args.new_tokens} new tokens at {args.batch} request(s) a unit, {args.rounds} "
          "rounds; engines stepped in turns; seconds over the first engine's")
    ref = got[names[0]]
    ref_d = np.asarray(ref["decode"])
    ref_w = ref_d + np.asarray(ref["prefill"])
    boot = bootstrap_indices(0, 2000, len(ref_d))
    for name in names:
        g = got[name]
        d = np.asarray(g["decode"])
        w = d + np.asarray(g["prefill"])
        same = sum(a == b for a, b in zip(g["outputs"], ref["outputs"]))
        print(f"{name:12s} prefill {w.sum() - d.sum():7.1f} s | decode {d.sum():7.1f} s {interval(d, ref_d, boot)} | "
              f"whole {w.sum():7.1f} s {interval(w, ref_w, boot)} | outputs equal {same}/{len(g['outputs'])}",
              flush=True)


if __name__ == "__main__":
    main()
