"""What every row of a benchmark shares (:class:`Bench`: the models, the prompts as token ids, the stop tokens, the
curve, and how a row decodes: :class:`DecodeSettings`), and the prompts it decodes (:func:`load_benchmark_prompts`).

The runners, the report and the replay check read :class:`DecodeSettings`, not the benchmark's whole config: the
config is read in one place (``benchmark.run``), and the llama.cpp benchmark shares the runners' loop with
its own config."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any, Self

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from benchmark.config import BenchmarkConfig
from compute.timing import CostModel
from data_gen.prompts import Prompt, PromptSourceConfig, load_prompts, render_prompt, split_of

log = logging.getLogger("pipelines.benchmark")

SAMPLE_SEED_STRIDE = 1_000_000
"""Sample s of prompt i decodes with seed ``seed + i + s * SAMPLE_SEED_STRIDE``: sample 0 keeps ``seed + i``, and no
seed depends on the number of prompts (a run extended to more prompts keeps every sample's seed)."""


class SettingsOf:
    """A dataclass of settings a part of the benchmark reads, built only by :meth:`of` from the config the run was
    given: each field is the ``BenchmarkConfig`` field of the same name (documented there), so the settings carry no
    defaults of their own (the llama.cpp benchmark states its values in ``LlamaCppBenchConfig.benchmark_config``)."""

    @classmethod
    def of(cls, cfg: BenchmarkConfig) -> Self:
        """The settings ``cfg`` holds under these fields' names."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class DecodeSettings(SettingsOf):
    """How every row decodes a prompt: the fields of the benchmark's config that a row's tokens and counts depend on
    (each named as in ``BenchmarkConfig``, which documents it)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    """Per prompt: ``seed + index`` (sampling; further samples: :data:`SAMPLE_SEED_STRIDE`)."""
    samples_per_prompt: int
    max_draft_len: int
    top_k_features: int
    batch_size: int
    force: bool

    @property
    def mode(self) -> str:
        """``greedy`` (temperature 0) or ``sampling``."""
        return "greedy" if self.temperature == 0 else "sampling"


@dataclass(frozen=True)
class RunOrder(SettingsOf):
    """How the rows take turns on the prompts: the fields of the benchmark's config of the same names (documented
    there)."""

    order: str
    repeats: int
    curve_probes: bool
    interleave: bool


@dataclass
class Bench:
    """What every runner shares: the models, the prompts as token ids, the stop tokens and how a row decodes."""

    decoding: DecodeSettings
    draft: PreTrainedModel
    target: PreTrainedModel
    companion: PreTrainedModel | None
    tokenizer: PreTrainedTokenizerBase
    prompts: list[list[int]]
    eos: list[int]
    cost_model: CostModel | None = None
    hf_cost_model: CostModel | None = None
    """transformers' own curve (``hf_curve``), None when not measured."""
    offset: int = 0
    """Index of ``prompts[0]`` among the run's decodes: decode u is sample ``u % samples_per_prompt`` of prompt
    ``u // samples_per_prompt`` (``prompts`` repeats each prompt once per sample: :func:`sample_units`)."""
    reference: list[list[int]] | None = None
    """Target-only's outputs of ``prompts`` once its row ran (the greedy oracle's look-ahead)."""
    shared: dict[str, Any] = field(default_factory=dict)
    """State every per-prompt view of the bench shares (the reference target, loaded once)."""

    def unit(self, i: int) -> tuple[int, int]:
        """(prompt, sample) of ``prompts[i]``: the run's prompt index and which of its samples it is."""
        return divmod(self.offset + i, self.decoding.samples_per_prompt)

    def seed_of(self, i: int) -> int:
        """The sampling seed of ``prompts[i]`` (``seed + prompt + sample * SAMPLE_SEED_STRIDE``), the same in every
        row."""
        prompt, sample = self.unit(i)
        return self.decoding.seed + prompt + sample * SAMPLE_SEED_STRIDE

    def with_new_tokens(self, n: int, prompts: int | None = None) -> Bench:
        """A view of the bench that decodes ``n`` new tokens a prompt (of its first ``prompts`` prompts: all by
        default): the warm-up's short runs, the reference row's shorter ones."""
        return replace(self, decoding=replace(self.decoding, max_new_tokens=n), prompts=self.prompts[:prompts])


@dataclass(frozen=True)
class PromptChoice(SettingsOf):
    """Which prompts a run decodes and how they render: the benchmark config's fields of these names (the vLLM
    benchmark builds one from its own config)."""

    prompt_texts: list[str] | None
    prompts: list[PromptSourceConfig]
    seed: int
    split: str | None
    n_prompts: int
    use_chat_template: bool
    max_prompt_tokens: int


def load_benchmark_prompts(cfg: BenchmarkConfig | PromptChoice, tokenizer) -> tuple[list[list[int]], list[str], dict]:
    """Token ids of the benchmark prompts, their ids, and stats."""
    cfg = cfg if isinstance(cfg, PromptChoice) else PromptChoice.of(cfg)
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


def sample_units(prompts: list[list[int]], samples_per_prompt: int) -> list[list[int]]:
    """Each prompt once per sample, prompt by prompt (its samples side by side): the decodes a run makes, in order."""
    return [p for p in prompts for _ in range(samples_per_prompt)]


def decode_units(n: int, samples_per_prompt: int) -> list[tuple[int, int]] | None:
    """(prompt, sample) of each of a run's first ``n`` decodes (the bootstrap resamples the prompts, each with its
    samples), None with one sample a prompt (each decode is its own prompt)."""
    if samples_per_prompt == 1:
        return None
    return [divmod(u, samples_per_prompt) for u in range(n)]


def stop_tokens(tokenizer: PreTrainedTokenizerBase, target: PreTrainedModel) -> list[int]:
    """The target's end-of-sequence ids and the tokenizer's."""
    eos = target.generation_config.eos_token_id
    out = set([eos] if isinstance(eos, int) else list(eos or []))
    if tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return sorted(out)
