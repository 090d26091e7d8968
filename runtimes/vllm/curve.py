"""vLLM's own verification curve on this machine, per batch size, and the acceptance vLLM's draft meets on validation
prompts.

The target alone gives ``target_s[1]`` at batch B; the pair with specstop's proposer running ``static:k`` splits each
step into the draft's forwards and the rest (``target_s[k + 1]``, vLLM's overheads inside), and at ``static:0`` times
a step that drafts nothing and skips the draft's forward (``extra["skip_s"]``: what the batch rule's "draft nothing"
costs in that engine, its speculative overheads inside). The two engines are timed in turn over ``rounds`` and each
batch size keeps every figure of its fastest round (all from one round, since a shared host's step time moves by a
third within minutes: docs/vllm.md). Prompts are random ids: decode cost depends on the cached length, not the text.

Usage: .venv-vllm/bin/python -m pipelines.measure_costs --runtime vllm --data_dir outputs/default/data
"""
from __future__ import annotations

import logging
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from compute.cpu import cpu_model
from compute.timing import BATCH_CURVES, SKIP_STEP, CostModel, lower_envelope
from runtimes.vllm.engine import EngineSpec, StepClock, build_engine, generate, release, spec_positions
from runtimes.vllm.proposer import PolicySettings, active, install, uninstall

log = logging.getLogger("pipelines.measure_costs")

__all__ = ["VllmCurveSettings", "measure_vllm_curve", "measure_vllm_acceptance", "time_steps"]


@dataclass(frozen=True)
class VllmCurveSettings:
    """What the vLLM curve times."""

    target: str
    draft: str
    batches: tuple[int, ...] = (1, 2, 4, 8)
    max_length: int = 9
    """Verification lengths L = 1 .. max_length (k = L - 1 drafts a request)."""
    steps: int = 12
    """Decode steps timed per (batch, k) a round; the median is kept."""
    rounds: int = 2
    """Times each engine is loaded and timed in turn; each batch size keeps its fastest round's figures."""
    prompt_len: int = 128
    device: str = "cpu"
    target_name: str = ""
    draft_name: str = ""


def _add(engine: Any, n: int, prompt_len: int, tag: str) -> list[str]:
    from vllm import SamplingParams

    rng = random.Random(0)
    sp = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(n)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(prompt_len)]}, sp)
    return ids


def time_steps(llm: Any, clock: StepClock, batch: int, steps: int, prompt_len: int, tag: str,
               on_step: Callable[[], float] | None = None) -> tuple[float, float]:
    """Median seconds of ``steps`` decode steps of ``batch`` requests, and the median of ``on_step()`` (the draft's
    seconds) per step, after prefill and two warm-up steps."""
    engine = llm.llm_engine
    ids = _add(engine, batch, prompt_len, tag)
    clock.take()
    while not clock.steps or not clock.steps[-1].decode:
        engine.step()
    for _ in range(2):
        engine.step()
    walls, extras = [], []
    for _ in range(steps):
        before = on_step() if on_step else 0.0
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        extras.append((on_step() - before) if on_step else 0.0)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(walls), statistics.median(extras)


def _target_only(s: VllmCurveSettings) -> dict[int, float]:
    llm = build_engine(EngineSpec(target=s.target, max_num_seqs=max(s.batches), device=s.device))
    clock = StepClock(llm)
    out = {}
    for b in s.batches:
        out[b], _ = time_steps(llm, clock, b, s.steps, s.prompt_len, f"t{b}")
        log.info("vLLM target alone, batch %d: %.1f ms a step", b, out[b] * 1e3)
    del clock
    release(llm)
    return out


Timed = tuple[dict[int, float], dict[int, float], float]
"""At one batch size, as timed: {L: the draft's seconds a token}, {L: the target side's seconds}, the skipped step."""


def _speculative(s: VllmCurveSettings) -> dict[int, Timed]:
    """Batch -> ({L: draft seconds a token}, {L: target-side seconds of a step verifying L tokens a request}, seconds
    of a step that drafts nothing and skips the draft's forward)."""
    install(PolicySettings(spec="static:1", max_draft_len=s.max_length - 1))
    llm = build_engine(EngineSpec(target=s.target, draft=s.draft, k=s.max_length - 1, max_num_seqs=max(s.batches),
                                  device=s.device))
    clock, proposer = StepClock(llm), active()
    out: dict[int, Timed] = {}
    for b in s.batches:
        draft, target = {}, {}
        for k in range(1, s.max_length):
            proposer.set_policy(PolicySettings(spec=f"static:{k}", max_draft_len=s.max_length - 1))
            wall, d = time_steps(llm, clock, b, s.steps, s.prompt_len, f"s{b}-{k}",
                                 lambda p=proposer: p.draft_s)
            target[k + 1] = max(wall - d, 1e-6)
            draft[k + 1] = d / k
            log.info("vLLM batch %d, %d drafts a request: step %.1f ms (draft %.1f ms)", b, k, wall * 1e3, d * 1e3)
        proposer.set_policy(PolicySettings(spec="static:0", max_draft_len=s.max_length - 1))  # after the k's: a
        skip, _ = time_steps(llm, clock, b, s.steps, s.prompt_len, f"s{b}-0")  # batch size's first steps run slower
        log.info("vLLM batch %d, no drafts and no draft forward: step %.1f ms", b, skip * 1e3)
        out[b] = (draft, target, skip)
    del clock, proposer
    release(llm)
    return out


