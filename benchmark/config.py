"""What the benchmarks share (:class:`HarnessConfig`, which llama.cpp's and vLLM's configs extend), what
``python -m pipelines.benchmark`` runs (:class:`BenchmarkConfig`; ``configs/benchmark*.yaml`` mirror them), and which
policy specs the benchmark tunes on validation data (:func:`needs_tuning`)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from data_gen.config import ModelsConfig
from data_gen.prompts import PromptSourceConfig
from predictors.tracking import TrackingConfig

TUNABLE_BASELINES = ("svip", "adaedl", "max_confidence", "draft_prob")


@dataclass
class HarnessConfig:
    """What every benchmark shares (the engine benchmark, llama.cpp's and vLLM's extend it): where it writes, the
    model pair, the prompts, their lengths, the policies, the run order's repeats, the curve and the intervals."""

    out_dir: str = "outputs/benchmark"
    """Folder for benchmark.md / .json, the run's curve and config.yaml (created)."""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    """Draft / target model names (and the fields the runtime reads: dtype, device, compute path, cache_dir)."""
    prompts: list[PromptSourceConfig] = field(
        default_factory=lambda: [PromptSourceConfig("humaneval"), PromptSourceConfig("mtbench")]
    )
    """Prompt sources (see data_gen.prompts); prompts are filtered to ``split`` and taken round-robin across sources."""
    split: str | None = "test"
    """Keep only prompts of this split (train / val / test by prompt id; held-out = test); None keeps all."""
    n_prompts: int = 8
    """Number of prompts benchmarked."""
    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    max_prompt_tokens: int = 512
    """Prompts longer than this are left-truncated."""
    max_new_tokens: int = 128
    """New tokens per prompt (fewer when the target ends the answer)."""
    policies: list[str] = field(default_factory=list)
    """specstop policies the benchmark runs (decoding.policies.build_policy specs)."""
    repeats: int = 2
    """Runs of every row per prompt (order prompt), each pass in a seeded shuffled order; a row's seconds on a prompt
    are the median of its runs, each pass's slow phase (the rows' median) taken out (``benchmark.records
    .pass_adjusted``); the outputs must agree."""
    cost_file: str | None = None
    """The runtime's verification curve (python -m pipelines.measure_costs); measured at the start of the run when
    unset."""
    n_boot: int = 1000
    """Bootstrap resamples of the prompts for the intervals."""
    seed: int = 0
    """Seed of the bootstrap's resamples and of sampling (per prompt: seed + index; the engine benchmark's further
    samples of a prompt: ``BenchmarkConfig.samples_per_prompt``)."""

    def __post_init__(self) -> None:
        if self.n_prompts < 1:
            raise ValueError(f"n_prompts={self.n_prompts}: must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats}: must be >= 1 (runs of every row per prompt)")
        if self.n_boot < 1:
            raise ValueError(f"n_boot={self.n_boot}: must be >= 1")


