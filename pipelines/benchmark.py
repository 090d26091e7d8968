"""End-to-end decoding benchmark: target-only, transformers assisted generation, and the engine with every stop policy.

On the same held-out prompts (HumanEval and MT-Bench test split, half each, by default) and in one run, all rows on
the same model objects (so every row runs on the same compute path, ``--models.compute``):
- ``target-only``: ``target.generate``, the exact reference output and the speed baseline; ``target-only (eager)`` also
  times the target on ``reference_compute`` (default eager fp32: the speed of a plain transformers load);
- transformers assisted generation (``assistant_model=draft``): ``hf:static:K`` (K tokens, constant schedule),
  ``hf:heuristic`` (+2 / -1 from 5) and ``hf:default`` (20 tokens, confidence 0.4: transformers' defaults);
- ``decoding.engine.SpeculativeDecoder`` with every policy in ``policies`` and every predictor in ``predictors`` (export
  folders or ``models:/<name>@champion``); ``hfp:<policy>`` runs a policy inside transformers' generate. Tuned specs
  read the validation split of ``tune_data_dir`` and replay it under this run's measured curve: ``static:best`` (the
  static length of highest replayed speedup), ``<baseline>:tuned`` (``svip:tuned``, ``adaedl:tuned``,
  ``max_confidence:tuned``, ``draft_prob:tuned``: threshold of highest replayed speedup; under sampling
  ``draft_prob``, q(x) of the drafted token, is what transformers' confidence criterion compares, not the top-1
  probability). Thresholded learned exports are tuned again the same way (``tune_predictors``).

Rows run side by side (``order: prompt``, the default): every row decodes prompt 1, then every row prompt 2, and so on,
so a machine that slows down or speeds up during the run (a shared VM does, by 10-30%) moves every row alike and the
paired ratios stay fair; ``order: row`` runs each row over all prompts in turn. The reference row
(``reference_compute``) decodes ``reference_max_new_tokens`` per prompt (its tokens/s is what it is compared on).
In greedy decoding the oracle reads target-only's output as its look-ahead (exact decoding emits it token for token),
so its rounds verify like any policy's and its time is measured; in sampling it runs the target one step per drafted
token and its time is estimated from the curve.

The verification curve (``compute.timing.CostModel``, L = 1..16 new tokens, read from ``cost_file`` or measured at the
start) prices SV's rounds, the sampling oracle's estimate and the tuning, and is printed in the report.

Per row: tokens/s, speedup over target-only with a paired bootstrap interval over prompts, the ratio to the best
entropy policy (SVIP, AdaEDL) with its interval, for cost-aware rows (``verification == goodput``) the ratio to the best
thresholded engine policy (learned or training-free, ``verification == threshold`` with a threshold: not static, not
the oracle) with its interval, mean accepted length, target calls per token, draft tokens wasted per token,
stop-decision cost as a fraction of one draft forward, exactness (greedy: outputs equal to target-only's) and ROUGE-L
against target-only's output. Writes ``benchmark.md``, ``benchmark.json`` (with each engine row's policy spec, the
prompts' token ids and target-only's output ids), ``speedup.png``, ``cost_model.json`` (``cost_model_rows.json``: the
curve probed between the prompts) and the resolved ``config.yaml``
to ``out_dir``; logs them to MLflow. The console shows a table within 100 columns; the full one is in ``benchmark.md``.

A stopped run continues: with ``order: prompt`` every finished prompt's rows are kept in ``<out_dir>/prompts`` and the
report is rewritten after each prompt (marked partial); the same command on the same machine reads them back and
goes on at the first unfinished prompt, on the curve the run began with (``pipelines.benchmark_resume``; ``--resume
false`` starts over).

With ``replay_check`` the run ends with ``pipelines.replay_check``: the benchmark's prompts labelled along target-only's
output, every engine row's policy replayed offline under this run's curve, predicted against measured tokens/s
(``replay_check`` in benchmark.json and benchmark.md, ``replay_check.png``).

Usage:
    python -m pipelines.benchmark --config configs/benchmark.yaml
    python -m pipelines.benchmark --config configs/benchmark-smoke.yaml --n_prompts 2
"""
from __future__ import annotations

import json
import logging
import re
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.timing import CostModel, clock
from data_gen.generate import ModelsConfig
from data_gen.prompts import PromptSourceConfig
from pipelines.benchmark_pace import Pace, PaceMeter, excess, normal_pace
from pipelines.benchmark_resume import PROMPTS_DIR, PromptStore, run_identity
from predictors.base import GOODPUT, THRESHOLD

if TYPE_CHECKING:
    from decoding.engine import DecodeStats

log = logging.getLogger(__name__)

ENTROPY_KINDS = ("svip", "adaedl")
"""Policies the learned ones must beat: the training-free entropy bounds."""
TUNABLE_BASELINES = ("svip", "adaedl", "max_confidence", "draft_prob")


