"""What ``python -m pipelines.generate`` is configured by: the model pair (:class:`ModelsConfig`) and the generator's
mix, budget and batching (:class:`GenerateConfig`); the YAML files in configs/ mirror them.

Usage: ``cfg = GenerateConfig(models=ModelsConfig(draft="tiny:1", target="tiny:2"), max_records=1000)``
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from compute.models import ModelSpec
from data_gen.prompts import PromptSourceConfig
from data_gen.schema import ORIGINS

AUTO = "auto"
"""``gen_batch_size`` sized from this host's measured step curve (``data_gen.batch_sizing``)."""


@dataclass
class ModelsConfig:
    """The model pair (and optional companion) and where they run."""

    draft: str = "packaged:qwen2.5-coder-0.5b-instruct"
    """Draft model: packaged:<name>, tiny:SEED[:HIDDEN[:LAYERS]], a local directory, a .gguf file or a hub id."""
    target: str = "packaged:qwen2.5-coder-1.5b-instruct"
    """Target model, same forms; must share the draft's tokenizer."""
    companion: str | None = None
    """Optional companion model for Speculative Verification (about the draft's size, same tokenizer)."""
    dtype: str = "float32"
    """float32, bfloat16 or float16."""
    device: str = "cpu"
    """torch device for all models (under Fabric each rank uses its own device)."""
    cache_dir: str = "~/.cache/specstop"
    """Cache of the packaged models (joined GGUF converted once to safetensors)."""
    compute: str = "auto"
    """CPU compute path: ``auto``, ``packed-bf16``, ``packed`` or ``eager`` (docs/compute-path.md)."""
    bf16_draft_head: bool = True
    """On packed-bf16, the draft's and companion's LM heads in bf16 too (recorded as ``head_dtype``)."""
    bf16_target_head: bool = True
    """On specstop's bf16 kernel, the target's LM head in bf16 returning fp32 logits (recorded as ``head_dtype``)."""
    fuse_linears: bool = True
    """On a packed path, q/k/v and gate/up run as one GEMM each (recorded as ``pack_layout``)."""
    native_gemm: bool = True
    """On packed-bf16, linears run on specstop's bf16 kernel where the CPU has it, else oneDNN's (recorded as ``gemm``).
    """
    int8_draft: bool = True
    """On specstop's kernel, draft and companion weights as int8 with per-channel scales, half a draft step's bytes; the
    target keeps bf16 (recorded as ``weights``)."""

    def spec(self, name: str, role: str = "target") -> ModelSpec:
        """The ModelSpec of ``name`` loaded as ``role`` (draft, target or companion)."""
        if role not in ("draft", "target", "companion"):
            raise ValueError(f"role={role!r}: use draft, target or companion")
        target = role == "target"
        return ModelSpec(name, dtype=self.dtype, device=self.device, cache_dir=self.cache_dir, compute=self.compute,
                         bf16_head=self.bf16_target_head if target else self.bf16_draft_head, fp32_logits=target,
                         fuse_linears=self.fuse_linears, native_gemm=self.native_gemm,
                         int8_weights=self.int8_draft and not target)


