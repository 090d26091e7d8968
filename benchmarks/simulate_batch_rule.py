"""Does the batch rule beat vLLM's fixed K by its own prices? Traced requests walked B at a time, priced by a curve.

A folder of vLLM serving traces (``runtimes.vllm.traces``: every sent token's features and whether vLLM accepted it)
holds, per request, its rounds in order; laid end to end they give the request's output position by position: the
calibrated acceptance of the draft's token there (scored by the policy) and whether vLLM accepted it
(:func:`traced_texts`). B requests are walked along their outputs together, each step decided as the proposer does
(``predictors.batch_goodput``: whether the step drafts at all, from each request's recent acceptance as the proposer
forecasts it, :func:`~predictors.batch_goodput.after_position` after each position, what each request sends), or with
K tokens a request for vLLM's fixed settings; a request moves on by the tokens it emitted (its accepted run and the
target's own), takes the next traced request when its output ends, and a step's seconds come from the curve at B
(``pipelines.measure_costs --runtime vllm``; a step that drafts nothing skips the draft's forward). Every setting walks
the same queue of requests (``cycles`` passes in seeded orders); only steps with B requests in flight count, as a
server at B keeps them. The printed ratio is the rule's tokens/s over the fastest fixed K's: what the rule buys with
every request of the batch in flight, free of a host's noise and of a group's tail (``benchmarks/vllm_group_tail.py``).
The oracle knows each request's accepted run and sends it, under the common cap that makes the step fastest
(:func:`oracle_step`): the ceiling of any stopper at that batch size.

What it leaves out: a traced round ends at its first rejection, so a round that drafts past a rejection meets the
next traced round's scores there (the draft would have drafted from its own wrong token; nothing past a rejection is
accepted either way); the position after a round whose tokens were all accepted (the target's bonus token, never
drafted) counts as accepted, its score drawn from the accepted tokens'; the curve's fastest rounds stand for the
host's pace; a calibration refitted on the same traces (the benchmark's ``calibrated`` exports: their train and val
requests) is walked in sample, so the rule's acceptances are as well calibrated as they will ever be.

Usage:
    python benchmarks/simulate_batch_rule.py outputs/benchmark-vllm/traces \\
        outputs/benchmark-vllm/cost_model.vllm.json --policy goodput:outputs/benchmark-vllm/calibrated/disco
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compute.timing import CostModel  # noqa: E402
from decoding.policies import build_policy  # noqa: E402
from evaluation.data import load_columns  # noqa: E402
from evaluation.replay.scores import policy_scores  # noqa: E402
from predictors.base import as_tensor_dict  # noqa: E402
from predictors.batch_goodput import (  # noqa: E402
    BatchCost,
    RecentShare,
    after_position,
    batch_keep_drafting,
    send_lengths,
)
from runtimes.vllm.proposer import load_curves, prior_acceptance  # noqa: E402
from runtimes.vllm.stopper import curve_for_batch  # noqa: E402
from runtimes.vllm.traces import is_trace_folder  # noqa: E402

Round = tuple[list[float], list[bool]]
"""The positions a request's round can draft (to the cap): their calibrated acceptance, whether vLLM accepts each."""

Text = tuple[list[float], list[bool]]
"""A traced request's output, position by position: the calibrated acceptance of the draft's token there, and whether
vLLM accepted it."""

Decide = Callable[[list[Round], list[float]], tuple[list[int], int]]
"""A setting's step: (the requests' rounds, their forecasts) -> (what each request sends, draft forwards run)."""


@dataclass
class Tally:
    """Tokens, seconds, draft forwards and sent tokens summed over simulated steps."""

    tokens: float = 0.0
    seconds: float = 0.0
    forwards: int = 0
    sent: int = 0
    steps: int = 0

    def add(self, tokens: float, seconds: float, forwards: int, sent: int) -> None:
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        self.forwards, self.sent, self.steps = self.forwards + forwards, self.sent + sent, self.steps + 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def traced_texts(scores: np.ndarray, positions: np.ndarray, accepted: np.ndarray, requests: list[str],
                 rng: np.random.Generator) -> list[Text]:
    """Each traced request's rounds laid end to end, in the order it drafted them: a round's tokens up to and with its
    first rejection (the target's correction takes that position; the next round starts after it); after a round whose
    tokens were all accepted, the target's bonus token's position (never drafted), counted accepted at a score drawn
    from the accepted tokens'."""
    pool = scores[accepted] if accepted.any() else scores
    texts: dict[str, Text] = {}
    clean: dict[str, bool] = {}  # the request's current round: every token so far accepted
    for i, rid in enumerate(requests):
        text = texts.setdefault(rid, ([], []))
        if positions[i] == 0 and clean.get(rid):
            text[0].append(float(rng.choice(pool)))
            text[1].append(True)
        clean[rid] = bool(accepted[i]) and (positions[i] == 0 or clean[rid])
        text[0].append(float(scores[i]))
        text[1].append(bool(accepted[i]))
    return list(texts.values())


