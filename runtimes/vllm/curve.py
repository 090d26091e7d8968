"""vLLM's own verification curve on this machine, per batch size, and the acceptance vLLM's draft meets on validation
prompts.

Two engines run side by side, the target alone and the pair with specstop's proposer, and their decode steps are
taken in turns, one of each: the target alone's step gives ``target_s[1]`` at batch B. The pair's proposer drafts
``k`` tokens a request at each step, ``k`` cycling through a shuffled 1 .. max_length - 1 and then two steps of 0 per
cycle, so that every figure is timed over the same minutes of the host (a shared host's step time moves by a third
within minutes: figures timed one after another would mix a fast phase with a slow one in the ratios the batch rule
weighs). vLLM verifies at a step what the proposer drafted at the step before, so a step splits into the draft's
forwards (``k`` now, timed inside the proposer) and the rest, ``target_s[k_before + 1]`` (vLLM's overheads inside); a
step after a 0 that drafts 0 again skips the draft's forward altogether (``extra["skip_s"]``: what the batch rule's
"draft nothing" costs in that engine). Each figure is the median of its ``cycles`` steps, kept as measured (no monotone
envelope over L): vLLM's CPU GEMM can run a pass over more tokens faster than one over fewer (2 rows slower than 4),
and the rules that price the curve should send the cheaper, longer pass there. Prompts are random ids: decode cost
depends on the cached length, not the text.

Usage: .venv-vllm/bin/python -m pipelines.measure_costs --runtime vllm --data_dir outputs/default/data
"""
from __future__ import annotations

import logging
import os
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple

from compute.cpu import cpu_model
from compute.timing import BATCH_CURVES, SKIP_STEP, CostModel
from runtimes.vllm.engine import EngineSpec, StepClock, build_engine, generate, release, spec_positions
from runtimes.vllm.proposer import PolicySettings, active, install, uninstall

log = logging.getLogger("pipelines.measure_costs")

__all__ = ["VllmCurveSettings", "CurveStep", "curve_figures", "schedule", "measure_vllm_curve",
           "measure_vllm_acceptance"]


@dataclass(frozen=True)
class VllmCurveSettings:
    """What the vLLM curve times."""

    target: str
    draft: str
    batches: tuple[int, ...] = (1, 2, 4, 8)
    max_length: int = 9
    """Verification lengths L = 1 .. max_length (k = L - 1 drafts a request)."""
    cycles: int = 12
    """Cycles of drafting lengths per batch size: every figure is the median of this many steps."""
    prompt_len: int = 128
    device: str = "cpu"
    dtype: str = "bfloat16"
    """vLLM's dtype for both engines (``runtimes.vllm.engine.VLLM_DTYPES``)."""
    target_name: str = ""
    draft_name: str = ""
    seed: int = 0


class CurveStep(NamedTuple):
    """One timed decode step of the pair: drafts a request verified (proposed the step before), drafts a request
    proposed now, wall seconds, the draft's seconds inside."""

    verified: int
    drafted: int
    wall_s: float
    draft_s: float


Figures = tuple[float, float, dict[int, float], float]
"""At one batch size: the target alone's step, the draft's seconds a token, {L: target-side seconds}, skipped step."""


def schedule(max_k: int, cycles: int, seed: int = 0) -> list[int]:
    """Drafts a request at each timed step: per cycle a shuffled 1 .. ``max_k``, then 0, 0 (the second 0 verifies
    one token a request and skips the draft's forward)."""
    rng = random.Random(seed)
    out: list[int] = []
    for _ in range(cycles):
        ks = list(range(1, max_k + 1))
        rng.shuffle(ks)
        out += [*ks, 0, 0]
    return out


def curve_figures(alone: list[float], steps: list[CurveStep]) -> Figures:
    """Medians over the interleaved steps: the target alone's step; the draft's seconds a token (steps that drafted
    and did not catch up skipped tokens); the target side (wall less the draft's forwards) by the length verified;
    the step that verified one token a request and ran no draft forward."""
    draft = [s.draft_s / s.drafted for s in steps if s.drafted and s.verified]
    target: dict[int, list[float]] = defaultdict(list)
    for s in steps:
        if s.verified:
            target[s.verified + 1].append(max(s.wall_s - s.draft_s, 1e-6))
    skip = [s.wall_s for s in steps if not s.verified and not s.drafted]
    if not (alone and draft and skip):
        raise ValueError("the curve needs target-alone steps, drafting steps and skipped steps")
    return (statistics.median(alone), statistics.median(draft),
            {n: statistics.median(v) for n, v in sorted(target.items())}, statistics.median(skip))


def _add(engine: Any, n: int, prompt_len: int, tag: str) -> list[str]:
    from vllm import SamplingParams

    rng = random.Random(0)
    sp = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(n)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(prompt_len)]}, sp)
    return ids


def _to_decode(llm: Any, clock: StepClock, batch: int, prompt_len: int, tag: str) -> list[str]:
    """``batch`` requests added to ``llm`` and stepped past their prefill and two warm-up steps."""
    engine = llm.llm_engine
    ids = _add(engine, batch, prompt_len, tag)
    clock.take()
    while not clock.steps or not clock.steps[-1].decode:
        engine.step()
    for _ in range(2):
        engine.step()
    return ids


