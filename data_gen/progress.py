"""One progress view for long jobs: a bar over the chain of stages (on a terminal), one summary line per stage, and
heartbeat lines at least once a minute where no bar shows (nohup, CI, a scheduler), all through ``logging``.

Usage::

    with ChainProgress(["generate", "train disco", "evaluate"], log) as chain:
        with chain.stage("generate") as st:
            generate(cfg, progress=chain.generation(remaining=12_000).folder())
            st.summary = "12,000 records"
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm


def fmt_duration(seconds: float) -> str:
    """``4.2 s``, ``42 s``, ``12 min``, ``2 h 05 min``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    if minutes < 90:
        return f"{minutes:.0f} min"
    return f"{int(minutes // 60)} h {int(minutes % 60):02d} min"


def plural(n: int, word: str) -> str:
    """``1 folder``, ``2 folders``."""
    return f"{n} {word}" + ("" if n == 1 else "s")


HEARTBEAT_S = 45.0
"""Seconds between heartbeat lines (``SPECSTOP_HEARTBEAT_S`` overrides): under a minute, with a margin."""


def heartbeat_default() -> bool:
    """Heartbeat lines by default where no bar shows progress: stderr is not a terminal."""
    return not sys.stderr.isatty()


class Heartbeat:
    """A log line every :data:`HEARTBEAT_S` seconds from a daemon thread while long work runs, with its rate and ETA
    once :meth:`update` gives them; ``enabled=False`` starts no thread.

    Usage::

        with Heartbeat(log, "benchmark row svip", total=8, unit="prompts") as hb:
            for i, p in enumerate(prompts):
                run(p)
                hb.update(i + 1)
    """

    def __init__(self, log: logging.Logger, name: str, total: float | None = None, unit: str = "records",
                 enabled: bool | None = None, interval: float | None = None) -> None:
        self.log, self.name, self.total, self.unit = log, name, total, unit
        self.enabled = heartbeat_default() if enabled is None else enabled
        self.interval = interval or float(os.environ.get("SPECSTOP_HEARTBEAT_S", HEARTBEAT_S))
        self.done: float | None = None
        self.resumed = 0.0
        self.note = ""
        self.t0 = time.perf_counter()
        self.work_t0: float | None = None
        """When the counted work began (``perf_counter``), if after ``t0``: the rate leaves the set-up before it out."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, done: float, total: float | None = None, note: str = "", unit: str | None = None,
               resumed: float | None = None, work_t0: float | None = None) -> None:
        """Record ``done`` units of ``total`` (kept when None); ``note`` ends the line; ``resumed`` units were read back
        and stay out of the rate; ``work_t0`` (a ``perf_counter`` time) is when the counted work began."""
        self.done = done
        if work_t0 is not None:
            self.work_t0 = work_t0
        if resumed is not None:
            self.resumed = resumed
        if total is not None:
            self.total = total
        if unit is not None:
            self.unit = unit
        self.note = note

    def line(self) -> str:
        """The heartbeat line as it reads now."""
        elapsed = time.perf_counter() - self.t0
        if self.done is None:
            return f"{self.name}: running for {fmt_duration(elapsed)}" + (f"; {self.note}" if self.note else "")
        working = time.perf_counter() - max(self.t0, self.work_t0 or self.t0)
        rate = (self.done - self.resumed) / working if working > 0 else 0.0
        of = f"/{self.total:,.0f}" if self.total else ""
        eta = ""
        if self.total and rate > 0:
            eta = f", ETA {fmt_duration(max(0.0, self.total - self.done) / rate)}"
        note = f"; {self.note}" if self.note else ""
        return (f"{self.name}: {self.done:,.0f}{of} {self.unit} in {fmt_duration(elapsed)} "
                f"({rate_text(rate, self.unit)}{eta}){note}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.log.info("heartbeat: %s", self.line())

    def __enter__(self) -> Heartbeat:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name=f"heartbeat {self.name}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)


def rate_text(rate: float, unit: str) -> str:
    """``rate`` (units a second) in the unit of time that reads best: per second from one a second, else per minute,
    else the minutes one takes (``0.01 prompts/s`` reads as ``1.7 min a prompt``)."""
    if rate >= 1.0 or rate <= 0.0:
        return f"{rate:,.2f} {unit}/s"
    if rate * 60.0 >= 1.0:
        return f"{rate * 60.0:,.1f} {unit}/min"
    return f"{1.0 / rate / 60.0:,.1f} min a {unit.removesuffix('s')}"


@dataclass
class Stage:
    """A running stage: the caller sets ``summary`` (e.g. ``"8 epochs, val AUC 0.66"``) and may set ``records`` (for a
    rate), ``reused`` or ``resumed``."""

    name: str
    summary: str = ""
    records: int | None = None
    reused: bool = False
    resumed: bool = False
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    heartbeat: Heartbeat | None = None
    """The stage's heartbeat (logs while it runs when stderr is not a terminal); callers may ``update`` it."""

    def line(self) -> str:
        what = f"{self.summary} " if self.summary else ""
        rate = f" ({self.records / self.seconds:,.1f} records/s)" if self.records and self.seconds > 0 else ""
        return f"stage {self.name}: {what}in {fmt_duration(self.seconds)}{rate}"


