"""Latency cost model of one speculative-decoding round, measured on this machine for one model pair.

A round drafts ``n`` tokens (``n`` draft steps, ``n`` companion steps with a companion) and verifies them with one
target forward of ``L = n + 1`` new tokens; target-only decoding is ``n = 0``. ``target_s[L]`` is that forward, the one
length convention of the engine, the replay, SV's goodput rule and the benchmark. The file records where it was
measured, and :meth:`CostModel.mismatch` names what differs from the run at hand.

Usage: python -m pipelines.measure_costs --out outputs/cost_model.json
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache

from compute.models import shared_depth
from compute.native import NativeExtension
from compute.path_choice import cpu_info
from compute.precision import compute_path_of

__all__ = ["CostModel", "BATCH_CURVES", "lower_envelope", "measure_cost_model", "pool_cost_models",
           "assumed_cost_model", "clock", "STATISTICS", "forward_bytes", "read_bandwidth", "prefill", "crop"]


BATCH_CURVES = "batch_curves"
"""Key of ``CostModel.extra`` holding a curve per batch size (vLLM's: ``runtimes.vllm.curve``), batch -> dict."""

SKIP_STEP = "skip_s"
"""Key of ``CostModel.extra`` holding the seconds of a decode step in which no request drafts and the draft's forward
is skipped, timed in the speculative engine itself (vLLM: specstop's proposer at ``static:0``); it prices "draft
nothing" where ``target_s[1]`` is the target alone's own engine, which carries none of the speculative engine's
per-step work."""

MEASURED_RUNTIMES = ("specstop", "llamacpp", "transformers")
"""The runtimes ``pipelines.measure_costs --runtime`` times on this machine."""


@dataclass
class CostModel:
    """Seconds per draft token and per target verification pass, by verification length."""

    draft_s_per_token: float
    """Seconds of one draft decode step (one new token over a KV cache)."""
    target_s: dict[int, float]
    """Seconds of a target forward of L new tokens over a cached prefix, by L >= 1 (interpolated, extrapolated
    linearly)."""
    companion_s_per_token: float = 0.0
    """Seconds of one companion decode step (0 when no companion was measured)."""
    draft_catchup_s: float = 0.0
    """Extra seconds of a draft forward of two tokens over one of one: the catch-up after a round whose drafts were all
    accepted (on llama.cpp two tokens run other kernels and cost much more); 0 when not measured."""
    device: str = "cpu"
    """Device the timings were taken on."""
    dtype: str = "float32"
    """Model dtype during the timings."""
    draft_name: str = ""
    """Draft model name (``config.name_or_path``)."""
    target_name: str = ""
    """Target model name."""
    companion_name: str = ""
    """Companion model name ('' when none)."""
    prompt_len: int = 0
    """Cached prefix length the timings were taken at."""
    compute_path: str = "eager"
    """Compute path of the target during the timings (``compute.compute_path``)."""
    runtime: str = "specstop"
    """The runtime whose forwards were timed: ``specstop`` (its engine and transformers' ``generate``), ``llamacpp``, or
    another; pricing one runtime with another's curve warns (:meth:`runtime_mismatch`)."""
    machine: dict[str, Any] = field(default_factory=dict)
    """Where it was measured: CPU model name, SIMD flags, torch version and CPU capability, threads."""
    assumed: bool = False
    """True when the numbers are an assumption, not a measurement (reports label the speedups accordingly)."""
    notes: str = ""
    """Free text: how the numbers were obtained."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else worth keeping (raw repeat timings, timestamp)."""

    def __post_init__(self) -> None:
        self.target_s = {int(k): float(v) for k, v in self.target_s.items()}
        if not self.target_s:
            raise ValueError("CostModel.target_s is empty: measure at least one verification length")
        if min(self.target_s) < 1:
            raise ValueError(f"CostModel.target_s lengths must be >= 1, got {sorted(self.target_s)}")
        if min(self.draft_s_per_token, self.companion_s_per_token, self.draft_catchup_s) < 0 or \
                min(self.target_s.values()) <= 0:
            raise ValueError("CostModel times must be positive (draft, companion and catch-up >= 0, target > 0)")
        self._ls = np.array(sorted(self.target_s), dtype=np.float64)
        self._ts = np.array([self.target_s[int(k)] for k in self._ls], dtype=np.float64)
        self._cache: dict[float, float] = {}

    def target_time(self, length: float) -> float:
        """Seconds of one target forward over ``length`` new tokens (interpolated / linearly extrapolated)."""
        hit = self._cache.get(length)
        if hit is None:
            hit = self._cache[length] = self._target_time(length)
        return hit

    def _target_time(self, length: float) -> float:
        ls, ts = self._ls, self._ts
        if len(ls) == 1:
            return float(ts[0] * max(length, 1.0) / ls[0]) if length > ls[0] else float(ts[0])
        if length <= ls[-1]:
            return float(np.interp(length, ls, ts))
        # the slope over the curve's upper half, not its last step: a lower envelope (``with_statistic``) or a kernel's
        # tile size can leave the last steps flat, and a flat tail would price every longer forward as free
        j = min(int(np.searchsorted(ls, ls[-1] / 2)), len(ls) - 2)
        slope = max((ts[-1] - ts[j]) / (ls[-1] - ls[j]), 0.0)
        return float(ts[-1] + slope * (length - ls[-1]))

    def round_time(self, n_draft: int, n_verify: int | None = None, companion: bool = False) -> float:
        """Seconds of a round that drafts ``n_draft`` tokens and verifies ``n_verify`` of them (default all; SV verifies
        fewer), with one companion step per drafted token when ``companion``."""
        n_verify = n_draft if n_verify is None else n_verify
        per_draft = self.draft_s_per_token + (self.companion_s_per_token if companion else 0.0)
        return n_draft * per_draft + self.target_time(n_verify + 1)

    def catchup_time(self, pending: int) -> float:
        """Extra seconds of a round's first draft forward when it reads ``pending`` tokens (2 after a round whose drafts
        were all accepted), each past the first at ``draft_catchup_s``."""
        return max(pending - 1, 0) * self.draft_catchup_s

    @property
    def target_only_s_per_token(self) -> float:
        """Seconds per output token of target-only decoding (target_s at L = 1)."""
        return self.target_time(1)

    def curve_table(self, floor: bool = False) -> str:
        """The verification curve as text: L, milliseconds, ratio to L = 1; with ``floor``, each figure's memory floor
        and ratio to it."""
        base = self.target_time(1)
        floors = self.floors() if floor else None
        lines = [f"{'L':>3} {'ms':>9} {'x L=1':>7}" + (f" {'floor ms':>9} {'x floor':>8}" if floors else "")]
        for L, t in sorted(self.target_s.items()):
            line = f"{L:>3} {t * 1e3:>9.1f} {t / base:>7.2f}"
            if floors:
                line += f" {floors['target_s'] * 1e3:>9.1f} {t / floors['target_s']:>8.2f}"
            lines.append(line)
        head = (f"target verification curve ({self.target_name or '?'}, {self.compute_path}, {self.dtype}, "
                f"{self.machine.get('model_name', '?')}, {self.machine.get('threads', '?')} threads); draft "
                f"{self.draft_s_per_token * 1e3:.1f} ms/token")
        if floors:
            head += (f" (floor {floors['draft_s'] * 1e3:.1f} ms, {self.draft_s_per_token / floors['draft_s']:.2f}x)"
                     f"; floor = bytes a one-token forward reads ({self.extra['draft_bytes'] / 1e9:.2f} GB draft, "
                     f"{self.extra['target_bytes'] / 1e9:.2f} GB target) / read bandwidth measured in this run "
                     f"({self.extra['read_bandwidth'] / 1e9:.1f} GB/s)")
        if self.companion_s_per_token:
            head += f", companion {self.companion_s_per_token * 1e3:.1f} ms/token"
        if self.draft_catchup_s:
            head += f", draft catch-up (a second token read) +{self.draft_catchup_s * 1e3:.1f} ms"
        return head + "\n" + "\n".join(lines)

    def floors(self) -> dict[str, float] | None:
        """The memory floor of a draft step and of a target forward in seconds (bytes read over the measured bandwidth;
        the same for every L), None when not measured."""
        if not all(self.extra.get(k) for k in ("draft_bytes", "target_bytes", "read_bandwidth")):
            return None
        bw = float(self.extra["read_bandwidth"])
        return {"draft_s": self.extra["draft_bytes"] / bw, "target_s": self.extra["target_bytes"] / bw}

    def mismatch(self, draft_name: str, target_name: str, compute_path: str | None = None,
                 machine: dict[str, Any] | None = None, dtype: str | None = None) -> list[str]:
        """What differs between this measurement and a run with these models, path, dtype and machine (empty: none),
        each entry naming both sides, e.g. ``"target: measured packaged:a, run packaged:b"``."""
        out = []
        for what, mine, theirs in (("draft", self.draft_name, draft_name), ("target", self.target_name, target_name),
                                   ("compute path", self.compute_path, compute_path), ("dtype", self.dtype, dtype)):
            if mine and theirs and mine != theirs:
                out.append(f"{what}: measured {mine}, run {theirs}")
        if machine and self.machine:
            for key in ("model_name", "simd_flags", "bf16_chain"):
                if self.machine.get(key) and machine.get(key) and self.machine[key] != machine[key]:
                    mine, theirs = self.machine[key], machine[key]
                    if key == "simd_flags":
                        mine, theirs = " ".join(mine), " ".join(theirs)
                    out.append(f"CPU {key}: measured on {mine!r}, run on {theirs!r}")
        return out

    def runtime_mismatch(self, runtime: str) -> str | None:
        """A one-line warning when this curve was measured on another runtime than ``runtime`` (None: it fits; a
        ``specstop`` curve prices transformers' ``generate`` too)."""
        fits = {self.runtime} | ({"transformers"} if self.runtime == "specstop" else set())
        if runtime in fits:
            return None
        how = (f"python -m pipelines.measure_costs --runtime {runtime}" if runtime in MEASURED_RUNTIMES
               else "specstop times specstop, transformers and llama.cpp; time the runtime's own steps where it runs")
        return (f"the cost file was measured on runtime {self.runtime!r}, not {runtime!r}: the {runtime} settings are "
                f"priced with {self.runtime}'s curve; measure {runtime}'s own ({how})")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["target_s"] = {str(k): v for k, v in sorted(self.target_s.items())}
        return d

    def to_json(self, path: str | Path | None = None) -> str:
        """The cost model as a JSON string; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return text

    @classmethod
    def from_json(cls, path: str | Path) -> CostModel:
        """Read a cost model written by :meth:`to_json`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        """The inverse of :meth:`to_dict` (keys it does not know go to ``extra``)."""
        d = dict(d)
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            d["extra"] = {**d.get("extra", {}), **{k: d.pop(k) for k in unknown}}
        return cls(**d)

    def with_statistic(self, statistic: str) -> CostModel:
        """The same measurement summarised by ``min``, ``median`` or ``mean`` of its raw timings in ``extra``
        (ValueError without them)."""
        if statistic not in STATISTICS:
            raise ValueError(f"statistic={statistic!r}: use one of {', '.join(STATISTICS)}")
        raw_t = {int(k.removeprefix("target_raw_s_L")): v for k, v in self.extra.items()
                 if k.startswith("target_raw_s_L") and v}
        if not self.extra.get("draft_raw_s") or len(raw_t) < len(self.target_s):
            raise ValueError("this cost model keeps no raw timings (measure it again with pipelines.measure_costs)")
        comp = self.extra.get("companion_raw_s")
        one, two = self.extra.get("draft_raw_s_L1"), self.extra.get("draft_raw_s_L2")
        catchup = _catchup(one, two, statistic) if one and two else self.draft_catchup_s
        return replace(
            self, draft_s_per_token=_stat(self.extra["draft_raw_s"], statistic),
            companion_s_per_token=_stat(comp, statistic) if comp else self.companion_s_per_token,
            draft_catchup_s=catchup,
            target_s=_curve(raw_t, statistic),
            extra={**self.extra, "statistic": statistic},
        )

    def describe(self) -> str:
        """One line for reports."""
        ts = ", ".join(f"L={k}: {v * 1e3:.2f} ms" for k, v in sorted(self.target_s.items()))
        tag = "ASSUMED (not measured)" if self.assumed else f"measured on {self.device} ({self.dtype})"
        comp = f", companion {self.companion_s_per_token * 1e3:.2f} ms/token" if self.companion_s_per_token else ""
        return (
            f"{tag}: draft {self.draft_s_per_token * 1e3:.2f} ms/token{comp}; target verification {ts}"
            f" [{self.draft_name or '?'} -> {self.target_name or '?'}]"
        )


def pool_cost_models(models: list[CostModel], statistic: str = "mean") -> CostModel:
    """One curve from several measurements of one pair, their raw timings pooled per length and summarised by
    ``statistic`` (mean: the expected cost on a host whose speed moves; median: a typical step; min: the fastest
    moment)."""
    if not models:
        raise ValueError("pool_cost_models: no cost models to pool")
    pooled: dict[str, list[float]] = {}
    for cm in models:
        keys = [k for k in cm.extra if k.startswith(("target_raw_s_L", "draft_raw_s", "companion_raw_s"))]
        if "draft_raw_s" not in keys:
            raise ValueError("pool_cost_models: a cost model keeps no raw timings (measure_cost_model keeps them)")
        for k in keys:
            pooled.setdefault(k, []).extend(float(v) for v in cm.extra[k])
    first = models[0]
    extra = {**first.extra, **pooled, "pooled_measurements": len(models),
             "measured_at": [cm.extra.get("measured_at") for cm in models]}
    notes = f"{statistic} over {len(models)} pooled measurements; " + first.notes
    return replace(first, notes=notes, extra=extra).with_statistic(statistic)


def assumed_cost_model() -> CostModel:
    """A labelled assumption for when no measured cost model exists: the Qwen2.5-Coder 0.5B / 1.5B pair's CPU fp32
    figures (150 / 375 ms a token), verification assumed to grow 5% a token."""
    base = 0.375
    return CostModel(
        draft_s_per_token=0.150,
        target_s={1: base, 41: base * (1 + 0.05 * 40)},
        assumed=True,
        draft_name="qwen2.5-coder-0.5b (assumed)",
        target_name="qwen2.5-coder-1.5b (assumed)",
        notes="ASSUMPTION: 150 ms/draft token, 375 ms/target token, +5% per extra verified token; not measured.",
    )


def clock(device: Any) -> float:
    """perf_counter after the device finished its queued work: the one timer of the cost model, the engine and the
    benchmark."""
    if getattr(device, "type", str(device)).startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()


def prefill(model: Any, ids: Any) -> Any:
    """A DynamicCache holding ``model``'s keys and values over ``ids`` (one forward)."""
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def crop(cache: Any, length: int) -> None:
    """Cut a DynamicCache back to ``length`` tokens (a negative argument removes tokens in old and new transformers)."""
    extra = int(cache.get_seq_length()) - length
    if extra > 0:
        cache.crop(-extra)


STATISTICS = ("min", "median", "mean")
"""How raw timings are summarised (:meth:`CostModel.with_statistic`, :func:`pool_cost_models`)."""


def _stat(times: list[float], statistic: str) -> float:
    if statistic == "mean":
        return statistics.fmean(times)
    return min(times) if statistic == "min" else statistics.median(times)


def _catchup(one: list[float], two: list[float], statistic: str) -> float:
    """``draft_catchup_s`` from the draft's raw seconds for a forward of one and of two tokens (at least 0)."""
    return max(_stat(two, statistic) - _stat(one, statistic), 0.0)


def _monotone(lengths: list[int], times: list[float]) -> list[float]:
    """Lower monotone envelope T(L) = min over L' >= L: a shorter pass timed slower than a longer one met load from
    other processes, so it takes the longer one's time."""
    order = np.argsort(lengths)
    t = np.asarray(times, dtype=np.float64)[order]
    env = np.minimum.accumulate(t[::-1])[::-1]
    out = np.empty_like(env)
    out[order] = env
    return out.tolist()


def lower_envelope(curve: dict[int, float]) -> dict[int, float]:
    """``curve`` (L -> seconds) made non-decreasing by the lower monotone envelope (see ``_monotone``)."""
    lengths = sorted(curve)
    return dict(zip(lengths, _monotone(lengths, [curve[L] for L in lengths])))


def _curve(raw: dict[int, list[float]], statistic: str) -> dict[int, float]:
    """Verification seconds by L from the raw timings of each length: the statistic, then the monotone envelope."""
    ls = sorted(raw)
    return dict(zip(ls, _monotone(ls, [_stat(raw[L], statistic) for L in ls])))


def _time_head(model: Any, repeats: int, statistic: str) -> tuple[float, list[float]]:
    """Seconds of a model's final norm and LM head on one hidden state: the step of a companion that shares the draft's
    layers."""
    p = next(model.parameters())
    h = torch.randn(1, 1, int(model.config.hidden_size), generator=torch.Generator().manual_seed(0)).to(p.device)
    norm, head = model.get_decoder().norm, model.get_output_embeddings()
    times = []
    for r in range(repeats + 1):  # the first is a warm-up
        t0 = clock(p.device)
        head(norm(h))
        t1 = clock(p.device)
        if r:
            times.append(t1 - t0)
    return _stat(times, statistic), times


def _time_decode(model: Any, prompt: Any, steps: int, repeats: int, statistic: str) -> tuple[float, list[float]]:
    """Seconds of one single-token decode step over a KV cache of the prompt (min or median over all steps)."""
    dev = prompt.device
    vocab = int(model.config.vocab_size)
    times: list[float] = []
    for _ in range(repeats):
        cache = prefill(model, prompt)
        tok = torch.randint(0, vocab, (1, 1), device=dev)
        model(input_ids=tok, past_key_values=cache, use_cache=True)  # warm-up step
        for _ in range(steps):
            tok = torch.randint(0, vocab, (1, 1), device=dev)
            t0 = clock(dev)
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            out.logits[:, -1].argmax(-1)
            times.append(clock(dev) - t0)
    return _stat(times, statistic), times


def measure_cost_model(
    draft: Any,
    target: Any,
    companion: Any = None,
    lengths: tuple[int, ...] = tuple(range(1, 17)) + (24, 32, 40),
    prompt_len: int = 128,
    repeats: int = 3,
    decode_steps: int = 8,
    statistic: str = "min",
) -> CostModel:
    """Time the draft step and the target's verification forwards on the models' device, in inference mode, and on the
    CPU the memory floor beside them; returns the :class:`CostModel` (raw timings in ``extra``).

    Args:
        draft, target, companion: causal LMs already on their device and dtype.
        lengths: verification lengths L to time.
        prompt_len: tokens in the cached prefix (random ids).
        repeats: timed repetitions per measurement; decode_steps: draft steps timed per repetition.
        statistic: ``min`` (default: the cost without interference on a shared host) or ``median``; verification times
            are then made non-decreasing in L.
    """
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths must be non-empty and >= 1, got {lengths}")
    if statistic not in ("min", "median"):
        raise ValueError(f"statistic={statistic!r}: use 'min' or 'median'")
    if repeats < 1 or prompt_len < 1:
        raise ValueError(f"repeats ({repeats}) and prompt_len ({prompt_len}) must be >= 1")
    param = next(target.parameters())
    dev = param.device
    g = torch.Generator().manual_seed(0)
    vocab = min(int(draft.config.vocab_size), int(target.config.vocab_size))
    prompt = torch.randint(0, vocab, (1, prompt_len), generator=g).to(dev)
    extra: dict[str, Any] = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "statistic": statistic}
    bandwidths = [read_bandwidth()] if dev.type == "cpu" else []  # before and after: the host's bandwidth drifts
    with torch.inference_mode():
        draft_prompt = prompt.to(next(draft.parameters()).device)
        draft_s, extra["draft_raw_s"] = _time_decode(draft, draft_prompt, decode_steps, repeats, statistic)
        # the draft's forward of one and of two tokens over one cache: its catch-up after a fully accepted round
        pair = _time_target(draft, draft_prompt, [1, 2], repeats, vocab, g)
        extra.update({f"draft_raw_s_L{L}": t for L, t in pair.items()})
        comp_s = _time_companion(companion, draft, prompt, decode_steps, repeats, statistic, extra)
        raw_t = _time_target(target, prompt, sorted(set(int(x) for x in lengths)), repeats, vocab, g)
    extra.update({f"target_raw_s_L{L}": t for L, t in raw_t.items()})
    if bandwidths:  # the fastest read: the floor is a lower bound
        bandwidths.append(read_bandwidth())
        extra.update(draft_bytes=forward_bytes(draft), target_bytes=forward_bytes(target),
                     read_bandwidth=max(bandwidths), read_bandwidths=bandwidths)
    return CostModel(
        compute_path=compute_path_of(target),
        machine=cpu_info(),
        draft_s_per_token=float(draft_s),
        draft_catchup_s=_catchup(pair[1], pair[2], statistic),
        target_s=_curve(raw_t, statistic),
        companion_s_per_token=float(comp_s),
        device=str(dev),
        dtype=str(param.dtype).removeprefix("torch."),
        draft_name=_name(draft),
        target_name=_name(target),
        companion_name=_name(companion),
        prompt_len=prompt_len,
        notes=(f"{statistic} of {repeats} repeats ({decode_steps} decode steps each), verification times: lower "
               f"monotone envelope in L; prefix of {prompt_len} random tokens"),
        extra=extra,
    )


