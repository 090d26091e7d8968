"""One benchmark row (:class:`Row`): a decoding method's outputs, seconds and round counters over the prompts, and its
entry of the report (tokens/s, ratios with paired bootstrap intervals over prompts, the engine's realised step
costs)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from benchmark.records import paired_ratio, row_records
from decoding.engine import DecodeStats
from predictors.round_rules import rule_named

HF_METHOD = "transformers assisted"
"""The ``method`` of the rows that run transformers' assisted generation (``hf:``)."""


@dataclass
class Row:
    """One benchmark row: per-prompt outputs, tokens and seconds, and the round counters (with several samples a
    prompt, every per-prompt list holds one entry per sample, prompt by prompt)."""

    name: str
    method: str
    kind: str = ""
    """Policy kind (static, svip, disco...) for engine rows; '' for the others."""
    seconds: list[float] = field(default_factory=list)
    """Seconds per prompt (estimated for analysis-only rows: ``estimated``; over several runs a prompt,
    ``benchmark.records.pass_adjusted`` of them)."""
    pass_seconds: list[list[float | None]] = field(default_factory=list)
    """Per prompt, each run's seconds pass by pass (None: a run whose output differed from the first's), when the row
    ran more than once a prompt; else empty."""
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    rounds: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_tokens: int = 0
    prompt_rounds: list[int | None] = field(default_factory=list)
    """Per prompt: rounds, drafted and accepted draft tokens (None where a batch of prompts shares its counters)."""
    prompt_drafted: list[int | None] = field(default_factory=list)
    prompt_accepted: list[int | None] = field(default_factory=list)
    estimated: bool = False
    """The seconds are estimated from the curve, not measured (the sampling oracle's analysis-only time)."""
    prompt_rouge_l: list[float] = field(default_factory=list)
    """Per prompt: ROUGE-L F1 to target-only's output (``rouge_l`` is their mean)."""
    prompt_humaneval: list[bool | None] = field(default_factory=list)
    """Per prompt: its answer passes the HumanEval problem's tests (None: not a HumanEval prompt)."""
    exact: bool | None = None
    exact_by_design: bool = True
    rouge_l: float | None = None
    identical_prompts: int | None = None
    """Prompts whose output equals target-only's (greedy)."""
    humaneval_pass: float | None = None
    """Share of the run's HumanEval prompts whose answer passes the problem's tests (``benchmark.humaneval_check``)."""
    note: str = ""
    spec: str = ""
    """Engine rows: the policy spec that rebuilds the row's policy (``decoding.policies.build_policy``)."""
    threshold: float | None = None
    """Engine rows tuned here: the threshold set on the spec's policy (``evaluation.replay.with_threshold``)."""
    verification: str = ""
    """Engine rows: the policy's verification kind (``predictors.base``)."""
    thresholded: bool = False
    """Engine rows: a thresholded policy (``verification == threshold`` with a threshold: learned or entropy)."""
    reference: bool = False
    """The reference row (another compute path, maybe fewer tokens): no exactness check."""
    prefill_seconds: list[float] = field(default_factory=list)
    """Engine rows: seconds per prompt spent prefilling the prompt (inside ``seconds``)."""
    runs: int = 1
    """Runs of the row over its prompts (per prompt 1 up to ``repeats``: ``pass_seconds``; the fastest run's outputs,
    counters and engine timings kept)."""
    decode: DecodeStats | None = field(default=None, repr=False)
    """Engine rows: the engine's counters and timings over the row's prompts (stop decisions, draft steps,
    verification passes: the costs the engine realised)."""

    def extend(self, other: Row) -> None:
        """Append ``other``'s prompts (the same row run on further prompts) and add its counters."""
        self.seconds += other.seconds
        self.pass_seconds += other.pass_seconds
        self.outputs += other.outputs
        self.prefill_seconds += other.prefill_seconds
        self.prompt_rounds += other.prompt_rounds
        self.prompt_drafted += other.prompt_drafted
        self.prompt_accepted += other.prompt_accepted
        self.estimated = self.estimated or other.estimated
        self.runs += other.runs
        for k in ("rounds", "accepted", "target_calls", "draft_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        if other.decode is not None:
            self.decode = other.decode if self.decode is None else self.decode + other.decode

    def count_prompt(self, rounds: int | None, drafted: int | None, accepted: int | None) -> None:
        """Append one prompt's round counters."""
        self.prompt_rounds.append(rounds)
        self.prompt_drafted.append(drafted)
        self.prompt_accepted.append(accepted)

    def records(self, units: list[tuple[int, int]] | None = None) -> dict[str, list[Any]]:
        """The row's per-prompt records (``benchmark.records``; ``units``: each entry's (prompt, sample) when a prompt
        has several samples), with ROUGE-L and HumanEval per entry where scored."""
        rec = row_records(self.outputs, self.seconds, self.prompt_rounds, self.prompt_drafted, self.prompt_accepted,
                          units, self.pass_seconds)
        if self.prompt_rouge_l:
            rec["rouge_l"] = list(self.prompt_rouge_l)
        if self.prompt_humaneval:
            rec["humaneval_pass"] = list(self.prompt_humaneval)
        return rec

    @property
    def stop_overhead(self) -> float | None:
        """Engine rows: one stop decision as a fraction of one draft forward (``DecodeStats.stop_overhead``)."""
        return None if self.decode is None else self.decode.stop_overhead

    def step_costs(self) -> dict[str, Any]:
        """Engine rows: the draft step and the verification pass the engine realised, in ms, the passes' mean new
        tokens and how many passes had each length (verified drafts + 1; analysis-only rows have no verification pass
        of their own), and the decoding time outside the forwards the curve prices, in ms per output token (stop
        decisions and their features, verification bookkeeping, cache crops: what the replay check's prediction leaves
        out)."""
        d = self.decode
        passes = d.target_calls - d.prompt_passes if d is not None and d.analysis_time == 0 else 0
        unpriced = None
        if passes and d is not None and d.tokens:
            rest = d.wall_time - d.prefill_time - d.draft_time - d.target_time
            unpriced = round(1000 * rest / d.tokens, 2)
        hist = Counter()  # new tokens (verified drafts + 1) of the passes after the prompts' (those are the prefill's)
        if passes and d is not None:
            hist = Counter(k + 1 for k in d.sent_lengths) - Counter(k + 1 for k in d.prompt_pass_lengths)
        n = sum(hist.values())
        return {
            "draft_ms_per_step": round(1000 * d.draft_time / d.draft_forwards, 2) if d and d.draft_forwards else None,
            "verify_ms_per_pass": round(1000 * d.target_time / passes, 2) if passes else None,
            "verify_mean_tokens": round(sum(L * c for L, c in hist.items()) / n, 2) if n else None,
            "verify_lengths": {str(L): hist[L] for L in sorted(hist)} or None,
            "unpriced_ms_per_token": unpriced,
        }

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.seconds)
        return self.tokens / total if total > 0 else 0.0

    def metrics(self, base: Row, best_entropy: Row | None, boot: np.ndarray,
                best_thresholded: Row | None = None, units: list[tuple[int, int]] | None = None) -> dict[str, Any]:
        """The row's report entry; ``boot`` [n_boot, n_prompts] resampled prompt indices for the intervals;
        ``units``: each entry's (prompt, sample) when a prompt has several samples (resampled with their prompt)."""
        prompts = None if units is None else [p for p, _ in units]
        speed = ratio_ci(self, base, boot, prompts)
        vs_ent = (ratio_ci(self, best_entropy, boot, prompts) if best_entropy is not None and self.kind
                  else (None, None, None))
        cost_aware = self.method == "engine" and rule_named(self.verification).cost_aware
        vs_thr = ratio_ci(self, best_thresholded, boot, prompts) if cost_aware else (None, None, None)
        wasted = self.draft_tokens - self.accepted
        return {
            "row": self.name, "method": self.method, "kind": self.kind,
            "spec": self.spec or None, "threshold": self.threshold, "verification": self.verification or None,
            "thresholded": self.thresholded,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "speedup": _round(speed[0]), "speedup_lo": _round(speed[1]), "speedup_hi": _round(speed[2]),
            "vs_best_entropy": _round(vs_ent[0]), "vs_best_entropy_lo": _round(vs_ent[1]),
            "vs_best_entropy_hi": _round(vs_ent[2]),
            "vs_best_thresholded": _round(vs_thr[0]), "vs_best_thresholded_lo": _round(vs_thr[1]),
            "vs_best_thresholded_hi": _round(vs_thr[2]),
            "rounds": self.rounds, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
            "mean_accepted": round(self.accepted / self.rounds, 3) if self.rounds else None,
            "mean_drafted": round(self.draft_tokens / self.rounds, 3) if self.rounds else None,
            "target_calls_per_token": (round(self.target_calls / self.tokens, 3)
                                       if self.tokens and self.rounds else None),
            "wasted_per_token": round(wasted / self.tokens, 3) if self.tokens and self.draft_tokens else None,
            "stop_overhead": None if self.stop_overhead is None else round(self.stop_overhead, 4),
            "estimated": self.estimated, "exact": self.exact, "reference": self.reference,
            "rouge_l": None if self.rouge_l is None else round(self.rouge_l, 4),
            "humaneval_pass": None if self.humaneval_pass is None else round(self.humaneval_pass, 4),
            "tokens": self.tokens, "seconds": round(sum(self.seconds), 3), "runs": self.runs, "note": self.note,
            "identical_prompts": self.identical_prompts,
            "prompt_tokens": [len(o) for o in self.outputs], "prompt_seconds": [round(x, 4) for x in self.seconds],
            "prefill_seconds": [round(x, 4) for x in self.prefill_seconds] or None,
            "prompt_passes": self.decode.prompt_passes if self.decode is not None else None,
            **self.step_costs(), "records": self.records(units),
        }


def _round(v: float | None) -> float | None:
    return None if v is None else round(float(v), 3)


def ratio_ci(row: Row, ref: Row | None, boot: np.ndarray, prompts: list[int] | None = None
             ) -> tuple[float | None, float | None, float | None]:
    """tokens/s of ``row`` over ``ref``'s, and its 95% paired bootstrap interval over prompts
    (``benchmark.records.paired_ratio``; ``prompts``: each entry's prompt index when a prompt has several samples)."""
    if ref is None or not row.seconds or len(row.seconds) != len(ref.seconds) or ref.tokens_per_s <= 0:
        return None, None, None
    return paired_ratio([len(o) for o in row.outputs], row.seconds, [len(o) for o in ref.outputs], ref.seconds, boot,
                        prompts)
