"""The vLLM benchmark (``python -m pipelines.vllm_bench``): vLLM itself on the pair, side by side on the same test
prompts, greedy, at each batch size (1: one request at a time; B: B requests sent together):

- ``vLLM target alone`` (no ``speculative_config``): the reference output and speed;
- ``vllm:K`` for each ``static_k``: vLLM's own draft-model proposer at ``num_speculative_tokens = K``; vLLM 0.32.0
  has no default K for a draft model (the config requires one), so ``default_k`` (5, its documentation's example)
  stands for "vLLM's defaults";
- ``vllm:K (recommended)``: the static K that ``recommend_data``'s validation split picks under vLLM's curve at
  batch 1 (``benchmark.vllm_recommend``), and ``vllm per-batch (recommended)``: one engine with
  ``num_speculative_tokens_per_batch_size`` from the per-batch picks (K = 0, no drafting, where speculation does
  not pay);
- each ``policies`` entry inside vLLM: specstop's proposer (``runtimes.vllm.proposer``) at
  ``num_speculative_tokens = policy_k``, each request's drafting stopped by its own copy of the policy;
- ``static:K (policies' engine)`` for each ``proposer_static_k``: the same proposer at a fixed K (0: no drafting and
  no draft forward), and ``vllm:K (policies' engine)`` for each ``engine_vllm_k``: vLLM's own draft loop at K in that
  engine (the spec ``vllm:K``), both taking turns with the policies on each unit, so that the policies compare with
  vLLM's fixed settings inside one engine (two engines differ by more than their settings: where the host placed
  their weights, its phase while each ran).

One engine per configuration (an engine's speculative config is fixed when it loads). The target alone's engine
stays loaded for the whole run and runs each unit (a prompt at batch 1, a group of B prompts at batch B) before and
after each of every other engine's rows on it: each row's time on a unit is paired with the mean of the target
alone's two runs of the same unit that bracket it, seconds apart (``RowRun.beside``), so that a slow phase of the
host (on a shared 2-core machine the same step's time moves by a third within minutes) scales both and cancels in
their ratio (``runtimes.vllm.bench_report.paired_rows``). With ``interleave`` the pairing is closer still: the row
and the target alone run the unit together, their engine steps in turns (``run_beside``), so that both meet the same
seconds of the host. The rows of one engine (the policies in specstop's
proposer) take turns on each unit, one run of the target alone between two rows. The target alone runs every unit
twice in its own engine, its two rows paired the same way: their ratio is the run's noise floor (with
``second_build`` its second row runs in a second build of its engine, beside the first like any other engine's row:
how far two builds of one engine differ on the host, which a ratio of two engines carries too). With ``repeats`` >
1 the engines run again in reverse order and each unit's faster run is kept. Each output is checked against
target-alone's at the same batch size. vLLM's metrics count drafts and accepted tokens; every engine step is timed
(``runtimes.vllm.engine.StepClock``) so that ``runtimes.vllm.check`` can price the row's own steps with vLLM's curve
(the replay check).

Writes ``benchmark.json`` / ``benchmark.md``, ``cost_model.vllm.json`` (measured at the start when ``cost_file`` is
null) and ``config.yaml`` to ``out_dir``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from typing import Any

from benchmark.config import HarnessConfig
from benchmark.interleave import Lane, interleave
from data_gen.config import ModelsConfig
from data_gen.progress import Heartbeat
from runtimes.vllm import proposer as vllm_proposer
from runtimes.vllm.engine import (
    EngineSpec,
    StepClock,
    StepLog,
    build_engine,
    check_dtype,
    generate,
    generate_steps,
    release,
    spec_counters,
)

log = logging.getLogger("pipelines.vllm_bench")

__all__ = ["VllmBenchConfig", "EngineRows", "Reference", "RowRole", "RowRun", "run_engine", "run_unit", "unit_steps",
           "run_beside", "drain", "row_from_dict", "merge_passes", "TARGET_ALONE"]

TARGET_ALONE = "vLLM target alone"


@dataclass(frozen=True)
class RowRole:
    """What a vLLM row runs, as typed values: its name is formatted from them (:attr:`name`) and never read back."""

    what: str
    """``target`` (vLLM's target alone), ``static`` (its own num_speculative_tokens ``k``), ``per_batch`` (the
    recommended K per batch size in one engine) or ``policy`` (a specstop policy ``spec`` in its proposer)."""
    k: int = 0
    spec: str = ""
    recommended: bool = False
    defaults: bool = False
    """The static K standing for vLLM's defaults."""
    again: bool = False
    """The target alone's second row, run beside its first on every unit (the run's noise floor)."""
    rebuilt: bool = False
    """With ``again``: the second row ran in a second build of the target alone's engine, stepped beside the first
    like any other engine's row (how far two builds of one engine differ: the floor under a ratio of two engines),
    not again in the first build."""
    per_request: bool = False
    """A policy whose requests stop by their own rule alone, not their batch's."""
    with_policies: bool = False
    """A per-request policy run in the policies' engine, taking turns with its rows (False: in an engine of its own,
    as stored runs before it ran them)."""
    as_measured: bool = False
    """A policy run again priced at vLLM's curve and calibration as measured, beside policy rows that followed what
    their engine met (kept so that stored rows with this role still load)."""
    following: bool = False
    """A policy whose batch rule prices steps at the factors its engine meets and corrects its calibration by vLLM's
    verdicts (``PolicySettings.follow``), run beside the same policy as measured."""
    in_proposer: bool = False
    """A static K run in the policies' engine (``static:K`` by specstop's proposer, K = 0 drafting nothing and
    skipping the draft's forward; or vLLM's own loop, :attr:`own_loop`), taking turns with the policies on each unit:
    the fixed settings they compare with inside one engine, free of what another engine's pace does to a ratio."""
    own_loop: bool = False
    """With ``in_proposer``: vLLM's own draft loop at K (``vllm:K``), not specstop's ``static:K``."""

    @property
    def name(self) -> str:
        if self.what == "target":
            return TARGET_ALONE + (" (second build)" if self.rebuilt else " (again)" if self.again else "")
        if self.what == "static" and self.in_proposer:
            return f"{'vllm' if self.own_loop else 'static'}:{self.k} (policies' engine)"
        if self.what == "static":
            return (f"vllm:{self.k}" + (" (recommended)" if self.recommended else "")
                    + (" (defaults)" if self.defaults else ""))
        if self.what == "per_batch":
            return "vllm per-batch (recommended)"
        return (self.spec + (" (per request)" if self.per_request else "")
                + (" (as measured)" if self.as_measured else "") + (" (following)" if self.following else ""))

    @property
    def fixed(self) -> bool:
        """vLLM's own fixed settings: the target alone (its first row; the second measures the noise) and a static K."""
        return (self.what == "target" and not self.again) or (self.what == "static" and not self.in_proposer)

    @property
    def ablation(self) -> bool:
        """A policy run again with a part of specstop's rule turned off or changed (what that part buys), never the
        best."""
        return self.per_request or self.as_measured or self.following

    @property
    def in_policies_engine(self) -> bool:
        """The row ran in the policies' engine (a policy under the batch rule, a per-request one beside them, or a
        static K there)."""
        return (self.what == "policy" and (not self.per_request or self.with_policies)) or self.in_proposer

    @property
    def proposer_spec(self) -> str | None:
        """The policy set in specstop's proposer before the row (``again`` keys the target's second row apart from its
        first in the stored engines; None: vLLM's own proposer or the target alone)."""
        if self.what == "policy":
            return self.spec
        if self.in_proposer:
            return f"{'vllm' if self.own_loop else 'static'}:{self.k}"
        return ("second build" if self.rebuilt else "again") if self.again else None


