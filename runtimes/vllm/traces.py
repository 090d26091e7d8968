"""Serving traces: each token specstop's proposer sent to vLLM's verification, its features and vLLM's verdict.

A request's proposal is logged when it is sent (:meth:`TraceWriter.sent`) and labelled when the next step says how many
of it the target rejected (:meth:`TraceWriter.verdicts`): the accepted tokens get ``greedy_match`` 1, the first
rejected one 0, and the tokens after it (never judged) are not written. Rows carry the drafted position, the request,
the batch size and a split by a hash of the request id (``train`` for three requests in five, ``val`` and ``test`` one
each), so that ``pipelines.train`` (``trace_data``) can learn from some requests, ``pipelines.calibrate`` fit on
others and both report on the rest. They go to Parquet shards in ``data_gen``'s
file layout (``shard-NNNNN.parquet`` written whole through a temporary name, and ``config.json`` with the pair's
fingerprints, runtime and precision), so a killed server loses at most the rows not yet written and the folder reads as
a data folder: ``python -m pipelines.calibrate --data_dir TRACES --predictor EXPORT`` refits a predictor's
calibration on what vLLM accepts.

Usage: ``SPECSTOP_VLLM_TRACES=outputs/traces SPECSTOP_VLLM_POLICY=... vllm serve ...`` or
``PolicySettings(..., traces_dir="outputs/traces")``; traces come from validation prompts, never test prompts.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from evaluation.calibration import fit_maps
from evaluation.data import draft_fingerprint, load_columns, subset
from predictors.export import load_predictor, read_metadata, update_metadata

log = logging.getLogger(__name__)

__all__ = ["TraceWriter", "TRACE_TAGS", "trace_split", "refit_calibration", "first_acceptance", "FIRST_ACCEPTANCE",
           "first_acceptance_field", "trace_folder", "is_trace_folder", "fit_splits"]

CONFIG_FILE = "config.json"
FIRST_ACCEPTANCE = "vllm_first_acceptance"
"""The field of a refitted export's ``predictor.json``: :func:`first_acceptance` of the traces it was fitted on."""
TRACE_TAGS = ("runtime", "precision", "fingerprints")
"""The fields of ``config.json`` a folder's traces must share: appending traces of another pair or precision to it is
refused."""


def trace_split(request_id: str) -> str:
    """A request's split by a stable hash of its id: ``test`` and ``val`` one request in five each, else ``train``."""
    return {0: "test", 1: "val"}.get(zlib.crc32(request_id.encode()) % 5, "train")


PAIR_KEYS = ("name", "vocab_size", "vocab_sha")
"""What a trace folder's draft must share with a data folder's to be read with it (the precision may differ: that is
what traces add)."""


def trace_folder(path: str | Path, data_draft: dict[str, Any] | None) -> Path:
    """``path`` checked as a folder of serving traces of ``data_draft``'s model (a data folder's draft fingerprint):
    one-line errors for a folder that holds no traces or traces of another draft."""
    folder = Path(path)
    if not is_trace_folder(folder) or not list(folder.glob("shard-*.parquet")):
        raise ValueError(f"trace_data {folder}: no serving traces here (a config.json of kind vllm_traces and "
                         "shard-*.parquet files): serve with SPECSTOP_VLLM_TRACES=DIR first")
    theirs = (draft_fingerprint(folder) or {})
    if data_draft is not None and any(theirs.get(k) != data_draft.get(k) for k in PAIR_KEYS):
        raise ValueError(f"trace_data {folder}: traces of draft {theirs.get('name')} (vocab {theirs.get('vocab_sha')}),"
                         f" the data's draft is {data_draft.get('name')} (vocab {data_draft.get('vocab_sha')}): give "
                         "traces of the same pair")
    return folder


