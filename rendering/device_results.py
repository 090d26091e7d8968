"""Stored GPU checks: the summary of ``scripts/device_check.sh``'s run (``rendering.result_store`` kind
``device_check``) and the Markdown that fills ``<!-- results:gpu -->`` (docs/gpu.md).

Usage::

    write_summary(summarize_device_check("outputs/device-check/device-check.json"), "results")
    print(gpu_block(load_summaries("results")))
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rendering.result_store import SCHEMA, Summary, SummaryError, dated, newest

__all__ = ["summarize_device_check", "gpu_block"]


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise SummaryError(f"{path}: missing (is the run finished?)") from e

def summarize_device_check(path: str | Path, command: str = "bash scripts/device_check.sh") -> dict[str, Any]:
    """The summary of ``scripts/device_check.sh``'s ``device-check.json``: its commit as it recorded it at its start
    (``DEVICE_CHECK_COMMIT`` on a copied tree), its start, end and seconds as it timed them."""
    d = _read(Path(path))
    host = d.get("host") or {}
    commit = d.get("commit") or {}
    started = d.get("started")
    return {
        "schema": SCHEMA, "kind": "device_check", "config": "smoke", "command": command,
        "date": (started or d["date"])[:10], "commit": commit.get("commit"), "dirty": commit.get("dirty"),
        "commit_note": commit.get("note"), "code_recorded": "at start" if started else "at storing",
        "started": started, "ended": d.get("ended"), "duration_s": d.get("seconds"),
        "machine": {"model_name": host.get("gpu") or "unknown GPU", "isa": f"CUDA {host.get('torch_cuda')}",
                    "torch": host.get("torch"), "python": host.get("python"), "nvidia_smi": host.get("nvidia_smi")},
        "compute_path": d.get("device", "cuda"), "pair": {"draft": "tiny:1", "target": "tiny:2:32:3"},
        "result": d.get("result"), "seconds": d.get("seconds"),
        "steps": [{"step": st["name"], "status": st["status"], "seconds": st["seconds"],
                   "details": st.get("line", "")} for st in d.get("steps", [])],
    }


def gpu_block(summaries: list[Summary]) -> str:
    """docs/gpu.md's block: the newest stored GPU check."""
    s = newest(summaries, "device_check")
    if s is None:
        return "No stored GPU check yet: run `bash scripts/device_check.sh` on a GPU host and store its summary."
    d = s.data
    lines = [f"{d['machine']['model_name']} ({d['machine'].get('nvidia_smi') or ''}), torch {d['machine']['torch']}, "
             f"{d['machine']['isa']}, Python {d['machine']['python']}; {dated(d)}"
             + (f" ({d['commit_note']})" if d.get("commit_note") else "") + f"; `{d['command']}`: "
             f"**{d['result']}** in {d['seconds']:.0f} s.", "", "| step | status | seconds | details |",
             "|---|---|---|---|"]
    for st in d["steps"]:
        lines.append(f"| {st['step']} | {st['status']} | {st['seconds']:.0f} | {st.get('details') or ''} |")
    return "\n".join(lines)