@dataclass
class VllmBenchConfig(HarnessConfig):
    """What ``python -m pipelines.vllm_bench`` runs (the shared fields: ``benchmark.config.HarnessConfig``);
    configs/benchmark-vllm.yaml mirrors it."""

    out_dir: str = "outputs/benchmark-vllm"
    """Folder for benchmark.md / .json, cost_model.vllm.json and config.yaml (created)."""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    """models.draft / models.target: packaged:<name> (converted once to Hugging Face folders) or folders; device."""
    vllm_dtype: str = "bfloat16"
    """vLLM's dtype for both models: bfloat16, or float32 on a CPU without AVX-512 BF16 or AMX (docs/vllm.md,
    "Precision"); the curve, the traces and every engine run in it."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4])
    """Concurrent requests: 1 runs the prompts one by one; B sends B prompts together (n_prompts / B groups)."""
    static_k: list[int] = field(default_factory=lambda: [1, 3, 5])
    """vLLM's own static num_speculative_tokens rows."""
    default_k: int = 5
    """The K standing for vLLM's defaults (0.32.0 has none for a draft model; 5 is its documentation's example)."""
    recommend_data: str | None = "outputs/default/data"
    """The main job's data folder: where vLLM's curve is copied (``pipelines.recommend --runtime vllm`` reads it),
    and, with ``acceptance_prompts: 0``, K per batch size tuned on its validation split under vLLM's curve (null and
    0: no recommended rows)."""
    acceptance_prompts: int = 8
    """Prompts of ``acceptance_split`` that vLLM's own speculation at K = policy_k runs on to measure its acceptance
    per draft position; the recommendation prices each K with it and vLLM's curve (``runtimes.vllm.settings``). 0:
    tune on recommend_data's labelled tokens instead."""
    acceptance_split: str = "val"
    """The split of ``prompts`` the acceptance is measured on (never the benchmark's own)."""
    policies: list[str] = field(default_factory=list)
    """specstop policies inside vLLM (decoding.policies.build_policy specs), each deciding for its batch where vLLM's
    curve and a calibrated acceptance allow (``predictors.batch_goodput``)."""
    per_request_policies: list[str] = field(default_factory=list)
    """Policies run again with each request stopping by its own rule alone (rows named ``<spec> (per request)``), in
    the policies' engine where it runs."""
    following_policies: list[str] = field(default_factory=list)
    """Policies run again in the policies' engine with the batch rule following what the engine meets (its steps'
    pace, vLLM's verdicts per draft position; rows named ``<spec> (following)``)."""
    proposer_static_k: list[int] = field(default_factory=lambda: [0, 3])
    """Static Ks run by specstop's proposer in the policies' engine, taking turns with the policies on each unit
    (rows ``static:K (policies' engine)``; 0: no drafting and no draft forward): the policies' fixed comparison
    inside one engine (beside ``vllm:K`` of the same K: what specstop's proposer costs over vLLM's loop)."""
    engine_vllm_k: list[int] = field(default_factory=lambda: [1, 3, 5])
    """Static Ks run by vLLM's own draft loop in the policies' engine (rows ``vllm:K (policies' engine)``, each K
    from 1 to ``policy_k``): vLLM's fixed settings beside the policies in one engine."""
    trace_predictor: str | None = None
    """An export whose features are traced in vLLM on ``trace_prompts`` prompts of ``acceptance_split`` (drafting to
    ``policy_k``), written to ``out_dir/traces``, and whose calibration is refitted on them into
    ``out_dir/calibrated/<export name>`` (a policy can then name ``goodput:<that folder>``)."""
    trace_prompts: int = 0
    """Prompts of ``acceptance_split`` traced (0: no traces)."""
    calibration_dir: str | None = "outputs/default/train/calibrated"
    """Calibrated training-free exports for goodput:<score> policies."""
    policy_k: int = 8
    """num_speculative_tokens of the engine the policies run in (the cap of a round)."""
    curve_batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    """Batch sizes of the curve measured at the start."""
    kv_cache_gb: int = 2
    """vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE on the CPU, a whole number)."""
    interleave: bool = False
    """Each row of an engine runs each unit together with the target alone's run of it, their engine steps in turns
    (the one with fewer new tokens next, each step timed alone: ``benchmark.interleave``), so that a slow phase of
    the host falls on both alike; the row's seconds are its own steps' and the target alone's beside it those of the
    same interleave. false: the target alone runs the unit before the first row and after each (the mean of the two
    around a row is its pace). The target alone's own second row runs after its first either way (one engine cannot
    step beside itself), unless ``second_build``."""
    second_build: bool = False
    """The target alone's second row runs in a second build of its engine, beside the first like any other engine's
    row: its ratio to the first is how far two builds of one engine differ on this host (where the memory landed),
    the floor under every ratio of two engines. false: it runs again in the first build, after the first row."""
    queue_groups: int = 1
    """At a batch size B > 1, a unit is a stream of ``queue_groups`` x B prompts admitted from a queue, at most B in
    flight and the next as one finishes (a server at max concurrency B); 1: a closed group of B prompts sent
    together, whose last requests finish with fewer in flight."""

    def unit_size(self, batch: int) -> int:
        """Prompts in one unit at ``batch`` concurrent requests (a prompt at 1, a group or stream above)."""
        return batch * self.queue_groups if batch > 1 else 1

    def __post_init__(self) -> None:
        super().__post_init__()  # repeats: passes over the engines in alternating order, each prompt's faster run kept
        check_dtype(self.vllm_dtype)
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch_sizes {self.batch_sizes}: give batch sizes >= 1")
        if any(self.n_prompts % b for b in self.batch_sizes):
            raise ValueError(f"--n_prompts {self.n_prompts} must be a multiple of every batch size {self.batch_sizes}")
        if self.queue_groups < 1 or any(self.n_prompts % self.unit_size(b) for b in self.batch_sizes):
            raise ValueError(f"--queue_groups {self.queue_groups}: give 1 or more, with --n_prompts {self.n_prompts} a "
                             f"multiple of queue_groups x every batch size above 1 {self.batch_sizes}")
        if min(self.static_k, default=1) < 1 or self.default_k < 1 or self.policy_k < 1:
            raise ValueError("static_k, default_k and policy_k must be >= 1 (K = 0 is the target-alone row)")
        if not all(0 <= k <= self.policy_k for k in self.proposer_static_k):
            raise ValueError(f"--proposer_static_k {self.proposer_static_k}: each K from 0 to policy_k "
                             f"({self.policy_k}), the cap of the policies' engine")
        if not all(1 <= k <= self.policy_k for k in self.engine_vllm_k):
            raise ValueError(f"--engine_vllm_k {self.engine_vllm_k}: each K from 1 to policy_k ({self.policy_k}), "
                             "the cap of the policies' engine")
        if self.interleave and self.following_policies:
            raise ValueError(f"--following_policies {self.following_policies} with interleave: a following policy "
                             "times a verification from its proposal to its next round, which the other engine's "
                             "steps would fill; set interleave false or following_policies []")
        if self.acceptance_prompts < 0:
            raise ValueError(f"--acceptance_prompts {self.acceptance_prompts}: give 0 (tune on recommend_data) or more")
        if self.acceptance_prompts and self.acceptance_split == self.split:
            raise ValueError(f"--acceptance_split {self.acceptance_split}: the benchmark's own prompts; use val")


