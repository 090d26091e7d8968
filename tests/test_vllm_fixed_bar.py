"""``benchmarks/vllm_fixed_bar.py``: a stored vLLM run's policies against both fixed bars, from its records."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from vllm_fixed_bar import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_a_stored_run_prints_both_bars_and_bad_input_is_one_line(tmp_path, capsys):
    stored = sorted((ROOT / "results").glob("vllm_benchmark-*.json"))[0]
    assert main([str(stored)]) == 0
    out = capsys.readouterr().out
    assert "the fastest fixed (" in out and "the fastest on the other groups (" in out
    assert main([str(tmp_path / "missing")]) == 1 and "no such file or folder" in capsys.readouterr().err
    other = tmp_path / "main.json"
    other.write_text(json.dumps({"kind": "main_job"}))
    assert main([str(other)]) == 1 and "not a stored vLLM benchmark" in capsys.readouterr().err
    assert main([str(tmp_path)]) == 1 and "no benchmark.json" in capsys.readouterr().err
