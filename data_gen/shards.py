"""Parquet shards of labelled draft tokens: atomic writes, resume, config guard and summary statistics.

A shard holds one chunk of prompts (``shard-00042.parquet``), so any number of ranks write into one folder and a
restarted run skips the chunks it has. A partial or unreadable shard is redone; ``complete.json`` lets the main job skip
a finished folder without loading a model.

Usage: ``writer = ShardWriter(out_dir, features); writer.write(chunk_index, records)``
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
SHARD_GLOB = "shard-*.parquet"


COST_SUFFIX = ".cost.json"


def shard_path(out_dir: Path, chunk: int) -> Path:
    return out_dir / f"shard-{chunk:05d}.parquet"


def cost_path(shard: Path) -> Path:
    """The cost accounting written beside a shard (``shard-00042.cost.json``)."""
    return shard.with_name(shard.stem + COST_SUFFIX)


def config_fingerprint(data_config: dict) -> str:
    """Hash of the fields that change what the records are (not out_dir, not progress options)."""
    return hashlib.sha256(json.dumps(data_config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_data_config(data_dir: str | Path) -> dict | None:
    """The ``config.json`` a generator wrote into ``data_dir`` (None when there is none)."""
    path = Path(data_dir) / CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def prepare_out_dir(out_dir: Path, data_config: dict, resolved: dict, overwrite: bool) -> None:
    """Create ``out_dir`` or check its shards were made by the same data config (FileExistsError unless ``overwrite``).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    fp = config_fingerprint(data_config)
    cfg_file = out_dir / CONFIG_FILE
    shards = list(out_dir.glob(SHARD_GLOB))
    if cfg_file.exists():
        old = json.loads(cfg_file.read_text())
        if old.get("fingerprint") != fp and shards:
            if not overwrite:
                changed = sorted(
                    k for k in set(old.get("data", {})) | set(data_config)
                    if old.get("data", {}).get(k) != data_config.get(k)
                )
                raise FileExistsError(
                    f"{out_dir} holds {len(shards)} shards of a different data config (changed: {changed}). "
                    "Use another out_dir, or pass --overwrite true (in the main job: --data.overwrite true) to delete "
                    "them."
                )
            log.warning("overwrite: deleting %d shards of a different config in %s", len(shards), out_dir)
            for p in shards:
                p.unlink()
                cost_path(p).unlink(missing_ok=True)
            (out_dir / SUMMARY_FILE).unlink(missing_ok=True)
    elif shards and not overwrite:
        raise FileExistsError(
            f"{out_dir} holds shards but no {CONFIG_FILE}; pass --overwrite true (in the main job: "
            "--data.overwrite true) or use another out_dir"
        )
    tmp = cfg_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({"fingerprint": fp, "data": data_config, "resolved": resolved}, indent=2, default=str))
    os.replace(tmp, cfg_file)


def wait_for_out_dir(out_dir: Path, data_config: dict, timeout_s: float = 600.0, poll_s: float = 0.2) -> None:
    """A rank other than 0: wait until rank 0 has prepared ``out_dir`` for this config (TimeoutError naming the folder
    after ``timeout_s``)."""
    fp, cfg_file = config_fingerprint(data_config), out_dir / CONFIG_FILE
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if json.loads(cfg_file.read_text()).get("fingerprint") == fp:
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not prepare {out_dir} for this data config within {timeout_s:.0f} s "
                               f"(see its log: it may have refused the folder)")
        time.sleep(poll_s)


def finished_chunks(out_dir: Path, owns: Callable[[int], bool] | None = None) -> dict[int, int]:
    """Chunk index -> row count of every complete shard; this rank's partial shards are deleted and an unreadable shard
    is moved aside, so its chunk is generated again."""
    for partial in out_dir.glob("*.parquet.tmp"):
        if owns is not None and not owns(int(partial.name.split(".")[0].split("-")[1])):
            continue
        log.warning("removing partial shard %s (a run was interrupted while writing it)", partial.name)
        partial.unlink(missing_ok=True)
    done = {}
    for p in sorted(out_dir.glob(SHARD_GLOB)):
        try:
            done[int(p.stem.split("-")[1])] = pq.ParquetFile(p).metadata.num_rows
        except (pa.ArrowException, OSError) as e:  # ArrowInvalid: no footer; OSError: unreadable
            set_aside(p, e)
    return done


