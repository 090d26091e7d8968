"""A main job's records and its stored figures recomputed from them.

The job writes ``<out_dir>/records.parquet`` (:data:`rendering.result_store.MAIN_JOB_RECORDS`) beside its
results.json; storing its summary copies it beside the summary as ``<summary name>.records.parquet``. One Parquet
file, one ``section`` column telling its three tables apart (columns another section uses are null):

- ``test``: the test split's tokens the classification table scored, per draw: ``sample_id``, ``label:<name>`` for
  each predictor's own label and ``score:<scorer>`` for each predictor on that label and each training-free score;
- ``cv``: the cross-validation's out-of-fold scores (``evaluation.crossval.summarise``'s input: predictor, fold,
  sample_id, domain, label y, learned score, the training-free scores' columns), with its bootstrap's ``n_boot`` and
  ``seed`` in the file's metadata;
- ``replay``: per replayed figure (``row``, ``field``: a predictor's ``test_speedup``, a runtime's ``speedup``,
  ``default_speedup``, ``compare:<policy>``, ``oracle_speedup``) each sequence's emitted tokens and replayed seconds
  and the curve's target-only seconds per token.

Per-token values are float32 where that holds them exactly (the models score in float32), else float64.
:func:`verify_main_job` recomputes with the job's own routines (``label_auc``, :func:`best_free_score`, ``summarise``,
:func:`cv_figures`, ``pooled_speedup``, ``best_of``) and names the first figure that disagrees.

Usage::

    first = verify_main_job(summary.data, sidecar_path(summary.path))   # None when every figure agrees
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from evaluation.classification import FREE_SCORES, label_auc
from evaluation.crossval import summarise
from evaluation.evaluate import ScoredTokens
from evaluation.replay.rounds import ReplayResult, pooled_speedup
from predictors.labels import derive_label
from rendering.result_store import Disagreement, best_of

__all__ = ["NoRecords", "Disagreement", "best_free_score", "cv_figures", "test_records", "cv_records",
           "replay_records", "write_records", "verify_main_job"]

SCHEMA = "specstop-main-job-records/1"
META_KEY = b"specstop"
"""The Parquet metadata key of the records' schema and the cross-validation bootstrap's n_boot and seed."""
CV_FIELDS = ("auc", "best_free", "auc_best_free", "diff", "diff_lo", "diff_hi")
"""The cross-validation table's columns a predictor's row takes, as ``cv_<column>``."""
CV_COLUMNS = ("predictor", "train_fraction", "label", "draw", "fold", "sample_id", "domain", "y", "score",
              *FREE_SCORES.values())
"""What ``summarise`` reads of the out-of-fold scores."""


class NoRecords(ValueError):
    """A main-job summary without its records file: nothing to recompute its figures from."""


# ------------------------------------------------------------------------------------------- the job's own figures
def best_free_score(aucs: Mapping[str, float | None]) -> tuple[str, float] | None:
    """(name, AUC) of the training-free score a predictor is compared with: the highest of those scored (None when
    none was)."""
    scored = {k: v for k, v in aucs.items() if v is not None}
    if not scored:
        return None
    best = max(scored, key=scored.__getitem__)
    return best, scored[best]


def cv_figures(table: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """Per predictor, the ``cv_*`` fields of its row from the cross-validation table's ``all`` group."""
    return {r["predictor"]: {f"cv_{k}": r.get(k) for k in CV_FIELDS}
            for r in table[table["group"] == "all"].to_dict("records")}


# ----------------------------------------------------------------------------------------------------- the records
def _compact(values: Any) -> np.ndarray:
    """Floats as float32 where that holds every value exactly, else float64."""
    v = np.asarray(values, dtype=np.float64)
    small = v.astype(np.float32)
    return small if np.array_equal(small.astype(np.float64), v, equal_nan=True) else v