@dataclass
class BenchmarkConfig:
    """Everything ``python -m pipelines.benchmark`` does; configs/benchmark*.yaml mirror it."""

    out_dir: str = "outputs/benchmark"
    """Folder for benchmark.md / .json, speedup.png, cost_model.json and config.yaml (created)."""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    """Draft / target / companion model names, dtype, device and compute path."""
    prompts: list[PromptSourceConfig] = field(
        default_factory=lambda: [PromptSourceConfig("humaneval"), PromptSourceConfig("mtbench")]
    )
    """Prompt sources (see data_gen.prompts); prompts are filtered to ``split`` and taken round-robin across sources."""
    prompt_texts: list[str] | None = None
    """Plain prompt strings used instead of ``prompts`` (no split filter)."""
    split: str | None = "test"
    """Keep only prompts of this split (train / val / test by prompt id; held-out = test); None keeps all."""
    n_prompts: int = 8
    """Number of prompts benchmarked."""
    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    max_prompt_tokens: int = 512
    """Prompts longer than this are left-truncated."""
    max_new_tokens: int = 96
    """New tokens per prompt."""
    temperature: float = 0.0
    """0 = greedy (exactness checked against target-only); > 0 = sampling."""
    top_p: float = 1.0
    """Nucleus mass for sampling."""
    max_draft_len: int = 16
    """Hard cap on draft tokens per round for the engine."""
    top_k_features: int = 10
    """Top-k draft probabilities in the features (match the predictors' training data)."""
    policies: list[str] = field(
        default_factory=lambda: ["static:5", "heuristic", "max_confidence", "svip:0.3", "adaedl"]
    )
    """Engine policies (decoding.policies.build_policy specs, plus static:best and <baseline>:tuned, see above);
    ``hfp:<spec>`` runs the spec inside transformers' generate."""
    predictors: list[str] = field(default_factory=list)
    """Learned predictors for the engine: export folders or models:/<name>@champion."""
    tune_predictors: bool = True
    """Tune each thresholded learned predictor on the validation split of ``tune_data_dir`` under this run's curve,
    as ``<baseline>:tuned`` rows are (the export's threshold was tuned by the main job under its own curve, measured in
    another run, maybe another phase of the host: thresholded rows then compare unlike with like); false keeps the
    export's threshold."""
    hf_rows: list[str] = field(default_factory=lambda: ["static:5", "heuristic", "default"])
    """transformers assisted-generation rows: static:K, heuristic, default."""
    reference_compute: str | None = "eager"
    """Also time target-only with the target loaded on this compute path (eager: fp32 as transformers loads it);
    null skips the row. Costs one more target in memory while the benchmark runs."""
    reference_max_new_tokens: int | None = None
    """New tokens per prompt of the reference row (None: max_new_tokens); fewer keep a slow reference short."""
    order: str = "prompt"
    """prompt: every row on one prompt before the next (drift hits all rows alike); row: one row over all prompts."""
    repeats: int = 2
    """order prompt: run every row this many times on each prompt, in plan order and then reversed, alternately (so
    drift and the shared host's slow phases, which last 10-20 s here, fall on early and late rows alike), and keep each
    row's faster run on that prompt, its output checked equal (the minimum, as ``timeit`` advises: the cost without
    interference from other processes; target-only thus runs before and after the other rows). 1: each row once, in
    plan order. The reference row (``reference_compute``) runs once."""
    rerun_slower_than: float | None = None
    """order prompt, repeats > 1: after the prompt's first pass, run a row (target-only too) again only when its
    forwards ran more than this fraction (e.g. 0.05) slower than the prompt's normal pace (its rows' median, per model,
    against the curve: ``pipelines.benchmark_pace``), i.e. when a slow phase of the host hit it. Saved 27% of the rows'
    time in the eighteenth session's run, but a row then keeps a typical run where every row twice keeps the faster of
    two (the curve's own convention): on a noisy host the replay check, priced with minimum times, drifted 8-14% from
    the rows (README). null (default): every row runs ``repeats`` times."""
    batch_size: int = 1
    """Engine rows decode this many prompts per batch (left padding, per-sequence draft lengths)."""
    cost_file: str | None = None
    """Verification curve JSON (pipelines.measure_costs); measured at the start of the run when missing."""
    tune_data_dir: str | None = None
    """Labelled data folder whose validation split tunes static:best and <baseline>:tuned (by replay under this run's
    curve); the main job's is outputs/default/data."""
    max_static: int = 10
    """static:best tries lengths 1 .. max_static."""
    n_boot: int = 1000
    """Bootstrap resamples of the prompts for the intervals."""
    replay_check: bool = False
    """At the end, label the prompts along target-only's output and replay every engine row's policy offline under this
    run's curve: predicted against measured tokens/s (pipelines.replay_check)."""
    curve_probes: bool = True
    """order prompt: measure the curve again after each prompt's rows (one repeat, a few seconds) and write the mean
    of their pooled timings as ``cost_model_rows.json``, the host's average speed while the rows ran, which the replay
    check prices with (the policies themselves use the curve measured before the rows, as a user's would be)."""
    resume: bool = True
    """order prompt: keep each finished prompt's rows in ``<out_dir>/prompts`` and continue a stopped run of the same
    config on the same machine at its first unfinished prompt, on the curve it began with
    (``pipelines.benchmark_resume``); false: start over (earlier files moved aside)."""
    force: bool = False
    """Load predictors trained for another draft model anyway."""
    warmup: bool = True
    """Run each path once on a short generation before timing."""
    seed: int = 0
    """Sampling seed (per prompt: seed + index)."""
    tracking: bool = True
    """Log parameters, metrics and artefacts to MLflow."""
    tracking_uri: str | None = None
    """MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)."""
    experiment: str = "specstop-benchmark"
    """MLflow experiment name."""

    def __post_init__(self) -> None:
        if self.n_prompts < 1:
            raise ValueError(f"n_prompts={self.n_prompts}: must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: must be >= 1")
        if self.order not in ("prompt", "row"):
            raise ValueError(f"order={self.order!r}: use prompt (rows side by side per prompt) or row")
        if self.order == "prompt" and self.batch_size > 1:
            raise ValueError("order=prompt decodes one prompt at a time: use batch_size 1, or order row for batches")
        if self.reference_max_new_tokens is not None and self.reference_max_new_tokens < 1:
            raise ValueError(f"reference_max_new_tokens={self.reference_max_new_tokens}: must be >= 1 (or null)")
        if self.max_static < 1 or self.n_boot < 1:
            raise ValueError(f"max_static={self.max_static} and n_boot={self.n_boot} must be >= 1")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats}: must be >= 1 (runs of every row per prompt)")
        if self.rerun_slower_than is not None and self.rerun_slower_than < 0:
            raise ValueError(f"rerun_slower_than={self.rerun_slower_than}: must be >= 0 (a fraction, e.g. 0.05), or "
                             "null to run every row `repeats` times")
        for r in self.hf_rows:
            if r not in ("heuristic", "default") and not re.fullmatch(r"static:\d+", r):
                raise ValueError(f"hf_rows: {r!r} is not one of static:K, heuristic, default")
        if self.prompt_texts is not None and not [t for t in self.prompt_texts if t.strip()]:
            raise ValueError("prompt_texts: give at least one non-empty prompt (or null to use prompts)")
        if self.cost_file is not None and not Path(self.cost_file).is_file():
            raise ValueError(f"--cost_file {self.cost_file}: no such file; measure one with python -m "
                             f"pipelines.measure_costs --out {self.cost_file}, or leave it unset to measure in the run")
        tuned = [s for s in self.policies if _needs_tuning(s)]
        if tuned and self.tune_data_dir is None:
            raise ValueError(f"policies {tuned} are tuned on validation data: set --tune_data_dir (e.g. "
                             f"outputs/default/data) or name fixed values (static:5, svip:0.3)")


def _needs_tuning(spec: str) -> bool:
    return spec == "static:best" or (spec.endswith(":tuned") and spec.split(":")[0] in TUNABLE_BASELINES)


@dataclass
class Row:
    """One benchmark row: per-prompt outputs, tokens and seconds, and the round counters."""

    name: str
    method: str
    kind: str = ""
    """Policy kind (static, svip, disco...) for engine rows; '' for the others."""
    seconds: list[float] = field(default_factory=list)
    """Seconds per prompt (estimated for analysis-only rows)."""
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    rounds: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_tokens: int = 0
    exact: bool | None = None
    exact_by_design: bool = True
    rouge_l: float | None = None
    identical_prompts: int | None = None
    """Prompts whose output equals target-only's (greedy)."""
    note: str = ""
    spec: str = ""
    """Engine rows: the policy spec that rebuilds the row's policy (``decoding.policies.build_policy``)."""
    threshold: float | None = None
    """Engine rows tuned here: the threshold set on the spec's policy (``evaluation.replay.with_threshold``)."""
    verification: str = ""
    """Engine rows: the policy's verification kind (``predictors.base``)."""
    thresholded: bool = False
    """Engine rows: a thresholded policy (``verification == threshold`` with a threshold: learned or entropy)."""
    reference: bool = False
    """The reference row (another compute path, maybe fewer tokens): no exactness check."""
    prefill_seconds: list[float] = field(default_factory=list)
    """Engine rows: seconds per prompt spent prefilling the prompt (inside ``seconds``)."""
    runs: int = 1
    """Runs of the row over its prompts (per prompt 1 up to ``repeats``; the faster one kept)."""
    decode: DecodeStats | None = field(default=None, repr=False)
    """Engine rows: the engine's counters and timings over the row's prompts (stop decisions, draft steps,
    verification passes: the costs the engine realised)."""

    def extend(self, other: Row) -> None:
        """Append ``other``'s prompts (the same row run on further prompts) and add its counters."""
        self.seconds += other.seconds
        self.outputs += other.outputs
        self.prefill_seconds += other.prefill_seconds
        self.runs += other.runs
        for k in ("rounds", "accepted", "target_calls", "draft_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        if other.decode is not None:
            self.decode = other.decode if self.decode is None else self.decode + other.decode

    @property
    def stop_overhead(self) -> float | None:
        """Engine rows: one stop decision as a fraction of one draft forward (``DecodeStats.stop_overhead``)."""
        return None if self.decode is None else self.decode.stop_overhead

    def step_costs(self) -> dict[str, Any]:
        """Engine rows: the draft step and the verification pass the engine realised, in ms, the passes' mean new
        tokens and how many passes had each length (verified drafts + 1; analysis-only rows have no verification pass
        of their own)."""
        d = self.decode
        passes = d.target_calls - d.prompt_passes if d is not None and d.analysis_time == 0 else 0
        hist = Counter()  # new tokens (verified drafts + 1) of the passes after the prompts' (those are the prefill's)
        if passes and d is not None:
            hist = Counter(k + 1 for k in d.verified_lengths) - Counter(k + 1 for k in d.prompt_pass_lengths)
        n = sum(hist.values())
        return {
            "draft_ms_per_step": round(1000 * d.draft_time / d.draft_forwards, 2) if d and d.draft_forwards else None,
            "verify_ms_per_pass": round(1000 * d.target_time / passes, 2) if passes else None,
            "verify_mean_tokens": round(sum(L * c for L, c in hist.items()) / n, 2) if n else None,
            "verify_lengths": {str(L): hist[L] for L in sorted(hist)} or None,
        }

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.seconds)
        return self.tokens / total if total > 0 else 0.0

    def metrics(self, base: Row, best_entropy: Row | None, boot: np.ndarray,
                best_thresholded: Row | None = None) -> dict[str, Any]:
        """The row's report entry; ``boot`` [n_boot, n_prompts] resampled prompt indices for the intervals."""
        speed = _ratio_ci(self, base, boot)
        vs_ent = _ratio_ci(self, best_entropy, boot) if best_entropy is not None and self.kind else (None, None, None)
        cost_aware = self.method == "engine" and self.verification == GOODPUT
        vs_thr = _ratio_ci(self, best_thresholded, boot) if cost_aware else (None, None, None)
        wasted = self.draft_tokens - self.accepted
        return {
            "row": self.name, "method": self.method, "kind": self.kind,
            "spec": self.spec or None, "threshold": self.threshold, "verification": self.verification or None,
            "thresholded": self.thresholded,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "speedup": _round(speed[0]), "speedup_lo": _round(speed[1]), "speedup_hi": _round(speed[2]),
            "vs_best_entropy": _round(vs_ent[0]), "vs_best_entropy_lo": _round(vs_ent[1]),
            "vs_best_entropy_hi": _round(vs_ent[2]),
            "vs_best_thresholded": _round(vs_thr[0]), "vs_best_thresholded_lo": _round(vs_thr[1]),
            "vs_best_thresholded_hi": _round(vs_thr[2]),
            "rounds": self.rounds, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
            "mean_accepted": round(self.accepted / self.rounds, 3) if self.rounds else None,
            "mean_drafted": round(self.draft_tokens / self.rounds, 3) if self.rounds else None,
            "target_calls_per_token": (round(self.target_calls / self.tokens, 3)
                                       if self.tokens and self.rounds else None),
            "wasted_per_token": round(wasted / self.tokens, 3) if self.tokens and self.draft_tokens else None,
            "stop_overhead": None if self.stop_overhead is None else round(self.stop_overhead, 4),
            "exact": self.exact, "rouge_l": None if self.rouge_l is None else round(self.rouge_l, 4),
            "tokens": self.tokens, "seconds": round(sum(self.seconds), 3), "runs": self.runs, "note": self.note,
            "identical_prompts": self.identical_prompts,
            "prompt_tokens": [len(o) for o in self.outputs], "prompt_seconds": [round(x, 4) for x in self.seconds],
            "prefill_seconds": [round(x, 4) for x in self.prefill_seconds] or None,
            "prompt_passes": self.decode.prompt_passes if self.decode is not None else None,
            **self.step_costs(),
        }


