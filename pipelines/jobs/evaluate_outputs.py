"""What other jobs keep of an evaluation's result (``pipelines.jobs.evaluate.run_evaluation``): the fitted calibration
maps written into the predictors' exports and the calibrated training-free scores exported beside them
(:func:`store_calibrations`), and the main job's table rows of the calibration errors and the cost-aware rule
(:func:`cost_aware_rows`)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from evaluation.calibration import calibrated_scores
from predictors.export import export_predictor, update_metadata

__all__ = ["store_calibrations", "cost_aware_rows"]


def store_calibrations(result: Mapping[str, Any], exports: Mapping[str, str | Path], free_dir: str | Path | None
                       ) -> dict[str, Path]:
    """Write the fitted maps into the export folders (``predictor.json`` ``calibration``; the registry then holds them)
    and export each calibrated training-free score to ``<free_dir>/<kind>`` (``goodput:<that folder>``, or
    ``build_policy("goodput:<kind>", calibration_dir=free_dir)``). Returns name -> folder written."""
    calib = result.get("calibration")
    if calib is None:
        return {}
    written: dict[str, Path] = {}
    for name, maps in calib.maps.items():
        stored = {m: c.to_dict() for m, c in maps.items()}
        if name in exports:
            update_metadata(exports[name], calibration=stored)
            written[name] = Path(exports[name])
    if free_dir is not None:
        for name, pol in calibrated_scores().items():
            if name in calib.maps:
                folder = export_predictor(pol, Path(free_dir) / pol.kind, {"calibration": {
                    m: c.to_dict() for m, c in calib.maps[name].items()}})
                written[name] = folder
    return written


def cost_aware_rows(result: Mapping[str, Any], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Rows for the main job's table, keyed by row name: each policy's ECE per decoding mode (``ece_greedy``,
    ``ece_sampling``), ``<name> (goodput)`` with the replayed speedup of the cost-aware rule on the test split
    (``test_speedup``, first replay mode), and the best training-free score thresholded and cost-aware."""
    replay, calib = result.get("replay"), result.get("calibration")
    ece: dict[str, dict[str, float]] = {}
    if calib is not None and len(calib.table):
        for _, r in calib.table.iterrows():
            ece.setdefault(r["policy"], {})[f"ece_{r['mode']}"] = float(r["ece"])
    rows: dict[str, dict[str, Any]] = {name: dict(ece.get(name, {})) for name in names}
    if replay is None or not len(replay) or "speedup" not in replay:
        return rows
    rep = replay[replay["mode"] == replay["mode"].iloc[0]] if "mode" in replay else replay
    speed = {str(p): float(v) for p, v in zip(rep["policy"], rep["speedup"]) if np.isfinite(v)}

    def row(name: str, label: str) -> dict[str, Any]:
        return {"predictor": name, "label": label, "test_speedup": speed[name], **ece.get(name.split(" (")[0], {})}

    for name in names:
        if f"{name} (goodput)" in speed:
            rows[f"{name} (goodput)"] = row(f"{name} (goodput)", "cost-aware")
    free = [n for n in calibrated_scores() if f"{n} (goodput)" in speed]
    if free:
        best = max(free, key=lambda n: speed[f"{n} (goodput)"])
        rows[f"{best} (goodput)"] = row(f"{best} (goodput)", "cost-aware, best training-free")
    fixed = {k: v for k, v in speed.items() if k in ("svip", "adaedl", "max-confidence") or k.startswith("static-best")}
    if fixed:
        best = max(fixed, key=fixed.__getitem__)
        rows[best] = row(best, "thresholded, best training-free")
    return rows
