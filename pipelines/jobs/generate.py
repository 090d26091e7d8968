"""Data generation as the jobs run it: on one process or on Fabric ranks (:func:`generate`, what ``python -m
pipelines.generate`` runs), and the main job's data stage (:func:`ensure_data`: each folder generated or resumed when
short of its budget, left alone when complete, refused when another data config made it).

Usage::

    summary = generate(GenerateConfig(out_dir="outputs/smoke/data", max_records=2000))
    dirs = ensure_data([cfg.data, *map(generate_config, cfg.extra_data)], True, chain, stage)
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path

from data_gen.config import GenerateConfig
from data_gen.folders import check_same_config
from data_gen.generate import run_generation
from data_gen.progress import ChainProgress, Stage
from data_gen.shards import SHARD_GLOB, config_fingerprint, finished_chunks, is_complete, mark_complete
from pipelines.cli import parse_config

__all__ = ["generate", "generate_config", "ensure_data", "plural"]

log = logging.getLogger("pipelines.train")


def _fabric_worker(fabric, cfg: GenerateConfig) -> dict:
    device = str(fabric.device) if cfg.accelerator != "cpu" else "cpu"
    return run_generation(cfg, rank=fabric.global_rank, world_size=fabric.world_size, device=device)


def generate(cfg: GenerateConfig, progress: Callable[[dict], None] | None = None) -> dict:
    """Run generation on one process, or on ``cfg.devices`` x ``cfg.num_nodes`` ranks with Fabric (each rank writes
    its own shards; rank 0 summarises after all ranks finish). ``progress``: called after each shard on one process
    (``data_gen.generate.run_generation``); the Fabric ranks keep their own bars."""
    if cfg.devices * cfg.num_nodes <= 1:
        return run_generation(cfg, progress=progress)
    from lightning_fabric import Fabric  # heavy: only a multi-process run needs it

    fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, strategy="ddp_spawn")
    fabric.launch(_fabric_worker, cfg)
    # Every rank has written its shards; summarise once over all of them (resume skips every finished chunk).
    return run_generation(replace(cfg, devices=1, num_nodes=1))


def generate_config(path: str) -> GenerateConfig:
    """A generate config from its YAML file (an ``extra_data`` entry of the main job)."""
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"extra_data entry {path!r} is not a file (give generate-config YAML paths from {Path.cwd()})"
        )
    return parse_config(GenerateConfig, ["--config", path], "generate config")


def plural(n: int, word: str) -> str:
    """``1 folder``, ``2 folders``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def ensure_data(gens: Iterable[GenerateConfig], generate_if_missing: bool, chain: ChainProgress,
                st: Stage) -> list[Path]:
    """The data folders of ``gens`` (in order), each generated or resumed when short; the stage's summary says what
    was done.

    A folder is left alone, without loading any model, when a generation run of the same config and budget completed
    it (``data_gen.shards.is_complete``) or when it holds the budget already. Unreadable shards are moved aside
    (``finished_chunks``), which makes the folder short again. A folder made by another data config is refused.
    Without ``generate_if_missing``, a folder with no shards is an error."""
    dirs, todo, have_by_dir = [], [], {}
    for gen in gens:
        data_dir = Path(gen.out_dir)
        have = sum(finished_chunks(data_dir).values()) if data_dir.exists() else 0
        fp = config_fingerprint(gen.data_config())
        if generate_if_missing:
            check_same_config(data_dir, gen, fp)
        done = (have and is_complete(data_dir, fp, gen.max_records)) or (
            gen.max_records is not None and have >= gen.max_records)
        if not done and generate_if_missing:
            todo.append((gen, fp))
        elif have == 0:
            raise FileNotFoundError(
                f"no shards ({SHARD_GLOB}) in {data_dir}; run python -m pipelines.generate "
                "or pass --generate_if_missing true"
            )
        dirs.append(data_dir)
        have_by_dir[data_dir] = have
    before = sum(have_by_dir.values())
    if not todo:
        st.reused = True
        st.summary = f"{before:,} records in {plural(len(dirs), 'folder')} reused, nothing to generate"
        return dirs
    _generate_missing(todo, have_by_dir, chain)
    after = sum(sum(finished_chunks(d).values()) for d in dirs)
    st.records = after - before
    st.summary = f"{after - before:,} records" + (f" ({after:,} in {plural(len(dirs), 'folder')})" if before else "")
    return dirs


def _generate_missing(todo: list[tuple[GenerateConfig, str]], have_by_dir: dict[Path, int],
                      chain: ChainProgress) -> None:
    """Generate (or resume) each short folder under one progress meter, and mark it complete."""
    budgets = [gen.max_records for gen, _ in todo]
    if None in budgets:
        remaining = None
    else:
        remaining = sum(max(0, b - have_by_dir[Path(g.out_dir)]) for (g, _), b in zip(todo, budgets))
    meter = chain.generation(remaining)
    for gen, fp in todo:
        data_dir = Path(gen.out_dir)
        log.info("data folder %s has %d records (budget %s): generating (resumes finished shards)", data_dir,
                 have_by_dir[data_dir], "all prompts" if gen.max_records is None else f"{gen.max_records:,}")
        generate(gen, progress=meter.folder())
        mark_complete(data_dir, fp, gen.max_records)
