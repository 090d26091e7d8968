"""What a job checks of its data folders before reading them: the data config that made them, their identity (data and
model fingerprints), and whether they hold given columns.

Usage: ``ident = data_identity([Path("outputs/default/data")])   # {"data_fingerprint", "records", "draft", ...}``
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from data_gen.config import GenerateConfig
from data_gen.shards import CONFIG_FILE, SHARD_GLOB, SUMMARY_FILE, finished_chunks, folder_columns

__all__ = ["check_same_config", "data_identity", "has_columns"]


def check_same_config(data_dir: Path, gen: GenerateConfig, fp: str) -> None:
    """Refuse a data folder another data config made (unless ``--data.overwrite true``), before any model loads; ``fp``
    is ``gen``'s fingerprint."""
    f = data_dir / CONFIG_FILE
    if gen.overwrite or not f.is_file() or not any(data_dir.glob(SHARD_GLOB)):
        return
    old = json.loads(f.read_text())
    if old.get("fingerprint") == fp:
        return
    new = json.loads(json.dumps(gen.data_config(), default=str))
    changed = sorted(k for k in set(old.get("data", {})) | set(new) if old.get("data", {}).get(k) != new.get(k))
    raise FileExistsError(f"{data_dir} holds shards of a different data config (changed: {changed}). Use another "
                          f"out_dir for that data, or pass --data.overwrite true to delete them.")


def data_identity(data_dirs: list[Path]) -> dict[str, Any]:
    """Fingerprints of the data and of the models that made it; several folders must share the models."""

    def read(d: Path, name: str) -> dict:
        return json.loads((d / name).read_text()) if (d / name).exists() else {}

    cfgs = [read(d, CONFIG_FILE) for d in data_dirs]
    fps = cfgs[0].get("resolved", {}).get("fingerprints", {})
    for d, c in zip(data_dirs[1:], cfgs[1:]):
        other = c.get("resolved", {}).get("fingerprints", {})
        if other and fps and other != fps:
            raise ValueError(f"data folders {data_dirs[0]} and {d} were made by different models ({fps} vs {other}); "
                             f"a predictor trains on one model pair")
    summary = read(data_dirs[0], SUMMARY_FILE)
    prints = [c.get("fingerprint") for c in cfgs]
    return {
        "data_fingerprint": prints[0] if len(prints) == 1 else "+".join(str(p) for p in prints),
        "records": sum(sum(finished_chunks(d).values()) for d in data_dirs),
        "draft": fps.get("draft"),
        "target": fps.get("target"),
        "companion": fps.get("companion"),
        "acceptance_rate": summary.get("overall", {}).get("acceptance_rate"),
        "greedy_match_rate": summary.get("overall", {}).get("greedy_match_rate"),
    }


def has_columns(data_dirs: list[Path], columns: tuple[str, ...]) -> bool:
    """Every folder's shards hold every one of ``columns``."""
    return all(set(columns) <= names for names in folder_columns(data_dirs).values())
