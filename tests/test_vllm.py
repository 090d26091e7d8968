"""specstop inside vLLM, the parts that need no vLLM: per-request stopping over a batched draft loop (hand-made
logits make each request's stop known), the per-batch schedule and its pasteable settings, the replay check's
pricing, and the one-line refusals. The proposer itself runs in ``.venv-vllm`` (``pipelines.vllm_bench``,
``benchmarks/bench_catch_up.py``)."""
from __future__ import annotations

import pytest
import torch

from compute.timing import CostModel
from decoding.policies import build_policy
from runtimes.vllm.bench import RowRole, RowRun, VllmBenchConfig
from runtimes.vllm.check import check_rows, predicted_seconds, step_levels, step_price
from runtimes.vllm.engine import StepLog
from runtimes.vllm.proposer import PolicySettings, build_stopper, check_vllm, load_curves
from runtimes.vllm.settings import BatchPick, paste_lines, schedule_ranges
from runtimes.vllm.stopper import RequestStopper, curve_for_batch

V = 32


def logits(rows: list[float]) -> torch.Tensor:
    """[B, V] logits whose argmax is token 3 with top-1 probability about ``p`` per row."""
    out = torch.zeros(len(rows), V)
    for i, p in enumerate(rows):
        out[i, 3] = torch.log(torch.tensor(p * (V - 1) / (1 - p)))
    return out


def curve(draft: float = 0.01, per_token: float = 0.002, base: float = 0.1) -> CostModel:
    return CostModel(draft_s_per_token=draft, target_s={L: base + per_token * (L - 1) for L in range(1, 10)},
                     runtime="vllm")


def test_each_request_stops_by_its_own_policy() -> None:
    stopper = RequestStopper(build_policy("svip:0.5"))  # SVIP stops where the draft's entropy bound is crossed
    stopper.begin_round(["a", "b"], None, num_speculative_tokens=5)
    sure, unsure = 0.99, 0.2
    _, done = stopper.step(logits([sure, unsure]))
    assert not done  # b stopped, a goes on
    for _ in range(4):
        if done:
            break
        _, done = stopper.step(logits([sure, unsure]))
    a, b = stopper.proposals()
    assert len(a) == 5 and a == [3] * 5  # the greedy token, drafted to the cap
    assert len(b) == 1  # b's unsure token was drafted, then its round stopped
    assert stopper.counts.idle_rows == 4  # b's rows rode the four later draft positions
    assert stopper.counts.steps[-1] == (2, 5, (6 + 2) / 2)


def test_static_policy_drafts_exactly_k_and_stops_the_loop() -> None:
    stopper = RequestStopper(build_policy("static:2"))
    stopper.begin_round(["a"], None, num_speculative_tokens=8)
    assert stopper.step(logits([0.5]))[1] is False
    assert stopper.step(logits([0.5]))[1] is True  # every request done: the proposer ends vLLM's loop
    assert stopper.proposals() == [[3, 3]]


def test_feedback_accepts_sent_minus_rejected_and_new_requests_start_fresh() -> None:
    stopper = RequestStopper(build_policy("static:3"))
    stopper.begin_round(["a", "b"], None, 3)
    for _ in range(3):
        stopper.step(logits([0.9, 0.9]))
    stopper.proposals()
    stopper.begin_round(["a", "c"], rejected=[1, 0], num_speculative_tokens=3)  # b finished, c is new
    assert stopper.counts.accepted == 2
    assert set(stopper._policies) == {"a", "c"}  # noqa: SLF001 - the per-request copies


def test_goodput_needs_a_curve_and_drafts_nothing_where_no_round_pays() -> None:
    from predictors.calibration import Calibrator
    from predictors.goodput import GoodputPolicy

    half = Calibrator("isotonic", x=[0.0, 1.0], y=[0.5, 0.5])  # every draft accepted with probability 1/2
    policy = GoodputPolicy(build_policy("adaedl:0.5"), {"greedy": half})
    with pytest.raises(ValueError, match="measure_costs --runtime vllm"):
        RequestStopper(policy)
    costly = {1: curve(draft=1.0)}  # a draft step costs ten target forwards: no round can pay
    stopper = RequestStopper(policy, costly, batch_rule=False)  # one request priced alone: it drafts nothing
    stopper.begin_round(["a"], None, 5)
    assert stopper.all_stopped() and stopper.proposals() == [[]]
    # the batch rule prices vLLM's first draft forward as paid (vLLM runs it anyway): its token costs only its
    # verification and is sent; the next forward is not run
    batch = RequestStopper(policy, costly)
    batch.begin_round(["a"], None, 5)
    assert not batch.all_stopped()
    assert batch.step(logits([0.9]))[1] is True and batch.proposals() == [[3]]
    cheap = RequestStopper(policy, {1: curve(draft=0.001, per_token=0.0005)})
    cheap.begin_round(["a"], None, 5)
    assert not cheap.all_stopped()


def test_curve_for_batch_takes_the_next_measured_size() -> None:
    curves = {1: curve(base=0.1), 4: curve(base=0.2), 8: curve(base=0.3)}
    assert curve_for_batch(curves, 1) is curves[1]
    assert curve_for_batch(curves, 3) is curves[4]
    assert curve_for_batch(curves, 16) is curves[8]


def test_schedule_merges_equal_neighbours_and_starts_at_one() -> None:
    picks = [BatchPick(1, 3, 1.4, 1.3, 3), BatchPick(2, 3, 1.2, 1.1, 3), BatchPick(4, 0, 0.97, 1.0, 1),
             BatchPick(8, 0, 0.9, 1.0, 1)]
    assert schedule_ranges(picks, 8) == ((1, 3, 3), (4, 8, 1))  # where no K pays, the best K, not 0
    lines = paste_lines(picks, "D", 8)
    assert '"num_speculative_tokens": 3' in lines[0]
    assert '"num_speculative_tokens_per_batch_size": [[1, 3, 3], [4, 8, 1]]' in lines[1]
    assert "vllm serve" in lines[2] and "at 4, 8 concurrent requests no K is predicted 1.15x" in lines[3]
    none = [BatchPick(1, 0, 0.95, 1.0, 2)]
    assert "do not speculate" in paste_lines(none, "D", 4)[0]


def test_replay_check_prices_decode_steps_and_takes_prefill_as_measured() -> None:
    cm = curve()
    assert step_price(cm, 0) == pytest.approx(0.1)
    assert step_price(cm, 3) == pytest.approx(3 * 0.01 + 0.1 + 0.006)
    steps = [StepLog(0.5, 1, False), StepLog(0.2, 1, True), StepLog(0.2, 1, True)]
    row = RowRun(name="vllm:3", batch=1, spec="vllm:3", outputs=[[[1] * 8]], seconds=[0.9], steps=[steps])
    assert predicted_seconds(row, {1: cm}, lambda b: 3) == [pytest.approx(0.5 + 2 * step_price(cm, 3))]
    pol = RowRun(name="p", batch=1, spec="p", outputs=[[[1] * 8]], seconds=[0.9], steps=[steps],
                 rounds=[[(1, 2, 3.0), (1, 1, 1.0), (1, 0, 1.0)]])  # the last step skipped the draft's forward
    per = ((2 * 0.01 + cm.target_time(3.0)) + (1 * 0.01 + cm.target_time(1.0)) + cm.target_time(1.0)) / 3
    assert predicted_seconds(pol, {1: cm}, None) == [pytest.approx(0.5 + 2 * per)]
    skipping = curve()
    skipping.extra["skip_s"] = 0.12  # the curve's skipped step prices the round that ran no forward
    per = ((2 * 0.01 + cm.target_time(3.0)) + (1 * 0.01 + cm.target_time(1.0)) + 0.12) / 3
    assert predicted_seconds(pol, {1: skipping}, None) == [pytest.approx(0.5 + 2 * per)]
    alone = RowRun(name="target", batch=1, spec="target", outputs=[[[1] * 8]], seconds=[0.9], steps=[steps],
                   role=RowRole("target"))
    assert predicted_seconds(alone, {1: cm}, lambda b: 0) == [pytest.approx(0.5 + 2 * cm.target_time(1))]
    k0 = RowRun(name="per-batch", batch=1, spec="per-batch", outputs=[[[1] * 8]], seconds=[0.9], steps=[steps],
                role=RowRole("per_batch"))  # vLLM's K = 0 still runs the draft's forward
    assert predicted_seconds(k0, {1: cm}, lambda b: 0) == [pytest.approx(0.5 + 2 * (0.01 + cm.target_time(1)))]


