"""``benchmarks/bench_curve_shape.py``: vLLM's curve file and its lower monotone envelope at every batch size."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_curve_shape import enveloped  # noqa: E402

from compute.timing import BATCH_CURVES, CostModel  # noqa: E402
from runtimes.vllm.proposer import load_curves  # noqa: E402


def test_the_envelope_flattens_every_batch_size_and_keeps_the_rest(tmp_path):
    shape = {1: 1.0, 2: 1.3, 3: 1.2, 4: 1.0, 5: 1.6}
    curves = {b: CostModel(draft_s_per_token=0.05 * b, target_s={k: v * b for k, v in shape.items()}, runtime="vllm")
              for b in (1, 2)}
    top = CostModel(draft_s_per_token=0.05, target_s=dict(curves[1].target_s), runtime="vllm",
                    extra={BATCH_CURVES: {str(b): c.to_dict() for b, c in curves.items()}, "skip_s": 0.9})
    top.to_json(tmp_path / "curve.json")
    got = load_curves(enveloped(tmp_path / "curve.json", tmp_path / "env.json"))
    assert got[1].target_s == {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.6}
    assert got[2].target_s == {1: 2.0, 2: 2.0, 3: 2.0, 4: 2.0, 5: 3.2}
    assert got[2].draft_s_per_token == 0.1 and load_curves(tmp_path / "curve.json")[1].target_s[2] == 1.3
    assert CostModel.from_json(tmp_path / "env.json").extra["skip_s"] == 0.9
