"""A row runs again only when a slow phase hit it: forwards timed against the curve (``benchmark.pace``),
the prompt's median pace as the norm, target-only measured as every row, the reference row once."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmark.bench import Bench, DecodeSettings, RunOrder
from benchmark.config import BenchmarkConfig
from benchmark.pace import Pace, PaceMeter, excess, normal_pace
from benchmark.plan import run_rows
from benchmark.rows import Row
from compute.timing import CostModel

pytestmark = pytest.mark.usefixtures("one_thread")

CURVE = CostModel(draft_s_per_token=0.01, target_s={1: 0.1, 2: 0.1, 4: 0.2})


class _Echo(torch.nn.Module):
    """A model whose forward sleeps nothing and counts its calls (called by keyword, as transformers does)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        return input_ids


def test_the_meter_prices_decoding_passes_and_leaves_prefills_out():
    target, draft = _Echo(), _Echo()
    with PaceMeter({"target": target, "draft": draft}, CURVE) as meter:
        target(input_ids=torch.zeros(1, 3, dtype=torch.long))   # a verification pass of 3: t(3) interpolated
        target(input_ids=torch.zeros(1, 40, dtype=torch.long))  # a prefill: longer than the curve, not priced
        draft(input_ids=torch.zeros(1, 1, dtype=torch.long))
        draft(torch.zeros(1, 2, dtype=torch.long))              # positional: priced too
        draft(input_ids=torch.zeros(1, 30, dtype=torch.long))   # the draft's prefill
    assert meter.pace.predicted["target"] == pytest.approx(CURVE.target_time(3))
    assert meter.pace.predicted["draft"] == pytest.approx(0.02)
    assert 0 < meter.pace.actual["target"] < 1 and 0 < meter.pace.actual["draft"] < 1
    target(input_ids=torch.zeros(1, 1, dtype=torch.long))  # hooks gone after the block
    assert meter.pace.predicted["target"] == pytest.approx(CURVE.target_time(3)) and target.calls == 3


def test_excess_weighs_each_models_time_by_its_normal_pace():
    fast = Pace(actual={"target": 1.1, "draft": 0.6}, predicted={"target": 1.0, "draft": 0.5})
    slow = Pace(actual={"target": 1.5, "draft": 0.6}, predicted={"target": 1.0, "draft": 0.5})
    only_target = Pace(actual={"target": 2.2}, predicted={"target": 2.0})
    normal = normal_pace([fast, fast, slow, only_target])
    assert normal == {"target": pytest.approx(1.1), "draft": pytest.approx(1.2)}
    assert excess(fast, normal) == pytest.approx(0.0)
    assert excess(slow, normal) == pytest.approx(2.1 / 1.7 - 1)  # 0.4 s over the 1.7 s its forwards normally take
    assert excess(only_target, normal) == pytest.approx(0.0)
    assert excess(Pace(), normal) is None and excess(None, normal) is None  # nothing priced: cannot be judged
    assert excess(fast, {"target": 1.0}) is None