class ChainProgress:
    """The bar over the planned ``stages`` and the per-stage summary lines to ``log``; the bar shows only on a terminal
    unless ``disable`` says, and ``heartbeat`` (default: off a terminal) logs in every stage."""

    def __init__(self, stages: list[str], log: logging.Logger, disable: bool | None = None,
                 heartbeat: bool | None = None) -> None:
        self.planned = list(stages)
        self.log = log
        self.heartbeat = heartbeat_default() if heartbeat is None else heartbeat
        self.current: Stage | None = None
        self.done: list[Stage] = []
        self.t0 = time.perf_counter()
        self._stack = ExitStack()
        self.bar = tqdm(total=max(1, len(self.planned)), desc="specstop", disable=disable, leave=False,
                        bar_format="{desc} |{bar:16}| {elapsed}{postfix}")
        if not self.bar.disable:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._stack.enter_context(logging_redirect_tqdm())  # log lines print above the bar

    def __enter__(self) -> ChainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def stage(self, name: str) -> Iterator[Stage]:
        """Run one stage, shown on the bar, its summary logged when it ends; a stage cut by an exception (Ctrl-C too)
        logs how long it ran and that the same command resumes."""
        st = Stage(name, heartbeat=Heartbeat(self.log, f"stage {name}", enabled=self.heartbeat))
        step = f"{self.planned.index(name) + 1}/{len(self.planned)} " if name in self.planned else ""
        self.bar.set_description(f"stage {step}{name}", refresh=False)
        self.bar.set_postfix_str("")
        t = time.perf_counter()
        self.current = st
        if self.heartbeat:
            self.log.info("stage %s: started", name)
        try:
            with st.heartbeat:
                yield st
        except BaseException:
            st.seconds = time.perf_counter() - t
            self.log.warning("stage %s cut after %s: finished shards and exports are kept; the same command resumes",
                             name, fmt_duration(st.seconds))
            raise
        st.seconds = time.perf_counter() - t
        self.done.append(st)
        self.log.info(st.line())
        self._advance(0.0)

    def _advance(self, fraction_of_current: float) -> None:
        self.bar.n = min(self.bar.total, len(self.done) + fraction_of_current)
        self.bar.refresh()

    def generation(self, remaining: int | None) -> GenerationMeter:
        """The meter of the generate stage over its data folders (``meter.folder()`` is each folder's callback); with
        ``remaining`` records the first shard logs the whole budget's ETA."""
        return GenerationMeter(self, remaining)

    def times(self) -> dict[str, float]:
        """Seconds per finished stage, in order, and the total."""
        return {**{s.name: round(s.seconds, 3) for s in self.done}, "total": round(time.perf_counter() - self.t0, 3)}

    def from_scratch(self) -> bool:
        """No finished stage reused or resumed earlier work: the total is what the whole job costs."""
        return not any(s.reused or s.resumed for s in self.done)

    def total_line(self) -> str:
        total = time.perf_counter() - self.t0
        parts = ", ".join(f"{s.name} {fmt_duration(s.seconds)}" + (" (reused)" if s.reused else "") for s in self.done)
        return f"total {fmt_duration(total)}: {parts}"

    def close(self) -> None:
        """Close the bar (the caller prints :meth:`total_line` under its results)."""
        self.bar.close()
        self._stack.close()


class GenerationMeter:
    """Records, records/s and ETA of the generate stage, summed over its data folders."""

    def __init__(self, chain: ChainProgress, remaining: int | None) -> None:
        self.chain, self.remaining = chain, remaining
        self.banked_records, self.banked_seconds = 0, 0.0  # finished folders
        self.records, self.seconds = 0, 0.0  # the current folder (its generator's counts)
        self.shards = 0
        self.work_t0: float | None = None  # when the first folder's shards began: the heartbeat's rate starts there

    def folder(self) -> Callable[[dict], None]:
        """The callback for the next data folder (banks the counts of the previous one)."""
        self.banked_records += self.records
        self.banked_seconds += self.seconds
        self.records, self.seconds = 0, 0.0
        return self.on_shard

    def on_shard(self, event: dict) -> None:
        """The generator's callback after each shard (counts since its start); an ``in_shard`` event only moves the
        heartbeat."""
        if self.work_t0 is None and "seconds" in event:  # loading, packing and the probes stay out of the rate
            self.work_t0 = time.perf_counter() - float(event["seconds"])
        if "in_shard" in event:
            self._beat(self.banked_records + int(event.get("new_records", 0)))
            return
        self.records, self.seconds = int(event["new_records"]), float(event["seconds"])
        self._beat(self.banked_records + self.records)
        self.shards += 1
        new, secs = self.banked_records + self.records, self.banked_seconds + self.seconds
        rate = new / secs if secs > 0 else 0.0
        left = max(0, self.remaining - new) if self.remaining else None
        eta = fmt_duration(left / rate) if left is not None and rate > 0 else "?"
        budget = f"/{self.remaining:,}" if self.remaining else ""
        self.chain.bar.set_postfix_str(f"{new:,}{budget}, {rate:,.1f} records/s, ETA {eta}")
        if self.remaining:
            self.chain._advance(min(1.0, new / self.remaining))
        if self.shards > 1:
            return
        if left is None:
            self.chain.log.info("generate: first shard: %s records in %s (%.1f records/s); no budget (max_records "
                                "null): every prompt is labelled", f"{new:,}", fmt_duration(secs), rate)
        else:
            self.chain.log.info("generate: first shard: %s records in %s (%.1f records/s); %s records to go, ETA %s. "
                                "Too long? Stop it (Ctrl-C) and pass a smaller --data.max_records: finished shards "
                                "are kept", f"{new:,}", fmt_duration(secs), rate, f"{left:,}", eta)

    def _beat(self, records: int) -> None:
        stage = self.chain.current
        if stage is not None and stage.heartbeat is not None:
            stage.heartbeat.update(records, self.remaining or None, work_t0=self.work_t0)