Spec = tuple[float, dict[int, float], float]
"""At one batch size: the draft's seconds a token, the target side's seconds by L, the skipped step's seconds."""

Round = tuple[dict[int, float], dict[int, Timed]]
"""One round: batch -> the target alone's step, batch -> what :func:`_speculative` timed."""


def fastest_round(rounds: list[Round]) -> tuple[dict[int, float], dict[int, Spec]]:
    """Per batch size, every figure from the one round whose steps sum least (the target alone's, each L's, the
    skipped step's), so that the ratios the batch rule weighs never mix a fast host phase with a slow one."""
    alone: dict[int, float] = {}
    spec: dict[int, Spec] = {}
    for b in rounds[0][1]:
        def total(r: Round, b: int = b) -> float:
            draft, target, skip = r[1][b]
            return r[0][b] + skip + sum(draft[n] * (n - 1) + t for n, t in target.items())
        best = min(rounds, key=total)
        draft, target, skip = best[1][b]
        alone[b] = best[0][b]
        spec[b] = (statistics.median(draft.values()), dict(target), skip)
    return alone, spec


def _fastest_rounds(s: VllmCurveSettings) -> tuple[dict[int, float], dict[int, Spec]]:
    """Both engines timed ``s.rounds`` times in turn; per batch size the figures of its fastest round."""
    rounds: list[Round] = []
    for r in range(s.rounds):
        log.info("vLLM curve: round %d of %d", r + 1, s.rounds)
        rounds.append((_target_only(s), _speculative(s)))
    return fastest_round(rounds)


def measure_vllm_curve(s: VllmCurveSettings) -> CostModel:
    """vLLM's curve at each batch size, batch 1's at the top level and every batch's under ``extra.batch_curves``."""
    import vllm

    alone, spec = _fastest_rounds(s)
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    machine = {**(cpu_model() if s.device == "cpu" else {}), "threads": threads, "vllm": vllm.__version__}
    curves = {}
    for b in s.batches:
        draft, target, skip = spec[b]
        raw = {1: alone[b], **target}
        curves[b] = CostModel(draft_s_per_token=draft, target_s=lower_envelope(raw), device=s.device,
                              dtype="bfloat16", draft_name=s.draft_name or s.draft,
                              target_name=s.target_name or s.target, prompt_len=s.prompt_len, compute_path="vllm",
                              runtime="vllm", machine=machine,
                              notes=f"vLLM {vllm.__version__} at batch {b}: median of {s.steps} decode steps, "
                                    f"the fastest of {s.rounds} rounds (every figure of a batch from one), "
                                    "lower monotone envelope over L",
                              extra={"raw_target_s": raw, SKIP_STEP: skip})
    top = curves[min(s.batches)]
    top.extra[BATCH_CURVES] = {str(b): cm.to_dict() for b, cm in curves.items()}
    return top


def measure_vllm_acceptance(target: str, draft: str, prompts: list[list[int]], k: int = 8, max_new_tokens: int = 128,
                            device: str = "cpu") -> dict[str, Any]:
    """How far vLLM's draft-model speculation is accepted on ``prompts`` (greedy, K = ``k``), from vLLM's counters:
    ``survival[j - 1]`` = S(j), the share of rounds whose first j drafts were all accepted."""
    uninstall()  # vLLM's own proposer: K drafts every round
    llm = build_engine(EngineSpec(target=target, draft=draft, k=k, max_num_seqs=2, device=device))
    for p in prompts:
        generate(llm, [p], max_new_tokens)
    drafts, per_pos = spec_positions(llm)
    release(llm)
    if not drafts:
        raise RuntimeError("vLLM drafted nothing on the acceptance prompts: its counters have no draft round")
    survival = [round(a / drafts, 4) for a in per_pos[:k]]
    log.info("vLLM's acceptance at K = %d over %d prompts (%d rounds): S(j) = %s", k, len(prompts), drafts, survival)
    return {"survival": survival, "drafts": int(drafts), "k": k, "prompts": len(prompts)}
