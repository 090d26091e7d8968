"""Generate labelled draft tokens into Parquet shards (resumable; multi-process through Lightning Fabric).

Usage:
    python -m pipelines.generate --config configs/smoke.yaml
    python -m pipelines.generate --config configs/default.yaml --max_records 50000 --devices 2
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable

from data_gen.generate import GenerateConfig, run_generation
from pipelines.cli import parse_config, setup_logging, user_errors


def _fabric_worker(fabric, cfg: GenerateConfig) -> dict:
    device = str(fabric.device) if cfg.accelerator != "cpu" else "cpu"
    return run_generation(cfg, rank=fabric.global_rank, world_size=fabric.world_size, device=device)


def generate(cfg: GenerateConfig, progress: Callable[[dict], None] | None = None) -> dict:
    """Run generation on one process, or on ``cfg.devices`` x ``cfg.num_nodes`` ranks with Fabric (each rank writes
    its own shards; rank 0 summarises after all ranks finish). ``progress``: called after each shard on one process
    (``data_gen.generate.run_generation``); the Fabric ranks keep their own bars."""
    if cfg.devices * cfg.num_nodes <= 1:
        return run_generation(cfg, progress=progress)
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, strategy="ddp_spawn")
    fabric.launch(_fabric_worker, cfg)
    # Every rank has written its shards; summarise once over all of them (resume skips every finished chunk).
    from dataclasses import replace

    return run_generation(replace(cfg, devices=1, num_nodes=1))


def main(argv: list[str] | None = None) -> dict:
    setup_logging()
    with user_errors("python -m pipelines.generate"):
        cfg = parse_config(GenerateConfig, argv, __doc__)
        summary = generate(cfg)
    print(json.dumps({k: summary[k] for k in ("overall", "by_origin") if k in summary}, indent=2))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