def test_replay_check_takes_the_curves_level_from_the_fixed_rows_steps() -> None:
    cm = curve()
    slow = [StepLog(0.5, 1, False), *[StepLog(1.5 * step_price(cm, 3), 1, True)] * 2]  # host 1.5x slower than its curve
    fixed = RowRun(name="vllm:3", batch=1, spec="vllm:3", outputs=[[[1] * 8]], seconds=[0.5 + 3 * step_price(cm, 3)],
                   steps=[slow])
    pol_steps = [StepLog(0.5, 1, False), *[StepLog(0.3, 1, True)] * 2]
    pol = RowRun(name="p", batch=1, spec="p", outputs=[[[1] * 8]], seconds=[0.9], steps=[pol_steps],
                 rounds=[[(1, 3, 4.0)]])
    k_of = {"vllm:3": lambda b: 3, "p": None}
    # one speculative fixed row cannot tell the draft's level from the target's: one shared factor
    assert step_levels([fixed, pol], {1: cm}, k_of) == {1: (pytest.approx(1.5), pytest.approx(1.5))}
    rows = check_rows([fixed, pol], {1: cm}, k_of)  # policy rows never set the level
    assert rows[0]["ratio"] == pytest.approx(1.0, abs=1e-3) and rows[0]["verify_level"] == pytest.approx(1.5)
    assert rows[1]["ratio"] == pytest.approx(0.9 / (0.5 + 1.5 * 2 * step_price(cm, 3)), abs=1e-3)


def test_replay_check_fits_the_drafts_level_apart_from_the_targets() -> None:
    """Beside another engine the target's steps slowed 1.3x and the draft's 0.9x: the target alone and vLLM's K = 3
    recover both factors, and a policy's steps are priced with them."""
    cm = curve()
    price = {0: 1.3 * cm.target_time(1), 3: 0.9 * 3 * cm.draft_s_per_token + 1.3 * cm.target_time(4)}

    def row(name: str, k: int, role: RowRole) -> RowRun:
        steps = [StepLog(0.5, 1, False), *[StepLog(price[k], 1, True)] * 4]
        return RowRun(name=name, batch=1, spec=name, outputs=[[[1] * 8]], seconds=[0.5 + 4 * price[k]],
                      steps=[steps], role=role)

    alone, k3 = row("target", 0, RowRole("target")), row("vllm:3", 3, RowRole("static", k=3))
    pol = RowRun(name="p", batch=1, spec="p", outputs=[[[1] * 8]], seconds=[0.5 + 4 * price[3]],
                 steps=[k3.steps[0]], rounds=[[(1, 3, 4.0)]])  # the same steps as K = 3
    k_of = {"target": lambda b: 0, "vllm:3": lambda b: 3, "p": None}
    assert step_levels([alone, k3, pol], {1: cm}, k_of)[1] == (pytest.approx(0.9), pytest.approx(1.3))
    assert [r["ratio"] for r in check_rows([alone, k3, pol], {1: cm}, k_of)] == [pytest.approx(1.0)] * 3


def test_replay_prices_the_policies_engine_at_its_own_static_ks_levels() -> None:
    """vLLM's K = 3 ran at its curve; the policies' engine ran 1.3x slower: its static K = 3 sets its rows' level,
    so a policy there replays at 1.0, and a policy stopping per request in another engine keeps vLLM's level."""
    cm = curve()

    def row(name: str, factor: float, role: RowRole, rounds: list | None = None) -> RowRun:
        price = factor * step_price(cm, 3)
        return RowRun(name=name, batch=1, spec=name, outputs=[[[1] * 8]], seconds=[0.5 + 4 * price],
                      steps=[[StepLog(0.5, 1, False), *[StepLog(price, 1, True)] * 4]], role=role,
                      rounds=[rounds] if rounds else [])

    vllm3 = row("vllm:3", 1.0, RowRole("static", k=3))
    ours3 = row("static:3 (policies' engine)", 1.3, RowRole("static", k=3, in_proposer=True), [(1, 3, 4.0)])
    pol = row("p", 1.3, RowRole("policy", spec="p"), [(1, 3, 4.0)])
    alone = row("p (per request)", 1.3, RowRole("policy", spec="p", per_request=True), [(1, 3, 4.0)])
    k_of = {"vllm:3": lambda b: 3, ours3.name: None, "p": None, alone.name: None}
    got = {r["row"]: r for r in check_rows([vllm3, ours3, pol, alone], {1: cm}, k_of)}
    assert got["vllm:3"]["ratio"] == pytest.approx(1.0, abs=1e-3)
    assert got["p"]["ratio"] == pytest.approx(1.0, abs=1e-3) and got["p"]["verify_level"] == pytest.approx(1.3)
    slower = (0.5 + 4 * 1.3 * step_price(cm, 3)) / (0.5 + 4 * step_price(cm, 3))
    assert got[alone.name]["ratio"] == pytest.approx(slower, abs=1e-3)


def test_replay_prices_vllms_own_engines_at_the_target_alones_pace_beside_them() -> None:
    """vLLM's K = 1 ran at the curve's pace, its K = 3 minutes later in a phase 1.4x slower, which the target alone's
    runs beside it met too: at the target alone's pace both replay at 1.0, where one level for both missed each."""
    cm = curve()
    alone_s = 0.5 + 4 * step_price(cm, 0)

    def row(name: str, k: int, slow: float, role: RowRole, beside: list[float]) -> RowRun:
        price = slow * step_price(cm, k)
        return RowRun(name=name, batch=1, spec=name, outputs=[[[1] * 8]], seconds=[slow * 0.5 + 4 * price],
                      steps=[[StepLog(slow * 0.5, 1, False), *[StepLog(price, 1, True)] * 4]], role=role,
                      beside=beside)

    alone = row("target", 0, 1.0, RowRole("target"), [])
    k1 = row("vllm:1", 1, 1.0, RowRole("static", k=1), [alone_s])
    k3 = row("vllm:3", 3, 1.4, RowRole("static", k=3), [1.4 * alone_s])
    k_of = {"target": lambda b: 0, "vllm:1": lambda b: 1, "vllm:3": lambda b: 3}
    got = check_rows([alone, k1, k3], {1: cm}, k_of)
    assert [r["ratio"] for r in got] == [pytest.approx(1.0, abs=1e-3)] * 3
    assert got[2]["measured_tokens_per_s"] == pytest.approx(8 / (0.5 + 4 * step_price(cm, 3)), rel=1e-3)


def test_curve_file_of_another_runtime_is_refused(tmp_path) -> None:
    path = tmp_path / "cm.json"
    CostModel(draft_s_per_token=0.01, target_s={1: 0.1, 2: 0.11}, runtime="llamacpp").to_json(path)
    with pytest.raises(ValueError, match="not vLLM's"):
        load_curves(path)
    c = curve()
    c.extra["batch_curves"] = {"1": curve().to_dict(), "4": curve(base=0.3).to_dict()}
    c.to_json(path)
    assert sorted(load_curves(path)) == [1, 4]


def test_bad_input_is_one_line() -> None:
    with pytest.raises(ValueError, match="multiple of every batch size"):
        VllmBenchConfig(n_prompts=6, batch_sizes=[1, 4])
    with pytest.raises(ValueError, match="K = 0 is the target-alone row"):
        VllmBenchConfig(static_k=[0])
    with pytest.raises(ValueError, match="unknown policy"):
        build_stopper(PolicySettings(spec="nonsense:1"))


def test_missing_vllm_names_the_setup_command() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="scripts/setup.sh --vllm"):
            check_vllm()
    else:
        pytest.skip("vLLM is installed here")