UnitRun = tuple[list[list[int]], float, list[StepLog], dict[str, float], list, tuple[int, int],
                dict[str, list[float]]]
"""One unit's run: outputs, seconds, steps, vLLM's counters, the proposer's rounds, (idle rows, draft rows), judged
tokens by draft position."""


@dataclass
class RowRun:
    """One row at one batch size: per unit (a prompt at batch 1, a group or stream of prompts at batch B) its
    outputs and the faster run's seconds and steps."""

    name: str
    batch: int
    spec: str
    """``target``, ``vllm:K``, ``vllm-per-batch:...`` or a policy spec."""
    outputs: list[list[list[int]]] = field(default_factory=list)
    """Per unit, each prompt's output token ids."""
    seconds: list[float] = field(default_factory=list)
    steps: list[list[StepLog]] = field(default_factory=list)
    """Per unit, the faster run's engine steps."""
    unit_counters: list[dict[str, float]] = field(default_factory=list)
    """Per unit, the kept run's vLLM speculative-decoding counters (drafts, draft_tokens, accepted)."""
    rounds: list[list[tuple[int, int, float]]] = field(default_factory=list)
    """Policy rows: per unit, the proposer's rounds (requests, draft positions, mean verified length)."""
    unit_idle: list[tuple[int, int]] = field(default_factory=list)
    """Per unit, the kept run's (idle rows, draft rows): draft-forward rows computed for requests that had stopped,
    of all rows computed (policy rows)."""
    unit_positions: list[dict[str, list[float]]] = field(default_factory=list)
    """Per unit, the kept run's judged tokens by draft position: position -> [judged, predicted acceptance summed,
    accepted] (``runtimes.vllm.stopper.StopperCounts.by_position``; policy rows with a calibrated acceptance)."""
    role: RowRole | None = None
    """What the row runs (its name is formatted from it)."""
    beside: list[float] = field(default_factory=list)
    """Per unit, the target alone's mean seconds over its runs of the same unit right before and right after this
    row's (the drift reference; for the target alone's second row, its first row's run; empty for the first row)."""

    def add_unit(self, run: UnitRun, beside: float | None = None) -> None:
        """Append one unit's kept run (as :func:`run_unit` returns it) and the target alone's seconds beside it."""
        outs, wall, steps, counters, rounds, idle, positions = run
        if beside is not None:
            self.beside.append(beside)
        self.outputs.append(outs)
        self.seconds.append(wall)
        self.steps.append(steps)
        self.rounds.append(rounds)
        self.unit_counters.append(dict(counters))
        self.unit_idle.append(tuple(idle))
        self.unit_positions.append(dict(positions))

    def unit(self, i: int) -> UnitRun:
        """Unit ``i``'s kept run, in :meth:`add_unit`'s form."""
        counters = self.unit_counters[i] if i < len(self.unit_counters) else {}
        idle = self.unit_idle[i] if i < len(self.unit_idle) else (0, 0)
        positions = self.unit_positions[i] if i < len(self.unit_positions) else {}
        return self.outputs[i], self.seconds[i], self.steps[i], counters, self.rounds[i], idle, positions

    def at_pace(self, ref: RowRun) -> RowRun:
        """This row as if run at the pace ``ref`` (the target alone's first row) ran at: each unit's seconds and steps
        scaled by ``ref``'s seconds on it over the target alone's beside it (:attr:`beside`); as it is without them."""
        if not self.beside or len(self.beside) != len(self.seconds) or len(ref.seconds) != len(self.seconds):
            return self
        pace = [t / b for t, b in zip(ref.seconds, self.beside)]
        return replace(self, seconds=[s * f for s, f in zip(self.seconds, pace)],
                       steps=[[replace(s, wall_s=s.wall_s * f) for s in unit] for unit, f in zip(self.steps, pace)])

    def full_batch(self, unit: list) -> int:
        """Requests a step of ``unit`` runs while the row is full: its group's, or a stream's batch size."""
        return min(self.batch, len(unit))

    def in_flight(self) -> list[tuple[int, float]] | None:
        """Per unit, (tokens, seconds) of its decode steps that ran the row's batch size of requests (every request of
        a group; a stream's steps between its first admissions and its tail): the row's pace while full, as a server
        at this concurrency keeps it; a unit's tail, where its last requests finish with fewer in flight, is left
        out. None where the steps' tokens were not counted."""
        out = []
        for unit, steps in zip(self.outputs, self.steps):
            full = [s for s in steps if s.decode and s.batch >= self.full_batch(unit)]
            if not full or not all(s.tokens for s in full):
                return None
            out.append((sum(s.tokens for s in full), sum(s.wall_s for s in full)))
        return out or None

    @property
    def by_position(self) -> dict[int, tuple[int, float, float]]:
        """Draft position -> (tokens judged, mean predicted acceptance, vLLM's accepted share), over the units."""
        total: dict[int, list[float]] = {}
        for unit in self.unit_positions:
            for j, cell in unit.items():
                acc = total.setdefault(int(j), [0.0, 0.0, 0.0])
                for k in range(3):
                    acc[k] += cell[k]
        return {j: (int(c[0]), c[1] / c[0], c[2] / c[0]) for j, c in sorted(total.items()) if c[0]}

    @property
    def counters(self) -> dict[str, float]:
        """vLLM's counters summed over the units."""
        total: dict[str, float] = {}
        for unit in self.unit_counters:
            for k, v in unit.items():
                total[k] = total.get(k, 0.0) + v
        return total

    @property
    def idle_rows(self) -> int:
        return sum(u[0] for u in self.unit_idle)

    @property
    def draft_rows(self) -> int:
        return sum(u[1] for u in self.unit_idle)

    @property
    def tokens(self) -> int:
        return sum(len(o) for unit in self.outputs for o in unit)

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.seconds)
        return self.tokens / total if total else 0.0


