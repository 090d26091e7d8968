"""What the evaluation reads of a data folder: the record columns as numpy arrays, rows of a split or a draw, and the
data config's draft fingerprint and temperature; every scorer, replay and tuning reads records here.

Usage::

    cols = load_columns("outputs/default/data", ["val", "test"], extra_columns=("draft_hidden",))
    val = subset(cols, cols["split"].astype(str) == "val")
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from data_gen.shards import DataPath, read_columns, read_data_config
from predictors.labels import draw_mask, label_draw

__all__ = ["BASE_COLUMNS", "load_columns", "subset", "label_specs_by_draw", "draft_fingerprint", "data_temperature"]

BASE_COLUMNS = (
    "sample_id",
    "source",
    "domain",
    "split",
    "seq_id",
    "origin",
    "draw",
    "rollout",
    "prefix_len",
    "offset",
    "position",
    "draft_token",
    "q",
    "p",
    "accept_prob",
    "target_argmax",
    "greedy_match",
    "tv",
    "draft_entropy",
    "draft_max_prob",
    "draft_topk",
    "companion_prob",
    "companion_sim",
    "companion_entropy",
    "companion_accept",
    "oracle_len",
    "oracle_censored",
)
"""Columns always read when present (``draft_hidden`` only when a policy needs it)."""


def load_columns(
    data_dir: DataPath, splits: list[str] | None = None, extra_columns: tuple[str, ...] = ()
) -> dict[str, np.ndarray]:
    """Record columns of the shards in ``data_dir`` (rows of ``splits`` only) as numpy arrays: :data:`BASE_COLUMNS` and
    ``extra_columns``, those present."""
    return read_columns(data_dir, (), splits=splits, optional=(*BASE_COLUMNS, *extra_columns))


def subset(columns: Mapping[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of every column where ``mask`` holds."""
    return {k: np.asarray(v)[mask] for k, v in columns.items()}


def label_specs_by_draw(
    columns: Mapping[str, np.ndarray], label_specs: list[tuple[str, float]]
) -> dict[str, tuple[dict[str, np.ndarray], list[tuple[str, float]]]]:
    """draw -> (its rows, the label specs scored on them): greedy match on argmax draws, q/p <= lambda and min(1, p/q)
    on sampled ones; one draw per position is one group, "all"."""
    out: dict[str, tuple[dict[str, np.ndarray], list[tuple[str, float]]]] = {}
    for fam, lam in label_specs:
        draw = label_draw(fam)
        mask = draw_mask(columns, draw)
        key = draw if mask is not None else "all"
        if key not in out:
            out[key] = (subset(columns, mask) if mask is not None else dict(columns), [])
        out[key][1].append((fam, lam))
    return out


def draft_fingerprint(data_dir: str | Path) -> dict | None:
    """The draft model fingerprint stored in ``data_dir/config.json`` (None when absent)."""
    cfg = read_data_config(data_dir)
    if cfg is None:
        return None
    for getter in (
        lambda c: c["resolved"]["fingerprints"]["draft"],
        lambda c: c["fingerprints"]["draft"],
        lambda c: c["draft_fingerprint"],
    ):
        try:
            fp = getter(cfg)
        except (KeyError, TypeError):
            continue
        if isinstance(fp, dict):
            return fp
    return None


def data_temperature(data_dir: str | Path) -> float | None:
    """Sampling temperature the data was generated at (``config.json``; None when unknown)."""
    cfg = read_data_config(data_dir)
    if cfg is None:
        return None
    for sect in (cfg.get("data"), cfg.get("resolved"), cfg):
        if isinstance(sect, dict) and isinstance(sect.get("temperature"), (int, float)):
            return float(sect["temperature"])
    return None
