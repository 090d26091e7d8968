"""Measure the verification curve of a model pair on this machine: draft step, companion step, target forward of
L = 1..17 new tokens over a cached prefix, with the CPU model and flags, torch version, threads and compute path in the
JSON, and on the CPU the memory floor printed beside each figure (the bytes a one-token forward reads over the read
bandwidth measured in the same run). With ``--runtime llamacpp`` it times llama.cpp's own forwards instead (through
llama-cpp-python, on the pair's GGUF files: ``runtimes.llamacpp.llama.measure_llamacpp_curve``), written as
``cost_model.llamacpp.json`` with ``runtime: llamacpp``; with ``--runtime transformers`` it also times transformers'
assisted generation (its forwards as ``generate`` runs them and the work around them:
``runtimes.transformers.costs``), written as ``cost_model.transformers.json``.

The one timing model (``compute.timing.CostModel``) that the replay, Speculative Verification and the benchmark read.
Timings taken while other processes load the machine overstate costs: measure on a quiet machine (the minimum over
repeats is kept and the curve made non-decreasing in L).

Usage:
    python -m pipelines.measure_costs --data_dir outputs/default/data  # that folder's pair -> its cost_model.json
    python -m pipelines.measure_costs --models.draft packaged:qwen2.5-coder-0.5b-instruct \\
        --models.target packaged:qwen2.5-coder-1.5b-instruct --out outputs/costs.json [--models.compute eager]
    .venv-vllm/bin/python -m pipelines.measure_costs --runtime vllm --data_dir outputs/default/data  # per batch size
    python -m pipelines.measure_costs --runtime llamacpp --models.draft packaged:qwen2.5-coder-0.5b-instruct \\
        --models.target packaged:qwen2.5-coder-1.5b-instruct [--threads 2]  # or .gguf paths; or --data_dir
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from compute.gguf_files import ensure_gguf
from compute.timing import CostModel, measure_cost_model
from data_gen.config import GenerateConfig, ModelsConfig
from data_gen.generate import load_models
from data_gen.prompts import PromptSourceConfig
from data_gen.shards import read_data_config
from pipelines.cli import parse_config, setup_logging, user_errors
from runtimes.llamacpp.llama import load_pair, measure_llamacpp_curve
from runtimes.transformers.costs import measure_transformers_costs
from runtimes.vllm.curve import VllmCurveSettings, measure_vllm_acceptance, measure_vllm_curve
from runtimes.vllm.engine import check_dtype, hf_folder, prepare_env, reexec_with_iomp
from runtimes.vllm.proposer import check_vllm
from runtimes.vllm.run import prompt_ids
from runtimes.vllm.settings import ACCEPTANCE

log = logging.getLogger(__name__)

RUNTIMES = ("specstop", "llamacpp", "transformers", "vllm")
"""Runtimes whose forwards can be timed: specstop's loaded models, llama.cpp on the pair's GGUF files,
transformers' assisted generation over specstop's loaded models (``runtimes.transformers.costs``), or vLLM's own
engine steps per batch size (``runtimes.vllm.curve``, in ``.venv-vllm``)."""


@dataclass
class MeasureCostsConfig:
    """What ``python -m pipelines.measure_costs`` measures and where it writes it."""

    data_dir: str | None = None
    """A folder written by pipelines.generate: its models are measured (on this run's compute path, see models.compute)
    and its cost_model.json rewritten. Without it, ``models`` names the pair."""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    """Draft / target / companion, dtype, device and compute path (used as given when data_dir is not set)."""
    out: str | None = None
    """JSON file to write (default: <data_dir>/cost_model.json, else outputs/cost_model.json; with runtime llamacpp
    cost_model.llamacpp.json in either folder, and likewise cost_model.vllm.json)."""
    max_length: int | None = None
    """Verification lengths L = 1 .. max_length are all timed; longer ones are extrapolated. Default 17 (a round of 16
    drafts, the usual cap, verifies 17 tokens); 9 for vLLM, whose every length is timed at every batch size."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """runtime vllm: the batch sizes (concurrent requests) whose curve is timed."""
    repeats: int = 5
    """Timing repeats per length; the minimum is kept (runtime vllm: max(repeats, 8) + 4 cycles of every drafting
    length, the median of each figure)."""
    prompt_len: int = 128
    """Cached prefix length (random tokens)."""
    runtime: str = "specstop"
    """specstop (the models as specstop loads them, on models.compute), transformers (the same models inside
    transformers' assisted generation) or llamacpp (llama.cpp through llama-cpp-python, on the GGUF files of
    models.draft / models.target: packaged:<name> or .gguf paths; the companion is not timed) or vllm (vLLM's own
    engine steps at each of batch_sizes, on the pair's Hugging Face folders; run it with .venv-vllm/bin/python,
    installed by bash scripts/setup.sh --vllm)."""
    vllm_dtype: str = "bfloat16"
    """runtime vllm: vLLM's dtype for both models, bfloat16 or float32 (docs/vllm.md, "Precision")."""
    threads: int | None = None
    """runtime llamacpp: llama.cpp's threads (default: torch's thread count)."""
    acceptance_prompts: int = 8
    """runtime vllm with data_dir: validation prompts of the data's prompt sources that vLLM's own speculation (K =
    max_length - 1) runs on; its acceptance per draft position, kept in the curve file, is what ``pipelines.recommend
    --runtime vllm`` prices each K with (0: not measured; the recommendation then replays the labelled data)."""

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime={self.runtime!r}: use one of {', '.join(RUNTIMES)}")
        check_dtype(self.vllm_dtype)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads}: must be >= 1")
        if self.max_length is None:
            self.max_length = 9 if self.runtime == "vllm" else 17
        if self.max_length < 2:
            raise ValueError(f"max_length={self.max_length}: the curve needs at least L = 1 and 2")
        if self.acceptance_prompts < 0:
            raise ValueError(f"acceptance_prompts={self.acceptance_prompts}: give 0 (not measured) or more")
        if self.repeats < 1 or self.prompt_len < 1:
            raise ValueError(f"repeats={self.repeats} and prompt_len={self.prompt_len} must be >= 1")
        if self.data_dir is not None and read_data_config(self.data_dir) is None:
            raise ValueError(f"--data_dir {self.data_dir}: no config.json there; give a folder written by "
                             "pipelines.generate, or leave data_dir unset and name the pair with "
                             "--models.draft/target")