def reference_rows(rows: list[RowRun]) -> dict[int, RowRun]:
    """Batch size -> the target alone's first row there: the pace every other row is paired with."""
    return {r.batch: r for r in rows if r.role is not None and r.role.what == "target" and not r.role.again}


def row_from_dict(d: dict[str, Any]) -> RowRun:
    """A :class:`RowRun` from its ``asdict`` form (an engine's stored rows)."""
    d = {k: v for k, v in d.items() if k not in ("counters", "idle_rows", "draft_rows")}  # totals: derived
    d["steps"] = [[StepLog(**s) for s in unit] for unit in d.get("steps", [])]
    d["rounds"] = [[tuple(r) for r in unit] for unit in d.get("rounds", [])]
    d["unit_idle"] = [tuple(u) for u in d.get("unit_idle", [])]
    d["unit_positions"] = d.get("unit_positions", [])
    d["role"] = RowRole(**d["role"]) if d.get("role") else None
    return RowRun(**d)


def merge_passes(runs: list[RowRun]) -> RowRun:
    """One row from its runs in several passes (same name, batch and units): each unit's faster run kept."""
    first = runs[0]
    out = RowRun(name=first.name, batch=first.batch, spec=first.spec, role=first.role)
    for i in range(len(first.seconds)):
        kept = min((r for r in runs if i < len(r.seconds)), key=lambda r: r.seconds[i])
        out.add_unit(kept.unit(i), kept.beside[i] if i < len(kept.beside) else None)
    return out


