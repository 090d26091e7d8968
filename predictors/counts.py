"""One vocabulary for the counts of speculative decoding rounds: every counter of a run extends :class:`RoundCounts`.

- ``decoding.stats.DecodeStats``: what a real run did (the engine; llama.cpp's hook and transformers' integration
  report theirs in it too);
- ``evaluation.replay.ReplayResult``: what the replay predicts (``pipelines.replay_check`` compares the two);
- ``runtimes.vllm.stopper.StopperCounts``: what the vLLM stopper decided (vLLM, not the stopper, counts ``tokens``);
- ``runtimes.llamacpp.draft.DraftCall``: one call of the llama.cpp hook, one round.

The words: a round is one sequence's draft-then-verify; ``drafted`` tokens the draft proposed, ``sent`` of them went
to the target, ``accepted`` of those were accepted (or taken unverified under sequential verification), and the round
emitted ``tokens``: the accepted ones plus the target's correction or bonus token. The class lives here, in
``predictors``, the lowest layer every counter's room imports.

Types: ``rounds`` is a whole number everywhere. The token counts are typed ``float``: under sampling the replay holds
expectations (``E[accepted]`` and what follows from it); the real runs count what happened and keep whole numbers
(int values, which the ``float`` annotation admits), so their records and reports print them as integers.
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
    sent: float = 0
    """Drafted tokens sent to the target (fewer than drafted when the round rule sends a prefix)."""
    accepted: float = 0
    """Sent tokens accepted (taken unverified under sequential verification; expected in sampling replay)."""
