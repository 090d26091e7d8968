"""What every row of a benchmark shares (:class:`Bench`: the models, the prompts as token ids, the stop tokens, the
curve), and the prompts it decodes (:func:`load_benchmark_prompts`)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute.timing import CostModel
from data_gen.prompts import Prompt, load_prompts, render_prompt, split_of
from pipelines.benchmark.config import BenchmarkConfig

log = logging.getLogger("pipelines.benchmark")


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
    hf_cost_model: CostModel | None = None
    """transformers' own curve (``hf_curve``), None when not measured."""
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


def load_benchmark_prompts(cfg: BenchmarkConfig, tokenizer) -> tuple[list[list[int]], list[str], dict]:
    """Token ids of the benchmark prompts, their ids, and stats."""
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


def stop_tokens(tokenizer: PreTrainedTokenizerBase, target: PreTrainedModel) -> list[int]:
    """The target's end-of-sequence ids and the tokenizer's."""
    eos = target.generation_config.eos_token_id
    out = set([eos] if isinstance(eos, int) else list(eos or []))
    if tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return sorted(out)
