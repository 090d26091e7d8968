"""One vocabulary for the counts of speculative decoding rounds, shared by the engine and the offline replay.

``decoding.engine.DecodeStats`` (what a real run did) and ``evaluation.replay.ReplayResult`` (what the replay
predicts) both extend :class:`RoundCounts`, so a count has one name wherever it is read (``pipelines.replay_check``
compares the two side by side). The class lives here, in ``predictors``, the lowest layer both ``decoding`` and
``evaluation`` import. The records of the runtime hooks use the same words without being totals of this kind: a
llama.cpp call (``runtimes.llamacpp.draft.DraftCall``) is one round's drafted, verified and accepted tokens, which
``SpecstopDraftModel.decode_stats`` sums into ``DecodeStats``; the vLLM stopper's ``StopperCounts`` sums rounds,
drafted, verified and accepted tokens but cannot know the tokens emitted (vLLM does).

Types: ``rounds`` is a whole number everywhere. The token counts are typed ``float``: under sampling the replay holds
expectations (``E[accepted]`` and what follows from it); the engine counts what happened and keeps whole numbers
(int values, which the ``float`` annotation admits), so its records and reports print them as integers. The defaults
are ``0`` for that reason; the replay adds its counts as floats.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RoundCounts"]


@dataclass
class RoundCounts:
    """Counts of verification rounds, summed over every sequence (a round is one sequence's draft-then-verify)."""

    rounds: int = 0
    """Verification rounds (per sequence)."""
    tokens: float = 0
    """Tokens emitted: accepted drafts plus one target token (correction or bonus) per round."""
    drafted: float = 0
    """Tokens the draft proposed."""
    verified: float = 0
    """Drafted tokens sent to the target (fewer than drafted when the goodput rule verifies a prefix)."""
    accepted: float = 0
    """Drafted tokens accepted (taken unverified under sequential verification; expected in sampling replay)."""
