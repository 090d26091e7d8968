"""A benchmark run kept prompt by prompt (with several samples a prompt, sample by sample) in ``<out_dir>/prompts`` so
a stopped run continues at its first unfinished prompt (or sample), on the curve it began with; another config (another
``samples_per_prompt``, seed or temperature among its fields), other prompts, rows or machine are refused, naming what
differs.

Usage: rerun the same command (``python -m pipelines.benchmark --config configs/benchmark-full.yaml``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from benchmark.config import BenchmarkConfig
from benchmark.rows import Row
from compute.timing import CostModel
from decoding.engine import DecodeStats

log = logging.getLogger(__name__)

__all__ = ["PromptStore", "run_identity"]

PROMPTS_DIR = "prompts"
"""The folder under ``out_dir`` with ``run.json`` and one ``prompt-NNNN.json`` per finished prompt (with several
samples a prompt: ``prompt-NNNN-sS.json`` per finished sample)."""

NOT_IDENTITY = ("out_dir", "resume", "replay_check", "n_boot", "tracking", "tracking_uri", "experiment", "n_prompts",
                "results_dir")
"""Config fields that do not change a prompt's measured rows (``n_prompts``: the prompts' own ids are compared, so a
run may be extended to more prompts)."""

def run_identity(cfg: BenchmarkConfig, prompts: list[list[int]]) -> dict[str, Any]:
    """What a resumed run must share with the stored one: the config fields that shape a prompt's rows and, per
    prompt, a digest of its token ids."""
    conf = {k: v for k, v in asdict(cfg).items() if k not in NOT_IDENTITY}
    digests = [hashlib.sha256(json.dumps(p).encode()).hexdigest()[:16] for p in prompts]
    return {"config": json.loads(json.dumps(conf, default=str)), "prompts": digests}


def row_to_dict(row: Row) -> dict[str, Any]:
    """A row as JSON-ready values (its engine counters nested)."""
    return asdict(row)


def row_from_dict(d: dict[str, Any]) -> Row:
    """The inverse of :func:`row_to_dict`."""
    d = dict(d)
    decode = d.pop("decode", None)
    known = {f.name for f in fields(Row)}
    row = Row(**{k: v for k, v in d.items() if k in known})
    row.decode = None if decode is None else DecodeStats.from_dict(decode)
    return row


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class PromptStore:
    """The decodes finished so far of one benchmark run under ``folder`` (``<out_dir>/prompts``), indexed as the run
    makes them: decode j is sample ``j % samples_per_prompt`` of prompt ``j // samples_per_prompt``."""

    def __init__(self, folder: str | Path, samples_per_prompt: int = 1) -> None:
        self.folder = Path(folder)
        self.samples_per_prompt = samples_per_prompt

    @property
    def run_file(self) -> Path:
        return self.folder / "run.json"

    def prompt_file(self, j: int) -> Path:
        """Decode j's file: ``prompt-NNNN.json``, or ``prompt-NNNN-sS.json`` with several samples a prompt."""
        if self.samples_per_prompt == 1:
            return self.folder / f"prompt-{j:04d}.json"
        i, s = divmod(j, self.samples_per_prompt)
        return self.folder / f"prompt-{i:04d}-s{s}.json"

    def set_aside(self) -> Path | None:
        """Move an earlier run's files to ``prompts.old-<time>`` (starting over loses nothing); returns where."""
        if not self.folder.exists():
            return None
        stem = f"{self.folder.name}.old-{time.strftime('%Y%m%d-%H%M%S')}"
        dest, i = self.folder.with_name(stem), 1
        while dest.exists():
            dest, i = self.folder.with_name(f"{stem}-{i}"), i + 1
        self.folder.rename(dest)
        log.info("benchmark: the earlier run's prompts moved to %s (starting over)", dest)
        return dest

    def resume(self, identity: dict[str, Any], machine: dict[str, Any], draft: str, target: str,
               compute_path: str) -> CostModel | None:
        """The stored run's curve when there is one to continue (None: nothing stored). ValueError naming what differs
        when the stored run is another config, other prompts or another machine."""
        if not self.run_file.is_file():
            return None
        stored = json.loads(self.run_file.read_text())
        diffs = _differences(stored["identity"], identity)
        curve = CostModel.from_dict(stored["cost_model"])
        diffs += curve.mismatch(draft, target, compute_path, machine)
        if diffs:
            raise ValueError(
                f"{self.folder} holds {len(self.done())} finished prompt(s) of another run ({'; '.join(diffs)}): rerun "
                f"with the same config on the same machine to continue it, or pass --resume false to start over (its "
                f"files are moved aside), or choose another --out_dir")
        return curve

    def begin(self, identity: dict[str, Any], curve: CostModel) -> None:
        """Record a new run (its identity and its curve) before its first prompt; prompt files without a run.json
        (whose run is unknown) are moved aside first, never read as this run's."""
        if self.done():
            self.set_aside()
        self.folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.run_file, json.dumps({"identity": identity, "cost_model": curve.to_dict()}, indent=1))

    def check_rows(self, names: list[str]) -> None:
        """Record the rows' names (tuned thresholds in them) at the run's first start; a continued run must plan the
        same rows (tuning is a replay of the validation split under the stored curve, so it should)."""
        stored = json.loads(self.run_file.read_text())
        if "rows" not in stored:
            stored["rows"] = names
            _write_atomic(self.run_file, json.dumps(stored, indent=1))
        elif stored["rows"] != names:
            raise ValueError(f"{self.folder}: this run plans the rows {names}, the stored run {stored['rows']} (the "
                             f"tuning data or the predictors changed?): pass --resume false to start over, or choose "
                             f"another --out_dir")

    def done(self) -> list[int]:
        """Indices of the decodes with a file (prompts, or (prompt, sample) pairs in run order), in order."""
        out = []
        for p in self.folder.glob("prompt-*.json"):
            i, _, s = p.stem.removeprefix("prompt-").partition("-s")
            out.append(int(i) * self.samples_per_prompt + int(s or 0))
        return sorted(out)

    def load(self, j: int) -> tuple[dict[str, Row], CostModel | None]:
        """Decode j's rows by name and the curve probed after them (None if none was)."""
        d = json.loads(self.prompt_file(j).read_text())
        probe = d.get("probe")
        return ({name: row_from_dict(r) for name, r in d["rows"].items()},
                None if probe is None else CostModel.from_dict(probe))

    def save(self, j: int, rows: dict[str, Row], probe: CostModel | None, wall_s: float | None = None) -> None:
        """Decode j's rows and probe, and the wall seconds it took, whole or not at all."""
        d = {"rows": {name: row_to_dict(r) for name, r in rows.items()},
             "probe": None if probe is None else probe.to_dict(), "wall_s": wall_s}
        _write_atomic(self.prompt_file(j), json.dumps(d))

    def wall_seconds(self) -> float | None:
        """The wall seconds the saved prompts took in the runs that saved them (None when one has no record): what a
        resumed run adds to its own to give the whole run's wall time."""
        walls = [json.loads(self.prompt_file(j).read_text()).get("wall_s") for j in self.done()]
        return None if None in walls else float(sum(walls))


def _differences(stored: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Config fields and prompts in which two identities differ, each naming both values."""
    out = []
    a, b = stored.get("config", {}), now["config"]
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            out.append(f"{k}: stored {a.get(k)!r}, now {b.get(k)!r}")
    pa, pb = stored.get("prompts", []), now["prompts"]
    common = min(len(pa), len(pb))
    if pa[:common] != pb[:common]:
        first = next(i for i in range(common) if pa[i] != pb[i])
        out.append(f"prompt {first + 1} has other token ids")
    return out