def _round(v: float | None) -> float | None:
    return None if v is None else round(float(v), 3)


def _ratio_ci(row: Row, ref: Row | None, boot: np.ndarray) -> tuple[float | None, float | None, float | None]:
    """tokens/s of ``row`` over ``ref``'s, and its 95% paired bootstrap interval over prompts."""
    if ref is None or not row.seconds or len(row.seconds) != len(ref.seconds) or ref.tokens_per_s <= 0:
        return None, None, None
    tok = np.array([len(o) for o in row.outputs], float)
    sec = np.array(row.seconds, float)
    rtok = np.array([len(o) for o in ref.outputs], float)
    rsec = np.array(ref.seconds, float)
    point = row.tokens_per_s / ref.tokens_per_s
    ratios = (tok[boot].sum(1) / sec[boot].sum(1)) / (rtok[boot].sum(1) / rsec[boot].sum(1))
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return point, float(lo), float(hi)


@dataclass
class Bench:
    """What every runner shares: the models, the prompts as token ids, the stop tokens and the config."""

    cfg: BenchmarkConfig
    draft: PreTrainedModel
    target: PreTrainedModel
    companion: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    prompts: list[list[int]]
    eos: list[int]
    cost_model: CostModel | None = None
    offset: int = 0
    """Index of ``prompts[0]`` in the run (seeds are ``cfg.seed + offset + i``)."""
    reference: list[list[int]] | None = None
    """Target-only's outputs of ``prompts`` once its row ran (the greedy oracle's look-ahead)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """State every per-prompt view of the bench shares (the reference target, loaded once)."""

    def generate_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"max_new_tokens": self.cfg.max_new_tokens, "eos_token_id": self.eos,
                              "pad_token_id": self.tokenizer.pad_token_id}
        if self.cfg.temperature > 0:
            kw.update(do_sample=True, temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=None)
        else:
            kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        return kw

    def new_tokens(self, seq: torch.Tensor, prompt_len: int) -> list[int]:
        """The generated part of ``seq``, cut after the first stop token."""
        new = seq[prompt_len:].tolist()
        for j, t in enumerate(new):
            if t in self.eos:
                return new[: j + 1]
        return new


# ----------------------------------------------------------------------------------------------------------- prompts
def load_benchmark_prompts(cfg: BenchmarkConfig, tokenizer) -> tuple[list[list[int]], list[str], dict]:
    """Token ids of the benchmark prompts, their ids, and stats."""
    from data_gen.prompts import Prompt, load_prompts, render_prompt, split_of

    if cfg.prompt_texts is not None:
        prompts = [Prompt(id=f"text:{i}", source="text", domain="chat", messages=[{"role": "user", "content": t}])
                   for i, t in enumerate(cfg.prompt_texts) if t.strip()]
        stats: dict = {"total": len(prompts)}
    else:
        loaded, stats = load_prompts(cfg.prompts, seed=cfg.seed)
        by_source: dict[str, list] = {}
        for p in loaded:
            if cfg.split is None or split_of(p.id) == cfg.split:
                by_source.setdefault(p.source, []).append(p)
        prompts = []
        queues = list(by_source.values())
        while len(prompts) < cfg.n_prompts and any(queues):
            for q in queues:
                if q and len(prompts) < cfg.n_prompts:
                    prompts.append(q.pop(0))
    prompts = prompts[: cfg.n_prompts]
    if not prompts:
        raise ValueError(f"no prompts left after the split filter split={cfg.split!r}; set split: null or add sources")
    if len(prompts) < cfg.n_prompts:
        log.warning("n_prompts=%d asked, but the sources hold %d prompts in split %r: running those (add sources or "
                    "set another split for more)", cfg.n_prompts, len(prompts), cfg.split)
    ids, names, n_trunc = [], [], 0
    for p in prompts:
        tok_ids, truncated = render_prompt(p, tokenizer, cfg.use_chat_template, cfg.max_prompt_tokens)
        if not tok_ids:
            raise ValueError(f"prompt {p.id} renders to no tokens")
        ids.append(tok_ids)
        names.append(p.id)
        n_trunc += int(truncated)
    return ids, names, {"prompts": len(ids), "truncated": n_trunc, "load": stats}


def _eos(tokenizer, target) -> list[int]:
    eos = target.generation_config.eos_token_id
    out = set([eos] if isinstance(eos, int) else list(eos or []))
    if tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return sorted(out)


# ----------------------------------------------------------------------------------------------------------- runners
def timed_prompts(bench: Bench, row: Row, decode: Callable[[int, torch.Tensor], torch.Tensor]) -> Row:
    """The one timed loop: ``decode(i, ids [1, T]) -> sequences [1, T + new]`` per prompt, seeded and timed alone."""
    dev = bench.target.device
    for i, ids in enumerate(bench.prompts):
        x = torch.tensor([ids], device=dev)
        torch.manual_seed(bench.cfg.seed + bench.offset + i)
        t0 = clock(dev)
        with torch.inference_mode():  # every row alike: the engine decodes in inference mode (fewer dispatch steps)
            out = decode(i, x)
        row.seconds.append(clock(dev) - t0)
        row.outputs.append(bench.new_tokens(out[0], len(ids)))
    return row


def run_target_only(bench: Bench, name: str = "target-only", target: PreTrainedModel | None = None) -> Row:
    """``target.generate``: one target forward per token (``target`` defaults to the bench's)."""
    model = target if target is not None else bench.target
    kw = bench.generate_kwargs()
    row = timed_prompts(bench, Row(name, "target.generate", note="reference"),
                        lambda i, x: model.generate(x, attention_mask=torch.ones_like(x), **kw))
    row.target_calls = row.tokens
    if target is None:
        bench.reference = row.outputs
        row.prefill_seconds = [prefill_seconds(model, ids) for ids in bench.prompts]
    return row


@torch.inference_mode()
def prefill_seconds(model: PreTrainedModel, ids: list[int]) -> float:
    """Seconds of one forward of a prompt into a fresh cache (target-only's prefill, timed after its row: the replay
    check adds each row's prefill to the curve's decoding time)."""
    from transformers import DynamicCache

    x = torch.tensor([ids], device=model.device)
    t0 = clock(model.device)
    model(input_ids=x, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return clock(model.device) - t0


class ForwardCounter:
    """Counts a model's forward calls through a hook on that model object only (no library class is patched)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


HF_SETTINGS: dict[str, dict[str, Any]] = {
    "heuristic": {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic",
                  "assistant_confidence_threshold": 0.0},
    "default": {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.4},
}


def run_hf(bench: Bench, kind: str) -> Row:
    """transformers assisted generation with the draft's generation_config set for ``kind`` (restored afterwards).

    Rounds are the target's forward calls after the prefill (one per prompt), drafted tokens the draft's forward
    calls (each proposes one token), accepted tokens = emitted tokens - rounds.
    """
    gc = bench.draft.generation_config
    if kind.startswith("static:"):
        settings = {"num_assistant_tokens": int(kind.split(":")[1]), "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.0}
    else:
        settings = HF_SETTINGS[kind]
    saved = {k: getattr(gc, k, None) for k in settings}
    kw = bench.generate_kwargs()
    t_calls, d_calls = ForwardCounter(bench.target), ForwardCounter(bench.draft)

    def decode(i: int, x: torch.Tensor) -> torch.Tensor:
        for k, v in settings.items():  # the heuristic schedule adapts num_assistant_tokens: reset per prompt
            setattr(gc, k, v)
        return bench.target.generate(x, attention_mask=torch.ones_like(x), assistant_model=bench.draft, **kw)

    try:
        row = timed_prompts(bench, Row(f"hf:{kind}", "transformers assisted"), decode)
    finally:
        t_calls.close()
        d_calls.close()
        for k, v in saved.items():
            setattr(gc, k, v)
    row.rounds = row.target_calls = t_calls.calls - len(bench.prompts)
    row.draft_tokens = d_calls.calls
    row.accepted = row.tokens - row.rounds
    return row


def run_hf_policy(bench: Bench, spec: str) -> Row:
    """A stop policy inside transformers' generate (decoding.hf_integration)."""
    from decoding.hf_integration import generate_with_policy
    from decoding.policies import build_policy

    policy = build_policy(spec, draft=bench.draft, draft_tokenizer=bench.tokenizer,
                          max_draft_len=bench.cfg.max_draft_len, force=bench.cfg.force)
    kw = bench.generate_kwargs()
    per_prompt: list[dict] = []

    def decode(i: int, x: torch.Tensor) -> torch.Tensor:
        out, st = generate_with_policy(bench.target, bench.draft, x, policy, bench.cfg.top_k_features,
                                       attention_mask=torch.ones_like(x), **kw)
        per_prompt.append(st)
        return out

    row = timed_prompts(bench, Row(f"hfp:{spec}", "transformers + policy", kind=policy.kind), decode)
    for st in per_prompt:
        rounds = [(d, a) for d, a in zip(st["draft_lengths"], st["accepted_lengths"]) if d > 0]
        row.rounds += len(rounds)
        row.target_calls += len(st["accepted_lengths"])
        row.draft_tokens += sum(d for d, _ in rounds)
        row.accepted += sum(a for _, a in rounds)
    row.note = f"stop time {sum(st['stop_time'] for st in per_prompt):.3f}s"
    return row


def run_engine(bench: Bench, spec: str | Any, label: str | None = None, rebuild: dict[str, Any] | None = None) -> Row:
    """The engine with one policy (a spec or a ready policy), prompts in batches of ``cfg.batch_size``; ``rebuild``
    ({"spec", "threshold"}) records how a ready policy is built again (default: the spec itself)."""
    from decoding.policies import build_decoder, policy_label

    cfg = bench.cfg
    dec = build_decoder(
        bench.draft, bench.target, spec, draft_tokenizer=bench.tokenizer, target_tokenizer=bench.tokenizer,
        companion=bench.companion, force=cfg.force, temperature=cfg.temperature, top_p=cfg.top_p,
        max_draft_len=cfg.max_draft_len, top_k_features=cfg.top_k_features, cost_model=bench.cost_model,
    )
    pol = dec.policy
    row = Row(label or policy_label(spec, pol), "engine", kind=pol.kind, exact_by_design=pol.exact,
              verification=pol.verification, thresholded=pol.verification == THRESHOLD and pol.has_threshold)
    info = rebuild or {"spec": spec if isinstance(spec, str) else ""}
    row.spec, row.threshold = info.get("spec", ""), info.get("threshold")
    total = None
    pad = bench.tokenizer.pad_token_id if bench.tokenizer.pad_token_id is not None else bench.eos[0]
    for start in range(0, len(bench.prompts), cfg.batch_size):
        chunk = bench.prompts[start : start + cfg.batch_size]
        width = max(len(p) for p in chunk)
        x = torch.full((len(chunk), width), pad, dtype=torch.long)  # [B, T] left-padded
        m = torch.zeros_like(x)
        for b, p in enumerate(chunk):
            x[b, width - len(p) :] = torch.tensor(p)
            m[b, width - len(p) :] = 1
        look_ahead = None
        if pol.needs_target and cfg.temperature == 0 and bench.reference is not None:
            look_ahead = bench.reference[start : start + len(chunk)]  # the greedy oracle: no target steps
        out, st = dec.generate(x, m, cfg.max_new_tokens, bench.eos, cfg.seed + bench.offset + start,
                               reference=look_ahead)
        total = st if total is None else total + st
        seconds = st.wall_time
        row.prefill_seconds += [st.prefill_time / len(chunk)] * len(chunk)
        if st.analysis_time > 0:  # sampling oracle: the look-ahead replaced by one priced verification per round
            assert bench.cost_model is not None
            seconds = st.wall_time - st.analysis_time - st.target_time
            seconds += sum(bench.cost_model.target_time(k + 1) for k in st.draft_lengths)
        for b in range(len(chunk)):  # a batch's time is shared by its prompts in proportion to their tokens
            row.outputs.append(bench.new_tokens(out[b], width))
        n_new = [len(o) for o in row.outputs[-len(chunk):]]
        row.seconds += [seconds * n / max(sum(n_new), 1) for n in n_new]
    assert total is not None
    row.rounds, row.accepted = total.rounds, total.accepted
    row.target_calls = total.target_calls - total.prompt_passes  # target passes after each prompt's (the prefill's)
    row.draft_tokens, row.decode = total.drafted, total
    if total.analysis_time > 0:
        row.note = "analysis only: time estimated (look-ahead replaced by the measured verification curve)"
    elif pol.needs_target:
        row.note = "look-ahead read from target-only's output (greedy); time measured"
    if not dec.policy.exact:
        row.note = "approximate (sequential verification)"
    return row


def rouge_l(outputs: list[list[int]], refs: list[list[int]], tokenizer) -> float:
    """Mean ROUGE-L F1 of decoded outputs against decoded references."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    vals = []
    for o, r in zip(outputs, refs):
        a, b = tokenizer.decode(r, skip_special_tokens=True), tokenizer.decode(o, skip_special_tokens=True)
        if not a.strip() and not b.strip():
            vals.append(1.0)
            continue
        vals.append(scorer.score(a, b)["rougeL"].fmeasure)
    return sum(vals) / len(vals) if vals else 0.0


# ----------------------------------------------------------------------------------------------------------- tuning
def tune_on_validation(specs: Sequence[str], bench: Bench) -> dict[str, tuple[Any, str, dict[str, Any]]]:
    """``static:best`` and ``<baseline>:tuned`` specs -> (policy, label, how to rebuild it: {"spec", "threshold"})
    chosen by replay of the validation split of ``cfg.tune_data_dir`` under the bench's cost model (greedy: argmax
    draws; sampling: sampled draws)."""
    from decoding.policies import build_policy
    from evaluation.replay import ReplayConfig, prepare_replay_data, replay_policy, tune_threshold, with_threshold

    wanted = [s for s in specs if _needs_tuning(s)]
    if not wanted:
        return {}
    cfg, cm = bench.cfg, bench.cost_model
    assert cm is not None and cfg.tune_data_dir is not None
    if not Path(cfg.tune_data_dir).is_dir():  # checked here, not in the config: the main job may write it later
        raise ValueError(f"--tune_data_dir {cfg.tune_data_dir}: no such folder; run the main job first (python -m "
                         f"pipelines.train --config configs/default.yaml writes outputs/default/data) or give a data "
                         f"folder written by pipelines.generate")
    mode, cols = _validation_columns(bench)
    out: dict[str, tuple[Any, str, dict[str, Any]]] = {}
    for spec in wanted:
        if spec == "static:best":
            data = prepare_replay_data(cols, ReplayConfig(mode=mode, origins=("target",)))
            speed = {k: replay_policy(build_policy(f"static:{k}"), data, cm, mode).speedup
                     for k in range(1, cfg.max_static + 1)}
            k = max(speed, key=speed.get)
            log.info("static:best = static:%d (replayed speedups on val: %s)", k,
                     ", ".join(f"{j}: {v:.2f}" for j, v in speed.items()))
            out[spec] = (build_policy(f"static:{k}"), f"static:{k} (val-best)", {"spec": f"static:{k}"})
            continue
        kind = spec.split(":")[0]
        pol = build_policy(kind, max_draft_len=cfg.max_draft_len)
        thr, sp = tune_threshold(pol, cols, cm, split=None, mode=mode)
        log.info("%s tuned on val: threshold %.4g (replayed speedup %.2f)", kind, thr, sp)
        tuned = with_threshold(pol, thr)
        # the label is the spec that builds this policy again (svip's spec takes h = 1 - its threshold)
        param = tuned.h if kind == "svip" else thr
        out[spec] = (tuned, f"{kind}:{param:.3g} (val-tuned)", {"spec": kind, "threshold": thr})
    return out


def _validation_columns(bench: Bench, extra: tuple[str, ...] = ()) -> tuple[str, dict[str, np.ndarray]]:
    """(decoding mode, the validation split of ``cfg.tune_data_dir`` with one draw per position, as the replay reads:
    argmax draws for greedy decoding, sampled ones for sampling), ``extra`` columns included when present."""
    from pipelines.evaluate import load_columns, subset
    from predictors.labels import draw_mask

    cfg = bench.cfg
    assert cfg.tune_data_dir is not None
    mode = "sampling" if cfg.temperature > 0 else "greedy"
    cols = load_columns(cfg.tune_data_dir, splits=["val"], extra_columns=extra)
    mask = draw_mask(cols, "greedy" if mode == "greedy" else "sample")
    return mode, subset(cols, mask) if mask is not None else cols


def tune_predictors(specs: Sequence[str], bench: Bench) -> dict[str, tuple[Any, str, dict[str, Any]]]:
    """Thresholded learned predictors (export folders, registry refs) -> (policy at the threshold that replays fastest
    on the validation split under the bench's cost model, label, how to rebuild it), as :func:`tune_on_validation`
    tunes the training-free ones (an approximate policy as if every drafted token were verified, as the main job does:
    ``evaluation.replay.tune_threshold``). Cost-aware and transformers rows have no threshold and are left out."""
    from decoding.policies import build_policy, policy_label
    from evaluation.replay import missing_columns, tune_threshold, with_threshold
    from predictors.base import SEQUENTIAL

    cfg, cm = bench.cfg, bench.cost_model
    assert cm is not None and cfg.tune_data_dir is not None
    pols = {}
    for spec in specs:
        if spec.startswith(("hfp:", "goodput:")):
            continue
        pol = build_policy(spec, draft=bench.draft, draft_tokenizer=bench.tokenizer, max_draft_len=cfg.max_draft_len,
                           force=cfg.force)
        if pol.has_threshold and pol.verification in (THRESHOLD, SEQUENTIAL):
            pols[spec] = pol
    if not pols:
        return {}
    mode, cols = _validation_columns(bench, tuple(sorted({c for p in pols.values() for c in p.required_columns})))
    out: dict[str, tuple[Any, str, dict[str, Any]]] = {}
    for spec, pol in pols.items():
        miss = missing_columns(pol, cols)
        if miss:
            log.warning("%s keeps its export's threshold %.4g: the validation data in %s lacks %s", spec,
                        pol.threshold, cfg.tune_data_dir, miss)
            continue
        thr, sp = tune_threshold(pol, cols, cm, split=None, mode=mode)
        log.info("%s tuned on val under this run's curve: threshold %.4g (export's %.4g; replayed speedup %.2f)",
                 spec, thr, pol.threshold, sp)
        base = policy_label(spec, pol)
        label = f"{base[:-1]}, val-tuned {thr:.3g})" if base.endswith(")") else f"{base} (val-tuned {thr:.3g})"
        out[spec] = (with_threshold(pol, thr), label, {"spec": spec, "threshold": thr})
    return out


# ----------------------------------------------------------------------------------------------------------- report
COLUMNS = ("row", "tokens_per_s", "speedup", "vs_best_entropy", "vs_best_thresholded", "mean_accepted",
           "mean_drafted", "target_calls_per_token", "wasted_per_token", "stop_overhead", "identical_prompts",
           "rouge_l", "runs", "note")
RATIO_COLUMNS = ("speedup", "vs_best_entropy", "vs_best_thresholded")
"""Columns holding a ratio with its interval (``<c>_lo``, ``<c>_hi``)."""


def _cell(r: dict[str, Any], c: str) -> str:
    v = r.get(c)
    if c in RATIO_COLUMNS and v is not None and r.get(f"{c}_lo") is not None:
        return f"{v:.3f} [{r[f'{c}_lo']:.2f}, {r[f'{c}_hi']:.2f}]"
    return "" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


CONSOLE = (("row", "row"), ("tok/s", "tokens_per_s"), ("vs target-only", "speedup"), ("vs entropy", "vs_best_entropy"),
           ("vs thresholded", "vs_best_thresholded"), ("accepted", "mean_accepted"), ("same", "identical_prompts"))
"""The console table's (header, column): the rest is in benchmark.md."""


def _short(r: dict[str, Any], c: str, n_prompts: int) -> str:
    v = r.get(c)
    if v is None:
        return ""
    if c in RATIO_COLUMNS:
        lo, hi = r.get(f"{c}_lo"), r.get(f"{c}_hi")
        return f"{v:.2f}" if lo is None else f"{v:.2f} [{lo:.2f},{hi:.2f}]"
    if c == "identical_prompts":
        return f"{v}/{n_prompts}"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def console_table(rows: list[dict[str, Any]], n_prompts: int, width: int = 100) -> str:
    """The rows in aligned columns within ``width`` characters (row names cut with ``~`` when needed; columns no row
    fills dropped); every column is in benchmark.md."""
    cells = [[h for h, _ in CONSOLE]] + [[_short(r, c, n_prompts) for _, c in CONSOLE] for r in rows]
    used = [i for i in range(len(CONSOLE)) if i == 0 or any(c[i] for c in cells[1:])]
    widths = {i: max(len(c[i]) for c in cells) for i in used}
    widths[0] = max(12, min(widths[0], width - sum(widths[i] + 2 for i in used[1:])))

    def cell(v: str, i: int) -> str:
        v = v if len(v) <= widths[i] else v[: widths[i] - 1] + "~"
        return v.ljust(widths[i]) if i == 0 else v.rjust(widths[i])

    lines = ["  ".join(cell(c[i], i) for i in used).rstrip()[:width] for c in cells]
    lines.insert(1, "-" * max(len(x) for x in lines))
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r, c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def plot_speedups(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vals = np.array([r["speedup"] or 0.0 for r in rows])
    lo = np.array([r["speedup_lo"] if r["speedup_lo"] is not None else v for r, v in zip(rows, vals)])
    hi = np.array([r["speedup_hi"] if r["speedup_hi"] is not None else v for r, v in zip(rows, vals)])
    colors = ["grey" if r["method"] == "target.generate" else "tab:orange" if r["method"].startswith("transformers")
              else "tab:green" if r["kind"] in ENTROPY_KINDS else "tab:blue" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4.5))
    ax.bar(range(len(rows)), vals, color=colors, yerr=[vals - lo, hi - vals], capsize=3)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["row"] for r in rows], rotation=45, ha="right")
    ax.set_ylabel("speedup over target-only (95% CI over prompts)")
    ax.set_title("tokens/s relative to target-only (orange: transformers, green: entropy bounds, blue: engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def finish_rows(rows: list[Row], bench: Bench, quiet: bool = False) -> list[dict[str, Any]]:
    """Exactness and ROUGE-L against target-only, the bootstrap intervals, the best entropy row: the report rows
    (``quiet``: without logging the cost-aware line)."""
    ref = rows[0].outputs
    for r in rows[1:]:
        if not r.outputs or r.reference:
            continue
        if bench.cfg.temperature == 0:
            r.exact = r.outputs == ref
            r.identical_prompts = sum(a == b for a, b in zip(r.outputs, ref))
        r.rouge_l = rouge_l(r.outputs, ref, bench.tokenizer)
    entropy = [r for r in rows if r.kind in ENTROPY_KINDS and r.method == "engine" and r.outputs]
    best_entropy = max(entropy, key=lambda r: r.tokens_per_s) if entropy else None
    thresholded = [r for r in rows if r.thresholded and r.method == "engine" and r.outputs]
    best_thr = max(thresholded, key=lambda r: r.tokens_per_s) if thresholded else None
    boot = np.random.default_rng(bench.cfg.seed).integers(0, len(bench.prompts), (bench.cfg.n_boot, len(bench.prompts)))
    table = [r.metrics(rows[0], best_entropy, boot, best_thr) for r in rows]
    # target-only's tokens, and in greedy decoding those of every row whose output differs (an approximate policy's):
    # what pipelines.replay_check labels
    for t, r in zip(table, rows):
        if r is rows[0] or (bench.cfg.temperature == 0 and r.exact is False and r.method == "engine"):
            t["output_ids"] = r.outputs
    line = cost_aware_line(table, best_thr.name if best_thr else None)
    if line and not quiet:
        log.info(line)
    return table


def best_thresholded(table: list[dict[str, Any]]) -> str | None:
    """The fastest thresholded engine row of a report (learned or training-free; not static, the oracle, goodput)."""
    rows = [r for r in table if r.get("thresholded")]
    return max(rows, key=lambda r: r["tokens_per_s"])["row"] if rows else None


def cost_aware_line(table: list[dict[str, Any]], best_thresholded: str | None) -> str:
    """One line: the best cost-aware row against the best thresholded one, the ratio and its interval ('' when either
    is missing)."""
    cost_aware = [r for r in table if r.get("vs_best_thresholded") is not None]
    if not cost_aware or best_thresholded is None:
        return ""
    best = max(cost_aware, key=lambda r: r["tokens_per_s"])
    thr = next(r for r in table if r["row"] == best_thresholded)
    return (f"cost-aware against thresholded: best cost-aware {best['row']} {best['tokens_per_s']:.3f} tokens/s, "
            f"best thresholded {thr['row']} {thr['tokens_per_s']:.3f} tokens/s: {best['vs_best_thresholded']:.3f}x "
            f"[{best['vs_best_thresholded_lo']:.3f}, {best['vs_best_thresholded_hi']:.3f}] (95% paired bootstrap "
            f"over prompts)")


def write_report(table: list[dict[str, Any]], bench: Bench, names: list[str], out_dir: Path,
                 of: int | None = None) -> None:
    """``benchmark.md``, ``benchmark.json`` and ``speedup.png`` of the rows in ``table`` (``of``: the run's number of
    prompts when the table covers only the first ones, a report of a run still going or stopped)."""
    cfg, cm = bench.cfg, bench.cost_model
    from compute.compute_path import compute_path_of, cpu_info

    info = cpu_info()
    entropy = [r for r in table if r["kind"] in ENTROPY_KINDS and r["method"] == "engine"]
    best_e = max(entropy, key=lambda r: r["tokens_per_s"])["row"] if entropy else "none"
    best_t = best_thresholded(table)
    partial = (f"**Partial: the first {len(names)} of {of} prompts.** The run goes on, or was stopped: the same "
               f"command continues it (`{PROMPTS_DIR}/` keeps every finished prompt).\n") if of else ""
    md = [
        "# Decoding benchmark\n",
        *([partial] if partial else []),
        f"draft `{cfg.models.draft}`, target `{cfg.models.target}`, companion `{cfg.models.companion}`; "
        f"{len(names)} prompts ({', '.join(names)}), {cfg.max_new_tokens} new tokens, temperature {cfg.temperature}, "
        f"device {cfg.models.device}, compute path {compute_path_of(bench.target)} (fp32 activations), batch size "
        f"{cfg.batch_size}; CPU {info['model_name']} ({info['torch_cpu_capability']}, {torch.get_num_threads()} "
        f"threads), torch {info['torch']}.\n",
        "speedup = tokens/s over target-only on the same path; vs_best_entropy = tokens/s over the best entropy "
        f"policy ({best_e}); vs_best_thresholded (cost-aware rows) = tokens/s over the best thresholded engine policy, "
        f"learned or training-free ({best_t or 'none'}); [95% paired bootstrap interval over prompts]; mean_accepted / "
        "mean_drafted = draft tokens accepted / drafted per round; stop_overhead = one stop decision / one draft "
        "forward; identical_prompts = prompts whose output equals target-only's (greedy); rouge_l against "
        "target-only's output; runs = the row's timed runs over the prompts, the faster kept per prompt"
        f"{_runs_rule(cfg)}.\n",
        markdown_table(table),
    ]
    line = cost_aware_line(table, best_t)
    if line:
        md += ["", line[0].upper() + line[1:] + "."]
    if cm is not None:
        md += ["\n```", cm.curve_table(), "```"]
    (out_dir / "benchmark.md").write_text("\n".join(md) + "\n")
    report = {"rows": table, "prompts": names, "prompt_ids": bench.prompts, "cpu": info,
              "prompts_of_run": of or len(names)}
    (out_dir / "benchmark.json").write_text(json.dumps(report, indent=2))
    plot_speedups(table, out_dir / "speedup.png")


def _runs_rule(cfg: BenchmarkConfig) -> str:
    if cfg.order != "prompt" or cfg.repeats == 1:
        return " (one run per prompt)"
    if cfg.rerun_slower_than is None:
        return f" ({cfg.repeats} per prompt)"
    return (f" (a row again, up to {cfg.repeats} per prompt, only when its forwards ran over "
            f"{100 * cfg.rerun_slower_than:.0f}% slower than the prompt's pace against the curve)")


# ----------------------------------------------------------------------------------------------------------- main
def load_bench(cfg: BenchmarkConfig, store: PromptStore | None = None) -> tuple[Bench, list[str], dict]:
    """Load the models (one compute path for all rows), the prompts and the verification curve: the stored run's when
    ``store`` holds one to continue (checked to be this config, these prompts and this machine), else ``cost_file``'s
    or measured now."""
    from compute.compute_path import compute_path_of, cpu_info
    from data_gen.generate import GenerateConfig, load_models

    models, tok = load_models(GenerateConfig(models=cfg.models))
    prompts, names, p_stats = load_benchmark_prompts(cfg, tok)
    bench = Bench(cfg, models.draft, models.target, models.companion, tok, prompts, _eos(tok, models.target))
    identity = run_identity(cfg, prompts) if store is not None else None
    if store is not None:
        bench.cost_model = store.resume(identity, cpu_info(), str(bench.draft.config.name_or_path),
                                        str(bench.target.config.name_or_path), compute_path_of(bench.target))
        if bench.cost_model is not None:
            log.info("benchmark: continuing the run in %s (%d of %d prompts done) on its first curve", store.folder,
                     len(store.done()), len(prompts))
            return bench, names, p_stats
    bench.cost_model = load_cost_model(cfg, bench)
    if store is not None:
        store.begin(identity, bench.cost_model)
    return bench, names, p_stats


def load_cost_model(cfg: BenchmarkConfig, bench: Bench) -> CostModel:
    """``cost_file`` (warned when measured for another pair, path or CPU) or a measurement of L = 1..16 now."""
    from compute.compute_path import compute_path_of, cpu_info

    if cfg.cost_file:
        cm = CostModel.from_json(cfg.cost_file)
        for diff in cm.mismatch(str(bench.draft.config.name_or_path), str(bench.target.config.name_or_path),
                                compute_path_of(bench.target), cpu_info()):
            log.warning("cost file %s does not match this run: %s", cfg.cost_file, diff)
        return cm
    t0 = time.perf_counter()
    cm = measure_curve(bench, repeats=3)
    log.info("verification curve measured in %.0fs:\n%s", time.perf_counter() - t0, cm.curve_table())
    return cm


def measure_curve(bench: Bench, repeats: int) -> CostModel:
    """The pair's curve at every verification length 1..16, 24 and one past the draft cap."""
    from compute.timing import measure_cost_model

    return measure_cost_model(bench.draft, bench.target, bench.companion,
                              lengths=(*range(1, 17), 24, bench.cfg.max_draft_len + 1), repeats=repeats)


CURVE_DURING_ROWS = "cost_model_rows.json"
"""The curve pooled from probes between the prompts (``curve_probes``), beside the one measured before the rows."""


Runner = Callable[[Bench], Row]
"""Runs one row on the prompts of the bench it is given (all of them, or one in ``order: prompt``)."""


def row_plan(cfg: BenchmarkConfig, bench: Bench) -> list[tuple[str, Runner]]:
    """(name, runner) for every row, in order; target-only first."""
    tuned = tune_on_validation(cfg.policies, bench)
    if cfg.tune_predictors and cfg.tune_data_dir is not None:
        tuned.update(tune_predictors(cfg.predictors, bench))
    plan: list[tuple[str, Runner]] = [("target-only", lambda b: run_target_only(b))]
    for kind in cfg.hf_rows:
        plan.append((f"hf:{kind}", lambda b, k=kind: run_hf(b, k)))
    for spec in [*cfg.policies, *cfg.predictors]:
        if spec.startswith("hfp:"):
            plan.append((spec, lambda b, s=spec[4:]: run_hf_policy(b, s)))
        elif spec in tuned:
            pol, label, rebuild = tuned[spec]
            plan.append((label, lambda b, p=pol, lb=label, rb=rebuild: run_engine(b, p, lb, rb)))
        else:
            plan.append((spec, lambda b, s=spec: run_engine(b, s)))
    if cfg.reference_compute and cfg.reference_compute != cfg.models.compute:
        plan.append((f"target-only ({cfg.reference_compute})", run_reference))
    return plan


def run_reference(bench: Bench) -> Row:
    """Target-only on the target loaded again on ``cfg.reference_compute`` (loaded once per run, ``release_reference``
    frees it), ``reference_max_new_tokens`` per prompt."""
    cfg = bench.cfg
    target = bench.shared.get("reference_target")
    if target is None:
        from compute.models import load_model

        mc = replace(cfg.models, compute=cfg.reference_compute)
        target, _ = load_model(mc.spec(mc.target))
        bench.shared["reference_target"] = target
        if cfg.warmup:
            kw = {**bench.generate_kwargs(), "max_new_tokens": 4}
            x = torch.tensor([bench.prompts[0]], device=target.device)
            target.generate(x, attention_mask=torch.ones_like(x), **kw)
    n_new = cfg.reference_max_new_tokens or cfg.max_new_tokens
    short = replace(bench, cfg=replace(cfg, max_new_tokens=n_new))
    row = run_target_only(short, f"target-only ({cfg.reference_compute})", target)
    row.reference = True
    row.note = f"reference: target loaded with --models.compute {cfg.reference_compute}, {n_new} new tokens a prompt"
    return row


def release_reference(bench: Bench) -> None:
    """Free the reference target (if one was loaded)."""
    bench.shared.pop("reference_target", None)


PromptDone = Callable[[list[Row], int], None]
"""Called with the rows so far (plan order) and how many prompts they cover, after each prompt of ``order: prompt``."""


def run_rows(plan: list[tuple[str, Runner]], bench: Bench, store: PromptStore | None = None,
             on_prompt: PromptDone | None = None) -> list[Row]:
    """Every row on every prompt, in ``cfg.order``, with progress and an ETA; returns the rows in plan order. With a
    ``store`` (order prompt), prompts it holds are read back instead of run and each prompt run is saved to it."""
    t0 = time.perf_counter()
    if bench.cfg.order == "row":
        rows: list[Row] = []
        for i, (name, runner) in enumerate(plan):
            t_row = time.perf_counter()
            rows.append(runner(bench))
            rows[-1].runs = len(rows[-1].seconds)  # once per prompt
            _log_row(i, len(plan), name, rows, time.perf_counter() - t_row, t0)
        return rows
    merged: dict[str, Row] = {}
    n = len(bench.prompts)
    stored = set(store.done()) if store is not None else set()
    ran = 0
    for j, prompt in enumerate(bench.prompts):
        if j in stored:
            assert store is not None
            rows_j, probe = store.load(j)
        else:
            rows_j, probe = run_prompt(plan, replace(bench, prompts=[prompt], offset=j, reference=None), j)
            if store is not None:
                store.save(j, rows_j, probe)
            ran += 1
        if probe is not None:
            bench.shared.setdefault("curve_probes", []).append(probe)
        for name, row in rows_j.items():
            if name in merged:
                merged[name].extend(row)
            else:
                merged[name] = row
        done = time.perf_counter() - t0
        base = merged[plan[0][0]]
        line = ", ".join(f"{name} x{r.tokens_per_s / base.tokens_per_s:.2f}" for name, r in list(merged.items())[1:6]
                         if base.tokens_per_s)
        how = "read back from an earlier run" if j in stored else f"done ({done:.0f}s"
        eta = "" if j in stored else f", ETA {done / ran * sum(1 for k in range(j + 1, n) if k not in stored):.0f}s)"
        log.info("prompt %d/%d %s%s: target-only %.3f tokens/s; so far %s ...", j + 1, n, how, eta,
                 base.tokens_per_s, line)
        if on_prompt is not None and j not in stored:
            on_prompt([merged[name] for name, _ in plan], j + 1)
    return [merged[name] for name, _ in plan]


def run_prompt(plan: list[tuple[str, Runner]], view: Bench, j: int) -> tuple[dict[str, Row], CostModel | None]:
    """Every row of the plan on the one prompt of ``view`` (prompt j of the run), up to ``repeats`` times in
    alternating order, each row's faster run kept; with ``rerun_slower_than`` set, only the rows a slow phase hit run
    after the first pass (target-only included: every row is measured alike); then the curve probed once
    (``curve_probes``, else None)."""
    cfg = view.cfg
    tol = cfg.rerun_slower_than if view.cost_model is not None else None
    rows_j: dict[str, Row] = {}
    paces: dict[str, Pace | None] = {}
    normal: dict[str, float] = {}
    for r in range(cfg.repeats):  # target-only first in the first pass: the greedy oracle's look-ahead
        if r == 1 and tol is not None:
            normal = normal_pace([p for p in paces.values() if p is not None])
        again, spared = [], 0.0
        for name, runner in plan if r % 2 == 0 else plan[::-1]:
            if name in rows_j and rows_j[name].reference:
                continue
            if name in rows_j and tol is not None and not _was_slowed(paces[name], normal, tol):
                spared += sum(rows_j[name].seconds)
                continue
            row, pace = _run_paced(runner, view) if tol is not None else (runner(view), None)
            if name not in rows_j:
                rows_j[name], paces[name] = row, pace
                continue
            kept = _faster(rows_j[name], row, j)
            kept.runs = rows_j[name].runs + 1
            paces[name] = pace if kept is row else paces[name]
            rows_j[name] = kept
            again.append(name)
        if r >= 1 and tol is not None:
            log.info("prompt %d pass %d: ran again %d of %d rows (over %.0f%% slower than the prompt's pace: %s), "
                     "%.0fs of runs spared", j + 1, r + 1, len(again), len(plan), 100 * tol, ", ".join(again), spared)
    if cfg.repeats > 1 and tol is None:
        rows_j[plan[0][0]].note = (f"reference; per prompt the faster of {cfg.repeats} runs, before and after the "
                                   "other rows")
    probe = measure_curve(view, repeats=1) if cfg.curve_probes else None
    return rows_j, probe


def _run_paced(runner: Runner, view: Bench) -> tuple[Row, Pace]:
    """One run of a row with its target and draft forwards timed against the curve."""
    assert view.cost_model is not None
    with PaceMeter({"target": view.target, "draft": view.draft}, view.cost_model) as meter:
        row = runner(view)
    return row, meter.pace


def _was_slowed(pace: Pace | None, normal: dict[str, float], tol: float) -> bool:
    """A run whose priced forwards took more than ``1 + tol`` times the prompt's normal pace (or cannot be judged)."""
    x = excess(pace, normal)
    return x is None or x > tol


def _faster(first: Row, again: Row, j: int) -> Row:
    """One row run twice on prompt j: the faster run (a shared VM slows down for 10-20 s now and then, by up to 3x
    measured here: neither a row nor the denominator of its ratios must carry such a spike), or the first when the
    outputs differ (then only one run decoded each output; logged)."""
    if again.outputs != first.outputs:
        log.warning("%s gave other tokens on prompt %d the second time; keeping the first run", first.name, j + 1)
        return first
    return again if sum(again.seconds) < sum(first.seconds) else first


def _log_row(i: int, n: int, name: str, rows: list[Row], seconds: float, t0: float) -> None:
    done = time.perf_counter() - t0
    base, row = rows[0].tokens_per_s, rows[-1]
    log.info("row %d/%d %s: %.3f tokens/s (x%.3f), %d tokens in %.0fs; ETA %.0fs", i + 1, n, name, row.tokens_per_s,
             row.tokens_per_s / base if base else 0.0, row.tokens, seconds, done / (i + 1) * (n - i - 1))


def warm_up(bench: Bench) -> None:
    """Each path once on a 4-token generation of the first prompt (kernels, caches, oneDNN primitives)."""
    short = replace(bench, cfg=replace(bench.cfg, max_new_tokens=4), prompts=bench.prompts[:1])
    run_target_only(short)
    run_hf(short, "static:3")
    run_engine(short, "static:3")


def run_benchmark(cfg: BenchmarkConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Load models and prompts, run every row (progress and ETA per row), write the report; returns (rows, stats)."""
    t_start = time.perf_counter()
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store = None
    if cfg.order == "prompt":
        store = PromptStore(out_dir / PROMPTS_DIR)
        if not cfg.resume:
            store.set_aside()
    bench, names, p_stats = load_bench(cfg, store)
    assert bench.cost_model is not None
    bench.cost_model.to_json(out_dir / "cost_model.json")
    log.info("benchmark: %d prompts x %d new tokens, device %s, compute path %s", len(bench.prompts),
             cfg.max_new_tokens, cfg.models.device, cfg.models.compute)
    if cfg.warmup:
        warm_up(bench)
    plan = row_plan(cfg, bench)
    if store is not None:
        store.check_rows([name for name, _ in plan])

    def report_so_far(rows: list[Row], k: int) -> None:  # a run stopped now leaves the report of its first k prompts
        if k < len(bench.prompts):
            view = replace(bench, prompts=bench.prompts[:k])
            write_report(finish_rows(rows, view, quiet=True), view, names[:k], out_dir, of=len(bench.prompts))

    try:
        rows = run_rows(plan, bench, store, report_so_far)
    finally:
        release_reference(bench)
    table = finish_rows(rows, bench)
    write_report(table, bench, names, out_dir)
    write_curve_during_rows(bench, out_dir)
    check = run_replay_check(bench, out_dir) if cfg.replay_check else None
    return table, {"prompts": p_stats, "seconds": time.perf_counter() - t_start, "replay_check": check}


def write_curve_during_rows(bench: Bench, out_dir: Path) -> None:
    """``cost_model_rows.json`` from the probes taken between the prompts (none in row order or without probes: an
    earlier run's file is removed), and a log line comparing it with the curve measured before the rows."""
    from compute.timing import pool_cost_models

    probes = bench.shared.get("curve_probes") or []
    if not probes:
        (out_dir / CURVE_DURING_ROWS).unlink(missing_ok=True)  # an earlier run's probes do not describe this one
        return
    cm = pool_cost_models(probes)
    cm.to_json(out_dir / CURVE_DURING_ROWS)
    before = bench.cost_model
    if before is not None:
        log.info("curve during the rows (mean of %d probes): t(1) %.1f ms, t(8) / t(1) %.2f, draft step %.1f ms; "
                 "before the rows: %.1f ms, %.2f, %.1f ms", len(probes), 1e3 * cm.target_time(1),
                 cm.target_time(8) / cm.target_time(1), 1e3 * cm.draft_s_per_token, 1e3 * before.target_time(1),
                 before.target_time(8) / before.target_time(1), 1e3 * before.draft_s_per_token)


def run_replay_check(bench: Bench, out_dir: Path) -> dict[str, Any] | None:
    """``pipelines.replay_check`` on the report just written, with the bench's models (nothing loads again). A check
    that fails is logged with the command that reruns it and returns None: the measured rows stand and are logged."""
    from pipelines.replay_check import read_bench_folder, run_check, write_check

    log.info("replay check: labelling the %d prompts along target-only's output", len(bench.prompts))
    try:
        check = run_check(read_bench_folder(out_dir, bench.cfg), bench.draft, bench.target, bench.tokenizer,
                          bench.companion)
        write_check(check, out_dir)
    except Exception:  # an optional phase after the measurement: keep the benchmark's results
        log.exception("replay check failed; the benchmark's results are written. Rerun the check alone with: python "
                      "-m pipelines.replay_check --bench_dir %s", out_dir)
        return None
    return check


def _write_config(cfg: BenchmarkConfig, path: Path) -> None:
    import yaml

    path.write_text("# python -m pipelines.benchmark --config " + str(path) + "\n" + yaml.safe_dump(asdict(cfg)))


def metric_key(row: str) -> str:
    """A row name as an MLflow metric prefix."""
    return re.sub(r"[^A-Za-z0-9_.\-/ ]", "_", row)


ROW_METRICS = ("tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "vs_best_entropy", "vs_best_thresholded",
               "vs_best_thresholded_lo", "vs_best_thresholded_hi", "mean_accepted", "mean_drafted",
               "target_calls_per_token", "wasted_per_token", "stop_overhead", "rouge_l")


def log_to_mlflow(cfg: BenchmarkConfig, rows: list[dict[str, Any]], out_dir: Path,
                  check: dict[str, Any] | None = None) -> None:
    """Parameters, per-row metrics (and the replay check's) and the artefacts of a finished benchmark in one MLflow
    run."""
    import mlflow

    from pipelines.cli import resolve_tracking_uri

    mlflow.set_tracking_uri(resolve_tracking_uri(cfg.tracking_uri))
    mlflow.set_experiment(cfg.experiment)
    with mlflow.start_run(run_name="benchmark"):
        mlflow.log_params({k: str(v)[:250] for k, v in asdict(cfg).items()})
        for r in rows:
            for m in ROW_METRICS:
                if isinstance(r.get(m), (int, float)) and not isinstance(r.get(m), bool):
                    mlflow.log_metric(f"{metric_key(r['row'])}/{m}", float(r[m]))
        if check is not None:
            from pipelines.replay_check import check_metrics

            mlflow.log_metrics(check_metrics(check))
        mlflow.log_artifacts(str(out_dir))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, run the benchmark, log to MLflow; returns {"rows", "stats", "out_dir"}."""
    from pipelines.cli import parse_config, setup_logging, user_errors

    setup_logging()
    logging.getLogger("absl").setLevel(logging.WARNING)  # rouge-score logs once per scorer
    with user_errors("python -m pipelines.benchmark"):
        cfg = parse_config(BenchmarkConfig, argv, __doc__)
        out_dir = Path(cfg.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_config(cfg, out_dir / "config.yaml")
        rows, stats = run_benchmark(cfg)
    if cfg.tracking:
        log_to_mlflow(cfg, rows, out_dir, stats["replay_check"])
    print(console_table(rows, len(rows[0]["prompt_tokens"])))
    lines = [cost_aware_line(rows, best_thresholded(rows))]
    if stats["replay_check"] is not None:
        from pipelines.replay_check import summary_line

        lines.append(summary_line(stats["replay_check"]["summary"]))
    for x in [x for x in lines if x] + [f"full table: {out_dir / 'benchmark.md'}"]:
        print(textwrap.fill(x, 100, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False))
    return {"rows": rows, "stats": stats, "out_dir": str(out_dir)}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