def test_only_target_only_and_the_rows_a_slow_phase_hit_run_again(monkeypatch):
    """Pass 1 in plan order; pass 2 reversed with only the row whose forwards ran slow and the row that cannot be
    judged (target-only is measured as every row is); the others and the reference row once. Runs are counted, the
    faster run kept."""
    import benchmark.plan as bm

    calls: list[tuple[int, str]] = []
    slow_first = {"b"}  # b's first run fell in a slow phase
    paces = {"target-only": Pace({"target": 1.0}, {"target": 1.0}),
             "a": Pace({"target": 1.0, "draft": 1.0}, {"target": 1.0, "draft": 1.0}),
             "c": Pace({"target": 1.02, "draft": 1.0}, {"target": 1.0, "draft": 1.0}),  # 1% over: not again
             "d": Pace()}  # no priced forward (e.g. nothing hooked): cannot be judged, runs again

    def runner(name: str, reference: bool = False):
        def run(view: Bench) -> Row:
            k = sum(1 for j, n in calls if j == view.offset and n == name)
            calls.append((view.offset, name))
            return Row(name, "engine", seconds=[2.0 if k == 0 and name in slow_first else 1.0], outputs=[[1]],
                       reference=reference)
        return run

    def paced(run, view):
        row = run(view)
        slow = Pace({"target": 2.0, "draft": 1.0}, {"target": 1.0, "draft": 1.0})
        first = sum(1 for j, n in calls if j == view.offset and n == row.name) == 1
        return row, (slow if row.name in slow_first and first else paces.get(row.name, paces["a"]))

    monkeypatch.setattr(bm, "_run_paced", paced)
    plan = [(n, runner(n)) for n in ("target-only", "a", "b", "c", "d")] + [("ref", runner("ref", reference=True))]
    cfg = BenchmarkConfig(repeats=2, curve_probes=False, n_prompts=1, rerun_slower_than=0.05)
    bench = Bench(DecodeSettings.of(cfg), None, None, None, None, prompts=[[1]], eos=[0],  # type: ignore[arg-type]
                  cost_model=CURVE)
    rows = {r.name: r for r in run_rows(plan, bench, RunOrder.of(cfg))}
    assert [n for _, n in calls] == ["target-only", "a", "b", "c", "d", "ref", "d", "b"]
    assert {n: r.runs for n, r in rows.items()} == {"target-only": 1, "a": 1, "b": 2, "c": 1, "d": 2, "ref": 1}
    assert rows["b"].seconds == [1.0]  # the faster run kept

    assert "faster of 2" not in rows["target-only"].note
    calls.clear()  # null: every row twice, as before
    every_time = dataclasses.replace(cfg, rerun_slower_than=None)
    bench = Bench(DecodeSettings.of(every_time), None, None, None, None, prompts=[[1]], eos=[0],  # type: ignore[arg-type]
                  cost_model=CURVE)
    run_rows(plan, bench, RunOrder.of(every_time))
    assert len(calls) == 11


def test_a_negative_tolerance_is_refused():
    with pytest.raises(ValueError, match="rerun_slower_than"):
        BenchmarkConfig(rerun_slower_than=-0.1)


def test_a_run_stored_before_the_option_resumes_as_every_row_twice():
    from benchmark.resume import _differences, run_identity

    now = run_identity(BenchmarkConfig(rerun_slower_than=None), [[1]])
    stored = {"config": {k: v for k, v in now["config"].items() if k != "rerun_slower_than"}, "prompts": now["prompts"]}
    assert _differences(stored, now) == []
    adaptive = run_identity(BenchmarkConfig(rerun_slower_than=0.05), [[1]])
    assert _differences(stored, adaptive) == ["rerun_slower_than: stored None, now 0.05"]


def test_rows_are_paced_through_hooks_on_the_bench_models():
    """Without stubs: the runners' forwards reach the meter's hooks; a row that ran no priced forward runs again."""
    target, draft = _Echo(), _Echo()
    calls: list[str] = []

    def runner(name: str, forwards: bool):
        def run(view: Bench) -> Row:
            calls.append(name)
            if forwards:
                view.target(input_ids=torch.zeros(1, 2, dtype=torch.long))
                view.draft(input_ids=torch.zeros(1, 1, dtype=torch.long))
            return Row(name, "engine", seconds=[1.0], outputs=[[1]])
        return run

    plan = [("target-only", runner("target-only", True)), ("a", runner("a", True)), ("b", runner("b", False))]
    cfg = BenchmarkConfig(repeats=2, curve_probes=False, n_prompts=1, rerun_slower_than=10.0)
    bench = Bench(DecodeSettings.of(cfg), draft, target, None, None, prompts=[[1]], eos=[0],  # type: ignore[arg-type]
                  cost_model=CURVE)
    rows = {r.name: r for r in run_rows(plan, bench, RunOrder.of(cfg))}
    assert calls == ["target-only", "a", "b", "b"] and rows["b"].runs == 2 and rows["a"].runs == 1
    assert target._forward_pre_hooks == {} and target._forward_hooks == {}  # hooks removed after each run