def test_recommend_picks_a_k_per_batch_and_zero_where_drafting_does_not_pay(tmp_path) -> None:
    from main_job.recommend import vllm_batch_picks
    from tests.synthetic import make_records

    cols = make_records(n_prompts=30, tokens_per_prompt=40, companion=False)
    cheap = CostModel(draft_s_per_token=0.05, target_s={1: 1.0, 9: 1.05}, runtime="vllm")  # batch 1: drafts pay
    dear = CostModel(draft_s_per_token=0.5, target_s={1: 1.0, 2: 2.0, 9: 9.0}, runtime="vllm")  # batch 4: never
    one, four = vllm_batch_picks(cols, {1: cheap, 4: dear})
    assert one.batch == 1 and one.k >= 1 and one.test_speedup > 1.0
    assert four.batch == 4 and four.k == 0 and four.test_speedup == 1.0
    lines = paste_lines([one, four], "D", 8)
    assert f'"num_speculative_tokens_per_batch_size": [[1, 3, {one.k}], [4, 8, {max(1, four.best_k)}]]' in lines[1]


def test_a_stored_vllm_run_renders_its_rows_and_goals(tmp_path) -> None:
    import json

    import yaml

    from rendering.result_store import load_summaries, write_summary
    from runtimes.vllm.results import summarize_vllm_benchmark, vllm_block, vllm_readme_lines

    out = tmp_path / "run"
    out.mkdir()
    rows = [{"row": "vLLM target alone", "batch": 1, "tokens_per_s": 10.0, "speedup": 1.0, "speedup_lo": 1.0,
             "speedup_hi": 1.0, "identical": 8, "prompts": 8, "acceptance": None, "idle_share": None,
             "replay_ratio": 1.0, "role": {"what": "target"}},
            {"row": "vllm:3 (recommended)", "batch": 1, "tokens_per_s": 12.0, "speedup": 1.2, "speedup_lo": 1.1,
             "speedup_hi": 1.3, "identical": 8, "prompts": 8, "acceptance": 0.8, "idle_share": None,
             "replay_ratio": 0.97, "role": {"what": "static", "k": 3, "recommended": True}},
            {"row": "adaedl:0.6", "batch": 1, "tokens_per_s": 13.2, "speedup": 1.32, "speedup_lo": 1.2,
             "speedup_hi": 1.4, "identical": 8, "prompts": 8, "acceptance": 0.9, "idle_share": 0.0,
             "replay_ratio": 1.0, "vs_fastest_fixed": [1.1, 1.02, 1.19], "fastest_fixed": "vllm:3 (recommended)",
             "by_position": {"1": [100, 0.86, 0.84]}, "role": {"what": "policy", "spec": "adaedl:0.6"}}]
    goals = {"batch_1": {"fastest_fixed": "vllm:3 (recommended)", "recommended_row": "vllm:3 (recommended)",
                         "recommended_vs_fastest": 1.0, "recommended_vs_target_alone": 1.2}}
    (out / "benchmark.json").write_text(json.dumps({"table": rows, "goals": goals, "recommendation": ["batch 1: K"]}))
    (out / "config.yaml").write_text(yaml.safe_dump({"models": {"draft": "d", "target": "t"}, "n_prompts": 8,
                                                     "max_new_tokens": 128, "batch_sizes": [1]}))
    c = curve()
    c.machine = {"model_name": "AMD EPYC", "simd_flags": ["avx2"], "threads": 2, "vllm": "0.32.0"}
    c.extra["batch_curves"] = {"1": curve().to_dict()}
    c.to_json(out / "cost_model.vllm.json")
    write_summary(summarize_vllm_benchmark(out, "python -m pipelines.vllm_bench"), tmp_path / "results")
    summaries = load_summaries(tmp_path / "results")
    block = vllm_block(summaries)
    assert "| `vllm:3 (recommended)` | 12.00 | 1.20x [1.10, 1.30] |  | 8/8 | 0.80 | 0.970 |  |" in block
    assert "ran 1.000x the fastest fixed setting measured" in block
    assert "| `adaedl:0.6` | 1 | 0.86 / 0.84 (100) |" in block  # predicted / vLLM's acceptance (tokens judged)
    assert "| 1 | `adaedl:0.6` | 1.10x [1.02, 1.19] (`vllm:3 (recommended)`) |  |  |" in vllm_readme_lines(summaries)[1]
    from rendering.result_store import Summary

    xeon = {**summaries[0].data["machine"], "model_name": "Intel(R) Xeon(R) Processor", "family": "6", "model": "207"}
    later = Summary(tmp_path / "later.json", {**summaries[0].data, "machine": xeon, "date": "2099-01-01"})
    both = vllm_block([*summaries, later])  # each host kind's newest run, newest first, under its own heading
    assert both.index("### Intel Xeon") < both.index("### AMD EPYC") and both.count("Measured (") == 2
    from runtimes.vllm.results import vllm_section

    assert "Served from a queue" not in block
    served = Summary(tmp_path / "served.json", {**summaries[0].data, "queue_groups": 2})
    assert "a unit is a stream of 2 x B prompts, at most B in flight" in vllm_section(served)


def test_the_stored_gpu_check_renders() -> None:
    from pathlib import Path

    from rendering.device_results import gpu_block
    from rendering.result_store import load_summaries

    block = gpu_block(load_summaries(Path(__file__).resolve().parents[1] / "results"))
    assert "| pytest | pass |" in block and "**PASS**" in block


def test_a_predictor_for_another_draft_is_refused(tmp_path) -> None:
    from predictors.export import FingerprintMismatch, export_predictor

    folder = tmp_path / "export"
    export_predictor(build_policy("svip:0.5"), folder,
                     {"draft_fingerprint": {"name": "other-draft", "vocab_size": V, "hidden_size": 8}})
    mine = {"name": "packaged:qwen2.5-coder-0.5b-instruct", "vocab_size": V, "hidden_size": 8}
    with pytest.raises(FingerprintMismatch, match="other-draft"):
        build_stopper(PolicySettings(spec=str(folder), draft_fingerprint=mine))


def test_passes_alternate_the_engine_order_and_keep_each_prompts_faster_run(tmp_path) -> None:
    from compute.code_version import PartClock
    from runtimes.vllm.bench import EngineRows, RowRole
    from runtimes.vllm.engine import EngineSpec
    from runtimes.vllm.run import _run_passes

    cfg = VllmBenchConfig(out_dir=str(tmp_path), batch_sizes=[1], n_prompts=2, repeats=2)
    plan = [EngineRows(EngineSpec(target="T"), [RowRole("policy", spec="a")]),
            EngineRows(EngineSpec(target="T", draft="D", k=3), [RowRole("policy", spec="b")])]
    order: list[str] = []
    times = {("a", 0): [2.0, 1.0], ("a", 1): [1.5, 3.0], ("b", 0): [1.0, 1.0], ("b", 1): [2.0, 0.5]}

    def run(group: EngineRows, batches: list[int], done) -> list[RowRun]:
        assert batches == [1]
        name = next(iter(group.rows))
        pass_no = sum(1 for n in order if n == name)
        order.append(name)
        row = RowRun(name=name, batch=1, spec=name)
        for t in times[(name, pass_no)]:
            row.add_unit(([[1, 2]], t, [StepLog(t, 1, True)], {"drafts": t}, [], (0, 0), {}))
        done(1, [row])
        return [row]

    rows = _run_passes(plan, cfg, run, PartClock(tmp_path))
    assert order == ["a", "b", "b", "a"]
    assert [r.seconds for r in rows] == [[1.5, 1.0], [1.0, 0.5]]
    assert rows[1].counters == {"drafts": 1.5}
    clock = PartClock(tmp_path)
    assert _run_passes(plan, cfg, lambda *a: pytest.fail("stored passes are read back"), clock) and len(order) == 4
    assert clock.read_back_s is not None and clock.read_back_s >= 0  # each engine's seconds were kept when it ran


