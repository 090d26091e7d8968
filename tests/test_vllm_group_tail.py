"""``benchmarks/vllm_group_tail.py``: the decode steps a group ran with fewer of its requests in flight."""
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from vllm_group_tail import main, tail_rows  # noqa: E402

from runtimes.vllm.bench import RowRun  # noqa: E402
from runtimes.vllm.engine import StepLog  # noqa: E402


def test_the_tail_is_the_decode_steps_with_fewer_than_the_group_in_flight(tmp_path, capsys):
    row = RowRun(name="vllm:3", batch=2, spec="vllm:3")
    steps = [StepLog(0.5, 2, False, 2), StepLog(1.0, 2, True, 6), StepLog(1.0, 2, True, 6), StepLog(2.0, 1, True, 3)]
    row.add_unit(([[1] * 9, [2] * 6], 4.5, steps, {}, [], (0, 0), {}))
    alone = RowRun(name="one", batch=1, spec="target")
    alone.add_unit(([[1]], 1.0, [StepLog(1.0, 1, False, 1)], {}, [], (0, 0), {}))
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "a.json").write_text(json.dumps({"rows": [asdict(row), asdict(alone)]}))
    (got,) = tail_rows(tmp_path)  # batch 1 has no tail
    assert (got["steps"], got["tail_steps"], got["tail_share"]) == (3, 1, 0.5)
    assert (got["in_flight"], got["decode"]) == (6.0, 15 / 4)
    assert main([str(tmp_path)]) == 0 and "| 2 | vllm:3 | 3 | 1 | 50% | 6.00 | 3.75 |" in capsys.readouterr().out
    assert main([str(tmp_path / "missing")]) == 1