def _drop(llm: Any, ids: list[str]) -> None:
    engine = llm.llm_engine
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()


def _step(llm: Any, clock: StepClock) -> float:
    """One engine step; its wall seconds as the engine's ``StepClock`` timed it."""
    llm.llm_engine.step()
    return clock.steps[-1].wall_s


def _batch_figures(alone: tuple[Any, StepClock], pair: tuple[Any, StepClock], proposer: Any, batch: int,
                   s: VllmCurveSettings) -> Figures:
    """One batch size: both engines' decode steps in turns over the drafting schedule (:func:`schedule`)."""
    max_k = s.max_length - 1
    proposer.set_policy(PolicySettings(spec=f"static:{max_k}", max_draft_len=max_k))
    ids = (_to_decode(*alone, batch, s.prompt_len, f"t{batch}"), _to_decode(*pair, batch, s.prompt_len, f"s{batch}"))
    before, alone_s, steps = max_k, [], []
    for k in schedule(max_k, s.cycles, s.seed + batch):
        proposer.set_policy(PolicySettings(spec=f"static:{k}", max_draft_len=max_k))
        alone_s.append(_step(*alone))
        d0 = proposer.draft_s
        wall = _step(*pair)
        steps.append(CurveStep(before, k, wall, proposer.draft_s - d0))
        before = k
    _drop(alone[0], ids[0])
    _drop(pair[0], ids[1])
    return curve_figures(alone_s, steps)


def _measure(s: VllmCurveSettings) -> dict[int, Figures]:
    """Per batch size, the figures of both engines stepped in turns."""
    max_k = s.max_length - 1
    alone = build_engine(EngineSpec(target=s.target, max_num_seqs=max(s.batches), device=s.device, dtype=s.dtype))
    install(PolicySettings(spec="static:1", max_draft_len=max_k))
    pair = build_engine(EngineSpec(target=s.target, draft=s.draft, k=max_k, max_num_seqs=max(s.batches),
                                   device=s.device, dtype=s.dtype))
    engines, proposer = ((alone, StepClock(alone)), (pair, StepClock(pair))), active()
    out: dict[int, Figures] = {}
    for b in s.batches:
        out[b] = _batch_figures(*engines, proposer, b, s)
        one, draft, target, skip = out[b]
        log.info("vLLM curve, batch %d: target alone %.1f ms a step, draft %.1f ms a token, verification %s ms, "
                 "skipped step %.1f ms", b, one * 1e3, draft * 1e3,
                 " ".join(f"{n}:{t * 1e3:.0f}" for n, t in target.items()), skip * 1e3)
    del engines, proposer
    release(pair)
    release(alone)
    return out


def measure_vllm_curve(s: VllmCurveSettings) -> CostModel:
    """vLLM's curve at each batch size, batch 1's at the top level and every batch's under ``extra.batch_curves``."""
    import vllm

    figures = _measure(s)
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    machine = {**(cpu_model() if s.device == "cpu" else {}), "threads": threads, "vllm": vllm.__version__}
    curves = {}
    for b in s.batches:
        alone, draft, target, skip = figures[b]
        raw = {1: alone, **target}
        curves[b] = CostModel(draft_s_per_token=draft, target_s=raw, device=s.device,
                              dtype=s.dtype, draft_name=s.draft_name or s.draft,
                              target_name=s.target_name or s.target, prompt_len=s.prompt_len, compute_path="vllm",
                              runtime="vllm", machine=machine,
                              notes=f"vLLM {vllm.__version__} at batch {b}: both engines' decode steps in turns, "
                                    f"drafting lengths cycled {s.cycles} times, the median of each figure "
                                    "(no envelope over L: the measured shape)",
                              extra={SKIP_STEP: skip})
    top = curves[min(s.batches)]
    top.extra[BATCH_CURVES] = {str(b): cm.to_dict() for b, cm in curves.items()}
    return top


def measure_vllm_acceptance(target: str, draft: str, prompts: list[list[int]], k: int = 8, max_new_tokens: int = 128,
                            device: str = "cpu", dtype: str = "bfloat16") -> dict[str, Any]:
    """How far vLLM's draft-model speculation is accepted on ``prompts`` (greedy, K = ``k``), from vLLM's counters:
    ``survival[j - 1]`` = S(j), the share of rounds whose first j drafts were all accepted."""
    uninstall()  # vLLM's own proposer: K drafts every round
    llm = build_engine(EngineSpec(target=target, draft=draft, k=k, max_num_seqs=2, device=device, dtype=dtype))
    for p in prompts:
        generate(llm, [p], max_new_tokens)
    drafts, per_pos = spec_positions(llm)
    release(llm)
    if not drafts:
        raise RuntimeError("vLLM drafted nothing on the acceptance prompts: its counters have no draft round")
    survival = [round(a / drafts, 4) for a in per_pos[:k]]
    log.info("vLLM's acceptance at K = %d over %d prompts (%d rounds): S(j) = %s", k, len(prompts), drafts, survival)
    return {"survival": survival, "drafts": int(drafts), "k": k, "prompts": len(prompts)}