@dataclass
class EngineRows:
    """The rows one engine runs (``roles``, in order); ``batch_rule`` False: each request stops by its own rule."""

    engine: EngineSpec
    roles: list[RowRole]
    plugin: bool = False
    batch_rule: bool = True
    fresh: bool = False
    """Built anew even where its spec is the reference's (the target alone's second build)."""

    @property
    def rows(self) -> dict[str, str | None]:
        """Row name -> the policy spec set in specstop's proposer before it (:attr:`RowRole.proposer_spec`)."""
        return {r.name: r.proposer_spec for r in self.roles}


def _positions(proposer: Any) -> dict[str, list[float]]:
    return {str(j): list(c) for j, c in proposer.stopper.counts.by_position.items()} if proposer is not None else {}


def run_unit(llm: Any, clock: StepClock, proposer: Any, prompts: list[list[int]], max_new: int,
             batch: int | None = None) -> UnitRun:
    """Run one unit's prompts (together, or a stream at most ``batch`` in flight when it holds more) and collect
    what its row keeps."""
    return drain(unit_steps(llm, clock, proposer, prompts, max_new, batch, stepped=False))


def unit_steps(llm: Any, clock: StepClock, proposer: Any, prompts: list[list[int]], max_new: int,
               batch: int | None = None, stepped: bool = True) -> Generator[int, None, UnitRun]:
    """:func:`run_unit` as a generator: with ``stepped``, yields the unit's new tokens after each engine step (so
    that another engine's unit can step in between, ``benchmark.interleave``); without, runs it whole."""
    before, judged = spec_counters(llm), _positions(proposer)
    n_rounds = len(proposer.stopper.counts.steps) if proposer is not None else 0
    idle0 = (proposer.stopper.counts.idle_rows, proposer.stopper.counts.draft_steps) if proposer is not None else (0, 0)
    clock.take()
    if stepped:
        outs, wall = yield from generate_steps(llm, prompts, max_new, batch)
    else:
        outs, wall = generate(llm, prompts, max_new, batch)
    after = spec_counters(llm)
    rounds, idle = [], (0, 0)
    if proposer is not None:
        c = proposer.stopper.counts
        rounds = c.steps[n_rounds:]
        idle = (c.idle_rows - idle0[0], sum(b * pos for b, pos, _ in rounds))
    now = _positions(proposer)
    positions = {j: [x - y for x, y in zip(cell, judged.get(j, [0.0] * 3))] for j, cell in now.items()}
    return (outs, wall, clock.take(), {k: after[k] - before[k] for k in after}, rounds, idle,
            {j: cell for j, cell in positions.items() if cell[0]})