CORRUPT_SUFFIX = ".corrupt"


def set_aside(shard: Path, error: BaseException | str) -> Path | None:
    """Rename an unreadable shard (and its accounting) to ``<name>.corrupt``, logging why; None when another process
    moved it first."""
    bad = shard.with_name(shard.name + CORRUPT_SUFFIX)
    try:
        os.replace(shard, bad)
    except FileNotFoundError:
        return None
    cost = cost_path(shard)
    if cost.exists():
        os.replace(cost, cost.with_name(cost.name + CORRUPT_SUFFIX))
    reason = " ".join(str(error).split())[:200]
    log.warning("shard %s does not read (%s): moved aside to %s; its chunk is generated again", shard, reason, bad.name)
    return bad


class ShardWriter:
    """Writes one chunk's records as a Parquet shard through ``datasets`` (atomic rename)."""

    def __init__(self, out_dir: Path, features: datasets.Features) -> None:
        self.out_dir = out_dir
        self.features = features

    def write(self, chunk: int, records: dict[str, list], cost: dict | None = None) -> int:
        """Write the chunk's shard, its ``cost`` accounting first, so every complete shard has its accounting."""
        cols = {k: records[k] for k in self.features}  # schema order; extra keys are not stored
        ds = datasets.Dataset.from_dict(cols, features=self.features)
        final = shard_path(self.out_dir, chunk)
        if cost is not None:
            tmp_cost = final.with_name(final.name + ".cost.tmp")
            tmp_cost.write_text(json.dumps(cost, indent=1))
            os.replace(tmp_cost, cost_path(final))
        tmp = final.with_name(final.name + ".tmp")
        ds.to_parquet(str(tmp))
        os.replace(tmp, final)
        return len(ds)


COMPLETE_FILE = "complete.json"


def _shard_sizes(out_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(out_dir.glob(SHARD_GLOB))}


def mark_complete(out_dir: Path, fingerprint: str, max_records: int | None) -> None:
    """Record that a run of config ``fingerprint`` and budget ``max_records`` finished ``out_dir``, with its shards'
    names and sizes."""
    tmp = out_dir / (COMPLETE_FILE + ".tmp")
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "max_records": max_records,
                               "shards": _shard_sizes(out_dir)}, indent=1))
    os.replace(tmp, out_dir / COMPLETE_FILE)


def is_complete(out_dir: Path, fingerprint: str, max_records: int | None) -> bool:
    """True when :func:`mark_complete` recorded this config and budget and the shards are still the same files."""
    f = out_dir / COMPLETE_FILE
    if not f.is_file():
        return False
    try:
        mark = json.loads(f.read_text())
    except ValueError:
        return False
    return (mark.get("fingerprint") == fingerprint and mark.get("max_records") == max_records
            and mark.get("shards") == _shard_sizes(out_dir))


DataPath = str | Path | Sequence[str | Path]
"""Where records are: one data folder (or Parquet file), or a list of them read as one data set."""


def data_paths(data: DataPath) -> list[Path]:
    """``data`` as a list of paths (a single folder or file becomes a list of one)."""
    items = [data] if isinstance(data, (str, Path)) else list(data)
    if not items:
        raise ValueError("no data folder given: pass a folder of shards or a list of them")
    return [Path(d).expanduser() for d in items]


def shard_files(data_dir: DataPath) -> list[Path]:
    """The Parquet files of a data folder (``shard-*.parquet``, else any ``*.parquet`` below it, or the file itself), or
    of each folder of a list: where every reader finds its shards."""
    if not isinstance(data_dir, (str, Path)):
        return [f for d in data_paths(data_dir) for f in shard_files(d)]
    root = Path(data_dir).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"data folder {root} does not exist; generate data first (python -m pipelines.generate)"
        )
    if root.is_file():
        return [root]
    files = sorted(root.glob(SHARD_GLOB)) or sorted(root.rglob("*.parquet"))
    if not files:
        raise FileNotFoundError(
            f"no Parquet shards ({SHARD_GLOB}) in {root}; generate data first (python -m pipelines.generate)"
        )
    return files


def folder_columns(data_dir: DataPath) -> dict[Path, set[str]]:
    """Column names of each shard folder under ``data_dir`` (read from the folder's first shard's schema)."""
    first: dict[Path, Path] = {}
    for f in shard_files(data_dir):
        first.setdefault(f.parent, f)
    return {d: set(pq.read_schema(f).names) for d, f in first.items()}


