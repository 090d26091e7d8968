"""Progress in logs: with no terminal every stage logs a heartbeat line with its rate and ETA, at the set interval."""
from __future__ import annotations

import logging
import time

from data_gen.progress import ChainProgress, Heartbeat, rate_text


def test_heartbeat_lines_with_rate_and_eta(caplog, monkeypatch):
    monkeypatch.setenv("SPECSTOP_HEARTBEAT_S", "0.05")
    log = logging.getLogger("test.heartbeat")
    with caplog.at_level(logging.INFO, logger="test.heartbeat"), Heartbeat(log, "row svip", total=8,
                                                                            unit="prompts", enabled=True) as hb:
        time.sleep(0.12)
        hb.update(2)
        time.sleep(0.12)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("heartbeat:")]
    assert any("row svip: running for" in x for x in lines)
    assert any("2/8 prompts" in x and "prompts/s, ETA" in x for x in lines)


def test_a_resumed_run_leaves_the_read_back_units_out_of_its_rate():
    hb = Heartbeat(logging.getLogger("x"), "benchmark", total=23, unit="prompts", enabled=False)
    hb.t0 -= 100.0  # 100 s of work
    hb.update(12, resumed=11)  # 11 prompts read back from an earlier run, 1 run now
    assert "12/23 prompts" in hb.line() and "(1.7 min a prompt, ETA 18 min" in hb.line()


def test_slow_rates_read_per_minute_or_as_minutes_a_unit():
    assert rate_text(30.3, "records") == "30.30 records/s"
    assert rate_text(0.5, "prompts") == "30.0 prompts/min"
    assert rate_text(0.01, "prompts") == "1.7 min a prompt"
    assert rate_text(0.0, "samples") == "0.00 samples/s"


def test_disabled_heartbeat_starts_no_thread():
    with Heartbeat(logging.getLogger("x"), "quiet", enabled=False) as hb:
        assert hb._thread is None


def test_generation_meter_moves_the_stage_heartbeat(caplog, monkeypatch):
    """A main job piped to a file: the generate stage says it started, then beats with records, rate and ETA, also
    from updates the generator sends inside a shard."""
    monkeypatch.setenv("SPECSTOP_HEARTBEAT_S", "0.05")
    log = logging.getLogger("test.chain")
    chain = ChainProgress(["generate"], log, disable=True, heartbeat=True)
    with caplog.at_level(logging.INFO, logger="test.chain"), chain, chain.stage("generate"):
        meter = chain.generation(remaining=1000)
        on = meter.folder()
        on({"in_shard": 1, "new_records": 100})
        time.sleep(0.12)
        on({"new_records": 300, "seconds": 0.2, "chunk": 0, "chunks": 4})
        time.sleep(0.12)
    msgs = [r.getMessage() for r in caplog.records]
    assert "stage generate: started" in msgs
    beats = [m for m in msgs if m.startswith("heartbeat: stage generate")]
    assert any("100/1,000 records" in m for m in beats) and any("300/1,000 records" in m for m in beats)
    assert all("ETA" in m for m in beats)


def test_generation_heartbeat_rate_leaves_the_set_up_out():
    """Loading and probing before the first shard do not lower the rate, so the heartbeat's ETA agrees with the
    shard lines'."""
    chain = ChainProgress(["generate"], logging.getLogger("x"), disable=True, heartbeat=True)
    with chain, chain.stage("generate") as stage:
        stage.heartbeat.t0 -= 300.0  # 5 min of loading, packing and probes before the generator's first event
        meter = chain.generation(remaining=1000)
        meter.folder()({"new_records": 100, "seconds": 10.0, "chunk": 0, "chunks": 4})
        line = stage.heartbeat.line()
    assert "100/1,000 records" in line and "(10.00 records/s, ETA 2 min" in line, line
