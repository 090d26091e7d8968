"""How many sequences the generator decodes at once: ``gen_batch_size: auto`` resolved once per data folder from this
host's step curve, capped by memory, and halved when a batch does not fit.

A step reads every weight once whatever its rows, so where memory bounds it more rows cost little: the probe times a
draft + target step at 1-32 rows and takes the largest batch within ``STEP_RATIO`` of one row. The batch changes the
rounding of batched forwards, not what is generated; a folder records its value and a resume reuses it (the
measurements: docs/compute-path.md, "The generator's batch").

Usage: ``cfg = resolve_gen_batch(cfg, models, recorded_gen_batch(out_dir, cfg.data_config()))``
"""
from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from compute.timing import clock, lower_envelope, prefill
from data_gen.config import AUTO, GenerateConfig
from data_gen.labelling import LabelModels
from data_gen.shards import CONFIG_FILE, config_fingerprint

log = logging.getLogger(__name__)

CANDIDATES = (1, 8, 16, 32)
"""Batch sizes the probe times (rows of one decoding step)."""
STEP_RATIO = 1.15
"""The chosen batch is the largest whose draft + target step costs at most this times the one-row step."""
FLOOR_BATCH = 8
"""``auto`` never goes below this unless memory caps it: 8 rows reading each weight once beat fewer rows."""
PROBE_CONTEXT = 64
"""Cached tokens per row during the probe (one prefill of one row, repeated into every row)."""
PROBE_STEPS = 4
"""Timed steps per batch size (after one warm-up sweep); the fastest counts."""
MEMORY_SHARE = 0.5
"""Share of the memory available at the start that one batch's caches, states and activations may take."""
SLOW_READ_BYTES_S = 24e9
"""Read bandwidth (bytes/s) under which the progress says memory sets the generator's pace (2-core EPYC hosts: 26-57
GB/s, a 2-core Xeon 19.2 GB/s)."""

T = TypeVar("T")


@dataclass
class BatchChoice:
    """The resolved rollout batch, the line saying why, and the probe's curve (rows -> seconds of a draft + target
    step)."""

    size: int
    reason: str
    curve: dict[int, float]


