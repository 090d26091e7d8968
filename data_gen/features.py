"""The one feature function shared by data generation and decoding: every per-token input a predictor sees and every raw
label quantity comes from :func:`token_features`.

The labeller calls it with target logits over whole sequences, the engine without them on each drafted token, so a
predictor sees the same features in training and in decoding (tested). On a CPU without a nucleus cut the softmax
statistics are native calls (``compute.draft_stats``), elsewhere torch ops; both agree to float32 rounding.
"""
from __future__ import annotations

import math
from collections.abc import Collection

import torch
from torch import Tensor

from compute.draft_stats import draft_stats, pair_stats

__all__ = ["probs_from_logits", "probs_and_entropy", "entropy", "topk_values", "token_features", "FEATURE_COLUMNS",
           "TARGET_COLUMNS", "COMPANION_COLUMNS"]

# Columns computed from the draft alone (available at decode time).
FEATURE_COLUMNS = ("draft_token", "q", "draft_entropy", "draft_max_prob", "draft_topk")
# Columns that need the companion model (available at decode time when a companion runs).
COMPANION_COLUMNS = ("companion_prob", "companion_sim", "companion_entropy", "companion_accept")
# Raw label quantities: need the target, so only known after verification.
TARGET_COLUMNS = ("p", "accept_prob", "target_argmax", "greedy_match", "tv")


def probs_from_logits(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0) -> Tensor:
    """[..., V] float32 probabilities of the distribution a model samples from: softmax(logits / temperature)
    (temperature 0: greedy, softmax(logits)), cut to the ``top_p`` nucleus and renormalised."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop_sorted = (cum - sorted_p) >= top_p  # keep the smallest set whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def probs_and_entropy(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0) -> tuple[Tensor, Tensor]:
    """(:func:`probs_from_logits`, [...] their entropy); without a nucleus cut the entropy is log s - sum p (z - m),
    with log s = -log max p, which skips log_softmax's pass over the vocabulary."""
    probs = probs_from_logits(logits, temperature, top_p)
    if top_p < 1.0:
        return probs, entropy(probs)
    z = logits.float()
    if temperature > 0 and temperature != 1.0:
        z = z / temperature
    m, at = z.max(dim=-1, keepdim=True)
    terms = (z - m).mul_(probs)  # [..., V] p (z - m), one temporary
    # max p is p at the argmax of z (softmax is monotone; the same value as probs.amax, one pass over V fewer)
    return probs, -torch.log(probs.gather(-1, at).squeeze(-1)) - terms.sum(dim=-1)