def window(text: Text, at: int, cap: int, pool: np.ndarray, rng: np.random.Generator) -> Round:
    """The round a request at position ``at`` of its output meets: ``cap`` positions, past the output's end at
    scores drawn from ``pool`` and never accepted."""
    acc, ok = list(text[0][at:at + cap]), list(text[1][at:at + cap])
    acc += [float(rng.choice(pool)) for _ in range(cap - len(acc))]
    return acc, ok + [False] * (cap - len(ok))


def emitted(ok: list[bool], n: int) -> int:
    """Tokens a request emits when it sends ``n`` drafts: its accepted run among them, and the target's own."""
    run = 0
    while run < n and ok[run]:
        run += 1
    return run + 1


def fixed_step(k: int) -> Decide:
    """vLLM's fixed K: every request sends K, the step runs K forwards."""
    return lambda batch, _: ([k] * len(batch), k)


def rule_step(cost: BatchCost, cap: int) -> Decide:
    """The batch rule for a goodput policy, as vLLM's proposer decides a step (whether to draft at all from the
    requests' forecasts, then position by position)."""
    def decide(batch: list[Round], forecast: list[float]) -> tuple[list[int], int]:
        acc: list[list[float]] = [[] for _ in batch]
        drafting = [True] * len(batch)
        if not batch_keep_drafting(acc, drafting, cost, cap, forecast=forecast):
            return [0] * len(batch), 0
        go = True
        while go:
            for i, (scores, _) in enumerate(batch):
                if drafting[i]:
                    acc[i].append(scores[len(acc[i])])
            drafting, go = after_position(acc, drafting, cost, cap, cost_aware=True)
        forwards = max(len(a) for a in acc)
        return [min(s, len(a)) for s, a in zip(send_lengths(acc, cost, forwards), acc)], forwards
    return decide


def oracle_step(cost: BatchCost, cap: int) -> Decide:
    """A stopper that knows the future: each request sends its accepted run, cut at the common cap (0 .. ``cap``)
    whose step yields the most tokens a second."""
    def decide(batch: list[Round], _: list[float]) -> tuple[list[int], int]:
        runs = [emitted(ok, cap) - 1 for _, ok in batch]
        by_cap = [[min(r, c) for r in runs] for c in range(cap + 1)]
        sends = max(by_cap, key=lambda s: (sum(s) + len(s)) / cost.step_s(max(s), sum(s)))  # of equals, the first
        return sends, max(sends)
    return decide


@dataclass
class Walker:
    """A request in flight: its output, where it stands, its recent acceptance."""

    text: Text
    at: int = 0
    recent: RecentShare = field(default_factory=RecentShare)


def walk(texts: list[Text], queue: list[int], batch: int, decide: Decide, cost: BatchCost, cap: int, prior: float,
         pool: np.ndarray, seed: int = 0) -> Tally:
    """Walk ``queue`` (indices into ``texts``) with ``batch`` requests in flight under ``decide``, each step priced by
    ``cost`` (past an output's end, scores drawn from ``pool``); the steps with fewer in flight (the queue's end) are
    left out."""
    rng = np.random.default_rng(seed)
    todo = list(queue)
    flight = [Walker(texts[todo.pop(0)]) for _ in range(min(batch, len(todo)))]
    out = Tally()
    while len(flight) == batch:
        rounds = [window(w.text, w.at, cap, pool, rng) for w in flight]
        sends, forwards = decide(rounds, [w.recent.forecast(prior) for w in flight])
        tokens = [emitted(ok, n) for (_, ok), n in zip(rounds, sends)]
        out.add(sum(tokens), cost.step_s(forwards, sum(sends)), forwards, sum(sends))
        moved = []
        for w, n, t in zip(flight, sends, tokens):
            w.recent.seen(t - 1, n)  # as the proposer counts it, a round that sent nothing too
            w.at += t
            if w.at < len(w.text[1]):
                moved.append(w)
            elif todo:  # its output ended: the next request takes its place
                moved.append(Walker(texts[todo.pop(0)]))
        flight = moved
    return out


