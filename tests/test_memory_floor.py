"""The memory floor printed beside measured costs (compute.timing): the bytes a one-token forward reads and the floor
over the measured read bandwidth."""
from __future__ import annotations

import pytest

from compute import compute_path as cp
from compute.models import ModelSpec, load_model
from compute.timing import CostModel, forward_bytes, read_bandwidth


def test_forward_bytes_counts_the_weights_a_step_reads_once() -> None:
    """Every parameter and buffer once (not the input embedding: a lookup reads one row); packed, the packs' own
    bytes."""
    model, _ = load_model(ModelSpec("tiny:2:32:3", compute="eager"))
    emb = model.get_input_embeddings().weight
    every = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert forward_bytes(model) == every - emb.numel() * 4
    before = forward_bytes(model)
    cp.apply_compute_path(model, "packed", min_elements=0)
    packs = [m for m in model.modules() if isinstance(m, cp.PackedLinear)]
    assert packs and forward_bytes(model) == before  # fp32 packs: the same bytes in another layout


def test_the_floor_sits_beside_each_figure() -> None:
    cm = CostModel(draft_s_per_token=0.02, target_s={1: 0.1, 2: 0.11}, extra={
        "draft_bytes": 1e9, "target_bytes": 3e9, "read_bandwidth": 40e9})
    assert cm.floors() == pytest.approx({"draft_s": 0.025, "target_s": 0.075})
    table = cm.curve_table(floor=True)
    assert "floor ms" in table and "(floor 25.0 ms, 0.80x)" in table and "40.0 GB/s" in table
    assert table.splitlines()[2].split() == ["1", "100.0", "1.00", "75.0", "1.33"]
    assert "floor" not in cm.curve_table() and CostModel(draft_s_per_token=0.02, target_s={1: 0.1}).floors() is None


def test_read_bandwidth_is_a_rate() -> None:
    assert 1e8 < read_bandwidth(mib=64, repeats=2) < 1e13
