"""Shard bookkeeping without models: an unreadable shard is moved aside, a completed folder is recognised."""
from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_gen.shards import cost_path, finished_chunks, is_complete, mark_complete, shard_path


def _shard(folder, chunk: int, n: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": list(range(n))}), shard_path(folder, chunk))
    cost_path(shard_path(folder, chunk)).write_text("{}")


def test_unreadable_shard_is_named_and_moved_aside(tmp_path, caplog):
    _shard(tmp_path, 0, 100)
    _shard(tmp_path, 1, 50)
    bad = shard_path(tmp_path, 0)
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    (tmp_path / "shard-00002.parquet.tmp").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING):
        assert finished_chunks(tmp_path) == {1: 50}
    assert "shard-00000.parquet does not read" in caplog.text and "moved aside" in caplog.text
    assert (tmp_path / "shard-00000.parquet.corrupt").exists() and (tmp_path / "shard-00000.cost.json.corrupt").exists()
    assert not bad.exists() and not list(tmp_path.glob("*.tmp"))
    assert finished_chunks(tmp_path) == {1: 50}  # once moved, nothing more to say


def test_complete_marker_follows_the_shards(tmp_path):
    _shard(tmp_path, 0, 10)
    _shard(tmp_path, 1, 10)
    assert not is_complete(tmp_path, "fp", 100)
    mark_complete(tmp_path, "fp", 100)
    assert is_complete(tmp_path, "fp", 100)
    assert not is_complete(tmp_path, "other", 100) and not is_complete(tmp_path, "fp", 200)
    _shard(tmp_path, 1, 5)  # a shard replaced since: generate again
    assert not is_complete(tmp_path, "fp", 100)


def test_other_ranks_wait_until_rank_0_prepared_the_folder(tmp_path):
    """A rank other than 0 writes nothing before rank 0 has created and checked the folder: it waits for the config
    file of its data config, and names the folder when rank 0 never prepares it."""
    import threading

    from data_gen.shards import prepare_out_dir, wait_for_out_dir

    out, data = tmp_path / "d", {"seed": 0, "mix": "a"}
    later = threading.Timer(0.3, prepare_out_dir, args=(out, data, {}, False))
    later.start()
    wait_for_out_dir(out, data, timeout_s=10.0, poll_s=0.05)
    assert (out / "config.json").exists()
    with pytest.raises(TimeoutError, match=str(tmp_path / "d")):
        wait_for_out_dir(out, {"seed": 1, "mix": "a"}, timeout_s=0.2, poll_s=0.05)  # another config's folder


def test_a_rank_removes_only_its_own_partial_shards(tmp_path):
    """Another rank's temporary shard may be being written right now: only the chunks this rank writes are cleaned."""
    for c in (2, 3):
        (tmp_path / f"shard-{c:05d}.parquet.tmp").write_bytes(b"partial")
    assert finished_chunks(tmp_path, owns=lambda c: c % 2 == 0) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00003.parquet.tmp"]
    finished_chunks(tmp_path)
    assert list(tmp_path.iterdir()) == []
