"""What one policy's replay adds up to (``ReplayResult``): the shared round counts of ``predictors.counts`` plus the
replayed seconds, what target-only decoding would take for the same tokens, and the goodput rule's expectations."""
from __future__ import annotations

from dataclasses import dataclass, field

from predictors.counts import RoundCounts

__all__ = ["ReplayResult"]


@dataclass
class ReplayResult(RoundCounts):
    """Totals of one policy replayed over all sequences.

    The round counts are those of ``predictors.counts.RoundCounts``, held as floats (expected counts in sampling
    mode); ``tokens`` is clipped at the end of each stored sequence. ``as_row`` keeps its table columns' names."""

    n_seqs: int = 0
    time_s: float = 0.0
    """Replayed seconds under the cost model."""
    target_only_s: float = 0.0
    """Seconds target-only decoding would take for the same tokens."""
    draft_len_hist: dict[int, int] = field(default_factory=dict)
    """Rounds by number of drafted tokens."""
    round_tokens: list[tuple[float, float]] = field(default_factory=list)
    """Goodput policies: (expected, replayed) tokens of every round."""
    round_lengths: list[tuple[int, int]] = field(default_factory=list)
    """Goodput policies: (drafted, verified) tokens of every round (to compare with the engine's)."""
    expected_tokens: float = 0.0
    """Goodput policies: tokens the rounds expected to emit (calibrated acceptance of the verified prefixes)."""
    first_verify_s: float = 0.0
    """Seconds of each sequence's first verification pass under the cost model (in ``time_s``): the engine runs it
    inside the target's pass over the prompt, so a comparison with its measured prefill leaves it out."""

    def add_round(self, emitted: float, accepted: float, drafted: float, verified: float, seconds: float,
                  target_s_per_token: float, hist_key: int) -> None:
        """Count one verification round."""
        self.rounds += 1
        self.tokens += float(emitted)
        self.accepted += float(accepted)
        self.drafted += float(drafted)
        self.verified += float(verified)
        self.time_s += seconds
        self.target_only_s += emitted * target_s_per_token
        self.draft_len_hist[hist_key] = self.draft_len_hist.get(hist_key, 0) + 1

    @property
    def tokens_per_call(self) -> float:
        """Tokens emitted per target call (mean accepted length + 1)."""
        return self.tokens / self.rounds if self.rounds else float("nan")

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else float("nan")

    @property
    def drafted_per_round(self) -> float:
        return self.drafted / self.rounds if self.rounds else float("nan")

    @property
    def wasted_per_round(self) -> float:
        """Draft tokens not accepted, per round (rejected, after the first rejection, or drafted but not verified)."""
        return (self.drafted - self.accepted) / self.rounds if self.rounds else float("nan")

    @property
    def expected_per_round(self) -> float:
        """Goodput policies: expected tokens per round (NaN for the others)."""
        return self.expected_tokens / self.rounds if self.round_tokens else float("nan")

    @property
    def speedup(self) -> float:
        """Predicted speedup over target-only decoding."""
        return self.target_only_s / self.time_s if self.time_s > 0 else float("nan")

    def as_row(self) -> dict[str, float]:
        return {
            "n_seqs": self.n_seqs,
            "n_rounds": self.rounds,
            "tokens": self.tokens,
            "tokens_per_call": self.tokens_per_call,
            "mean_accepted": self.mean_accepted,
            "drafted_per_round": self.drafted_per_round,
            "wasted_per_round": self.wasted_per_round,
            "time_s": self.time_s,
            "speedup": self.speedup,
            "expected_per_round": self.expected_per_round,
        }