class TraceWriter:
    """Buffers labelled rows and writes them as whole shards of ``shard_rows`` (and the rest at exit)."""

    def __init__(self, folder: str | Path, tags: dict[str, Any], shard_rows: int = 512) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.tags = {k: tags.get(k) for k in TRACE_TAGS}
        self._check_config()
        self.shard_rows = max(1, int(shard_rows))
        self._pending: dict[str, tuple[list[dict[str, Any]], int]] = {}
        self._rows: list[dict[str, Any]] = []
        self._next = len(list(self.folder.glob("shard-*.parquet")))
        self.written = 0
        atexit.register(self.close)

    def _check_config(self) -> None:
        path = self.folder / CONFIG_FILE
        if path.is_file():
            old = {k: json.loads(path.read_text()).get(k) for k in TRACE_TAGS}
            if old != self.tags:
                diff = [k for k in TRACE_TAGS if old.get(k) != self.tags.get(k)]
                raise ValueError(f"{self.folder}: holds traces of another {', '.join(diff)} ({old} here, this run "
                                 f"{self.tags}): give another traces folder")
        else:
            path.write_text(json.dumps({**self.tags, "kind": "vllm_traces"}, indent=1))

    def sent(self, request_id: str, features: list[dict[str, Any]], batch: int) -> None:
        """A proposal of ``request_id`` went to verification: the features of each sent token, in draft order."""
        self._pending[request_id] = (features, batch)

    def verdicts(self, request_id: str, accepted: int, batch: int) -> None:
        """vLLM accepted the first ``accepted`` tokens of the request's last proposal: label and buffer them."""
        sent = self._pending.pop(request_id, None)
        if sent is None:
            return
        split = trace_split(request_id)
        for j, f in enumerate(sent[0][: accepted + 1]):
            self._rows.append({**f, "position": j, "greedy_match": float(j < accepted), "sample_id": request_id,
                               "batch": sent[1], "split": split, "draw": "greedy"})
        if len(self._rows) >= self.shard_rows:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows as one shard (through a temporary name: a shard is whole or absent)."""
        if not self._rows:
            return
        path = self.folder / f"shard-{self._next:05d}.parquet"
        tmp = path.with_suffix(".parquet.tmp")
        pq.write_table(pa.Table.from_pylist(self._rows), tmp)
        os.replace(tmp, path)
        self.written += len(self._rows)
        self._next += 1
        self._rows = []

    def close(self) -> None:
        """Write what is buffered (tokens still waiting for a verdict are not written)."""
        self.flush()


def is_trace_folder(path: str | Path) -> bool:
    """``path`` holds serving traces (its ``config.json`` is of kind ``vllm_traces``)."""
    config = Path(path) / CONFIG_FILE
    return config.is_file() and json.loads(config.read_text()).get("kind") == "vllm_traces"


def fit_splits(export: str | Path | None, traces: str | Path) -> list[str]:
    """The splits of a trace folder a calibration map is fitted on: ``train`` and ``val``, or only ``val`` where the
    predictor learned from this folder's ``train`` requests (its export's ``data_dir`` names it)."""
    seen = read_metadata(export).get("data_dir", []) if export is not None else []
    return ["val"] if any(Path(d).resolve() == Path(traces).resolve() for d in seen) else ["train", "val"]


def first_acceptance(cols: dict[str, Any]) -> dict[str, float] | None:
    """The share of traced first drafted tokens vLLM accepted, and how many (None: no first token traced): where a
    request's forecast of its acceptance starts when vLLM's curve file holds no acceptance run."""
    first = np.asarray(cols["position"]) == 0
    if not first.any():
        return None
    return {"share": float(np.mean(np.asarray(cols["greedy_match"])[first] > 0.5)), "tokens": int(first.sum())}


def first_acceptance_field(folder: str | Path, fitted: dict[str, Any] | None) -> dict[str, Any]:
    """The :data:`FIRST_ACCEPTANCE` entry for the export in ``folder`` whose greedy map was just fitted on ``fitted``
    (a trace folder's fit rows; None: other data): the traces' share, else None over a share an earlier refit left
    (it no longer describes the map), else nothing."""
    traced = first_acceptance(fitted) if fitted is not None else None
    return {FIRST_ACCEPTANCE: traced} if traced or FIRST_ACCEPTANCE in read_metadata(folder) else {}


def refit_calibration(traces_dir: str | Path, export: str | Path, dest: str | Path, method: str = "auto") -> Path:
    """Copy ``export`` to ``dest`` with its greedy calibration map refitted on traced requests it did not learn from
    (vLLM's verdicts on its own drafts; the ``test`` requests are left out): what a goodput policy serving in vLLM
    prices with. One-line errors for a folder without traced tokens or traces of another draft."""
    traces, dest = Path(traces_dir), Path(dest)
    if not list(traces.glob("shard-*.parquet")):
        raise ValueError(f"{traces}: no traced tokens (no shard-*.parquet): serve with SPECSTOP_VLLM_TRACES set first")
    policy = load_predictor(export, draft_fingerprint=draft_fingerprint(traces))
    splits = fit_splits(export, traces)
    cols = load_columns(traces, [*splits, "test"])
    fit = np.isin(np.asarray(cols["split"]).astype(str), splits)
    maps = fit_maps(policy, subset(cols, fit), ("greedy",), method)
    if "greedy" not in maps:
        raise ValueError(f"{traces}: too few traced tokens of {' and '.join(splits)} requests to fit a map")
    shutil.copytree(export, dest, dirs_exist_ok=True)
    update_metadata(dest, calibration={"greedy": maps["greedy"].to_dict()},
                    **first_acceptance_field(dest, subset(cols, fit)))
    log.info("calibration of %s refitted on %d traced tokens of vLLM: %s", export, int(fit.sum()), dest)
    return dest
