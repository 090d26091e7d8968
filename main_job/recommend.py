"""The recommendation job as a library: each runtime's speculative settings tuned on a data folder's validation split
under a measured curve (``evaluation.recommend``), beside the learned policies of a training folder.

``python -m pipelines.recommend`` runs it from the command line; the main job (``pipelines.train``) calls
:func:`recommend_runtimes` for the runtimes whose curve its data folder holds.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compute.gguf_files import GGUF_SUBDIR, PACKAGED_PREFIX
from compute.packaged import get_packaged
from compute.timing import CostModel
from data_gen.progress import Heartbeat
from data_gen.shards import read_data_config
from decoding.policies import GOODPUT_PREFIX, build_policy
from evaluation.data import load_columns
from evaluation.recommend import Recommendation, recommend
from predictors.base import StopPolicy
from predictors.runtime_rules import RUNTIMES

log = logging.getLogger("pipelines.recommend")

RUNTIME_COST_FILES = {"llamacpp": ("cost_model.llamacpp.json",),
                      "transformers": ("cost_model.transformers.json", "cost_model.json")}
"""The curves beside a data folder a runtime's recommendation is priced with, first found first: its own
(``pipelines.measure_costs --runtime R --data_dir D`` writes ``cost_model.R.json``), else the data's own specstop
curve (transformers' forward passes without its overheads; any other runtime: with a warning)."""


@dataclass
class RecommendConfig:
    """Arguments of ``python -m pipelines.recommend``."""

    data_dir: str
    """A folder written by pipelines.generate: its val split tunes, its test split scores."""
    runtime: str = "all"
    """llamacpp, transformers, vllm, or all (each runtime whose curve is found)."""
    cost_file: str | None = None
    """The curve to price rounds with (default: <data_dir>/cost_model.llamacpp.json for llama.cpp, else
    <data_dir>/cost_model.json); a curve of another runtime is used with a warning naming both."""
    train_dir: str | None = None
    """A main job's output folder whose DISCO export (and its cost-aware form) the settings are compared with
    (default: the ``train`` folder beside data_dir, when it exists)."""
    compare: list[str] = field(default_factory=list)
    """More policy specs to compare with (decoding.policies.build_policy)."""
    mode: str = "greedy"
    """greedy (exact token matches) or sampling (expected acceptance)."""
    draft: str | None = None
    """The draft model's path or name in the printed settings (default: the data folder's draft)."""
    out: str | None = None
    """JSON file for the recommendations (default: none)."""

    def __post_init__(self) -> None:
        if self.runtime != "all" and self.runtime not in RUNTIMES:
            raise ValueError(f"--runtime {self.runtime!r}: use one of {', '.join(RUNTIMES)} or all")
        if read_data_config(self.data_dir) is None:
            raise ValueError(f"--data_dir {self.data_dir}: no config.json there; give a folder written by "
                             f"pipelines.generate")
        if self.cost_file is not None and not Path(self.cost_file).is_file():
            raise ValueError(f"--cost_file {self.cost_file}: no such file (python -m pipelines.measure_costs writes "
                             f"one)")


def cost_file_for(cfg: RecommendConfig, runtime: str) -> Path | None:
    """The curve a runtime's recommendation is priced with: the one given, else the first of
    :data:`RUNTIME_COST_FILES` beside the data (a llama.cpp recommendation needs llama.cpp's own)."""
    if cfg.cost_file is not None:
        return Path(cfg.cost_file)
    data = Path(cfg.data_dir)
    for name in RUNTIME_COST_FILES.get(runtime, ("cost_model.json",)):
        if (data / name).is_file():
            return data / name
    return None


def compare_policies(cfg: RecommendConfig) -> dict[str, StopPolicy]:
    """The learned policies the settings are compared with: the training folder's DISCO export at its tuned
    threshold and its cost-aware form (when the export holds calibration maps), and ``cfg.compare``."""
    train = Path(cfg.train_dir) if cfg.train_dir else Path(cfg.data_dir).parent / "train"
    specs: dict[str, str] = {}
    export = train / "disco" / "export"
    if export.is_dir():
        specs = {"DISCO": str(export), "goodput DISCO": GOODPUT_PREFIX + str(export)}
    elif cfg.train_dir:
        raise ValueError(f"--train_dir {cfg.train_dir}: no disco/export there; give a main job's out_dir")
    specs.update({s: s for s in cfg.compare})
    out: dict[str, StopPolicy] = {}
    for name, spec in specs.items():
        try:
            out[name] = build_policy(spec, max_draft_len=40)
        except ValueError as e:  # an export without calibration maps has no cost-aware form
            if spec in cfg.compare:
                raise
            log.warning("not compared with %s: %s", name, e)
    return out


def recommend_runtimes(cfg: RecommendConfig, runtimes: Iterable[str] | None = None) -> dict[str, Recommendation]:
    """Tune and score each runtime (``cfg.runtime``, or ``runtimes``) whose curve is found; a runtime without one is
    logged with the command that measures it."""
    wanted = list(runtimes) if runtimes is not None else (list(RUNTIMES) if cfg.runtime == "all" else [cfg.runtime])
    files = {rt: cost_file_for(cfg, rt) for rt in wanted}
    for rt in [rt for rt, f in files.items() if f is None]:
        message = (f"no curve for {rt}: measure it with python -m pipelines.measure_costs --runtime {rt} "
                   f"--data_dir {cfg.data_dir}")
        if cfg.runtime == rt:
            raise ValueError(message)
        log.info(message)
    cols = load_columns(cfg.data_dir, ["val", "test"])
    compare = compare_policies(cfg)
    out: dict[str, Recommendation] = {}
    for rt, f in files.items():
        if f is None:
            continue
        cm = CostModel.from_json(f)
        with Heartbeat(log, f"recommend {rt}", unit="settings") as hb:
            out[rt] = recommend(rt, cols, cm, compare=compare, mode=cfg.mode,
                                progress=lambda done, total, h=hb: h.update(done, total))
        for w in out[rt].warnings:
            log.warning(w)
    return out


def draft_name(cfg: RecommendConfig, runtime: str = "transformers") -> str:
    """The draft as the printed settings name it: ``cfg.draft``, else the data folder's draft model (for llama.cpp a
    packaged draft's joined GGUF file, ``compute.gguf_files``)."""
    if cfg.draft:
        return cfg.draft
    models = (read_data_config(cfg.data_dir) or {}).get("resolved", {}).get("models", {})
    draft = str(models.get("draft") or "DRAFT")
    if not draft.startswith(PACKAGED_PREFIX):
        return draft
    name = draft.removeprefix(PACKAGED_PREFIX)
    if runtime == "llamacpp":
        cache = Path(str(models.get("cache_dir") or "~/.cache/specstop"))
        return str(cache / GGUF_SUBDIR / f"{name}.gguf")
    return get_packaged(name).upstream if runtime == "vllm" else draft  # vLLM loads the hub's model


def write_recommendations(recs: dict[str, Recommendation], path: str | Path) -> Path:
    """The recommendations as JSON (settings, replayed speedups, every setting tried)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body: dict[str, Any] = {rt: r.to_dict() for rt, r in recs.items()}
    path.write_text(json.dumps(body, indent=2))
    return path
