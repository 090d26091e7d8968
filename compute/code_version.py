"""Which code a measurement ran on: the git commit of specstop's checkout and whether its tracked files had uncommitted
changes, recorded at a run's start so a stored result names the code that measured it.

Outside a git checkout both are ``None`` and recording never fails; untracked files do not count as changes.

Usage: ``record_start(out_dir, command=...)`` at a run's start, ``record_end(out_dir)`` at its end,
``run_code(out_dir)`` and ``recorded_command(out_dir)`` when its summary is stored; a run that resumes part by part
keeps each part's seconds with a :class:`PartClock`, so that a resumed run still tells its duration.
"""
from __future__ import annotations

import datetime as dt
import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from compute.cpu import cpuinfo_fields

ROOT = Path(__file__).resolve().parents[1]
"""The folder holding specstop's packages: a git checkout's top level when run from one."""


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str] | None:
    """``git -C root args`` (None when git cannot run)."""
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.SubprocessError):
        return None


def _checkout(root: Path) -> bool:
    """Whether ``root`` is the top level of a git checkout (not a folder inside another repository)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    return top is not None and top.returncode == 0 and Path(top.stdout.strip()).resolve() == root.resolve()


def code_version(root: Path = ROOT) -> dict[str, str | bool | None]:
    """``{"commit": HEAD's full hash, "dirty": uncommitted changes to tracked files}``; None for each outside a git
    checkout, ``dirty`` None when git status cannot tell."""
    if not _checkout(root):
        return {"commit": None, "dirty": None}
    head = _git(root, "rev-parse", "HEAD")
    if head is None or head.returncode != 0:
        return {"commit": None, "dirty": None}
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    dirty = None if status is None or status.returncode != 0 else bool(status.stdout.strip())
    return {"commit": head.stdout.strip(), "dirty": dirty}


@functools.lru_cache(maxsize=64)
def in_history(commit: str, root: Path = ROOT) -> bool | None:
    """True when ``commit`` is HEAD or an ancestor, False when not, None when that cannot be told (no checkout, a
    shallow clone)."""
    if not _checkout(root):
        return None
    known = _git(root, "cat-file", "-e", f"{commit}^{{commit}}")
    if known is None:
        return None
    if known.returncode != 0:
        shallow = _git(root, "rev-parse", "--is-shallow-repository")
        return None if shallow is None or shallow.stdout.strip() == "true" else False
    found = _git(root, "merge-base", "--is-ancestor", commit, "HEAD")
    if found is None or found.returncode not in (0, 1):
        return None
    return found.returncode == 0


RUN_RECORD = "code_version.json"
"""The file in a run's out_dir listing each start and the run's end: ``{"starts": [{"commit", "dirty", "date",
"host"}, ...], "end": {"date", "duration_s"}}``, and for a run that resumes part by part ``"parts": {name: seconds}``
(:class:`PartClock`)."""


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def host_facts() -> dict[str, Any]:
    """The host a run starts on as lscpu names it: CPU model, vendor, family, model number, SIMD flags and logical CPUs
    (from /proc/cpuinfo)."""
    fields = cpuinfo_fields()
    flags = sorted(f for f in fields.get("flags", "").split() if f.startswith(("avx", "amx", "fma")))
    return {"model_name": fields.get("model name", ""), "vendor": fields.get("vendor_id", ""),
            "family": fields.get("cpu family", ""), "model": fields.get("model", ""), "simd_flags": flags,
            "cpus": os.cpu_count()}


def _record(out_dir: Path) -> dict[str, Any]:
    path = Path(out_dir) / RUN_RECORD
    if not path.is_file():
        return {"starts": []}
    try:
        record = json.loads(path.read_text())
        record["starts"] = list(record["starts"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a code record ({e}); delete it (the summary then names the code at storing "
                         "time)") from e
    return record


def _write(out_dir: Path, record: dict[str, Any]) -> None:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / RUN_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def record_start(out_dir: str | Path, root: Path = ROOT, command: str | None = None) -> dict[str, Any]:
    """Add this start (commit, dirty, UTC time, host and, when given, the command that started it) to
    ``out_dir/code_version.json`` and return its code; a new start clears an earlier end."""
    record = _record(Path(out_dir))
    now = code_version(root)
    record["starts"].append({**now, "date": _now(), "host": host_facts(), **({"command": command} if command else {})})
    record.pop("end", None)
    _write(Path(out_dir), record)
    return now


HOST_KIND = ("model_name", "vendor", "family", "model", "simd_flags", "cpus")
"""The host facts a resumed benchmark must share with its first start (its timings compare only on one host kind)."""


def check_resume(out_dir: str | Path) -> None:
    """A benchmark continuing the run in ``out_dir`` (this start already recorded) must run the code its first start
    ran (the same commit, not dirtier) on the same host kind: otherwise its rows would mix two codes or two hosts.
    Raises ValueError naming both in one line and removes this start's record; nothing measured is touched."""
    record = _record(Path(out_dir))
    starts = record["starts"]
    if len(starts) < 2:
        return
    first, now = starts[0], starts[-1]
    diffs = []
    if first.get("commit") != now.get("commit"):
        diffs.append(f"it started at commit {str(first.get('commit'))[:7]}, this is {str(now.get('commit'))[:7]}")
    elif now.get("dirty") and not first.get("dirty"):
        diffs.append(f"it started on a clean tree at {str(first.get('commit'))[:7]}, this tree has uncommitted changes")
    was, here = first.get("host") or {}, now.get("host") or {}
    if was and here and any(was.get(k) != here.get(k) for k in HOST_KIND):
        diffs.append(f"it started on {_host_line(was)}, this is {_host_line(here)}")
    if not diffs:
        return
    record["starts"].pop()
    _write(Path(out_dir), record)
    raise ValueError(f"{out_dir}: a run measured on one code and one host cannot continue here ({'; '.join(diffs)}): "
                     f"continue it on its code and host kind, or give another --out_dir (or move this one aside) to "
                     f"start over; nothing in it was changed")


def _host_line(host: dict[str, Any]) -> str:
    flags = host.get("simd_flags") or []
    isa = "AMX" if any(f.startswith("amx") for f in flags) else "AVX-512" if "avx512f" in flags else "AVX2"
    return (f"{host.get('model_name')} (family {host.get('family')} model {host.get('model')}, {host.get('cpus')} "
            f"CPUs, {isa})")


def new_run(out_dir: str | Path) -> None:
    """This start begins a new run in ``out_dir``: keep only its start, so the run names its own code, not an earlier
    run's (and the seconds of parts still in out_dir, which it may read back)."""
    record = _record(Path(out_dir))
    if len(record["starts"]) > 1:
        _write(Path(out_dir), {"starts": record["starts"][-1:], **({"parts": record["parts"]} if "parts" in record
                                                                   else {})})


def record_end(out_dir: str | Path, duration_s: float | None) -> dict[str, Any]:
    """Record the run's end and its duration as the run measured it (None: it cannot tell its whole duration) in
    ``out_dir/code_version.json``."""
    record = _record(Path(out_dir))
    record["end"] = {"date": _now(), "duration_s": None if duration_s is None else round(float(duration_s), 1)}
    _write(Path(out_dir), record)
    return record["end"]


class PartClock:
    """The seconds each finished part of a resumable run took (kept under ``parts`` in ``out_dir/code_version.json``),
    so that a run stopped and started again tells its whole duration: this start's own seconds plus what the parts it
    read back took when they ran (the time of a part cut short by the stop is not counted: nothing of it is kept).

    Usage: ``clock.ran(name, seconds)`` when a part is done, ``clock.read_back(name)`` when one is read back instead
    of run, ``clock.duration(this_start_s)`` at the end (None when a part read back has no seconds recorded)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.read_back_s: float | None = 0.0

    def ran(self, part: str, seconds: float) -> None:
        record = _record(self.out_dir)
        record.setdefault("parts", {})[part] = round(float(seconds), 1)
        _write(self.out_dir, record)

    def read_back(self, part: str) -> None:
        seconds = _record(self.out_dir).get("parts", {}).get(part)
        self.read_back_s = None if seconds is None or self.read_back_s is None else self.read_back_s + seconds

    def duration(self, this_start_s: float) -> float | None:
        return None if self.read_back_s is None else this_start_s + self.read_back_s


def recorded_command(out_dir: str | Path) -> str | None:
    """The command the run in ``out_dir`` was first started with, as its start recorded it (None: not recorded)."""
    starts = _record(Path(out_dir))["starts"]
    return starts[0].get("command") if starts else None


def run_code(out_dir: str | Path, root: Path = ROOT) -> dict[str, Any]:
    """A stored summary's provenance for the run in ``out_dir``: its first start's commit, dirty (any start dirty), host
    and time, its end and duration, the commits it was resumed at, and ``code_recorded`` (``at start`` or ``at
    storing``)."""
    record = _record(Path(out_dir))
    starts = record["starts"]
    if not starts:
        return {**code_version(root), "code_recorded": "at storing"}
    first = starts[0]
    end = record.get("end") or {}
    out: dict[str, Any] = {"commit": first.get("commit"),
                           "dirty": None if first.get("dirty") is None else any(s.get("dirty") for s in starts),
                           "code_recorded": "at start", "started": first.get("date"), "ended": end.get("date"),
                           "duration_s": end.get("duration_s"), "host": first.get("host")}
    later = list(dict.fromkeys(s["commit"] for s in starts[1:] if s.get("commit") not in (None, first.get("commit"))))
    if later:
        out["resumed_at"] = later
    return out
