"""What a step that drafts nothing costs in specstop's vLLM proposer, against the target alone's step.

Engines are built in the order given and step in turns, one step each (every engine sees the same seconds of the
host); each step is split into the target's forward (logits included), sampling, the drafter's part
(``propose_draft_token_ids``: vLLM's input preparation and specstop's ``propose``) and the rest (scheduling,
bookkeeping). Kinds: ``target`` (the target alone), ``static0`` (specstop's proposer at ``static:0``: no draft
forward, the no-draft sampler of ``runtimes.vllm.proposer.no_draft_sampler``), ``static0-rejection`` (the same with
vLLM's rejection sampler on every step, as before that sampler), ``vllmK`` (vLLM's own engine at K, e.g. ``vllm1``),
``proposer-vllmK`` (vLLM's own draft loop at K inside specstop's proposer in an engine of K = 8, as the vLLM
benchmark's policies' engine runs its ``vllm:K`` rows) and ``proposer-vllmK-kN`` (the same in an engine of K = N):
what hosting the policies costs vLLM's own settings.
A kind named twice is built twice: two builds of one engine differ only by where their memory landed, the floor
under any ratio of two engines. Each engine's decode seconds are printed over the first engine's with a 95% paired
bootstrap interval over units (prompts, or groups of ``--batch``), and whether its outputs equal the first's.

Usage (in ``.venv-vllm``, after ``bash scripts/setup.sh --vllm --real``):
    .venv-vllm/bin/python benchmarks/bench_idle_step.py --engines target,static0,static0-rejection \\
        --prompts 8 --new_tokens 64 --batch 1

An engine of the 1.5B pair holds about 6-7 GB here (weights, oneDNN's packed copies, a 1 GB KV cache): three fit in
24 GB.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtimes.vllm.engine import prepare_env, reexec_with_iomp  # noqa: E402

if __name__ == "__main__":  # vLLM's environment (a 1 GB KV cache an engine: several live at once) and Intel OpenMP
    prepare_env(1)
    reexec_with_iomp(sys.argv)

import numpy as np  # noqa: E402
from vllm_probe import add_pair_args, pair_and_prompts  # noqa: E402

from benchmark.records import bootstrap_indices, seconds_ratio  # noqa: E402
from runtimes.vllm import proposer as vllm_proposer  # noqa: E402
from runtimes.vllm.engine import EngineSpec, build_engine, generate  # noqa: E402

KINDS = ("target", "static0", "static0-rejection", "vllmK", "proposer-vllmK", "proposer-vllmK-kN")
KIND = re.compile(r"(target|static0|static0-rejection)|(proposer-)?vllm(\d+)(?:-k(\d+))?")
PARTS = {"forward": ("model", "forward"), "logits": ("model", "compute_logits"), "sampling": ("runner", "_sample"),
         "drafter": ("runner", "propose_draft_token_ids")}


def build(kind: str, target: str, draft: str, batch: int) -> Any:
    """One engine of ``kind`` (see the module docstring)."""
    got = KIND.fullmatch(kind)
    if got is None or (got[4] is not None and got[2] is None):
        raise SystemExit(f"--engines: unknown kind {kind!r}; use {', '.join(KINDS)}")
    seqs = max(2, batch)
    if kind == "target":
        vllm_proposer.uninstall()
        return build_engine(EngineSpec(target=target, max_num_seqs=seqs))
    if got[3] is not None and got[2] is None:  # vLLM's own engine at K
        vllm_proposer.uninstall()
        return build_engine(EngineSpec(target=target, draft=draft, k=int(got[3]), max_num_seqs=seqs))
    if got[2] is not None:  # vLLM's loop at K inside specstop's proposer, the engine at N (8: the policies' engine)
        vllm_proposer.install(vllm_proposer.PolicySettings(spec=f"vllm:{got[3]}", max_draft_len=8))
        llm = build_engine(EngineSpec(target=target, draft=draft, k=int(got[4] or 8), max_num_seqs=seqs))
        vllm_proposer.uninstall()
        return llm
    vllm_proposer.install(vllm_proposer.PolicySettings(spec="static:0", max_draft_len=8))
    if kind == "static0-rejection":
        import vllm.v1.worker.gpu_model_runner as runner
        from vllm.v1.sample.rejection_sampler import RejectionSampler

        runner.RejectionSampler = RejectionSampler
    llm = build_engine(EngineSpec(target=target, draft=draft, k=8, max_num_seqs=seqs))
    vllm_proposer.uninstall()
    return llm


def split_parts(llm: Any) -> dict[str, float]:
    """Wrap the runner's parts of a step with timers; returns the dict they add their seconds to."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    owners = {"model": runner.model, "runner": runner}
    acc: dict[str, float] = {}
    for part, (owner, name) in PARTS.items():
        obj = owners[owner]
        if not hasattr(obj, name):
            continue
        inner = getattr(obj, name)

        def timed(*a: Any, _inner: Any = inner, _part: str = part, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                acc[_part] = acc.get(_part, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)
    return acc


def run_unit(engines: list[tuple[str, Any, dict]], unit: list[list[int]], max_new: int, tag: str
             ) -> dict[str, tuple[float, list[dict[str, float]], list[list[int]], float]]:
    """The unit on every engine, one step each in turn: per engine its decode seconds, each decode step's parts
    (``step`` the whole), its outputs and its first (prefill) step's seconds, which the decode figures leave out."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, seed=0)
    got: dict[str, Any] = {}
    for name, llm, _ in engines:
        for j, p in enumerate(unit):
            llm.llm_engine.add_request(f"{name}-{tag}-{j}", {"prompt_token_ids": p}, params)
        got[name] = [0.0, [], {}, True, 0.0]
    live = list(engines)
    while live:
        for e in list(live):
            name, llm, acc = e
            acc.clear()
            t0 = time.perf_counter()
            outs = llm.llm_engine.step()
            wall = time.perf_counter() - t0
            rec = got[name]
            if rec[3]:
                rec[4] = wall
            else:
                rec[0] += wall
                rec[1].append({**acc, "step": wall})
            rec[3] = False
            for o in outs:
                rec[2][o.request_id] = list(o.outputs[0].token_ids)
            if not llm.llm_engine.has_unfinished_requests():
                live.remove(e)
    return {n: (r[0], r[1], [r[2][k] for k in sorted(r[2])], r[4]) for n, r in got.items()}


def run_rounds(engines: list[tuple[str, Any, dict]], prompts: list[list[int]], batch: int, max_new: int,
               rounds: int) -> dict[str, dict[str, list]]:
    """``rounds`` passes over ``prompts`` in units of ``batch``, every unit on every engine (:func:`run_unit`): per
    engine its decode and prefill seconds a unit, its decode steps' parts and its first pass's outputs."""
    got: dict[str, dict[str, list]] = {n: {"decode": [], "prefill": [], "steps": [], "outputs": []}
                                       for n, _, _ in engines}
    units = [prompts[u:u + batch] for u in range(0, len(prompts), batch)]
    for r in range(rounds):
        for u, unit in enumerate(units):
            for name, (sec, steps, outs, first) in run_unit(engines, unit, max_new, f"{r}-{u}").items():
                g = got[name]
                g["decode"].append(sec)
                g["prefill"].append(first)
                g["steps"] += steps
                if r == 0:
                    g["outputs"] += outs
        print(f"round {r + 1}/{rounds} done", flush=True)
    return got


def report(names: list[str], seconds: dict[str, list[float]], steps: dict[str, list[dict[str, float]]],
           outputs: dict[str, list[list[int]]], n_boot: int = 2000) -> None:
    """Per engine: ms a step in each part (medians), decode seconds over the first engine's [95% CI], outputs."""
    ref = names[0]
    boot = bootstrap_indices(0, n_boot, len(seconds[ref]))
    base = np.asarray(seconds[ref])
    for name in names:
        s = np.asarray(seconds[name])
        ratio, lo, hi = seconds_ratio(s, base, boot)
        parts = {p: statistics.median(st.get(p, 0.0) for st in steps[name]) * 1e3 for p in [*PARTS, "step"]}
        rest = statistics.median(st["step"] - sum(st.get(p, 0.0) for p in PARTS) for st in steps[name]) * 1e3
        same = sum(a == b for a, b in zip(outputs[name], outputs[ref]))
        print(f"{name:22s} {s.sum():7.1f} s  {ratio:.3f}x [{lo:.3f}, {hi:.3f}] the first's | median ms a step: "
              + " ".join(f"{p} {v:.2f}" for p, v in parts.items()) + f" rest {rest:.2f} | outputs equal "
              f"{same}/{len(outputs[name])}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(ap)
    ap.add_argument("--engines", default="target,static0,static0-rejection",
                    help=f"kinds in build order, comma-separated ({', '.join(KINDS)}); a kind twice: two builds")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts")
    args = ap.parse_args()
    target, draft, prompts = pair_and_prompts(args)
    kinds = args.engines.split(",")
    engines = []
    for i, kind in enumerate(kinds):
        llm = build(kind, target, draft, args.batch)
        generate(llm, prompts[: args.batch], 4)  # a batch size's first steps run slower
        engines.append((f"{i + 1}. {kind}", llm, split_parts(llm)))
    names = [n for n, _, _ in engines]
    got = run_rounds(engines, prompts, args.batch, args.new_tokens, args.rounds)
    print(f"{len(prompts)} prompts x {args.new_tokens} new tokens at {args.batch} request(s) a unit, "
          f"{args.rounds} rounds; engines stepped in turns")
    report(names, {n: got[n]["decode"] for n in names}, {n: got[n]["steps"] for n in names},
           {n: got[n]["outputs"] for n in names})


if __name__ == "__main__":
    main()