def topk_values(x: Tensor, k: int, block: int = 128) -> Tensor:
    """[..., V] -> [..., k] largest values, descending, as ``torch.topk``: the top-k of the k blocks with the largest
    maxima, which hold them all; several times faster over a vocabulary. Inputs must be NaN-free."""
    v = x.shape[-1]
    k = min(int(k), v)
    if v < 16 * block or k > 64:
        return x.topk(k, dim=-1).values
    nb = -(-v // block)
    if nb * block != v:
        x = torch.nn.functional.pad(x, (0, nb * block - v), value=float("-inf"))
    blocks = x.reshape(*x.shape[:-1], nb, block)  # [..., nb, block]
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [..., k] blocks with the k largest maxima
    cand = blocks.gather(-2, best.unsqueeze(-1).expand(*best.shape, block))  # [..., k, block]
    return cand.flatten(-2).topk(k, dim=-1).values


def entropy(probs: Tensor) -> Tensor:
    """Natural-log entropy over the last dimension: [..., V] -> [...] (``entr``: -p log p in one pass, 0 at p = 0)."""
    return torch.special.entr(probs).sum(-1)


def token_features(
    draft_logits: Tensor, draft_tokens: Tensor, *, target_logits: Tensor | None = None,
    companion_logits: Tensor | None = None, draft_hidden: Tensor | None = None, top_k: int = 10,
    temperature: float = 1.0, top_p: float = 1.0, columns: Collection[str] | None = None, stats: Tensor | None = None,
    companion_stats: Tensor | None = None,
) -> dict[str, Tensor]:
    """Per-draft-token features and raw label quantities; logits at index i score the token at index i (callers shift).

    Args:
        draft_logits, draft_tokens: [..., V] draft logits and [...] the drafted tokens (x ~ q).
        target_logits: [..., V] at the same positions; adds the label columns (``p``, ``accept_prob``, ``tv``, ...).
        companion_logits: [..., V] at the same positions; adds the SV signals (``companion_*``).
        draft_hidden: [..., H] the draft's last hidden state, stored as float16.
        top_k, temperature, top_p: top-k probabilities kept, and the sampling distribution they describe.
        columns: the draft columns wanted (a policy's ``required_columns``); None computes all.
        stats, companion_stats: the native statistics when the caller has them already (the engine's draft step).
    Returns:
        dict of tensors with leading shape [...], one per column.
    """
    want_entropy = columns is None or "draft_entropy" in columns
    want_topk = columns is None or "draft_max_prob" in columns or "draft_topk" in columns
    # without a nucleus cut, on one CPU: native statistics (compute.draft_stats), else torch ops over probabilities
    one_cpu = all(t is None or t.device == draft_logits.device for t in (target_logits, companion_logits))
    if not (top_p >= 1.0 and one_cpu):
        stats = None
    elif stats is None:
        stats = draft_stats(draft_logits, draft_tokens, max(1, top_k), temperature)
        if stats is not None:
            _check_finite("draft", stats[..., 0])  # the native calls put NaN in rows with NaN or inf logits
    if stats is not None:
        q, q_entropy = stats[..., 1], stats[..., 0]
        topk = stats[..., 2: 2 + min(max(1, top_k), draft_logits.shape[-1])]
    else:
        for name, t in (("target", target_logits), ("companion", companion_logits)):
            if t is not None:
                _check_finite(name, t)
        q, q_entropy, topk, q_all = _draft_columns(draft_logits, draft_tokens, max(1, top_k), temperature, top_p,
                                                   want_entropy, want_topk)
    out: dict[str, Tensor] = {"draft_token": draft_tokens.long(), "q": q}
    if want_entropy:
        out["draft_entropy"] = q_entropy
    if want_topk:
        out["draft_max_prob"] = topk[..., 0]  # sorted: [..., 0] is the max
        out["draft_topk"] = topk[..., :top_k]
    if draft_hidden is not None:
        out["draft_hidden"] = draft_hidden.to(torch.float16)
    tok = draft_tokens.long().unsqueeze(-1)
    if companion_logits is not None:
        if stats is not None:  # native: the companion against the draft in three passes, no [..., V] temporaries
            cs = companion_stats
            if cs is None:
                cs, _ = pair_stats(draft_logits, companion_logits, draft_tokens, temperature)
            _check_finite("companion", cs[..., 1])
            c, c_entropy, c_sim = cs[..., 0], cs[..., 1], cs[..., 3]
        else:
            c_all, c_entropy = probs_and_entropy(companion_logits, temperature, top_p)
            c, c_sim = c_all.gather(-1, tok).squeeze(-1), torch.minimum(q_all, c_all).sum(-1)
        out["companion_prob"] = c
        out["companion_sim"] = c_sim
        out["companion_entropy"] = c_entropy
        out["companion_accept"] = (c / q.clamp_min(1e-30)).clamp(max=1.0)
    if target_logits is not None:  # the labels (data generation; the decoding engine's oracle)
        _add_target_columns(out, draft_logits, target_logits, draft_tokens, q, None if stats is not None else q_all,
                            temperature, top_p)
    return out


def _add_target_columns(out: dict[str, Tensor], draft_logits: Tensor, target_logits: Tensor, draft_tokens: Tensor,
                        q: Tensor, q_all: Tensor | None, temperature: float, top_p: float) -> None:
    """Add the raw label columns to ``out``: from native statistics when ``q_all`` is None, else from the probabilities.
    """
    if q_all is None:
        ts, target_argmax = pair_stats(draft_logits, target_logits, draft_tokens, temperature)
        _check_finite("target", ts[..., 1])
        p, tv = ts[..., 0], ts[..., 2]
    else:
        p_all = probs_from_logits(target_logits, temperature, top_p)
        p, tv = p_all.gather(-1, draft_tokens.long().unsqueeze(-1)).squeeze(-1), 0.5 * (p_all - q_all).abs().sum(-1)
        target_argmax = target_logits.argmax(-1)  # greedy verification compares with the raw argmax
    out["p"] = p
    out["accept_prob"] = (p / q.clamp_min(1e-30)).clamp(max=1.0)
    out["target_argmax"] = target_argmax
    out["greedy_match"] = target_argmax == draft_tokens.long()
    out["tv"] = tv


def _check_finite(name: str, t: Tensor) -> None:
    """FloatingPointError naming the model when ``t`` holds NaN or inf: one reduction instead of a [..., V] bool mask
    (finite LM logits cannot overflow an fp32 sum)."""
    if not math.isfinite(t.sum(dtype=torch.float32)):
        raise FloatingPointError(f"{name} logits contain NaN or inf")


def _draft_columns(
    logits: Tensor, tokens: Tensor, k: int, temperature: float, top_p: float, want_entropy: bool, want_topk: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """The torch-ops path (a nucleus cut, a GPU, no native build): (q(token), entropy or None, top-k or None, all
    probabilities)."""
    if want_entropy:
        q_all, entropy_ = probs_and_entropy(logits, temperature, top_p)
        # without a nucleus cut the entropy is NaN for NaN, +inf or -inf logits (p (z - m) = 0 x -inf): the check
        _check_finite("draft", entropy_ if top_p >= 1.0 else logits)
    else:
        _check_finite("draft", logits)
        q_all, entropy_ = probs_from_logits(logits, temperature, top_p), None
    q = q_all.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    topk = topk_values(q_all, k) if want_topk else None
    return q, entropy_, topk, q_all