def test_a_stopped_engine_resumes_at_the_first_batch_size_it_did_not_finish(tmp_path) -> None:
    from compute.code_version import PartClock
    from runtimes.vllm.bench import EngineRows, RowRole
    from runtimes.vllm.engine import EngineSpec
    from runtimes.vllm.run import _engine_rows

    cfg = VllmBenchConfig(out_dir=str(tmp_path), batch_sizes=[1, 2, 4], n_prompts=4)
    group = EngineRows(EngineSpec(target="T", draft="D", k=3), [RowRole("policy", spec="a"),
                                                                 RowRole("policy", spec="b")])
    asked: list[list[int]] = []

    def rows_at(batch: int) -> list[RowRun]:
        return [RowRun(name=n, batch=batch, spec=n) for n in group.rows]

    def stopped_at_4(batches: list[int], done) -> list[RowRun]:
        asked.append(batches)
        for b in batches:
            if b == 4:
                raise RuntimeError("killed")
            done(b, rows_at(b))
        return []

    assert _engine_rows(1, 1, group, cfg, 0, stopped_at_4, PartClock(tmp_path)) == []  # failed: no rows this start
    clock = PartClock(tmp_path)

    def the_rest(batches: list[int], done) -> list[RowRun]:
        asked.append(batches)
        for b in batches:
            done(b, rows_at(b))
        return []

    rows = _engine_rows(1, 1, group, cfg, 0, the_rest, clock)
    assert asked == [[1, 2, 4], [4]]  # batch sizes 1 and 2 were kept when they finished
    assert [(r.batch, r.name) for r in rows] == [(b, n) for b in (1, 2, 4) for n in group.rows]
    assert clock.read_back_s is not None  # the parts read back had their seconds recorded


def test_a_differing_output_is_found_at_its_first_difference_against_its_batchs_target_alone() -> None:
    from runtimes.vllm.bench import TARGET_ALONE
    from runtimes.vllm.bench_report import _tie_goals
    from runtimes.vllm.ties import Divergence, divergences

    ref = RowRun(name=TARGET_ALONE, batch=1, spec="target", outputs=[[[1, 2, 3]], [[4, 5]]])
    row = RowRun(name="vllm:3", batch=1, spec="vllm:3", outputs=[[[1, 2, 9]], [[4, 5]]])
    short = RowRun(name="vllm:5", batch=1, spec="vllm:5", outputs=[[[1]], [[4, 5, 6]]])
    other_batch = RowRun(name="vllm:3", batch=4, spec="vllm:3", outputs=[[[7, 7, 7]]])
    assert divergences([ref, row, short, other_batch]) == [
        Divergence("vllm:3", 1, 0, 0, 2, 3, 9), Divergence("vllm:5", 1, 0, 0, 1, 2, -1)]
    ties = [{"gap": 0.03, "reference_is_top1": True}, {"gap": -0.05, "reference_is_top1": False}]
    assert _tie_goals(ties) == {"differing_outputs": 2, "differing_max_abs_gap": 0.05,
                                "differing_reference_top1_share": 0.5}


def test_the_curve_cycles_every_drafting_length_and_ends_each_cycle_with_a_skipped_step() -> None:
    from runtimes.vllm.curve import schedule

    ks = schedule(3, 4, seed=1)
    assert len(ks) == 4 * 5
    for c in range(4):
        cycle = ks[c * 5:(c + 1) * 5]
        assert sorted(cycle[:3]) == [1, 2, 3] and cycle[3:] == [0, 0]
    assert schedule(3, 4, seed=1) == ks


def test_the_curve_prices_each_step_by_what_it_verified_and_drafted() -> None:
    from runtimes.vllm.curve import CurveStep, curve_figures

    # draft 10 ms a token; target side 100 ms + 5 ms a verified token beyond the first; a step verifies the drafts
    # proposed the step before. A skipped step (0 then 0) runs 98 ms; the catch-up step after it drafts 40 ms more.
    def step(before: int, k: int, draft: float = 0.01) -> CurveStep:
        return CurveStep(before, k, 0.1 + 0.005 * before + k * draft, k * draft)

    steps = [step(3, 1), step(1, 3), step(3, 2), step(2, 0), CurveStep(0, 0, 0.098, 0.0),
             CurveStep(0, 2, 0.1 + 0.06, 0.06), step(2, 1, draft=0.012)]
    alone, draft, target, skip = curve_figures([0.09, 0.095, 0.2], steps)
    assert alone == 0.095 and skip == 0.098
    assert draft == pytest.approx(0.01)  # the catch-up step left out
    assert target == pytest.approx({2: 0.105, 3: 0.11, 4: 0.115})  # 2: the steps after 1 draft (both 105 ms)
    with pytest.raises(ValueError, match="skipped steps"):
        curve_figures([0.09], steps[:3])


def test_only_the_plugin_engine_builds_specstops_proposer(monkeypatch) -> None:
    """vLLM's static-K rows must run vLLM's own proposer even after a policy was installed for validation."""
    import runtimes.vllm.bench as vb
    import runtimes.vllm.proposer as vp
    from runtimes.vllm.bench import EngineRows
    from runtimes.vllm.engine import EngineSpec

    calls: list[tuple] = []
    monkeypatch.setattr(vp, "install", lambda s: calls.append(("install", s.spec)))
    monkeypatch.setattr(vp, "uninstall", lambda: calls.append(("uninstall",)))

    class Built(Exception):
        pass

    def build(spec: EngineSpec) -> None:
        raise Built

    monkeypatch.setattr(vb, "build_engine", build)
    cfg = VllmBenchConfig(batch_sizes=[1], n_prompts=1)
    groups = [EngineRows(EngineSpec(target="T", draft="D", k=3), [vb.RowRole("static", k=3)]),
              EngineRows(EngineSpec(target="T", draft="D", k=8), [vb.RowRole("policy", spec="adaedl:0.6")],
                         plugin=True)]
    for group in groups:
        with pytest.raises(Built):
            vb.run_engine(group, {1: [[[1]]]}, cfg,
                          lambda spec, batch_rule, **kw: PolicySettings(spec=spec, batch_rule=batch_rule, **kw))
    assert calls == [("uninstall",), ("install", "adaedl:0.6")]


def test_vllms_own_acceptance_prices_each_k_and_zero_wins_where_drafting_costs_more() -> None:
    from runtimes.vllm.settings import acceptance_picks

    survival = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    cheap, dear = curve(draft=0.01), curve(draft=0.2)
    one, wide = acceptance_picks(survival, {1: cheap, 4: dear})
    # batch 1: K tokens a step 1 + sum S(j), a step 0.01 K + 0.1 + 0.002 K
    expect = {k: (1 + sum(survival[:k])) * 0.1 / (0.01 * k + 0.1 + 0.002 * k) for k in range(1, 9)}
    best = max(expect, key=lambda k: expect[k])
    assert (one.k, one.best_k, one.source) == (best, best, "vllm acceptance")
    assert one.test_speedup == pytest.approx(expect[best], abs=1e-4)
    assert wide.k == 0 and wide.test_speedup == 1.0 and wide.val_speedup < 1.0
    assert "from vLLM's acceptance on validation prompts" in paste_lines([one, wide], "D", 8)[0]


def test_a_resumed_run_refuses_a_curve_of_another_machine(tmp_path) -> None:
    from compute.code_version import PartClock
    from runtimes.vllm.run import COST_FILE, _curves

    cm = curve()
    cm.draft_name, cm.target_name = "packaged:qwen2.5-coder-0.5b-instruct", "packaged:qwen2.5-coder-1.5b-instruct"
    cm.machine = {"model_name": "Some Other CPU", "simd_flags": ["avx2"]}
    cm.to_json(tmp_path / COST_FILE)
    with pytest.raises(ValueError, match="another pair, dtype or machine.*Some Other CPU"):
        _curves(VllmBenchConfig(out_dir=str(tmp_path)), "T", "D", PartClock(tmp_path))