@dataclass
class GenerateConfig:
    """Everything ``python -m pipelines.generate`` does; the YAML files in configs/ mirror it."""

    out_dir: str = "outputs/data"
    """Folder of the Parquet shards, config.json, summary.json and cost_model.json."""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    """Draft, target, companion."""
    prompts: list[PromptSourceConfig] = field(
        default_factory=lambda: [PromptSourceConfig("humaneval"), PromptSourceConfig("sharegpt", limit=400)]
    )
    """Prompt sources: humaneval, mtbench, sharegpt, a local .jsonl/.parquet file or a hub dataset name."""
    use_chat_template: bool = True
    """Apply the tokenizer's chat template (instruct models)."""
    max_prompt_tokens: int = 384
    """Longer prompts are left-truncated (counted and warned once)."""
    origins: dict[str, float] = field(default_factory=lambda: {"prompt": 1.0, "draft": 1.0, "target": 1.0, "spec": 1.0})
    """Share of each prefix origin (prompt, draft, target, spec, text); normalised."""
    sequences_per_prompt: int = 2
    """Sequences (each one origin) planned per prompt."""
    prefix_tokens: tuple[int, int] = (8, 64)
    """Range of m, the continuation tokens before the rollout (draft, target, spec origins)."""
    text_tokens: tuple[int, int] | None = None
    """Range of m for the text origin (answers cost no generation); None: ``prefix_tokens``."""
    rollout_len: int = 40
    """L, the draft rollout length after the prefix (SVIP's maximum draft length is 40)."""
    label_prefix: bool = True
    """Also label the m continuation tokens, teacher-forced (one pass labels them at no extra generation)."""
    temperature: float = 0.0
    """0: greedy drafts and continuations; > 0: sampled at this temperature (q and p describe that distribution)."""
    top_p: float = 1.0
    """Nucleus sampling mass for sampled drafts and continuations."""
    sample_draw: bool = False
    """Greedy data only: also record a token sampled from q at every labelled position (draw ``sample``)."""
    top_k: int = 10
    """Top-k draft probabilities stored per token."""
    store_hidden: bool = True
    """Store the draft's last hidden state (float16) for SPRINTER."""
    max_records: int | None = None
    """Budget in labelled draft tokens; generation stops at exactly this count (None: all prompts)."""
    prompts_per_shard: int = 8
    """Prompts per chunk; one shard per chunk (the unit of resume)."""
    gen_batch_size: int | str = AUTO
    """Sequences decoded together in a batch, or ``auto`` (``data_gen.batch_sizing``); not part of the data config,
    since it changes rounding, not records."""
    label_batch_tokens: int = 4096
    """Padded tokens (batch x longest) per labelling pass; halved with the batch when a pass does not fit."""
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    """train / val / test shares, assigned by prompt."""
    seed: int = 0
    """Seed of the prompt order, the origin draws and sampling."""
    overwrite: bool = False
    """Delete shards in out_dir made by a different config instead of refusing."""
    measure_costs: bool = True
    """Measure the draft / target cost model on this machine and store cost_model.json beside the shards."""
    devices: int = 1
    """Processes (CPU) or devices generating shards in parallel through Lightning Fabric."""
    accelerator: str = "cpu"
    """Fabric accelerator: cpu, cuda, auto."""
    num_nodes: int = 1
    """Fabric nodes."""

    def __post_init__(self) -> None:
        bad = set(self.origins) - set(ORIGINS)
        if bad:
            raise ValueError(f"--origins has unknown origins {sorted(bad)}; use {ORIGINS}")
        if not self.origins or sum(self.origins.values()) <= 0 or min(self.origins.values()) < 0:
            raise ValueError("--origins needs non-negative shares with a positive sum")
        if not 1 <= self.rollout_len <= 256:
            raise ValueError(f"--rollout_len must be in 1..256, got {self.rollout_len}")
        lo, hi = self.prefix_tokens
        if not 0 <= lo <= hi:
            raise ValueError(f"--prefix_tokens must be (min, max) with 0 <= min <= max, got {self.prefix_tokens}")
        if self.text_tokens is not None and not 0 <= self.text_tokens[0] <= self.text_tokens[1]:
            raise ValueError(f"--text_tokens must be (min, max) with 0 <= min <= max, got {self.text_tokens}")
        if self.max_records is not None and self.max_records <= 0:
            raise ValueError(f"--max_records must be positive or null, got {self.max_records}")
        if self.sample_draw and self.temperature > 0:
            raise ValueError(f"--sample_draw true needs --temperature 0 (got {self.temperature:g}): sampled data draws "
                             "every token from q already")
        if self.gen_batch_size != AUTO and (not isinstance(self.gen_batch_size, int) or self.gen_batch_size < 1):
            raise ValueError(f"--gen_batch_size must be a positive integer or auto, got {self.gen_batch_size!r}")
        if self.label_batch_tokens < 1:
            raise ValueError(f"--label_batch_tokens must be >= 1, got {self.label_batch_tokens}")
        if abs(sum(self.split_fractions) - 1) > 1e-6:
            raise ValueError(f"--split_fractions must sum to 1, got {self.split_fractions}")

    def data_config(self) -> dict:
        """The fields that determine the records (compared on resume)."""
        d = dataclasses.asdict(self)
        for k in ("out_dir", "overwrite", "measure_costs", "devices", "accelerator", "num_nodes", "max_records",
                  "gen_batch_size", "label_batch_tokens"):
            d.pop(k)
        d["models"].pop("device")
        d["models"].pop("cache_dir")
        return d
