"""Generate labelled draft tokens into Parquet shards (resumable; multi-process through Lightning Fabric).

The work is ``data_gen.generate.generate`` (the main job runs it too).

Usage:
    python -m pipelines.generate --config configs/smoke.yaml
    python -m pipelines.generate --config configs/default.yaml --max_records 50000 --devices 2
"""
from __future__ import annotations

import json
import sys

from data_gen.config import GenerateConfig
from data_gen.generate import generate
from pipelines.cli import parse_config, setup_logging, user_errors


def main(argv: list[str] | None = None) -> dict:
    setup_logging()
    with user_errors("python -m pipelines.generate"):
        cfg = parse_config(GenerateConfig, argv, __doc__)
        summary = generate(cfg)
    print(json.dumps({k: summary[k] for k in ("overall", "by_origin") if k in summary}, indent=2))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