def drain(steps: Generator[Any, None, Any]) -> Any:
    """Run a generator to its end and return its value."""
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def run_beside(row: tuple[Any, StepClock, Any], ref: tuple[Any, StepClock], prompts: list[list[int]], max_new: int,
               batch: int, device: Any) -> tuple[UnitRun, float]:
    """One unit run by a row's engine and by the target alone's together, their steps in turns (the one with fewer
    new tokens next, each step timed alone: ``benchmark.interleave``): the row's run, its seconds the sum of its own
    steps, and the target alone's seconds on the unit, measured in the same seconds of the host."""
    lanes = [Lane("row", unit_steps(*row, prompts, max_new, batch), _timed),
             Lane("target alone", unit_steps(*ref, None, prompts, max_new, batch), _timed)]
    got = interleave(lanes, device)
    return got["row"], got["target alone"][1]


def _timed(run: UnitRun, seconds: float) -> UnitRun:
    """A unit's run with its seconds those of its own steps (an interleaved run's wall holds the other's too)."""
    return (run[0], seconds, *run[2:])


@dataclass
class Reference:
    """The target alone's engine, loaded once and kept for the run: every other engine's units run beside it."""

    spec: EngineSpec
    llm: Any = None
    clock: StepClock | None = None

    def engine(self) -> tuple[Any, StepClock]:
        """The loaded engine and its clock (loaded on first use)."""
        if self.llm is None:
            self.llm = _load(self.spec)
            self.clock = StepClock(self.llm)
        assert self.clock is not None
        return self.llm, self.clock

    def close(self) -> None:
        if self.llm is not None:
            self.clock = None
            release(self.llm)
            self.llm = None


