"""Does a skipped draft forward cost acceptance? specstop's vLLM proposer, skipping steps with and without the catch-up.

A step that drafts nothing skips the draft's forward and the draft reads the skipped tokens at its next forward
(``runtimes.vllm.catch_up``). Run in vLLM on the real pair with ``static:K`` and three ways, side by side on the same
prompts: every step drafts; every ``--every``-th step drafts nothing and skips the draft's forward (the catch-up
feeds the draft what it missed); the same steps draft nothing but the draft's forward runs (its cache is right by
construction). Where the catch-up is exact the last two agree on acceptance and outputs; their time ratio is what
skipping saves. Greedy outputs must equal the first way's in every run (the target verifies every token).

Usage (in ``.venv-vllm``, after ``bash scripts/setup.sh --vllm --real``):
    .venv-vllm/bin/python benchmarks/bench_catch_up.py --prompts 4 --new_tokens 64 --k 3 --every 2
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtimes.vllm.engine import prepare_env, reexec_with_iomp  # noqa: E402

if __name__ == "__main__":  # vLLM's environment and Intel OpenMP before vLLM and torch load
    prepare_env(2)
    reexec_with_iomp(sys.argv)

from vllm_probe import add_pair_args, pair_and_prompts  # noqa: E402

from decoding.policies import build_policy  # noqa: E402
from runtimes.vllm import proposer as vllm_proposer  # noqa: E402
from runtimes.vllm.engine import EngineSpec, build_engine, generate, release, spec_counters  # noqa: E402
from runtimes.vllm.stopper import RequestStopper  # noqa: E402


def forced_skips(base: type, every: int, skip_forward: bool) -> type:
    """A stopper class that drafts nothing on every ``every``-th step (its forward skipped or run)."""

    class Skipping(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.skip_idle, self.n_steps, self.forced = skip_forward, 0, False

        def begin_round(self, *args: Any, **kwargs: Any) -> None:
            super().begin_round(*args, **kwargs)
            self.n_steps += 1
            self.forced = self.n_steps % every == 0

        def all_stopped(self) -> bool:
            return self.forced or super().all_stopped()

    return Skipping


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(ap)
    ap.add_argument("--k", type=int, default=3, help="tokens every drafting step drafts (static:K)")
    ap.add_argument("--every", type=int, default=2, help="every N-th step drafts nothing")
    args = ap.parse_args()
    target, draft, prompts = pair_and_prompts(args)
    spec = f"static:{args.k}"
    vllm_proposer.install(vllm_proposer.PolicySettings(spec=spec))
    llm = build_engine(EngineSpec(target=target, draft=draft, k=args.k, max_num_seqs=max(2, args.batch)))
    prop = vllm_proposer.active()
    generate(llm, [prompts[0]], 8)  # warm-up
    ways = {"every step drafts": RequestStopper,
            f"1 step in {args.every} skips the draft (catch-up)": forced_skips(RequestStopper, args.every, True),
            f"1 step in {args.every} drafts nothing, draft runs": forced_skips(RequestStopper, args.every, False)}
    ref, times = None, {}
    for name, cls in ways.items():
        prop.stopper = cls(build_policy(spec))
        before, t0, outs = spec_counters(llm), time.perf_counter(), []
        for i in range(0, len(prompts), args.batch):
            outs += generate(llm, prompts[i:i + args.batch], args.new_tokens)[0]
        times[name] = time.perf_counter() - t0
        after = spec_counters(llm)
        drafted, accepted = (after.get(k, 0) - before.get(k, 0) for k in ("draft_tokens", "accepted"))
        ref = outs if ref is None else ref
        same = sum(a == b for a, b in zip(outs, ref))
        print(f"{name:48s} {times[name]:6.1f} s  acceptance {accepted / max(drafted, 1):.3f} "
              f"({int(drafted)} drafted)  outputs equal to the first way's: {same}/{len(outs)}", flush=True)
    skip, run = list(times.values())[1:]
    print(f"skipping the draft's forward: {run / skip:.2f}x the time of running it (same decisions)")
    release(llm)


if __name__ == "__main__":
    main()