def read_columns(
    data_dir: DataPath, columns: Sequence[str], splits: Sequence[str] | None = None, optional: Sequence[str] = ()
) -> dict[str, np.ndarray]:
    """Columns of every shard under ``data_dir`` as numpy arrays (vector columns 2-D), only rows whose ``split`` is in
    ``splits``; ``optional`` columns only when every folder has them. KeyError naming a missing column."""
    per_folder = folder_columns(data_dir)
    for folder, names in per_folder.items():
        missing = [c for c in columns if c not in names]
        if missing:
            raise KeyError(f"the shards under {folder} lack the columns {missing} (has {sorted(names)})")
    present = set.intersection(*per_folder.values())
    want = list(dict.fromkeys([*columns, *(c for c in optional if c in present)]))
    flt = pc.field("split").isin(list(splits)) if splits is not None and "split" in present else None
    files = [str(f) for f in shard_files(data_dir)]
    table = pads.dataset(files, format="parquet").to_table(columns=want, filter=flt)
    if table.num_rows == 0 and splits is None:
        raise ValueError(f"the shards under {data_dir} hold no rows")
    out: dict[str, np.ndarray] = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            out[name] = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
        elif pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            out[name] = np.stack([np.asarray(v) for v in col.to_pylist()]) if len(col) else np.zeros((0, 0))
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out


def folder_cost(data_dir: Path) -> dict:
    """A folder's cost accounting added up: records and seconds per origin, labelling seconds per model, records cut by
    the budget, wall seconds, records/s."""
    total: dict = {"shards": 0, "shards_without_cost": 0, "records": 0, "dropped_by_budget": 0, "wall_s": 0.0,
                   "origin": {}, "label_s_by_model": {}}
    for shard in sorted(Path(data_dir).glob(SHARD_GLOB)):
        f = cost_path(shard)
        if not f.is_file():
            total["shards_without_cost"] += 1
            continue
        c = json.loads(f.read_text())
        total["shards"] += 1
        total["records"] += int(c.get("records", 0))
        total["dropped_by_budget"] += int(c.get("dropped_by_budget", 0))  # labelled, then cut by the budget
        total["wall_s"] += float(c.get("wall_s", 0.0))
        for o, d in c.get("origin", {}).items():
            acc = total["origin"].setdefault(o, {})
            for k, v in d.items():
                acc[k] = acc.get(k, 0) + v
        for m, v in c.get("label_s_by_model", {}).items():
            total["label_s_by_model"][m] = total["label_s_by_model"].get(m, 0.0) + v
    total["records_per_s"] = total["records"] / total["wall_s"] if total["wall_s"] > 0 else None
    return total


def load_records(data_dir: DataPath, columns: list[str] | None = None) -> datasets.Dataset:
    """All shards of a folder as one ``datasets.Dataset`` (optionally only some columns)."""
    return datasets.Dataset.from_parquet([str(p) for p in shard_files(data_dir)], columns=columns)


def summarize(data_dir: Path, extra: dict | None = None) -> dict:
    """Acceptance rate, greedy-match rate and oracle draft-length histogram, overall and per origin / domain / split."""
    cols = [
        "origin", "domain", "split", "draw", "greedy_match", "accept_prob", "oracle_len", "oracle_censored", "rollout"
    ]
    present = set.union(*folder_columns(data_dir).values())
    df = load_records(data_dir, [c for c in cols if c in present]).to_pandas()

    def block(d) -> dict:
        starts = d[d["rollout"]] if d["rollout"].any() else d
        hist = Counter(int(x) for x in starts["oracle_len"])
        return {
            "records": int(len(d)),
            "acceptance_rate": float(d["accept_prob"].mean()),
            "greedy_match_rate": float(d["greedy_match"].mean()),
            "oracle_len_mean": float(d["oracle_len"].mean()),
            "oracle_len_hist": {str(k): hist[k] for k in sorted(hist)},
        }

    summary = {"overall": block(df), "cost": folder_cost(data_dir)}
    for key in ("origin", "domain", "split", "draw"):
        if key not in df:
            continue
        summary[f"by_{key}"] = {str(k): block(g) for k, g in df.groupby(key)}
    if extra:
        summary.update(extra)
    (data_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    return summary