def _name(model: Any) -> str:
    return "" if model is None else str(getattr(model.config, "name_or_path", "") or type(model).__name__)


def _time_companion(companion: Any, draft: Any, prompt: Any, steps: int, repeats: int, statistic: str,
                    extra: dict[str, Any]) -> float:
    """Seconds of a companion's step (raw timings into ``extra``): its head alone when it shares the draft's layers,
    else its own decode step; 0 without one."""
    if companion is None:
        return 0.0
    if shared_depth(companion, draft):
        comp_s, extra["companion_raw_s"] = _time_head(companion, repeats, statistic)
        extra["companion_shares_draft_layers"] = True
        return comp_s
    comp_s, extra["companion_raw_s"] = _time_decode(companion, prompt.to(next(companion.parameters()).device), steps,
                                                    repeats, statistic)
    return comp_s


def _time_target(target: Any, prompt: Any, lengths: list[int], repeats: int, vocab: int, g: torch.Generator
                 ) -> dict[int, list[float]]:
    """Raw seconds of a target forward of L new tokens over the cached prompt, by L; the lengths interleaved so load
    spikes spread over all of them."""
    dev = prompt.device
    cache = prefill(target, prompt)
    prompt_len = prompt.shape[1]
    new = {L: torch.randint(0, vocab, (1, L), generator=g).to(dev) for L in lengths}
    raw_t: dict[int, list[float]] = {L: [] for L in lengths}
    for r in range(repeats + 1):  # the first sweep is a warm-up
        for L in lengths:
            crop(cache, prompt_len)
            t0 = clock(dev)
            target(input_ids=new[L], past_key_values=cache, use_cache=True)
            t1 = clock(dev)
            if r:
                raw_t[L].append(t1 - t0)
    return raw_t


def forward_bytes(model: nn.Module) -> int:
    """Bytes of weights a one-token forward of ``model`` reads: every parameter and buffer once, but one row of an input
    embedding the head does not share; the KV cache left out."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    lookup = {id(t) for t in emb.parameters()} if emb is not None else set()
    lookup -= {id(t) for t in head.parameters()} if head is not None else set()
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or id(t) in lookup or t.device.type == "meta":
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


_PROBE = NativeExtension("specstop_read_bandwidth", "read_bandwidth.cpp", "native read-bandwidth probe")


def read_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes per second this machine reads from memory on torch's threads: the fastest of ``repeats`` reads of a ``mib``
    MiB buffer by the native probe, or by torch's ``amax`` (slower, so its floor is too low)."""
    x = torch.ones(mib * 2**20, dtype=torch.int8)
    probe = _PROBE.module()
    if probe is not None:
        return x.numel() / probe.read_seconds(x, repeats)[0]
    xf = x.view(torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        xf.amax()
        best = min(best, time.perf_counter() - t0)
    return x.numel() / best
