"""(Re)measure the draft / target / companion cost model of a data folder's model pair on this machine.

The replay's predicted speedups use ``<data_dir>/cost_model.json``; timings taken while other processes loaded the
machine overstate the target's verification cost, so re-measure on a quiet machine before evaluating.

Usage: python -m pipelines.measure_costs --data_dir outputs/default/data [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from data_gen.generate import ModelsConfig, _load_models, GenerateConfig
from evaluation.cost_model import measure_cost_model


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data_dir", required=True, help="folder written by pipelines.generate (holds config.json)")
    ap.add_argument("--repeats", type=int, default=5, help="timing repeats; the minimum is kept")
    args = ap.parse_args(argv)
    data_dir = Path(args.data_dir)
    cfg_file = data_dir / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} is missing: --data_dir must be a folder written by pipelines.generate")
    models_cfg = ModelsConfig(**json.loads(cfg_file.read_text())["resolved"]["models"])
    models, _ = _load_models(GenerateConfig(models=models_cfg))
    cm = measure_cost_model(models.draft, models.target, models.companion, repeats=args.repeats)
    (data_dir / "cost_model.json").write_text(cm.to_json())
    out = json.loads(cm.to_json())
    print(json.dumps({k: out[k] for k in ("draft_s_per_token", "target_s", "companion_s_per_token")}, indent=2))
    return out


if __name__ == "__main__":
    main()