def test_a_curve_of_another_dtype_is_refused_and_a_dtype_vllm_does_not_run_named(tmp_path) -> None:
    from compute.code_version import PartClock
    from runtimes.vllm.run import _curves

    cm = curve()
    cm.dtype = "bfloat16"
    cm.to_json(tmp_path / "bf16.json")
    cfg = VllmBenchConfig(out_dir=str(tmp_path / "run"), cost_file=str(tmp_path / "bf16.json"), vllm_dtype="float32")
    with pytest.raises(ValueError, match="dtype: measured bfloat16, run float32"):
        _curves(cfg, "T", "D", PartClock(tmp_path))
    with pytest.raises(ValueError, match="vllm_dtype='float16': use bfloat16 or float32"):
        VllmBenchConfig(vllm_dtype="float16")


def test_a_k_predicted_inside_the_curves_error_is_not_recommended() -> None:
    from runtimes.vllm.settings import MARGINAL, acceptance_picks

    survival = [0.9] * 8
    base = curve(draft=0.02, per_token=0.0, base=0.1)  # drafting pays well (K = 8: 3.2x)
    slim = curve(draft=0.085, per_token=0.0, base=0.1)  # every K between 1.0x and MARGINAL (K = 8: 1.05x)
    one, four = acceptance_picks(survival, {1: base, 4: slim})
    assert one.k >= 1 and one.test_speedup >= MARGINAL
    assert 1.0 < four.val_speedup < MARGINAL and four.k == 0 and four.best_k >= 1


def test_every_row_runs_each_unit_between_two_runs_of_the_target_alone(monkeypatch) -> None:
    """The target alone's engine stays loaded; it runs each unit before the other engine's first row and after each,
    a row is paired with the mean of the two runs around it, the rows take turns, and the target's second row is
    paired with its first."""
    import runtimes.vllm.bench as vb
    from runtimes.vllm.engine import EngineSpec

    calls: list[str] = []
    warmed: list[tuple[str, int]] = []
    monkeypatch.setattr(vb, "_load", lambda spec: f"engine k={spec.k}")
    monkeypatch.setattr(vb, "StepClock", lambda llm: "clock")
    monkeypatch.setattr(vb, "release", lambda llm: None)
    monkeypatch.setattr(vb, "generate", lambda llm, prompts, n: warmed.append((llm, len(prompts))))
    monkeypatch.setattr(vb.vllm_proposer, "install", lambda s: None)
    monkeypatch.setattr(vb.vllm_proposer, "uninstall", lambda: None)

    class Proposer:
        spec = ""

        def set_policy(self, settings: PolicySettings) -> None:
            self.spec = settings.spec

        def close_traces(self) -> None:
            pass

    proposer = Proposer()
    monkeypatch.setattr(vb.vllm_proposer, "active", lambda: proposer)

    def run_unit(llm, clock, prop, prompts, max_new, batch=None):  # noqa: ANN001, ANN202
        who = prop.spec if prop is not None else llm
        calls.append(who)
        wall = {"engine k=0": 2.0}.get(who, 1.0) * len(calls)  # the host slows down call by call
        return [[1] * 4 for _ in prompts], wall, [], {}, [], (0, 0), {}

    monkeypatch.setattr(vb, "run_unit", run_unit)
    cfg = VllmBenchConfig(batch_sizes=[1], n_prompts=2)
    settings = lambda spec, batch_rule, **kw: PolicySettings(spec=spec, batch_rule=batch_rule, **kw)  # noqa: E731
    target = EngineSpec(target="T")
    ref = vb.Reference(target)
    alone = vb.run_engine(vb.EngineRows(target, [vb.RowRole("target"), vb.RowRole("target", again=True)]),
                          {1: [[[1]], [[2]]]}, cfg, settings, ref)
    assert calls == ["engine k=0"] * 4 and alone[0].beside == [] and alone[1].beside == [2.0, 8.0]
    calls.clear()
    rows = vb.run_engine(vb.EngineRows(EngineSpec(target="T", draft="D", k=8),
                                       [vb.RowRole("policy", spec="a"), vb.RowRole("policy", spec="b")], plugin=True),
                         {1: [[[1]], [[2]]]}, cfg, settings, ref)
    t = "engine k=0"
    assert calls == [t, "a", t, "b", t, t, "b", t, "a", t]
    # unit 0: a between runs 1 and 3 (2 s, 6 s), b between 3 and 5; unit 1 starts with b: 6 and 8, then a: 8 and 10
    assert [r.beside for r in rows] == [[4.0, 18.0], [8.0, 14.0]]
    assert warmed == [("engine k=0", 1), ("engine k=8", 1), ("engine k=0", 1)]  # each engine, each batch size
    from runtimes.vllm.bench_report import paired_rows

    paired = paired_rows([alone[0], *rows])
    assert paired[1].seconds == pytest.approx([2.0 * 2.0 / 4.0, 9.0 * 8.0 / 18.0])  # as if at the target's own pace


def test_a_second_build_of_the_target_alone_runs_beside_the_first(monkeypatch) -> None:
    """``second_build``: the target alone's second row gets an engine of its own (built anew though its spec is the
    reference's) and is paired with the reference's runs around it, like any other engine's row; the noise floor's
    name says which it was."""
    import runtimes.vllm.bench as vb
    from runtimes.vllm.run import _plan

    groups = _plan(VllmBenchConfig(batch_sizes=[1], n_prompts=2, second_build=True), "T", "D", [])
    first, second = groups[:2]
    assert list(first.rows) == ["vLLM target alone"] and not first.fresh
    assert list(second.rows.items()) == [("vLLM target alone (second build)", "second build")] and second.fresh
    assert second.engine == first.engine and not second.roles[0].fixed
    loads: list[str] = []
    monkeypatch.setattr(vb, "_load", lambda spec: loads.append("built") or f"build {len(loads)}")
    monkeypatch.setattr(vb, "StepClock", lambda llm: "clock")
    monkeypatch.setattr(vb, "release", lambda llm: None)
    monkeypatch.setattr(vb, "generate", lambda llm, prompts, n: None)
    monkeypatch.setattr(vb.vllm_proposer, "uninstall", lambda: None)
    calls: list[str] = []

    def run_unit(llm, clock, prop, prompts, max_new, batch=None):  # noqa: ANN001, ANN202
        calls.append(llm)
        return [[1] * 4 for _ in prompts], float(len(calls)), [], {}, [], (0, 0), {}

    monkeypatch.setattr(vb, "run_unit", run_unit)
    ref = vb.Reference(first.engine)
    settings = lambda spec, batch_rule, **kw: PolicySettings(spec=spec, batch_rule=batch_rule, **kw)  # noqa: E731
    rows = vb.run_engine(second, {1: [[[1]]]}, VllmBenchConfig(batch_sizes=[1], n_prompts=1), settings, ref)
    # the reference built first (an engine built after another re-registers vLLM's metrics, and the target alone's
    # have no speculative counters), then its own; the reference runs the unit before and after the row
    assert loads == ["built", "built"] and calls == ["build 1", "build 2", "build 1"]
    assert rows[0].beside == [2.0]  # the mean of the reference's runs around it (1 s and 3 s)
    assert rows[0].name == "vLLM target alone (second build)"