def models_of(cfg: MeasureCostsConfig) -> ModelsConfig:
    """The models to time: the data folder's pair on this run's device and compute path, or ``cfg.models``."""
    if cfg.data_dir is None:
        return cfg.models
    resolved = read_data_config(cfg.data_dir)["resolved"]["models"]
    resolved.update(device=cfg.models.device, compute=cfg.models.compute)
    return ModelsConfig(**{k: v for k, v in resolved.items() if k in ModelsConfig.__dataclass_fields__})


def measure(cfg: MeasureCostsConfig) -> CostModel:
    """Load the models and time them; returns the cost model (not yet written)."""
    if cfg.runtime == "llamacpp":
        return measure_llamacpp(cfg)
    if cfg.runtime == "vllm":
        return measure_vllm(cfg)
    models, _ = load_models(GenerateConfig(models=models_of(cfg)))
    lengths = tuple(range(1, cfg.max_length + 1))
    base = measure_cost_model(models.draft, models.target, models.companion, lengths=lengths,
                              prompt_len=cfg.prompt_len, repeats=cfg.repeats)
    if cfg.runtime == "transformers":  # generate's own forwards and overheads, names and machine from the base
        return measure_transformers_costs(models.draft, models.target, prompt_len=cfg.prompt_len,
                                          repeats=max(2, cfg.repeats // 2), base=base)
    return base


def measure_llamacpp(cfg: MeasureCostsConfig) -> CostModel:
    """llama.cpp's curve of the pair's GGUF files (joined once from the packaged parts, or the user's own)."""
    m = models_of(cfg)
    draft, target = ensure_gguf(m.draft, m.cache_dir), ensure_gguf(m.target, m.cache_dir)
    threads = cfg.threads or torch.get_num_threads()
    d, t = load_pair(draft, target, threads, n_ctx=max(512, cfg.prompt_len + cfg.max_length + 32))
    return measure_llamacpp_curve(d, t, tuple(range(1, cfg.max_length + 1)), prompt_len=cfg.prompt_len,
                                  repeats=cfg.repeats, n_threads=threads, draft_name=m.draft, target_name=m.target)


def measure_vllm(cfg: MeasureCostsConfig) -> CostModel:
    """vLLM's curve per batch size on the pair's Hugging Face folders (``runtimes.vllm.curve``)."""
    check_vllm()
    m = models_of(cfg)
    prepare_env(2, cfg.threads, m.device)
    target, draft = hf_folder(m.target, m.cache_dir), hf_folder(m.draft, m.cache_dir)
    cm = measure_vllm_curve(VllmCurveSettings(
        target=target, draft=draft, batches=tuple(cfg.batch_sizes), max_length=cfg.max_length,
        cycles=max(cfg.repeats, 8) + 4, prompt_len=cfg.prompt_len, device=m.device, dtype=cfg.vllm_dtype,
        target_name=m.target, draft_name=m.draft))
    if cfg.data_dir and cfg.acceptance_prompts:
        data = read_data_config(cfg.data_dir)["data"]
        sources = [PromptSourceConfig(**src) for src in data["prompts"]]
        prompts, _ = prompt_ids(sources, target, "val", cfg.acceptance_prompts,
                                use_chat_template=data.get("use_chat_template", True))
        cm.extra[ACCEPTANCE] = {**measure_vllm_acceptance(target, draft, prompts, cfg.max_length - 1,
                                                          device=m.device, dtype=cfg.vllm_dtype), "split": "val"}
    return cm


def default_out(cfg: MeasureCostsConfig) -> Path:
    """Where the cost file goes without ``--out``: beside the data folder's shards, else in outputs/."""
    name = "cost_model.json" if cfg.runtime == "specstop" else f"cost_model.{cfg.runtime}.json"
    return Path(cfg.data_dir) / name if cfg.data_dir else Path("outputs") / name


def main(argv: list[str] | None = None) -> dict:
    """Parse, measure, write the JSON and print the curve; returns the cost model as a dict."""
    setup_logging()
    with user_errors("python -m pipelines.measure_costs"):
        cfg = parse_config(MeasureCostsConfig, argv, __doc__)
        if cfg.runtime == "vllm":
            reexec_with_iomp(["-m", "pipelines.measure_costs", *(sys.argv[1:] if argv is None else argv)])
        out = Path(cfg.out) if cfg.out else default_out(cfg)
        cm = measure(cfg)
    cm.to_json(out)
    print(cm.curve_table(floor=True))
    print(f"written to {out}")
    return cm.to_dict()


if __name__ == "__main__":
    main(sys.argv[1:])