def recorded_gen_batch(out_dir: Path, data_config: dict) -> int | None:
    """The ``gen_batch_size`` a folder of this data config was generated with, None for a new folder or another config;
    read before the run rewrites ``config.json``."""
    path = Path(out_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    value = cfg.get("resolved", {}).get("gen_batch_size")
    same = cfg.get("fingerprint") == config_fingerprint(data_config)
    return value if same and isinstance(value, int) and value >= 1 else None


def record_gen_batch(out_dir: Path, size: int) -> None:
    """Write the folder's generation batch into its ``config.json``, so a resume with ``auto`` reuses it."""
    path = Path(out_dir) / CONFIG_FILE
    cfg = json.loads(path.read_text())
    cfg.setdefault("resolved", {})["gen_batch_size"] = int(size)
    tmp = path.with_suffix(".batch.tmp")
    tmp.write_text(json.dumps(cfg, indent=2, default=str))
    os.replace(tmp, path)


def resolve_gen_batch(cfg: GenerateConfig, models: LabelModels, recorded: int | None = None) -> GenerateConfig:
    """``cfg`` with an integer ``gen_batch_size``: the configured one, the folder's recorded one, or the probe's choice;
    logs the value and why once."""
    if cfg.gen_batch_size != AUTO:
        return cfg
    if recorded is not None:
        log.info("gen_batch_size auto -> %d: the value this folder was generated with (config.json)", recorded)
        return replace(cfg, gen_batch_size=recorded)
    choice = choose_batch(cfg, models)
    log.info("gen_batch_size auto -> %d: %s", choice.size, choice.reason)
    return replace(cfg, gen_batch_size=choice.size)


def choose_batch(cfg: GenerateConfig, models: LabelModels, rows: tuple[int, ...] = CANDIDATES) -> BatchChoice:
    """Probe the step curve and pick the batch (:func:`pick_batch`) under the memory cap and the chunk's sequences."""
    most = cfg.prompts_per_shard * cfg.sequences_per_prompt
    cap = memory_cap(cfg, models)
    limit = max(1, min(most, cap))
    rows = tuple(sorted({r for r in rows if r < limit} | {min(limit, max(rows))}))
    curve = step_curve(models, rows)
    size = pick_batch(curve, floor=min(FLOOR_BATCH, limit), cap=limit)
    steps = ", ".join(f"{r} rows {s * 1e3:.1f} ms" for r, s in curve.items())
    ratio = curve[size] / curve[min(curve)] if size in curve else float("nan")
    why = (f"a draft + target step of {size} rows costs {ratio:.2f}x one row's ({steps}; chosen: the largest at most "
           f"{STEP_RATIO:.2f}x, at least {FLOOR_BATCH}); memory allows {cap} rows, a chunk holds {most} sequences")
    return BatchChoice(size, why, curve)


def pick_batch(curve: dict[int, float], ratio: float = STEP_RATIO, floor: int = FLOOR_BATCH,
               cap: int | None = None) -> int:
    """The largest batch of ``curve`` whose step costs at most ``ratio`` x the smallest's, at least ``floor``, at most
    ``cap``."""
    if not curve:
        raise ValueError("pick_batch needs a step curve with at least one batch size")
    base = curve[min(curve)]
    cheap = [r for r, s in curve.items() if s <= ratio * base]
    size = max(max(cheap, default=min(curve)), floor)
    return max(1, min(size, cap)) if cap is not None else size


def step_curve(models: LabelModels, rows: tuple[int, ...] = CANDIDATES, context: int = PROBE_CONTEXT,
               steps: int = PROBE_STEPS) -> dict[int, float]:
    """Seconds of one draft step plus one target step at each batch of ``rows`` over ``context`` cached tokens a row
    (the fastest of ``steps``)."""
    draft = _model_steps(models.draft, rows, context, steps)
    target = _model_steps(models.target, rows, context, steps)
    return {r: draft[r] + target[r] for r in rows}


@torch.inference_mode()
def _model_steps(model: nn.Module, rows: tuple[int, ...], context: int, steps: int) -> dict[int, float]:
    """Seconds of one decoding step of ``model`` at each batch of ``rows``, the sizes interleaved so load spreads over
    all, made non-decreasing in rows."""
    dev = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    base = prefill(model, torch.randint(0, vocab, (1, context), generator=g).to(dev))
    caches = {}
    for r in rows:
        caches[r] = copy.deepcopy(base)
        if r > 1:
            caches[r].batch_repeat_interleave(r)
    best = dict.fromkeys(rows, float("inf"))
    for sweep in range(steps + 1):  # the first is a warm-up
        for r in rows:
            ids = torch.randint(0, vocab, (r, 1), generator=g).to(dev)
            t0 = clock(dev)
            model(input_ids=ids, past_key_values=caches[r], use_cache=True).logits[:, -1].argmax(-1)
            if sweep:
                best[r] = min(best[r], clock(dev) - t0)
    return lower_envelope(best)


def row_bytes(model: nn.Module, width: int) -> int:
    """Peak bytes one row of ``width`` tokens holds in a forward of ``model``: KV cache, kept states, transient
    activations."""
    c = model.config
    layers, hidden = int(c.num_hidden_layers), int(c.hidden_size)
    heads = int(c.num_attention_heads)
    kv_heads = int(getattr(c, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(c, "head_dim", None) or hidden // heads)
    inter = int(getattr(c, "intermediate_size", None) or 4 * hidden)
    per_token = 4 * (2 * layers * kv_heads * head_dim + hidden + 3 * inter)
    return width * per_token + 4 * heads * width * width


def available_bytes(device: torch.device) -> int | None:
    """Memory free for new allocations on ``device`` (``MemAvailable`` on the CPU, CUDA free memory), None if
    unreadable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def memory_cap(cfg: GenerateConfig, models: LabelModels, share: float = MEMORY_SHARE) -> int:
    """The most rows a batch may hold: ``share`` of available memory over a row of the longest sequence in draft and
    target."""
    width = cfg.max_prompt_tokens + max(cfg.prefix_tokens[1], (cfg.text_tokens or (0, 0))[1]) + cfg.rollout_len
    free = available_bytes(next(models.draft.parameters()).device)
    if free is None:
        return 1 << 16
    per_row = row_bytes(models.draft, width) + row_bytes(models.target, width)
    return max(1, int(share * free // per_row))


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure (torch's CPU or CUDA allocator, Python's ``MemoryError``)."""
    if isinstance(error, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def fitting(cfg: GenerateConfig, run: Callable[[GenerateConfig], T], what: str) -> tuple[T, GenerateConfig]:
    """``run(cfg)``, retried with half the batch after each allocation failure (said in one line); returns the result
    and the config it ran with."""
    while True:
        try:
            return run(cfg), cfg
        except Exception as e:  # noqa: BLE001 - only allocation failures are retried, the rest re-raised
            if not out_of_memory(e) or (cfg.gen_batch_size <= 1 and cfg.label_batch_tokens <= 1):
                raise
            smaller = replace(cfg, gen_batch_size=max(1, cfg.gen_batch_size // 2),
                              label_batch_tokens=max(1, cfg.label_batch_tokens // 2))
            log.warning("%s: a batch did not fit in memory (%s); gen_batch_size %d -> %d, label_batch_tokens %d -> %d, "
                        "redoing it (finished shards are kept)", what, " ".join(str(e).split())[:120],
                        cfg.gen_batch_size, smaller.gen_batch_size, cfg.label_batch_tokens, smaller.label_batch_tokens)
            cfg = smaller


def read_bandwidth_note(bandwidth: float | None, threshold: float = SLOW_READ_BYTES_S) -> str | None:
    """One line for the progress when the host reads memory slowly (each step reads every weight, so memory sets the
    pace), else None."""
    if not bandwidth or bandwidth >= threshold:
        return None
    return (f"this host reads memory at {bandwidth / 1e9:.1f} GB/s on {torch.get_num_threads()} threads (under "
            f"{threshold / 1e9:.0f} GB/s): every decoding step reads all the weights, so the machine's memory, not the "
            f"code, sets the generator's pace")


def host_read_bandwidth(out_dir: Path, measure: Callable[[], float] | None = None) -> float | None:
    """The read bandwidth in the folder's ``cost_model.json`` (measured with the curve), else ``measure()``."""
    path = Path(out_dir) / "cost_model.json"
    if path.is_file():
        bw = json.loads(path.read_text()).get("extra", {}).get("read_bandwidth")
        if bw:
            return float(bw)
    return measure() if measure is not None else None