def test_interleaved_rows_step_beside_the_target_alone_and_take_its_seconds_there(monkeypatch) -> None:
    """With ``interleave``, each row runs each unit together with the target alone, their engine steps in turns (the
    one with fewer new tokens next); the row's seconds are its own steps' and its pace reference the target alone's
    steps of the same interleave; the target's second row still runs after its first in its own engine."""
    import benchmark.interleave as il
    import runtimes.vllm.bench as vb
    from runtimes.vllm.engine import EngineSpec

    with pytest.raises(ValueError, match="following_policies"):
        VllmBenchConfig(interleave=True, following_policies=["goodput:x"])
    clock = Clock()
    monkeypatch.setattr(il, "clock", lambda device: clock())
    monkeypatch.setattr(vb, "_load", lambda spec: f"engine k={spec.k}")
    monkeypatch.setattr(vb, "StepClock", lambda llm: "clock")
    monkeypatch.setattr(vb, "release", lambda llm: None)
    monkeypatch.setattr(vb, "generate", lambda llm, prompts, n: None)
    monkeypatch.setattr(vb.vllm_proposer, "install", lambda s: None)
    monkeypatch.setattr(vb.vllm_proposer, "uninstall", lambda: None)
    monkeypatch.setattr(vb.vllm_proposer, "active", lambda: None)
    steps: list[str] = []

    def unit_steps(llm, clock_, prop, prompts, max_new, batch=None, stepped=True):  # noqa: ANN001, ANN202
        per_step, took = (1, 0.5) if llm == "engine k=0" else (2, 1.0)  # the target a token a step; the row two
        for done in range(per_step, 5, per_step):
            steps.append(llm)
            clock.t += took
            yield done
        return [[1] * 4 for _ in prompts], 99.0, [], {}, [], (0, 0), {}

    def run_unit(llm, clock_, prop, prompts, max_new, batch=None):  # noqa: ANN001, ANN202
        steps.append(f"{llm} whole")
        return [[1] * 4 for _ in prompts], 3.0, [], {}, [], (0, 0), {}

    monkeypatch.setattr(vb, "unit_steps", unit_steps)
    monkeypatch.setattr(vb, "run_unit", run_unit)
    cfg = VllmBenchConfig(batch_sizes=[1], n_prompts=1, interleave=True)
    settings = lambda spec, batch_rule, **kw: PolicySettings(spec=spec, batch_rule=batch_rule, **kw)  # noqa: E731
    target = EngineSpec(target="T")
    ref = vb.Reference(target)
    alone = vb.run_engine(vb.EngineRows(target, [vb.RowRole("target"), vb.RowRole("target", again=True)]),
                          {1: [[[1]]]}, cfg, settings, ref)
    assert steps == ["engine k=0 whole"] * 2 and alone[1].beside == [3.0]  # one engine: one run after the other
    steps.clear()
    (row,) = vb.run_engine(vb.EngineRows(EngineSpec(target="T", draft="D", k=3), [vb.RowRole("static", k=3)]),
                           {1: [[[1]]]}, cfg, settings, ref)
    t, k = "engine k=0", "engine k=3"
    assert steps == [k, t, t, k, t, t]  # fewest tokens next, the row first on a tie
    assert row.seconds == [2.0] and row.beside == [2.0]  # each its own steps: 2 x 1.0 s and 4 x 0.5 s


class Clock:
    """A stand-in for ``time.perf_counter`` that moves only when a test moves it."""

    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_batch_rule_prices_a_draft_forward_with_what_scoring_it_cost_here(monkeypatch) -> None:
    """vLLM's curve times its own proposer, which scores nothing; the stopper's own seconds per drafted position are
    measured as it runs and added to the draft forward's price at that batch size."""
    import runtimes.vllm.stopper as vs
    from predictors.calibration import Calibrator
    from predictors.goodput import GoodputPolicy

    policy = GoodputPolicy(build_policy("adaedl:0.5"), {"greedy": Calibrator("isotonic", x=[0.0, 1.0], y=[0.9, 0.9])})
    stopper = RequestStopper(policy, {1: curve(draft=0.01)}, follow=False)
    clock = Clock()
    monkeypatch.setattr(vs.time, "perf_counter", clock)
    decide = stopper._decide_for_batch  # noqa: SLF001

    def scoring() -> None:  # one position scored in 50 ms
        clock.t += 0.05
        decide()

    monkeypatch.setattr(stopper, "_decide_for_batch", scoring)
    stopper.begin_round(["a"], None, 1)
    assert stopper._batch.draft_s == pytest.approx(0.01)  # noqa: SLF001 - nothing measured yet
    stopper.step(logits([0.9]))
    stopper.proposals()
    stopper.begin_round(["a"], [0], 1)
    assert stopper._batch.draft_s == pytest.approx(0.06)  # noqa: SLF001


def test_the_batch_rule_prices_steps_at_the_factors_the_engine_meets(monkeypatch) -> None:
    """A round's draft forwards timed from its start to its proposals (less the scoring) and its verification from the
    proposals to the next round, each against the curve: the next rounds price the draft and the target at those
    factors; a step that took a new request in (its prefill) is not counted as a verification."""
    import runtimes.vllm.stopper as vs
    from predictors.calibration import Calibrator
    from predictors.goodput import GoodputPolicy
    from runtimes.vllm.met_costs import MetCosts

    cm = curve(draft=0.01)
    policy = GoodputPolicy(build_policy("adaedl:0.5"), {"greedy": Calibrator("isotonic", x=[0.0, 1.0], y=[0.9, 0.9])})
    clock = Clock()
    monkeypatch.setattr(vs.time, "perf_counter", clock)
    for follow in (True, False):
        stopper = RequestStopper(policy, {1: cm}, follow=follow)
        stopper.begin_round(["a"], None, 1)
        clock.t += 0.02  # the draft's forward: twice the curve's
        stopper.step(logits([0.9]))
        stopper.proposals()
        length = stopper.counts.steps[-1][2]
        clock.t += 1.5 * cm.target_time(length)  # the verification: 1.5x the curve's
        stopper.begin_round(["a"], [0], 1)
        assert stopper.met.levels(1) == (pytest.approx(2.0), pytest.approx(1.5))
        batch = stopper._batch  # noqa: SLF001
        expect = (0.02, 1.5 * cm.target_time(3.0)) if follow else (0.01, cm.target_time(3.0))
        assert (batch.draft_s, batch.target_time(3.0)) == (pytest.approx(expect[0]), pytest.approx(expect[1]))
    stopper.proposals()
    clock.t += 10.0  # a new request's prefill in the step
    stopper.begin_round(["a", "b"], [0, 0], 1)
    assert stopper.met.seen[1][1] == 1  # the verifications counted: the first only
    met = MetCosts()
    assert met.levels(4) == (1.0, 1.0)
    met.draft(4, 0.5)
    assert met.levels(4) == (1.0, 1.0)  # the curve as measured until both are met
    for f in [1.5] + [9.0] * 30:
        met.verify(4, f)
    assert met.levels(4) == (0.5, pytest.approx(4.0, abs=0.05))  # the latest weigh most, each kept within 4x


def test_each_positions_acceptance_follows_vllms_verdicts_there() -> None:
    """A map that says 0.9 where vLLM accepts half: after enough judged tokens the batch rule sees about half at that
    position (20 tokens judged as calibrated start the tally); as measured, it keeps the map's 0.9."""
    from predictors.calibration import Calibrator
    from predictors.goodput import GoodputPolicy
    from runtimes.vllm.stopper import PSEUDO_TOKENS

    policy = GoodputPolicy(build_policy("adaedl:0.5"), {"greedy": Calibrator("isotonic", x=[0.0, 1.0], y=[0.9, 0.9])})
    seen = {}
    for follow in (True, False):
        stopper = RequestStopper(policy, {1: curve(draft=0.001)}, max_draft_len=1, follow=follow)
        rejected = None
        for r in range(200):
            stopper.begin_round(["a"], rejected, 1)
            stopper.step(logits([0.9]))
            sent = stopper.proposals()[0]
            rejected = [len(sent) * (r % 2)]  # every other round's token rejected
        seen[follow] = stopper._acceptance[0][0]  # noqa: SLF001 - the last round's acceptance at position 1
        assert stopper.counts.per_request["a"] == [1] * 200  # each round sent its token
        assert stopper.tally[1] == [199.0, pytest.approx(0.9 * 199), 100.0]  # rounds 0-198 judged, even ones accepted
    assert seen[False] == pytest.approx(0.9)
    assert seen[True] == pytest.approx(0.9 * (100 + PSEUDO_TOKENS) / (0.9 * 199 + PSEUDO_TOKENS))


def test_static_zero_drafts_nothing_and_skips_the_drafts_forward() -> None:
    """``static:0`` (the target alone in the policies' engine): no request drafts, so the step skips the draft's
    first forward whatever the rule (the draft catches up later), and the step is recorded with no forward."""
    stopper = RequestStopper(build_policy("static:0"), skip_idle=True)
    stopper.begin_round(["a", "b"], None, num_speculative_tokens=8)
    assert stopper.all_stopped() and not stopper.batch_rule
    assert stopper.proposals() == [[], []]
    assert stopper.counts.steps[-1] == (2, 0, 1.0)
    kept = RequestStopper(build_policy("static:0"))  # without skipping, vLLM's first forward runs and is counted
    kept.begin_round(["a"], None, 8)
    kept.proposals()
    assert kept.counts.steps[-1] == (1, 1, 1.0)


