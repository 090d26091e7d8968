"""``benchmarks/price_draft_compaction.py``: idle rows priced at the curve's marginal draft-forward cost of a row."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from price_draft_compaction import main, priced_rows, row_ms  # noqa: E402

CURVES = {"1": {"draft_ms": 20.0}, "2": {"draft_ms": 22.0}, "4": {"draft_ms": 30.0}}


def summary() -> dict:
    rec = {"draft_rows": [40, 40], "idle_rows": [10, 30], "seconds": [1.0, 1.0]}
    return {"kind": "vllm_benchmark", "host": {"model_name": "cpu"}, "commit": "abc1234", "curves": CURVES,
            "rows": [{"batch": 4, "row": "policy", "records": rec},
                     {"batch": 1, "row": "policy", "records": rec},
                     {"batch": 4, "row": "target", "records": {"draft_rows": [0], "idle_rows": [0], "seconds": [1]}}]}


def test_a_row_costs_the_curves_slope_below_its_batch_size():
    assert row_ms(CURVES, 4) == 4.0 and row_ms(CURVES, 2) == 2.0
    assert row_ms(CURVES, 1) == 0.0 and row_ms(CURVES, 8) == 0.0  # nothing below, or not measured
    assert row_ms({"1": {"draft_ms": 54.0}, "2": {"draft_ms": 53.0}}, 2) == 0.0  # a dip saves nothing


def test_idle_rows_are_priced_against_the_rows_measured_seconds():
    (p,) = priced_rows(summary())  # batch 1 and rows that never drafted are left out
    assert p["idle_rows"] == 40 and p["idle_share"] == 0.5 and p["saved_s"] == 0.16 and p["share"] == 0.08


def test_another_file_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "s.json").write_text(json.dumps(summary()))
    assert main([str(tmp_path / "s.json")]) == 0 and "8.0%" in capsys.readouterr().out
    (tmp_path / "other.json").write_text(json.dumps({"kind": "benchmark"}))
    assert main([str(tmp_path / "other.json")]) == 2
    assert "not a stored vLLM benchmark" in capsys.readouterr().err
