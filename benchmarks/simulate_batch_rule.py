"""Does the batch rule beat vLLM's fixed K by its own prices? Trace-driven steps of B requests, priced by vLLM's curve.

Each drafted round in a folder of vLLM serving traces (``runtimes.vllm.traces``: every sent token's features and
whether vLLM accepted it) gives a request's calibrated acceptance per draft position, scored by the policy, and its
accepted tokens. A simulated step draws B rounds at random and decides for them as vLLM's proposer does
(``predictors.batch_goodput``: whether the step drafts at all, :func:`~predictors.batch_goodput.after_position` after
each position, what each request sends), or sends K tokens a request for vLLM's fixed settings; each step's seconds
come from the curve at B (``pipelines.measure_costs --runtime vllm``; a step that drafts nothing skips the draft's
forward), its tokens from the traced verdicts. The printed ratio is the rule's tokens/s over the fastest fixed K's
on the same drawn steps: what the rule buys with every request of the batch in flight, free of a host's noise and of
a group's tail (``benchmarks/vllm_group_tail.py``). The oracle knows each request's accepted run and sends it, under
the common cap that makes the step fastest (:func:`oracle_step`): the ceiling of any stopper at that batch size.

What it leaves out: a trace holds a round's tokens up to its first rejection, so a position after it gets a score
drawn from the traced scores at that position (it can only cost: nothing after a rejection is accepted); rounds are
drawn independently, where a server's requests run on in turn (a request's forecast before the first forward is
vLLM's measured first-position acceptance, not its own recent rounds); the curve's fastest rounds stand for the
host's pace.

Usage:
    python benchmarks/simulate_batch_rule.py outputs/benchmark-vllm/traces \\
        outputs/benchmark-vllm/cost_model.vllm.json --policy goodput:outputs/benchmark-vllm/calibrated/disco
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compute.timing import CostModel  # noqa: E402
from decoding.policies import build_policy  # noqa: E402
from evaluation.data import load_columns  # noqa: E402
from evaluation.replay.scores import policy_scores  # noqa: E402
from predictors.base import as_tensor_dict  # noqa: E402
from predictors.batch_goodput import BatchCost, after_position, batch_keep_drafting, send_lengths  # noqa: E402
from runtimes.vllm.proposer import load_curves, prior_acceptance  # noqa: E402
from runtimes.vllm.stopper import curve_for_batch  # noqa: E402
from runtimes.vllm.traces import is_trace_folder  # noqa: E402

Round = tuple[list[float], list[bool]]
"""A request's drafted round: calibrated acceptance per position, and whether vLLM accepted each (to the cap)."""


@dataclass
class Tally:
    """Tokens, seconds, draft forwards and sent tokens summed over simulated steps."""

    tokens: float = 0.0
    seconds: float = 0.0
    forwards: int = 0
    sent: int = 0

    def add(self, tokens: float, seconds: float, forwards: int, sent: int) -> None:
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        self.forwards, self.sent = self.forwards + forwards, self.sent + sent

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def traced_rounds(scores: np.ndarray, positions: np.ndarray, accepted: np.ndarray, cap: int,
                  rng: np.random.Generator) -> list[Round]:
    """The traced rounds (a round starts at position 0), each filled to ``cap`` positions: after its last traced
    token, scores drawn from the traced scores at that position and verdicts False."""
    pools = {p: scores[positions == p] for p in np.unique(positions)}
    pool_of = [pools.get(min(p, max(pools)), scores) for p in range(cap)]
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    out = []
    for a, b in zip(starts, starts[1:]):
        acc, ok = [float(x) for x in scores[a:b][:cap]], [bool(x) for x in accepted[a:b][:cap]]
        acc += [float(rng.choice(pool_of[p])) for p in range(len(acc), cap)]
        out.append((acc, ok + [False] * (cap - len(ok))))
    return out


def emitted(ok: list[bool], n: int) -> int:
    """Tokens a request emits when it sends ``n`` drafts: its accepted run among them, and the target's own."""
    run = 0
    while run < n and ok[run]:
        run += 1
    return run + 1


def rule_step(batch: list[Round], cost: BatchCost, cap: int, prior: float) -> tuple[int, float, int, int]:
    """One step decided by the batch rule for a goodput policy: (tokens, seconds, draft forwards, sent)."""
    n = len(batch)
    acc: list[list[float]] = [[] for _ in batch]
    drafting = [True] * n
    if not batch_keep_drafting(acc, drafting, cost, cap, forecast=[prior] * n):
        return n, cost.step_s(0, 0), 0, 0
    go = True
    while go:
        for i, (scores, _) in enumerate(batch):
            if drafting[i]:
                acc[i].append(scores[len(acc[i])])
        drafting, go = after_position(acc, drafting, cost, cap, cost_aware=True)
    forwards = max(len(a) for a in acc)
    sends = [min(s, len(a)) for s, a in zip(send_lengths(acc, cost, forwards), acc)]
    tokens = sum(emitted(ok, s) for (_, ok), s in zip(batch, sends))
    return tokens, cost.step_s(forwards, sum(sends)), forwards, sum(sends)