def test_the_policies_engine_runs_static_ks_beside_the_policies() -> None:
    from runtimes.vllm.run import _plan

    cfg = VllmBenchConfig(batch_sizes=[1], n_prompts=1, policies=["adaedl:0.6"], following_policies=["goodput:x"],
                          proposer_static_k=[0, 3], engine_vllm_k=[])
    groups = _plan(cfg, "T", "D", [])
    engine = next(g for g in groups if g.plugin)
    assert list(engine.rows.items()) == [("adaedl:0.6", "adaedl:0.6"), ("goodput:x (following)", "goodput:x"),
                                         ("static:0 (policies' engine)", "static:0"),
                                         ("static:3 (policies' engine)", "static:3")]
    static = engine.roles[-1]
    assert not static.fixed and static.in_policies_engine and not static.ablation  # not one of vLLM's own settings
    assert engine.roles[1].ablation and engine.roles[1].following
    with pytest.raises(ValueError, match="proposer_static_k"):
        VllmBenchConfig(batch_sizes=[1], n_prompts=1, proposer_static_k=[9])


def test_vllms_own_loop_runs_beside_the_policies_and_is_priced_as_vllms_k() -> None:
    """``engine_vllm_k``: vLLM's own draft loop at K in the policies' engine (spec ``vllm:K``), one of the engine's
    fixed settings (its levels, its in-engine comparison), priced as vLLM's K, not as a policy's logged rounds."""
    from runtimes.vllm.proposer import own_loop_k
    from runtimes.vllm.run import _k_of, _plan

    cfg = VllmBenchConfig(batch_sizes=[1], n_prompts=1, static_k=[3], default_k=3, policies=["adaedl:0.6"],
                          following_policies=[], proposer_static_k=[3], engine_vllm_k=[1, 3])
    plan = _plan(cfg, "T", "D", [])
    engine = next(g for g in plan if g.plugin)
    assert list(engine.rows.items())[-2:] == [("vllm:1 (policies' engine)", "vllm:1"),
                                              ("vllm:3 (policies' engine)", "vllm:3")]
    own = engine.roles[-1]
    assert own.in_proposer and own.in_policies_engine and not own.fixed and not own.ablation
    k_of = _k_of(plan)
    assert k_of["vllm:3 (policies' engine)"](4) == 3 and k_of["vllm:3 (defaults)"](4) == 3
    assert k_of["adaedl:0.6"] is None and k_of["static:3 (policies' engine)"] is None
    assert own_loop_k("vllm:5") == 5 and own_loop_k("static:5") is None and own_loop_k("adaedl:0.6") is None
    with pytest.raises(ValueError, match="vllm:K takes a whole K >= 1"):
        own_loop_k("vllm:0")
    with pytest.raises(ValueError, match="engine_vllm_k"):
        VllmBenchConfig(batch_sizes=[1], n_prompts=1, engine_vllm_k=[9])


def test_policies_compare_with_their_engines_fastest_static_k_as_measured() -> None:
    """In one engine the rows took turns on each unit: the ratio to its fastest static K uses the measured seconds,
    not the pairing with the target alone's engine (whose pace beside another engine moves)."""
    import numpy as np

    from runtimes.vllm.bench_report import against_engine_fixed

    def row(role: RowRole, seconds: list[float]) -> RowRun:
        r = RowRun(name=role.name, batch=1, spec=role.spec, role=role)
        for s in seconds:
            r.add_unit(([[1] * 10], s, [], {}, [], (0, 0), {}))
        return r

    rows = [row(RowRole("policy", spec="p"), [1.0, 2.0]), row(RowRole("static", k=0, in_proposer=True), [2.0, 4.0]),
            row(RowRole("static", k=1, in_proposer=True), [1.5, 2.5]), row(RowRole("static", k=1), [0.1, 0.1]),
            row(RowRole("policy", spec="p", per_request=True), [1.0, 1.0])]
    entries: list[dict] = [{} for _ in rows]
    against_engine_fixed(rows, entries, np.array([[0, 1], [1, 1]]))
    assert entries[0]["engine_fixed"] == "static:1 (policies' engine)"
    ratio, lo, hi = entries[0]["vs_engine_fixed"]
    assert ratio == pytest.approx(4.0 / 3.0, abs=1e-4) and 1.25 <= lo <= hi <= 1.5  # units: 1.5/1.0 and 2.5/2.0
    assert entries[1]["vs_engine_fixed"][0] == pytest.approx(4.0 / 6.0, abs=1e-4)
    assert "vs_engine_fixed" not in entries[2] and "vs_engine_fixed" not in entries[3]  # the fastest; vLLM's own
    assert "vs_engine_fixed" not in entries[4]  # another engine


def test_per_request_policies_take_turns_in_the_policies_engine() -> None:
    """Beside other policies they run in the policies' engine (its static Ks then price and compare them); alone,
    in an engine of their own; stored rows without the field keep their own engine."""
    from runtimes.vllm.run import _plan

    both = VllmBenchConfig(batch_sizes=[1], n_prompts=1, static_k=[], default_k=1, policies=["adaedl:0.6"],
                           per_request_policies=["svip:0.5"], following_policies=[], proposer_static_k=[1])
    groups = [g for g in _plan(both, "T", "D", []) if g.plugin]
    assert len(groups) == 1 and groups[0].batch_rule
    per = next(r for r in groups[0].roles if r.per_request)
    assert per.with_policies and per.in_policies_engine and per.name == "svip:0.5 (per request)"
    alone = VllmBenchConfig(batch_sizes=[1], n_prompts=1, static_k=[], default_k=1, policies=[],
                            per_request_policies=["svip:0.5"], following_policies=[], proposer_static_k=[1])
    (group,) = [g for g in _plan(alone, "T", "D", []) if g.plugin]
    assert not group.batch_rule and not group.roles[0].in_policies_engine
    assert not RowRole("policy", spec="svip:0.5", per_request=True).in_policies_engine


def test_a_calibration_gap_is_judged_against_the_goal_with_vllms_sampling_error() -> None:
    """A gap is decided only where the interval of vLLM's accepted share (Wilson, at the tokens judged) puts it wholly
    inside or outside +-0.03; at a few dozen tokens a position neither is."""
    from runtimes.vllm.bench_report import calibration_verdict, share_interval

    lo, hi = share_interval(51, 0.882)
    assert lo < 0.882 < hi and hi - lo == pytest.approx(0.18, abs=0.01)
    assert calibration_verdict({"1": [128, 0.819, 0.836], "4": [51, 0.897, 0.882]}) == "not decided"
    assert calibration_verdict({"1": [100_000, 0.80, 0.81], "2": [0, 0.0, 0.0]}) == "within"
    assert calibration_verdict({"1": [100_000, 0.80, 0.81], "3": [10_000, 0.80, 0.90]}) == "beyond at position 3"
    assert calibration_verdict({"5": [10_000, 0.80, 0.90]}) == "within"  # only positions 1-4 count


def test_a_vllm_run_reads_back_its_curve_traces_calibration_and_engine_parts(tmp_path) -> None:
    from runtimes.vllm.run import stored_parts

    cfg = VllmBenchConfig(out_dir=str(tmp_path))
    assert stored_parts(cfg) == []  # a new run: nothing of an earlier start is read back
    (tmp_path / "cost_model.vllm.json").write_text("{}")
    for part in ["traces/shard-00000.parquet", "calibrated/disco/predictor.json", "engines/0123abcd.json"]:
        (tmp_path / part).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / part).write_text("{}")
    assert [p.relative_to(tmp_path).as_posix() for p in stored_parts(cfg)] == [
        "cost_model.vllm.json", "traces/shard-00000.parquet", "calibrated/disco/predictor.json",
        "engines/0123abcd.json"]
    assert len(stored_parts(VllmBenchConfig(out_dir=str(tmp_path), cost_file="given.json"))) == 3  # a given curve