@dataclass
class BenchmarkConfig(HarnessConfig, TrackingConfig):
    """Everything ``python -m pipelines.benchmark`` does; configs/benchmark*.yaml mirror it."""

    out_dir: str = "outputs/benchmark"
    """Folder for benchmark.md / .json, speedup.png, cost_model.json and config.yaml (created)."""
    prompt_texts: list[str] | None = None
    """Plain prompt strings used instead of ``prompts`` (no split filter)."""
    max_new_tokens: int = 96
    """New tokens per prompt."""
    temperature: float = 0.0
    """0 = greedy (exactness checked against target-only); > 0 = sampling."""
    top_p: float = 1.0
    """Nucleus mass for sampling."""
    samples_per_prompt: int = 1
    """Sampling: decodes of every prompt per row, each with its own seed, the same for every row (sample s of prompt i:
    ``seed + i + s * benchmark.bench.SAMPLE_SEED_STRIDE``; sample 0 keeps ``seed + i``); the intervals resample
    prompts with all their samples, so they narrow as the samples average out the sampled lengths. Greedy decoding
    takes 1 (every sample would be the same run: ``repeats`` times those)."""
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
    """Tune each thresholded learned predictor on ``tune_data_dir``'s validation split under this run's curve, as
    ``<baseline>:tuned`` rows are, so thresholded rows compare like with like; false keeps the export's threshold."""
    hf_rows: list[str] = field(default_factory=lambda: ["static:5", "heuristic", "default"])
    """transformers assisted-generation rows: static:K, heuristic, default (its defaults: 20 tokens, confidence 0.4
    re-tuned online), recommended (its settings tuned on the validation split of ``tune_data_dir`` under this run's
    curve, as ``pipelines.recommend --runtime transformers`` tunes them)."""
    reference_compute: str | None = "eager"
    """Also time target-only with the target loaded on this compute path (eager: fp32 as transformers loads it);
    null skips the row. Costs one more target in memory while the benchmark runs."""
    reference_max_new_tokens: int | None = None
    """New tokens per prompt of the reference row (None: max_new_tokens); fewer keep a slow reference short."""
    order: str = "prompt"
    """prompt: every row on one prompt before the next (drift hits all rows alike), ``repeats`` times (the reference
    row once); row: one row over all prompts."""
    interleave: bool = False
    """order prompt: target-only and the engine's rows decode each prompt together, a step at a time, the row with the
    fewest new tokens next, each step timed alone (``benchmark.interleave``): a slow phase of the host falls on every
    row's tokens alike. Target-only then runs the target's forward a token at a time (greedy: ``generate``'s tokens);
    the other rows run after them, one by one."""
    batch_size: int = 1
    """Engine rows decode this many prompts per batch (left padding, per-sequence draft lengths)."""
    tune_data_dir: str | None = None
    """Labelled data folder whose validation split tunes static:best and <baseline>:tuned (by replay under this run's
    curve); the main job's is outputs/default/data."""
    max_static: int = 10
    """static:best tries lengths 1 .. max_static."""
    replay_check: bool = False
    """At the end, label the prompts along target-only's output and replay every engine row's policy offline under this
    run's curve (and each hf row's transformers rule under transformers' curve, with ``hf_curve``): predicted against
    measured tokens/s (``benchmark.check``)."""
    hf_curve: bool = False
    """Measure transformers' own curve before the rows (``runtimes.transformers.costs``: generate's forward passes as
    it runs them plus its time around them), written to cost_model.transformers.json: the hf:recommended row is tuned
    under it, and the replay check prices the hf rows with it (specstop's curve prices generate too cheaply)."""
    curve_probes: bool = True
    """order prompt: measure the curve again after each prompt's rows (one repeat, a few seconds) and write the mean
    of their pooled timings as ``cost_model_rows.json``, the host's average speed while the rows ran, which the replay
    check prices with (the policies themselves use the curve measured before the rows, as a user's would be)."""
    resume: bool = True
    """order prompt: keep each finished prompt's rows in ``<out_dir>/prompts`` and continue a stopped run of the same
    config on the same machine at its first unfinished prompt, on the curve it began with
    (``benchmark.resume``); false: start over (earlier files moved aside)."""
    force: bool = False
    """Load predictors trained for another draft model anyway."""
    warmup: bool = True
    """Run each path once on a short generation before timing."""
    results_dir: str | None = None
    """Also store the run's summary in this folder (e.g. results), which ``python -m pipelines.results`` renders."""
    experiment: str = field(default="specstop-benchmark", kw_only=True)
    """MLflow experiment of the run (the field: ``predictors.tracking``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt={self.samples_per_prompt}: must be >= 1")
        if self.samples_per_prompt > 1 and self.temperature == 0:
            raise ValueError(f"samples_per_prompt={self.samples_per_prompt} with temperature 0: greedy decoding gives "
                             f"every sample the same tokens; set --temperature > 0 or samples_per_prompt 1 (repeats "
                             f"times the runs)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: must be >= 1")
        if self.order not in ("prompt", "row"):
            raise ValueError(f"order={self.order!r}: use prompt (rows side by side per prompt) or row")
        if self.interleave and self.order != "prompt":
            raise ValueError(f"interleave=true steps the rows of one prompt together: use order prompt, not "
                             f"{self.order!r}")
        if self.order == "prompt" and self.batch_size > 1:
            raise ValueError("order=prompt decodes one prompt at a time: use batch_size 1, or order row for batches")
        if self.reference_max_new_tokens is not None and self.reference_max_new_tokens < 1:
            raise ValueError(f"reference_max_new_tokens={self.reference_max_new_tokens}: must be >= 1 (or null)")
        if self.max_static < 1:
            raise ValueError(f"max_static={self.max_static}: must be >= 1")
        for r in self.hf_rows:
            if r not in ("heuristic", "default", "recommended") and not re.fullmatch(r"static:\d+", r):
                raise ValueError(f"hf_rows: {r!r} is not one of static:K, heuristic, default, recommended")
        if self.prompt_texts is not None and not [t for t in self.prompt_texts if t.strip()]:
            raise ValueError("prompt_texts: give at least one non-empty prompt (or null to use prompts)")
        if self.cost_file is not None and not Path(self.cost_file).is_file():
            raise ValueError(f"--cost_file {self.cost_file}: no such file; measure one with python -m "
                             f"pipelines.measure_costs --out {self.cost_file}, or leave it unset to measure in the run")
        tuned = [s for s in self.policies if needs_tuning(s)] + [f"hf:{r}" for r in self.hf_rows if r == "recommended"]
        if tuned and self.tune_data_dir is None:
            raise ValueError(f"policies {tuned} are tuned on validation data: set --tune_data_dir (e.g. "
                             f"outputs/default/data) or name fixed values (static:5, svip:0.3)")


def needs_tuning(spec: str) -> bool:
    """``static:best`` and ``<baseline>:tuned``: specs chosen by replay of the validation split."""
    return spec == "static:best" or (spec.endswith(":tuned") and spec.split(":")[0] in TUNABLE_BASELINES)