def test_records(scored: Mapping[str, ScoredTokens], labels: Mapping[str, tuple[str, tuple[str, float]]]
                 ) -> list[pd.DataFrame]:
    """The ``test`` section: per draw that holds a predictor's own label (``labels``: predictor -> (label name,
    (family, lambda))), its tokens' prompt ids, those labels (``derive_label``, as the table derives them), those
    predictors' scores and the training-free scores."""
    out = []
    for draw, tokens in scored.items():
        mine = {k: (name, spec) for k, (name, spec) in labels.items() if spec in tokens.specs}
        if not mine:
            continue
        frame: dict[str, Any] = {"section": "test", "draw": draw}
        if "sample_id" in tokens.columns:
            frame["sample_id"] = np.asarray(tokens.columns["sample_id"]).astype(str)
        for name, spec in mine.values():
            frame[f"label:{name}"] = _compact(derive_label(tokens.columns, *spec).astype(np.float64))
        for scorer in [*mine, *FREE_SCORES]:
            if scorer in tokens.scores:
                frame[f"score:{scorer}"] = _compact(tokens.scores[scorer])
        out.append(pd.DataFrame(frame))
    return out


def cv_records(oof: pd.DataFrame) -> pd.DataFrame:
    """The ``cv`` section: the out-of-fold scores ``summarise`` reads, rows in their order (its bootstrap draws
    depend on it)."""
    frame = oof[[c for c in CV_COLUMNS if c in oof]].copy()
    for c in ("y", "score", *FREE_SCORES.values()):
        if c in frame:
            frame[c] = _compact(frame[c])
    frame["fold"] = frame["fold"].astype(np.int32)
    frame.insert(0, "section", "cv")
    return frame


def replay_records(row: str, field: str, replayed: str, result: ReplayResult) -> pd.DataFrame:
    """The ``replay`` section of one figure: the replayed row ``replayed``'s tokens and seconds on each sequence."""
    n = len(result.seq_tokens)
    return pd.DataFrame({"section": "replay", "row": row, "field": field, "replayed": replayed,
                         "seq": np.arange(n, dtype=np.int32), "tokens": np.asarray(result.seq_tokens, np.float64),
                         "seconds": np.asarray(result.seq_time_s, np.float64),
                         "target_s_per_token": np.full(n, result.target_s_per_token)})


def write_records(path: str | Path, sections: list[pd.DataFrame], meta: Mapping[str, Any]) -> Path:
    """Write the sections as one Parquet file (zstd), ``meta`` in its metadata; atomically."""
    tables = [pa.Table.from_pandas(f, preserve_index=False) for f in sections]
    table = pa.concat_tables(tables, promote_options="default")
    table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                           META_KEY: json.dumps({"schema": SCHEMA, **meta}).encode()})
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(path)
    return path


def read_records(path: Path) -> tuple[dict[str, pd.DataFrame], dict[str, Any]]:
    """(section -> its rows with the columns it uses, the metadata) of a records file; NoRecords without one."""
    if not path.is_file():
        raise NoRecords(f"{path}: missing")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: not a readable records file ({e}); store the run again") from e
    meta = json.loads((table.schema.metadata or {}).get(META_KEY, b"{}"))
    if meta.get("schema") != SCHEMA:
        raise NoRecords(f"{path}: schema {meta.get('schema')!r}, expected {SCHEMA!r}")
    frame = table.to_pandas()
    sections = {str(s): g.dropna(axis=1, how="all").reset_index(drop=True)
                for s, g in frame.groupby("section", sort=False)}
    return sections, meta


