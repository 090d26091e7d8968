"""What does specstop's proposer cost inside vLLM? vLLM's own draft proposer against specstop's at the same K.

Engines in one process, on the same prompts, in turns (the order reversed every round, so a host's slow phase falls
on each alike); by default three: vLLM's ``DraftModelProposer`` drafting K tokens a step; specstop's proposer running
``static:K`` in an engine whose ``num_speculative_tokens`` is K; the same in an engine capped at ``--cap`` (as the vLLM
benchmark's policies' engine is, so that longer policies fit). They draft the same tokens and verify them alike, so
their greedy outputs agree. Each engine's decode steps split into the time in the proposer's ``propose`` (the draft's
forwards and, for specstop's, its scoring) and the rest (the target's verification, sampling and scheduling).
``--engines`` picks the engines and the order they are built in. Two engines differ by more than their code (where
the host placed their weights, its phase while each ran): one built twice (``vllm,specstop,vllm``) shows by how much,
and ``detached`` runs vLLM's own draft loop at K in the specstop engine built last (the spec ``vllm:K``), so that the
two proposers meet in one engine and only their code differs. ``--policy`` runs a specstop policy in the specstop
engines instead of ``static:K`` (a goodput policy with ``--costs``, vLLM's curve): beside ``detached`` it shows what
the policy's deciding costs a step against vLLM's own loop in the same engine.

Usage (in ``.venv-vllm``, after ``bash scripts/setup.sh --vllm --real``):
    .venv-vllm/bin/python benchmarks/bench_vllm_proposer.py --prompts 4 --new_tokens 64 --k 3 --cap 8 --batch 1
    .venv-vllm/bin/python benchmarks/bench_vllm_proposer.py --engines vllm,specstop,vllm   # two vLLM engines
    .venv-vllm/bin/python benchmarks/bench_vllm_proposer.py --engines specstop,detached --rounds 4  # one engine
    .venv-vllm/bin/python benchmarks/bench_vllm_proposer.py --engines specstop-cap,detached --policy \
        goodput:outputs/benchmark-vllm-serve/calibrated/disco --costs outputs/benchmark-vllm-serve/cost_model.vllm.json
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
    prepare_env(1)
    reexec_with_iomp(sys.argv)

from vllm_probe import add_pair_args, pair_and_prompts  # noqa: E402

from runtimes.vllm import proposer as vllm_proposer  # noqa: E402
from runtimes.vllm.engine import EngineSpec, StepClock, build_engine, generate  # noqa: E402


def timed_propose(cls: type) -> type:
    """``cls`` with its ``propose`` timed and counted (on the instance: seconds ``propose_s``, calls ``propose_n``)."""

    class Timed(cls):  # type: ignore[misc,valid-type]
        propose_s = 0.0
        propose_n = 0

        def propose(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().propose(*args, **kwargs)
            finally:
                self.propose_s += time.perf_counter() - t0
                self.propose_n += 1

    return Timed


def scoring_s(prop: Any) -> float:
    """Seconds specstop's stopper has spent deciding (features, policy, batch rule); 0 for vLLM's proposer or none."""
    stopper = getattr(prop, "stopper", None)
    return stopper.counts.decide_s if stopper is not None else 0.0


def forwards(prop: Any, k: int) -> int:
    """Draft forwards ``prop`` has run: specstop's stopper counts its positions; vLLM's own loop runs K a proposal."""
    stopper = getattr(prop, "stopper", None)
    if stopper is not None and getattr(prop, "own_k", None) is None:
        return stopper.counts.draft_steps
    return getattr(prop, "propose_n", 0) * k


def build(target: str, draft: str | None, k: int, batch: int, settings: Any | None) -> tuple[Any, StepClock, Any]:
    """An engine drafting with vLLM's proposer (``settings`` None) or specstop's, its step clock and its proposer;
    ``draft`` None: the target alone (no proposer)."""
    import vllm.v1.worker.gpu_model_runner as runner

    if draft is None:
        llm = build_engine(EngineSpec(target=target, max_num_seqs=max(2, batch)))
        return llm, StepClock(llm), None

    if settings is None:
        vllm_proposer.uninstall()
    else:
        vllm_proposer.install(settings)
    runner.DraftModelProposer = timed_propose(runner.DraftModelProposer)
    built: list[Any] = []
    init = runner.DraftModelProposer.__init__

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(self)

    runner.DraftModelProposer.__init__ = keep
    llm = build_engine(EngineSpec(target=target, draft=draft, k=k, max_num_seqs=max(2, batch)))
    return llm, StepClock(llm), built[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_args(ap)
    ap.add_argument("--k", type=int, default=3, help="tokens every step drafts")
    ap.add_argument("--cap", type=int, default=8, help="num_speculative_tokens of the third engine")
    ap.add_argument("--rounds", type=int, default=2, help="turns of every engine over the prompts")
    ap.add_argument("--engines", default="vllm,specstop,specstop-cap",
                    help="engines in the order they are built, from target (the target alone), vllm, specstop (cap "
                         "K) and specstop-cap (cap --cap); a name twice builds it twice (vllm,specstop,vllm: an A/A "
                         "control of build order); detached runs vLLM's own draft loop at K in the specstop engine "
                         "built last (vllm:K), so that the two proposers meet in one engine")
    ap.add_argument("--policy", default=None, help="the specstop engines' policy spec (default: static:K)")
    ap.add_argument("--costs", default=None, help="vLLM's curve (cost_model.vllm.json): goodput policies need it")
    args = ap.parse_args()
    target, draft, prompts = pair_and_prompts(args)
    spec = args.policy or f"static:{args.k}"
    settings = vllm_proposer.PolicySettings(spec=spec, costs=args.costs, max_draft_len=max(args.k, args.cap))
    try:  # a bad spec or a missing curve fails here, in one line, before any engine loads
        vllm_proposer.build_stopper(settings)
    except (ValueError, FileNotFoundError) as e:
        ap.error(f"--policy {spec}: {e}")
    kinds = {"target": ("the target alone", 0, None),
             "vllm": (f"vLLM's proposer, K = {args.k}", args.k, None),
             "specstop": (f"specstop's, {spec}, cap {args.k}", args.k, settings),
             "specstop-cap": (f"specstop's, {spec}, cap {args.cap}", args.cap, settings)}
    engines: dict[str, tuple[Any, StepClock, Any, Any]] = {}  # name -> engine, its clock, proposer, its settings
    last: tuple[Any, StepClock, Any, Any] | None = None  # the specstop engine built last
    for i, kind in enumerate(args.engines.split(",")):
        if kind == "detached":
            if last is None:
                ap.error("--engines: detached needs a specstop engine built before it")
            own = vllm_proposer.PolicySettings(spec=f"vllm:{args.k}", max_draft_len=settings.max_draft_len)
            engines[f"vLLM's own loop, K = {args.k}, in the last"] = (*last[:3], own)
            continue
        if kind not in kinds:
            ap.error(f"--engines: {kind!r} is not one of {', '.join(kinds)}, detached")
        name, cap, how = kinds[kind]
        llm, clock, prop = build(target, None if kind == "target" else draft, cap, args.batch, how)
        built = engines[name if name not in engines else f"{name} (built {i + 1}.)"] = (llm, clock, prop, how)
        last = built if how is not None else last
    vllm_proposer.uninstall()  # vLLM's runner checks isinstance(drafter, DraftModelProposer): its own class holds all
    for llm, _, _, _ in engines.values():
        generate(llm, [prompts[0]], 8)  # warm-up
    totals = {name: [0.0, 0.0, 0.0, 0, 0] for name in engines}  # decode s, propose s, scoring s, steps, forwards
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            llm, clock, prop, how = engines[name]
            if how is not None:
                prop.set_policy(how)
            clock.take()
            before, scored, ran, outs = getattr(prop, "propose_s", 0.0), scoring_s(prop), forwards(prop, args.k), []
            for i in range(0, len(prompts), args.batch):
                outs += generate(llm, prompts[i:i + args.batch], args.new_tokens)[0]
            steps = [s for s in clock.take() if s.decode]
            totals[name][0] += sum(s.wall_s for s in steps)
            totals[name][1] += getattr(prop, "propose_s", 0.0) - before
            totals[name][2] += scoring_s(prop) - scored
            totals[name][3] += len(steps)
            totals[name][4] += forwards(prop, args.k) - ran
            outputs.setdefault(name, outs)
    ref_name = next(iter(engines))
    ref_s = totals[ref_name][0]
    print(f"{args.prompts} prompts x {args.new_tokens} new tokens, {args.batch} concurrent, {args.rounds} rounds")
    for name, (dec_s, prop_s, score_s, n, fw) in totals.items():
        same = sum(a == b for a, b in zip(outputs[name], outputs[ref_name]))
        per_forward = f", {1000 * prop_s / fw:5.1f} ms a forward" if fw else ""
        print(f"{name:34s} decode {dec_s:6.1f} s ({dec_s / ref_s:.3f}x the first)  {int(n)} steps: "
              f"{1000 * dec_s / n:6.1f} ms a step, {1000 * prop_s / n:5.1f} of it proposing "
              f"({1000 * score_s / n:4.1f} deciding; {fw / n:.2f} draft forwards a step{per_forward})  "
              f"outputs equal to the first's: {same}/{len(outputs[name])}", flush=True)


if __name__ == "__main__":
    main()