def _load(spec: EngineSpec) -> Any:
    t0 = time.perf_counter()
    llm = build_engine(spec)
    log.info("engine %s loaded in %.0f s", spec.speculative_config() or "target alone", time.perf_counter() - t0)
    return llm


def run_engine(group: EngineRows, units: dict[int, list[list[list[int]]]], cfg: VllmBenchConfig,
               settings_of: Any, reference: Reference | None = None,
               done: Callable[[int, list[RowRun]], None] | None = None) -> list[RowRun]:
    """Run each of ``group``'s rows once on every unit of every batch size (one pass), the rows taking turns on each
    unit, and the target alone on the same unit before the first row and after each (``reference``; the target
    alone's own group runs in that engine). ``settings_of(spec, batch_rule, **fields)`` gives the proposer's
    ``PolicySettings`` for a policy row; ``done(batch, rows)`` hears each batch size's rows as soon as they ran."""
    own = reference is not None and group.engine == reference.spec and not group.plugin and not group.fresh
    if group.plugin:  # specstop's proposer for this engine, vLLM's own for every other speculative one
        vllm_proposer.install(settings_of(next(iter(group.rows.values())), group.batch_rule))
    else:
        vllm_proposer.uninstall()
    # the target alone first: an engine built later re-registers vLLM's Prometheus metrics for the whole process,
    # and one without a draft would leave this engine's speculative counters unread (a resumed run builds it late)
    ref = reference.engine() if reference is not None and not own else None
    if own:
        llm, clock = reference.engine()
    else:
        llm = _load(group.engine)
        clock = StepClock(llm)
    proposer = vllm_proposer.active() if group.plugin else None
    out: list[RowRun] = []
    runs_total = sum(len(u) for u in units.values()) * len(group.roles)
    what = (f"specstop's proposer (K cap {group.engine.k})" if group.plugin else "target alone" if not group.engine.k
            else "per-batch K" if group.engine.per_batch else f"K = {group.engine.k}")
    with Heartbeat(log, f"vLLM engine, {what}", total=runs_total, unit="row runs") as beat:
        for batch, batch_units in units.items():
            rows = _batch_rows(group, batch, batch_units, cfg, settings_of, (llm, clock), proposer, ref, own, beat)
            if done is not None:
                done(batch, rows)
            out += rows
    if proposer is not None:
        proposer.close_traces()
    del proposer
    if not own:
        del clock
        release(llm)
    return out


