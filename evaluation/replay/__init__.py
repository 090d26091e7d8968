"""Offline replay of stop policies over stored labelled sequences: no model runs, only the per-token records.

Records are grouped by labelled segment (``seq_id`` and the segment start ``prefix_len - offset``, see
:func:`segment_keys`) and ordered by ``offset``. A round starts at offset ``s``: the policy drafts tokens ``s, s+1,
...``, and after each drafted token ``keep_drafting`` says whether to draft another (the token that triggers the stop is
still drafted and verified), up to ``policy.draft_cap()`` tokens and the end of the sequence. Verification:

- ``greedy``: accepted count ``a`` = leading ``greedy_match`` among the drafted tokens (first mismatch);
- ``sampling``: the expectation ``E[a] = sum_k prod_{j<=k} accept_prob_j`` over the drafted prefix (exact speculative
  sampling accepts token j with ``min(1, p/q)``), and the next round starts at ``s + round(E[a]) + 1``.

The round emits ``a + 1`` tokens (the correction, or the bonus token when all were accepted) and costs
``CostModel.round_time(n_drafted)``; ``policy.update(RoundFeedback(...))`` follows each round and ``policy.reset()``
starts each sequence. Predicted speedup = (tokens / replayed seconds) * target-only seconds per token (``target_s[1]``).

Why this is exact for greedy on ``origin == "target"`` teacher-forced sequences: greedy speculative decoding outputs
exactly the target's greedy continuation, and along that continuation the draft's prefix at offset ``s + j`` is
identical to the stored one while every earlier drafted token matched. So the accepted counts, the round boundaries and
the emitted tokens of every round are those of a real run. Two caveats: (1) the draft tokens *after* the first mismatch
of a round were drafted in a real run from the draft's own (wrong) token, while the stored features there come from the
target's token, so the number of *wasted* drafts of a threshold policy is approximate (accepted counts are not); (2) it
holds when the stored target continuation is the target's greedy output (temperature 0). Elsewhere (draft rollouts,
dataset text, sampling) the sequence after a mismatch is not what speculative decoding would have produced, and the
replay is an approximation that uses the stored prefixes as a sample of contexts. :class:`ReplayConfig` replays the
exact case by default and falls back, with a note in ``ReplayData.note``, when the data holds no such sequences.

Caveat (1) goes with ``ReplayConfig.branch_rollouts`` on data that holds the draft's own rollout from every prefix where
a drafted token fails greedy match, and from the end of the sequence (``data_gen.generate.label_continuation``): past a
round's first mismatch the round reads that rollout's rows, as the engine's draft does, so the drafted lengths (and the
goodput rule's verified lengths) are those of a real run too. ``ReplayConfig.max_new_tokens`` caps each round as the
engine caps it (``max_new_tokens - emitted - 1``) and lets a round draft past the stored end (an end of sequence) into
the rollout from there. ``pipelines.replay_check`` replays the benchmark's prompts this way.

Tokens are counted up to the end of the stored sequence (a round that would emit its bonus token past the end is
clipped), so in greedy mode every policy emits the same tokens and the speedup is a pure time ratio.

Special policies: the oracle (the ``hindsight`` round rule, DISCO's definition) drafts exactly the acceptable run
(greedy: leading matches; sampling: until the first rejection, in expectation), never the last stored token (its bonus
would lie past the end); it is the upper bound when a verification pass costs more than a draft step and verification
time is subadditive in length. The schedule oracle (:class:`OracleSchedule`) is the exact bound under any non-decreasing
cost model in greedy mode: a dynamic programme over each sequence picks, at every round start, how many of the
acceptable tokens to draft so that the total replayed time is minimal (in sampling mode it falls back to the expectation
oracle). Cost-aware policies (the ``goodput`` round rule: SV, ``goodput:`` wrappers) follow the one goodput rule of
``predictors.goodput`` (the engine calls the same functions): draft while the expected tokens/s of the lengths still
reachable improves, verify the best prefix, paying companion steps per drafted token when the policy reads them. Each of
their rounds also records the tokens it expected to emit beside the ones it did (``ReplayResult.round_tokens``).

Approximate policies (the ``sequential`` round rule, SPRINTER) are replayed as the engine runs them: the tokens a round
drafts before its last are taken unverified and only the last is checked (greedy match, or min(1, p/q) in expectation),
so a round of n drafted tokens emits n + 1 tokens or n. Once a round takes a mismatch unverified the engine's output
leaves the stored sequence while the replay goes on along it: the rounds' lengths and checks are a sample of the
policy's, not its trajectory.

Four modules (every public name importable from here):

- ``sequences``: what is replayed: ``ReplayConfig``, ``ReplayData``, ``prepare_replay_data`` (selection, order,
  rollouts);
- ``scores``: a policy's precomputed scores over the rows, missing columns, ``with_threshold``;
- ``rounds``: the round loop (``replay_policy`` runs ``_replay_sequence`` per stored sequence, which runs rounds:
  ``_replay_round``, with ``_round_rows`` the rows the round drafts from and ``_round_lengths`` the drafted and verified
  counts, then acceptance and cost are counted), what it adds up to (``ReplayResult``, the shared round counts of
  ``predictors.counts`` and seconds) and the oracles' rounds (``OracleSchedule``, the sampling oracle);
- ``tuning``: the tables, threshold sweeps, ``tune_threshold``, ``replay_table``.

Usage::

    from evaluation.replay import replay_table, ReplayConfig
    table = replay_table(columns, {"disco": policy}, cost_model, ReplayConfig(mode="greedy"))
"""
from __future__ import annotations

from evaluation.replay.rounds import OracleSchedule, ReplayResult, replay_policy
from evaluation.replay.scores import missing_columns, policy_scores, position_score_matrix, with_threshold
from evaluation.replay.sequences import REPLAY_MODES, ReplayConfig, ReplayData, prepare_replay_data, segment_keys
from evaluation.replay.tuning import (
    default_grid,
    default_replay_policies,
    replay_table,
    threshold_sweep,
    tune_threshold,
)

__all__ = [
    "REPLAY_MODES",
    "ReplayConfig",
    "ReplayData",
    "ReplayResult",
    "prepare_replay_data",
    "replay_policy",
    "replay_table",
    "threshold_sweep",
    "tune_threshold",
    "default_grid",
    "default_replay_policies",
    "policy_scores",
    "position_score_matrix",
    "missing_columns",
    "OracleSchedule",
    "segment_keys",
    "with_threshold",
]
