"""The engine's counters and timings (``DecodeStats``): the shared round counts of ``predictors.counts`` plus what
only a real run measures (target calls, per-round lengths, seconds per phase)."""
from __future__ import annotations

from dataclasses import dataclass, field

from predictors.counts import RoundCounts

__all__ = ["DecodeStats"]


@dataclass
class DecodeStats(RoundCounts):
    """Counters and timings of one or more ``generate`` calls (add them with ``+``).

    The round counts (``rounds``, ``tokens``, ``drafted``, ``sent``, ``accepted``) are those of
    ``predictors.counts.RoundCounts``, whole numbers here, summed over all sequences; the per-round lists use the same
    words (``drafted_lengths``, ``sent_lengths``, ``accepted_lengths``)."""

    target_calls: int = 0
    """Target forward passes (verification rounds; prefill not counted)."""
    wasted: int = 0
    """Draft tokens proposed but not emitted (rejected or cut by SV's goodput length)."""
    accepted_lengths: list[int] = field(default_factory=list)
    """Accepted draft tokens per sequence-round."""
    drafted_lengths: list[int] = field(default_factory=list)
    """Drafted tokens per sequence-round."""
    sent_lengths: list[int] = field(default_factory=list)
    """Drafted tokens sent to the target per sequence-round (fewer than drafted under the goodput rule)."""
    prompt_passes: int = 0
    """Sequence-rounds verified inside the target's pass over the prompt (each sequence's first: the target reads its
    prompt together with the first drafts, so that pass's time is in ``prefill_time``, not ``target_time``)."""
    prompt_pass_lengths: list[int] = field(default_factory=list)
    """Drafted tokens sent in those passes (also in ``sent_lengths``)."""
    expected_tokens: list[float] = field(default_factory=list)
    """Goodput policies: tokens each sequence-round was expected to emit (1 + E[accepted] of the verified prefix)."""
    draft_forwards: int = 0
    """Draft forward passes (batched steps)."""
    draft_time: float = 0.0
    """Seconds in draft (and companion) forward passes."""
    target_time: float = 0.0
    """Seconds in target verification forward passes (prefill excluded)."""
    stop_decisions: int = 0
    """Batched stop decisions taken (one per draft step)."""
    stop_time: float = 0.0
    """Seconds computing features and policy decisions (in greedy decoding on a CPU also the drafted token's argmax,
    which the features' native pass reads off for free)."""
    analysis_time: float = 0.0
    """Seconds in analysis-only target look-ahead (oracle); included in wall_time."""
    prefill_time: float = 0.0
    """Seconds prefilling the prompts into every model's cache (the target's pass over the prompts, which also verifies
    the first drafts, included); included in wall_time."""
    wall_time: float = 0.0
    """Seconds of the whole call(s)."""

    @classmethod
    def from_dict(cls, d: dict) -> DecodeStats:
        """Stats from their ``dataclasses.asdict`` form; ValueError naming the fields this version does not hold (a
        file written by an older version: measure it again)."""
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"decode stats with fields {unknown} that this version does not hold (written by an older "
                             "version; run it again into a new out_dir)")
        return cls(**d)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_time if self.wall_time > 0 else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def target_calls_per_token(self) -> float:
        return self.target_calls / self.tokens if self.tokens else 0.0

    @property
    def stop_overhead(self) -> float:
        """Cost of one stop decision as a fraction of one draft forward pass."""
        if not self.stop_decisions or not self.draft_forwards or self.draft_time <= 0:
            return 0.0
        return (self.stop_time / self.stop_decisions) / (self.draft_time / self.draft_forwards)

    def __add__(self, other: DecodeStats) -> DecodeStats:
        out = DecodeStats()
        for name in self.__dataclass_fields__:
            setattr(out, name, getattr(self, name) + getattr(other, name))
        return out

    def summary(self) -> dict[str, float]:
        """Flat metrics for logging."""
        return {
            "tokens": self.tokens,
            "rounds": self.rounds,
            "sent": self.sent,
            "tokens_per_s": self.tokens_per_s,
            "mean_accepted": self.mean_accepted,
            "target_calls_per_token": self.target_calls_per_token,
            "drafted": self.drafted,
            "wasted": self.wasted,
            "stop_overhead": self.stop_overhead,
            "wall_time": self.wall_time,
            "analysis_time": self.analysis_time,
            "prefill_time": self.prefill_time,
        }