# ------------------------------------------------------------------------------------------------------ verifying
def same(a: Any, b: Any) -> bool:
    """Equal figures: numbers within a relative 1e-9 (sums taken in another order), NaN equal to NaN, anything else
    exactly."""
    numbers = all(isinstance(v, float | int) and not isinstance(v, bool) for v in (a, b))
    if not numbers:
        return bool(a == b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _test_figures(test: pd.DataFrame | None, predictor: str, label: str) -> dict[str, Any]:
    """A predictor's test AUC on its own label and the best training-free score's, from the ``test`` section."""
    col = f"label:{label}"
    if test is None or col not in test:
        return {}
    rows = test[test[col].notna()]
    y = rows[col].to_numpy(np.float64)

    def auc(scorer: str) -> float | None:
        key = f"score:{scorer}"
        return label_auc(rows[key].to_numpy(np.float64), y) if key in rows else None

    out: dict[str, Any] = {"test_auc": auc(predictor)}
    best = best_free_score({name: auc(name) for name in FREE_SCORES})
    if best is not None:
        out.update(best_free=best[0], test_auc_best_free=best[1])
    return out


def _speedups(replay: pd.DataFrame | None) -> dict[tuple[str, str], float]:
    """(row, field) -> the speedup pooled over its sequences' records."""
    if replay is None:
        return {}
    return {(str(row), str(field)): pooled_speedup(g["tokens"].tolist(), g["seconds"].tolist(),
                                                   float(g["target_s_per_token"].iloc[0]))
            for (row, field), g in replay.groupby(["row", "field"], sort=False)}


def _first(row: str, stored: Mapping[str, Any], new: Mapping[str, Any], fields: tuple[str, ...]
           ) -> Disagreement | None:
    """The first of ``fields`` stored in ``stored`` that ``new`` does not give ("no records" when it has none)."""
    for key in fields:
        if stored.get(key) is None:
            continue
        got = new.get(key, "no records")
        if not same(stored[key], got):
            return Disagreement(row, key, stored[key], got)
    return None


def _predictor_figures(p: Mapping[str, Any], sections: Mapping[str, pd.DataFrame],
                       cv: Mapping[str, Mapping[str, Any]], speed: Mapping[tuple[str, str], float]) -> dict[str, Any]:
    """A predictor row's figures recomputed from the records."""
    new: dict[str, Any] = {}
    if p.get("test_auc") is not None:
        new.update(_test_figures(sections.get("test"), p["predictor"], p.get("label", "")))
    new.update(cv.get(p["predictor"], {}))
    if (p["predictor"], "test_speedup") in speed:
        new["test_speedup"] = speed[(p["predictor"], "test_speedup")]
    return new


def _recommendation_figures(r: Mapping[str, Any], speed: Mapping[tuple[str, str], float]) -> dict[str, Any]:
    """A runtime's recommendation's speedups recomputed from the records (target alone: 1.0 when it does not
    speculate), the best learned policy chosen among the compared ones as the summary chooses it."""
    rt = r["runtime"]
    new: dict[str, Any] = {}
    if (rt, "speedup") in speed:
        new["speedup"] = speed[(rt, "speedup")] if r["speculate"] else 1.0
    for key in ("default_speedup", "oracle_speedup"):
        if (rt, key) in speed:
            new[key] = speed[(rt, key)]
    best = best_of({f.removeprefix("compare:"): v for (row, f), v in speed.items()
                    if row == rt and f.startswith("compare:")})
    if best is not None:
        new["best_learned"], new["best_learned_speedup"] = best
    return new


def verify_main_job(data: Mapping[str, Any], records: Path) -> Disagreement | None:
    """The first figure of a main-job summary (each predictor's test AUCs, cross-validated difference and interval,
    replayed speedup; each runtime's recommendation's speedups) its records file does not give, None when all agree;
    NoRecords without the file."""
    sections, meta = read_records(records)
    cv: dict[str, dict[str, Any]] = {}
    if "cv" in sections:
        cv = cv_figures(summarise(sections["cv"], int(meta["cv_n_boot"]), int(meta["cv_seed"])))
    speed = _speedups(sections.get("replay"))
    for p in data["predictors"]:
        fields = ("test_auc", "best_free", "test_auc_best_free", "cv_diff", "cv_diff_lo", "cv_diff_hi", "test_speedup")
        first = _first(p["predictor"], p, _predictor_figures(p, sections, cv, speed), fields)
        if first is not None:
            return first
    for r in data.get("recommendations") or []:
        fields = ("speedup", "default_speedup", "best_learned", "best_learned_speedup", "oracle_speedup")
        first = _first(r["runtime"], r, _recommendation_figures(r, speed), fields)
        if first is not None:
            return first
    return None