def oracle_step(batch: list[Round], cost: BatchCost, cap: int) -> tuple[int, float, int, int]:
    """One step of a stopper that knows the future: each request sends its accepted run, cut at the common cap
    (0 .. ``cap``) whose step yields the most tokens a second: (tokens, seconds, draft forwards, sent)."""
    runs = [emitted(ok, cap) - 1 for _, ok in batch]
    steps = []
    for c in range(cap + 1):
        sends = [min(r, c) for r in runs]
        steps.append((sum(sends) + len(sends), cost.step_s(max(sends), sum(sends)), max(sends), sum(sends)))
    return max(steps, key=lambda step: step[0] / step[1])  # the first of equals: the smallest cap


def simulate(rounds: list[Round], cm: CostModel, batch: int, steps: int, cap: int, prior: float, ks: list[int],
             seed: int = 0) -> dict[str, Tally]:
    """Fixed ``K`` (each of ``ks``) and the rule on the same ``steps`` draws of ``batch`` rounds."""
    cost = BatchCost.from_cost_model(cm, batch, first_forward_paid=False)
    rng = np.random.default_rng(seed)
    out = {f"K = {k}": Tally() for k in ks} | {"batch rule": Tally(), "oracle": Tally()}
    for _ in range(steps):
        drawn = [rounds[i] for i in rng.integers(0, len(rounds), batch)]
        for k in ks:
            out[f"K = {k}"].add(sum(emitted(ok, k) for _, ok in drawn), cost.step_s(k, k * batch), k, k * batch)
        out["batch rule"].add(*rule_step(drawn, cost, cap, prior))
        out["oracle"].add(*oracle_step(drawn, cost, cap))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", help="a folder of vLLM serving traces (the vLLM benchmark's out_dir/traces)")
    ap.add_argument("costs", help="vLLM's curve (cost_model.vllm.json, with batch curves)")
    ap.add_argument("--policy", required=True, help="a goodput policy spec (goodput:<export or calibrated score>)")
    ap.add_argument("--batch_sizes", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=3000, help="simulated steps per batch size")
    ap.add_argument("--cap", type=int, default=8, help="most positions a step drafts (num_speculative_tokens)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        rounds, curves, prior = _inputs(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"simulate_batch_rule: {e}", file=sys.stderr)
        return 1
    ks = [0, 1, 2, 3, 5]
    print(f"{len(rounds)} traced rounds, cap {args.cap}, first-position prior {prior:.3f}, {args.steps} steps a size")
    head = ["requests", *(f"K = {k}" for k in ks), "batch rule", "rule / fastest K", "oracle / fastest K",
            "draft forwards a step", "sent a request"]
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for b in (int(x) for x in args.batch_sizes.split(",")):
        got = simulate(rounds, curve_for_batch(curves, b), b, args.steps, args.cap, prior, ks, args.seed)
        fixed = max((t.rate, name) for name, t in got.items() if name.startswith("K ="))
        rule, oracle = got["batch rule"], got["oracle"]
        print(f"| {b} | " + " | ".join(f"{got[f'K = {k}'].rate:.1f}" for k in ks) + f" | {rule.rate:.1f} | "
              f"{rule.rate / fixed[0]:.3f} ({fixed[1]}) | {oracle.rate / fixed[0]:.3f} | "
              f"{rule.forwards / args.steps:.2f} | {rule.sent / args.steps / b:.2f} |")
    return 0


def _inputs(args: argparse.Namespace) -> tuple[list[Round], dict[int, CostModel], float]:
    """The traced rounds scored by the policy, vLLM's curves by batch size and its first-position acceptance."""
    if not is_trace_folder(args.traces):
        raise ValueError(f"{args.traces}: not a folder of vLLM serving traces (its config.json says kind vllm_traces)")
    policy = build_policy(args.policy, max_draft_len=args.cap)
    if not policy.round_rule.cost_aware:
        raise ValueError(f"--policy {args.policy}: the simulation decides for goodput policies; give goodput:<export>")
    policy.use_mode("greedy")
    columns = load_columns(args.traces, extra_columns=tuple(policy.required_columns) + ("greedy_match",))
    if not len(columns.get("position", [])):
        raise ValueError(f"{args.traces}: no drafted tokens traced")
    scores = policy_scores(policy, as_tensor_dict({k: np.array(v) for k, v in columns.items()}))  # writable copies
    rng = np.random.default_rng(args.seed)
    rounds = traced_rounds(np.asarray(scores, dtype=float), np.asarray(columns["position"]),
                           np.asarray(columns["greedy_match"]) > 0.5, args.cap, rng)
    return rounds, load_curves(args.costs), prior_acceptance(args.costs)


if __name__ == "__main__":
    sys.exit(main())