def simulate(texts: list[Text], cm: CostModel, batch: int, cap: int, prior: float, ks: list[int], cycles: int = 4,
             seed: int = 0) -> dict[str, Tally]:
    """Fixed ``K`` (each of ``ks``), the rule and the oracle, each walking the same queue of ``cycles`` passes over
    ``texts`` (seeded orders) with ``batch`` requests in flight."""
    cost = BatchCost.from_cost_model(cm, batch, first_forward_paid=False)
    rng = np.random.default_rng(seed)
    queue = [int(i) for _ in range(cycles) for i in rng.permutation(len(texts))]
    pool = np.array([a for t in texts for a, ok in zip(*t) if ok] or [0.5])  # the accepted positions' scores
    settings = {f"K = {k}": fixed_step(k) for k in ks} | {"batch rule": rule_step(cost, cap),
                                                            "oracle": oracle_step(cost, cap)}
    return {name: walk(texts, queue, batch, decide, cost, cap, prior, pool, seed)
            for name, decide in settings.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", help="a folder of vLLM serving traces (the vLLM benchmark's out_dir/traces)")
    ap.add_argument("costs", help="vLLM's curve (cost_model.vllm.json, with batch curves)")
    ap.add_argument("--policy", required=True, help="a goodput policy spec (goodput:<export or calibrated score>)")
    ap.add_argument("--batch_sizes", default="1,2,4,8")
    ap.add_argument("--cycles", type=int, default=4, help="passes over the traced requests, each in a seeded order")
    ap.add_argument("--cap", type=int, default=8, help="most positions a step drafts (num_speculative_tokens)")
    ap.add_argument("--prior", type=float, default=None,
                    help="the first-position acceptance a request's forecast starts from (default: as the proposer "
                         "reads it, the curve file's measured one, else the policy export's traced one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        texts, curves, prior = _inputs(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"simulate_batch_rule: {e}", file=sys.stderr)
        return 1
    ks = [0, 1, 2, 3, 5]
    print(f"{len(texts)} traced requests ({sum(len(t[1]) for t in texts)} positions), cap {args.cap}, first-position "
          f"prior {prior:.3f}, {args.cycles} passes")
    head = ["requests", *(f"K = {k}" for k in ks), "batch rule", "rule / fastest K", "oracle / fastest K",
            "draft forwards a step", "sent a request"]
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        got = simulate(texts, curve_for_batch(curves, b), b, args.cap, prior, ks, args.cycles, args.seed)
        fixed = max((t.rate, name) for name, t in got.items() if name.startswith("K ="))
        rule, oracle = got["batch rule"], got["oracle"]
        print(f"| {b} | " + " | ".join(f"{got[f'K = {k}'].rate:.1f}" for k in ks) + f" | {rule.rate:.1f} | "
              f"{rule.rate / fixed[0]:.3f} ({fixed[1]}) | {oracle.rate / fixed[0]:.3f} | "
              f"{rule.forwards / max(rule.steps, 1):.2f} | {rule.sent / max(rule.steps, 1) / b:.2f} |")
    return 0


def _inputs(args: argparse.Namespace) -> tuple[list[Text], dict[int, CostModel], float]:
    """The traced outputs scored by the policy, vLLM's curves by batch size and its first-position acceptance."""
    if args.prior is not None and not 0.0 <= args.prior <= 1.0:
        raise ValueError(f"--prior {args.prior}: an acceptance, between 0 and 1")
    if not is_trace_folder(args.traces):
        raise ValueError(f"{args.traces}: not a folder of vLLM serving traces (its config.json says kind vllm_traces)")
    policy = build_policy(args.policy, max_draft_len=args.cap)
    if not policy.round_rule.cost_aware:
        raise ValueError(f"--policy {args.policy}: the simulation decides for goodput policies; give goodput:<export>")
    policy.use_mode("greedy")
    columns = load_columns(args.traces, extra_columns=tuple(policy.required_columns) + ("greedy_match", "sample_id"))
    if not len(columns.get("position", [])):
        raise ValueError(f"{args.traces}: no drafted tokens traced")
    requests = [str(r) for r in columns.pop("sample_id")]
    scores = policy_scores(policy, as_tensor_dict({k: np.array(v) for k, v in columns.items()}))  # writable copies
    texts = traced_texts(np.asarray(scores, dtype=float), np.asarray(columns["position"]),
                         np.asarray(columns["greedy_match"]) > 0.5, requests, np.random.default_rng(args.seed))
    prior = prior_acceptance(args.costs, policy) if args.prior is None else args.prior
    return texts, load_curves(args.costs), prior


if __name__ == "__main__":
    sys.exit(main())
