"""What to set in the runtime you deploy: llama.cpp's ``--spec-draft-*`` flags, transformers' assisted-generation
arguments, vLLM's ``speculative_config``, each tuned for this data folder's model pair on a measured curve.

Each runtime's own draft-length rule is replayed exactly over the labelled draft tokens (``predictors.runtime_rules``),
its fastest setting on the validation split chosen and scored on the test split beside the runtime's defaults, the
main job's learned policies and the oracle. When no setting beats target-only the answer is not to speculate.

Usage:
    python -m pipelines.recommend --data_dir outputs/default/data                      # every runtime with a curve
    python -m pipelines.recommend --data_dir outputs/default/data --runtime llamacpp   # needs llama.cpp's curve:
    python -m pipelines.measure_costs --runtime llamacpp --data_dir outputs/default/data
"""
from __future__ import annotations

import sys

from main_job.recommend import RecommendConfig, draft_name, recommend_runtimes, write_recommendations
from pipelines.cli import parse_config, setup_logging, user_errors


def main(argv: list[str] | None = None) -> dict:
    """Parse, tune every runtime asked for, print what to paste; returns the recommendations as dicts."""
    setup_logging()
    with user_errors("python -m pipelines.recommend"):
        cfg = parse_config(RecommendConfig, argv, __doc__)
        recs = recommend_runtimes(cfg)
    for rt, rec in recs.items():
        print("\n".join(rec.lines(draft_name(cfg, rt))))
    if cfg.out:
        print(f"written to {write_recommendations(recs, cfg.out)}")
    return {rt: r.to_dict() for rt, r in recs.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
