"""Does pricing vLLM's curve as measured pay, against its lower monotone envelope? One engine, one policy, two curves.

vLLM's curve (``pipelines.measure_costs --runtime vllm``) keeps each verification length's median as measured; its
lower monotone envelope (T(L) = min over L' >= L, what the curve was before) prices a pass over fewer tokens no dearer
than one over more, which vLLM's CPU GEMM does not hold to (2 rows slower than 4 on some hosts). This runs one
policy in one policies' engine (specstop's proposer, cap ``--cap``) priced by the curve file as given and by its
envelope, with vLLM's own draft loop at each ``--k`` in the same engine for scale: every row runs every unit
(``--batch`` prompts at once), the rows' order reversed from unit to unit, so that one build of one engine and the same
minutes of the host meet every row. Printed per row: tokens/s, its speed over the first row's with a 95% paired
bootstrap interval over units, the drafted tokens a round sent, and whether its outputs equal the first row's;
``--out`` keeps each unit's seconds, tokens and outputs as JSON.

Usage (in ``.venv-vllm``, after ``bash scripts/setup.sh --vllm --real`` and a vLLM benchmark's curve and refit):
    .venv-vllm/bin/python benchmarks/bench_curve_shape.py --costs outputs/benchmark-vllm-serve/cost_model.vllm.json \\
        --policy goodput:outputs/benchmark-vllm-serve/calibrated/disco --batch 1 --prompts 8 --rounds 2
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtimes.vllm.engine import prepare_env, reexec_with_iomp  # noqa: E402

if __name__ == "__main__":  # vLLM's environment and Intel OpenMP before vLLM and torch load
    prepare_env(1)
    reexec_with_iomp(sys.argv)

import numpy as np  # noqa: E402
from vllm_probe import add_pair_args, pair_and_prompts  # noqa: E402

from benchmark.records import bootstrap_indices, seconds_ratio  # noqa: E402
from compute.timing import BATCH_CURVES, CostModel, lower_envelope  # noqa: E402
from runtimes.vllm import proposer as vllm_proposer  # noqa: E402
from runtimes.vllm.engine import EngineSpec, build_engine, generate  # noqa: E402


def enveloped(costs: Path, out: Path) -> Path:
    """``costs`` with every batch size's verification curve made non-decreasing (the lower monotone envelope)."""
    cm = CostModel.from_json(costs)
    batches = {b: replace(c := CostModel.from_dict(d), target_s=lower_envelope(c.target_s)).to_dict()
               for b, d in (cm.extra.get(BATCH_CURVES) or {}).items()}
    replace(cm, target_s=lower_envelope(cm.target_s), extra={**cm.extra, BATCH_CURVES: batches}).to_json(out)
    return out


def run_row(llm: Any, settings: vllm_proposer.PolicySettings, unit: list[list[int]], new_tokens: int
            ) -> tuple[float, list[list[int]], int, int]:
    """The unit under ``settings``: (seconds, outputs, drafted tokens sent, rounds) of specstop's stopper."""
    proposer = vllm_proposer.active()
    proposer.set_policy(settings)
    outs, seconds = generate(llm, unit, new_tokens)
    counts = proposer.stopper.counts
    return seconds, [list(o) for o in outs], counts.sent, counts.rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(ap)
    ap.add_argument("--costs", required=True, help="vLLM's curve file (pipelines.measure_costs --runtime vllm)")
    ap.add_argument("--policy", required=True, help="the policy spec, e.g. goodput:EXPORT (vLLM-calibrated)")
    ap.add_argument("--k", default="1,3", help="vLLM's own loop at these K in the same engine (comma-separated)")
    ap.add_argument("--cap", type=int, default=8, help="num_speculative_tokens of the engine: a round's cap")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    ap.add_argument("--out", default=None, help="JSON file for the per-unit records")
    args = ap.parse_args()
    costs = Path(args.costs)
    if not costs.is_file():
        raise SystemExit(f"--costs: no curve file at {costs} (python -m pipelines.measure_costs --runtime vllm)")
    target, draft, prompts = pair_and_prompts(args)
    env = enveloped(costs, Path(args.out or costs).with_suffix(".envelope.json"))

    def settings(spec: str, curve: Path) -> vllm_proposer.PolicySettings:
        return vllm_proposer.PolicySettings(spec=spec, costs=str(curve), max_draft_len=args.cap)

    rows = {f"{args.policy} (curve as measured)": settings(args.policy, costs),
            f"{args.policy} (envelope)": settings(args.policy, env),
            **{f"vllm:{k}": settings(f"vllm:{k}", costs) for k in args.k.split(",")}}
    vllm_proposer.install(next(iter(rows.values())))
    llm = build_engine(EngineSpec(target=target, draft=draft, k=args.cap, max_num_seqs=max(2, args.batch)))
    generate(llm, prompts[: args.batch], 4)  # a batch size's first steps run slower
    units = [prompts[u:u + args.batch] for u in range(0, len(prompts), args.batch)]
    rec: dict[str, dict[str, list]] = {n: {"seconds": [], "tokens": [], "outputs": [], "sent": [], "rounds": []}
                                       for n in rows}
    for r in range(args.rounds):
        for u, unit in enumerate(units):
            order = list(rows) if (r * len(units) + u) % 2 == 0 else list(reversed(rows))
            for name in order:
                sec, outs, sent, rounds = run_row(llm, rows[name], unit, args.new_tokens)
                got = rec[name]
                got["seconds"].append(sec)
                got["tokens"].append(sum(len(o) for o in outs))
                got["sent"].append(sent)
                got["rounds"].append(rounds)
                if r == 0:
                    got["outputs"] += outs
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    report(rec, args)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rec}, indent=1))


def report(rec: dict[str, dict[str, list]], args: argparse.Namespace, n_boot: int = 2000) -> None:
    """Per row: tokens/s, seconds over the first row's [95% CI], tokens sent a round, outputs equal to the first's."""
    names = list(rec)
    first = rec[names[0]]
    boot = bootstrap_indices(0, n_boot, len(first["seconds"]))
    base = np.asarray(first["seconds"])
    print(f"{args.prompts} prompts x {args.new_tokens} new tokens, {args.batch} request(s) a unit, {args.rounds} "
          f"rounds, one engine (cap {args.cap}); speedup = the first row's seconds over the row's")
    for name in names:
        got = rec[name]
        s = np.asarray(got["seconds"])
        speedup, lo, hi = seconds_ratio(base, s, boot)
        rounds = sum(got["rounds"])
        sent = f"{sum(got['sent']) / rounds:.2f} sent a round" if rounds else "vLLM's loop"
        same = sum(a == b for a, b in zip(got["outputs"], first["outputs"]))
        print(f"{name:60s} {sum(got['tokens']) / s.sum():6.2f} tok/s  {speedup:.3f}x [{lo:.3f}, "
              f"{hi:.3f}]  {sent}  outputs equal {same}/{len(got['outputs'])}", flush=True)


if __name__ == "__main__":
    main()