def _batch_rows(group: EngineRows, batch: int, batch_units: list[list[list[int]]], cfg: VllmBenchConfig,
                settings_of: Any, engine: tuple[Any, StepClock], proposer: Any, ref: tuple[Any, StepClock] | None,
                own: bool, beat: Heartbeat) -> list[RowRun]:
    """``group``'s rows at one batch size, taking turns on each unit, the target alone (``ref``) before the first and
    after each; ``beat`` counts the row runs."""
    llm, clock = engine
    rows = [RowRun(name=r.name, batch=batch, spec=r.proposer_spec or r.name, role=r) for r in group.roles]
    for e in [llm] + ([ref[0]] if ref is not None else []):  # a batch size's first steps run slower
        generate(e, batch_units[0][:batch], 4)
    for u, prompts in enumerate(batch_units):
        turn = rows[u % len(rows):] + rows[:u % len(rows)]  # each row first on some units
        runs: dict[str, UnitRun] = {}
        stepped = cfg.interleave and ref is not None
        marks = [run_unit(*ref, None, prompts, cfg.max_new_tokens, batch)[1]] if ref is not None and not stepped else []
        besides: list[float] = []
        for row in turn:
            if proposer is not None:
                proposer.set_policy(settings_of(row.role.proposer_spec,
                                                group.batch_rule and not row.role.per_request,
                                                follow=row.role.following))
            if stepped:  # the row and the target alone on the unit together, a step at a time
                runs[row.name], alone = run_beside((llm, clock, proposer), ref, prompts, cfg.max_new_tokens, batch,
                                                   cfg.models.device)
                besides.append(alone)
            else:
                runs[row.name] = run_unit(llm, clock, proposer, prompts, cfg.max_new_tokens, batch)
            if ref is not None and not stepped:  # the target alone after each row: the next row's run before too
                marks.append(run_unit(*ref, None, prompts, cfg.max_new_tokens, batch)[1])
            beat.update((beat.done or 0) + 1, note=f"{row.name} at batch {batch}")
        for i, row in enumerate(turn):
            first = own and row.role.again  # the target's second row is paired with its first
            beside = besides[i] if stepped else (marks[i] + marks[i + 1]) / 2 if ref is not None else None
            row.add_unit(runs[row.name], runs[rows[0].name][1] if first else beside)
    for row in rows:
        log.info("%s at batch %d: %.2f tokens/s", row.name, batch, row.tokens_per_s)
    if getattr(proposer, "stopper", None) is not None and not cfg.interleave:  # interleaved, the other engine's
        # steps fall between a proposal and its next round, where the met verification is timed
        log.info("steps met at batch %d: draft forwards %.2fx and verifications %.2fx vLLM's curve", batch,
                 *proposer.stopper.met.levels(batch))
    return rows