def test_the_step_clock_counts_the_tokens_each_step_emits_and_marks_admissions() -> None:
    """A step that emits some request's first token prefilled it (the unit's first step, or a request admitted from
    the queue as another finished): not a decode step; a step's batch is the requests it ran."""
    from types import SimpleNamespace

    from runtimes.vllm.engine import StepClock

    script = [{"a": [1], "b": [1]}, {"a": [1, 2, 3], "b": [4]}, {"a": [5], "c": [1]}, {"a": [6], "c": [7, 8]}]

    class Engine:
        def __init__(self) -> None:
            self.output_processor = SimpleNamespace(process_outputs=lambda outs, **kw: outs)
            self.engine_core = SimpleNamespace(shutdown=lambda: None)

        def get_num_unfinished_requests(self) -> int:
            return 3

        def step(self) -> list:
            outs = [SimpleNamespace(request_id=r, new_token_ids=t) for r, t in script.pop(0).items()]
            return self.output_processor.process_outputs(outs)

    llm = SimpleNamespace(llm_engine=Engine())
    clock = StepClock(llm)
    for _ in range(4):
        llm.llm_engine.step()
    assert [(s.batch, s.decode, s.tokens) for s in clock.take()] == [(2, False, 2), (2, True, 4), (2, False, 2),
                                                                     (2, True, 3)]


def test_a_stream_keeps_at_most_its_batch_in_flight_and_its_full_steps_are_in_flight() -> None:
    """At a batch size below a unit's prompts the unit is a stream: its steps with the batch size's requests are in
    flight, the tail's and the admissions' are not."""
    row = RowRun(name="vLLM target alone", batch=2, spec="target", role=RowRole("target"))
    steps = [StepLog(1.0, 2, False, 2), StepLog(1.0, 2, True, 4), StepLog(1.0, 2, False, 2), StepLog(1.0, 2, True, 2),
             StepLog(1.0, 1, True, 1)]
    row.add_unit(([[1] * 5, [1] * 3, [1] * 3], 5.0, steps, {}, [], (0, 0), {}))
    assert row.in_flight() == [(6, 2.0)]
    cfg = VllmBenchConfig(batch_sizes=[1, 2, 4], n_prompts=16, queue_groups=2)
    assert [cfg.unit_size(b) for b in (1, 2, 4)] == [1, 4, 8]
    with pytest.raises(ValueError, match="--queue_groups 3"):
        VllmBenchConfig(batch_sizes=[1, 4], n_prompts=16, queue_groups=3)


def test_the_policies_engine_is_priced_at_the_target_alones_pace_without_its_own_static_ks() -> None:
    """With static Ks beside them in their engine, the policies' rows stay as measured (those rows set their level);
    without, they are priced at vLLM's engines' levels, so at the target alone's pace as vLLM's own rows are."""
    from runtimes.vllm.check import at_reference_pace

    def row(role: RowRole, seconds: float, beside: float | None) -> RowRun:
        r = RowRun(name=role.name, batch=4, spec=role.proposer_spec or role.name, role=role)
        r.add_unit(([[1] * 8] * 4, seconds, [StepLog(seconds, 4, True, 32)], {}, [], (0, 0), {}), beside)
        return r

    target = row(RowRole("target"), 2.0, None)
    policy = row(RowRole("policy", spec="disco"), 1.0, 1.5)  # the host ran faster beside it: 1.5 s for 2.0 s
    alone = at_reference_pace([target, row(RowRole("static", k=3), 1.2, 2.0), policy])
    assert alone[2].seconds == [pytest.approx(1.0 * 2.0 / 1.5)]
    beside = at_reference_pace([target, policy, row(RowRole("static", k=3, in_proposer=True), 1.1, 1.5)])
    assert beside[1].seconds == [1.0] and beside[2].seconds == [1.1]


def test_a_stepped_generation_gathers_each_steps_new_tokens_and_yields_between_steps(monkeypatch) -> None:
    """``generate_steps`` adds the unit's requests, steps the engine until none is unfinished, yields the new tokens
    emitted so far after each step (another engine can step in between) and returns each prompt's output in order,
    with the queue's admission cap held only while it runs."""
    import sys
    from types import SimpleNamespace

    from runtimes.vllm.bench import drain
    from runtimes.vllm.engine import generate_steps

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params",
                        SimpleNamespace(RequestOutputKind=SimpleNamespace(DELTA="delta")))
    scheduler = SimpleNamespace(max_num_active_reqs=8, max_num_running_reqs=8)
    added: list[tuple[str, dict]] = []
    caps: list[int] = []

    def out(i: int, tokens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(request_id=added[i][0], outputs=[SimpleNamespace(token_ids=tokens)])

    script = [lambda: [out(0, [1, 2]), out(1, [9])], lambda: [out(0, [3]), out(2, [5])]]

    def step() -> list:
        caps.append(scheduler.max_num_active_reqs)
        return script.pop(0)()

    engine = SimpleNamespace(add_request=lambda rid, prompt, params: added.append((rid, params)), step=step,
                             has_unfinished_requests=lambda: bool(script),
                             engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler)))
    steps = generate_steps(SimpleNamespace(llm_engine=engine), [[1], [2], [3]], 4, max_running=2)
    assert next(steps) == 3 and next(steps) == 5
    outs, _ = drain(steps)
    assert outs == [[1, 2, 3], [9], [5]] and caps == [2, 2] and scheduler.max_num_active_reqs == 8
    assert all(params["output_kind"] == "delta" and params["max_tokens"] == 4 for _, params in added)


def test_a_queue_caps_vllms_admissions_for_the_call_and_restores_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from types import SimpleNamespace

    from runtimes.vllm.engine import generate

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    scheduler = SimpleNamespace(max_num_active_reqs=8, max_num_running_reqs=8)
    seen = []

    def run(prompts: list, sp: dict, use_tqdm: bool) -> list:
        seen.append(scheduler.max_num_active_reqs)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7])]) for _ in prompts]

    llm = SimpleNamespace(generate=run, llm_engine=SimpleNamespace(
        engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler))))
    assert generate(llm, [[1], [2], [3]], 4, max_running=2)[0] == [[7]] * 3
    generate(llm, [[1], [2]], 4)
    assert seen == [2, 8] and scheduler.max_num_active_reqs == 8
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        generate(SimpleNamespace(generate=run, llm_engine=SimpleNamespace(engine_core=object())), [[1]] * 3, 4, 2)


def test_traces_are_tagged_with_the_dtype_vllm_runs_in(tmp_path) -> None:
    import json

    stopper = build_stopper(PolicySettings(spec="static:2", traces_dir=str(tmp_path / "t")), precision="float32")
    stopper.traces.close()
    assert json.loads((tmp_path / "t" / "config.json").read_text())["precision"] == "float32"
    with pytest.raises(ValueError, match="another precision"):  # a bfloat16 engine may not append to them
        build_stopper(PolicySettings(spec="static:2", traces_dir=str(tmp_path / "t")), precision="bfloat16")


def test_an_engine_that_cannot_fit_the_free_memory_is_refused_in_one_line(tmp_path, monkeypatch) -> None:
    import json

    from runtimes.vllm import engine

    for name, mib in (("t", 64), ("d", 16)):  # float32 safetensors, as packaged models are converted
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
        (tmp_path / name / "model.safetensors").write_bytes(b"\0" * (mib << 20))
    assert engine.weight_bytes(str(tmp_path / "t"), "bfloat16") == 32 << 20
    assert engine.weight_bytes(None, "float32") == 0
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    monkeypatch.setattr(engine, "available_bytes", lambda _: 80 << 20)
    spec = engine.EngineSpec(target=str(tmp_path / "t"), draft=str(tmp_path / "d"), k=3, dtype="float32")
    with pytest.raises(ValueError, match=r"t with a draft in float32 needs about 0.1 GiB .* give vllm_dtype bfloat16"):
        engine.check_memory(spec)  # 1.05 x 80 MiB = 84 MiB > 80 MiB
    engine.check_memory(engine.EngineSpec(target=str(tmp_path / "t"), draft=str(tmp_path / "d"), k=3))  # bf16 fits
