"""The draft statistics of a stop decision in one native call: entropy, q(token) and the top-k probabilities of
softmax(z / T) for each row of logits, without materialising the probabilities (``csrc/draft_stats.cpp``, its row
kernels in ``csrc/softmax_rows.h`` and ``csrc/pair_rows.h``); and DISCO's inputs and network on them in another
(:func:`disco_score`).

After a draft forward that streamed its weights through the caches, every small torch op of the stop decision costs
several times its warm cost (code and dispatcher state come back from memory); the torch version of these statistics
is about a dozen kernels and passes over the vocabulary, the native one is one call with two passes. It is built on
first use with ``torch.utils.cpp_extension.load`` (g++ and ninja; a few seconds, cached as
``compute.native`` says) as one binary with AVX-512, AVX2 and baseline clones picked at load time.
:func:`draft_stats` returns None where it does not apply (not a CPU tensor, no compiler, ``SPECSTOP_NATIVE=0``) and
callers compute the same quantities with torch ops (``data_gen.features``).

Usage::

    stats = draft_stats(logits, tokens, k=10, temperature=0.0)   # [N, 2 + k] or None
    tokens, stats = greedy_draft_stats(logits, k=10)              # greedy: the argmax and its statistics at once
    entropy, q, topk = stats[:, 0], stats[:, 1], stats[:, 2:]
    score = disco_score(topk, [position], [8.0], [False], (w1, b1, w2, b2), (-1, 1.0, 0.0))  # DiscoPolicy's
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from compute.native import NativeExtension

log = logging.getLogger(__name__)

__all__ = ["draft_stats", "greedy_draft_stats", "pair_stats", "sample_tokens", "disco_score", "native_available"]

_EXT = NativeExtension("specstop_draft_stats", "draft_stats.cpp", "native draft statistics")


def _load() -> Any:
    """The built extension, or None (``_EXT.failed`` says why)."""
    return _EXT.module()


def native_available() -> bool:
    """The native statistics are built and loaded (builds them on the first call)."""
    return _load() is not None


def draft_stats(logits: Tensor, tokens: Tensor, k: int, temperature: float = 0.0) -> Tensor | None:
    """[..., V] logits, [...] tokens -> [..., 2 + k] float32 (entropy, q(token), top-k probabilities descending, zeros
    past V) of softmax(logits / temperature) (temperature 0 or 1: softmax(logits)); NaN in a row whose logits hold NaN
    or inf. None when the native path does not apply (then use torch ops)."""
    if logits.device.type != "cpu" or k < 1:
        return None
    mod = _load()
    if mod is None:
        return None
    lead = logits.shape[:-1]
    out = mod.draft_stats(_rows(logits, logits.shape[-1]), tokens.reshape(-1).long(), int(k), float(temperature))
    return out.reshape(*lead, 2 + k)


def greedy_draft_stats(logits: Tensor, k: int, name: str = "draft") -> tuple[Tensor, Tensor] | None:
    """Greedy decoding's draft step in one native call: [B, V] logits -> ([B] int64 tokens, each row's first argmax as
    ``torch.argmax`` picks it; [B, 2 + k] their :func:`draft_stats`), the argmax read off the statistics' own passes.
    FloatingPointError naming ``name`` when a row's logits hold NaN or inf; None when the native path does not apply
    (then ``argmax`` and :func:`draft_stats`)."""
    if logits.device.type != "cpu" or k < 1 or logits.dim() != 2:
        return None
    mod = _load()
    if mod is None:
        return None
    try:
        return mod.greedy_stats(_rows(logits, logits.shape[-1]), int(k))
    except RuntimeError as e:
        if "non-finite logits" in str(e):
            raise FloatingPointError(f"{name} logits contain NaN or inf") from e
        raise


def pair_stats(draft_logits: Tensor, other_logits: Tensor, tokens: Tensor, temperature: float = 0.0
               ) -> tuple[Tensor, Tensor] | None:
    """The draft against another model (target or companion) on the same positions: ([..., 4] float32: the other's
    probability of the token, its entropy, TV = 1/2 sum |p - q| and the overlap sum min(p, q) of softmax(z / T);
    [...] int64: the first argmax of the other's raw logits), with no [..., V] temporaries. NaN (argmax -1) in a row
    whose logits hold NaN or inf; None when the native path does not apply."""
    if draft_logits.device.type != "cpu" or other_logits.device.type != "cpu":
        return None
    mod = _load()
    if mod is None:
        return None
    lead, v = draft_logits.shape[:-1], draft_logits.shape[-1]
    q, o = (_rows(t, v) for t in (draft_logits, other_logits))
    out, amax = mod.pair_stats(q, o, tokens.reshape(-1).long(), float(temperature))
    return out.reshape(*lead, 4), amax.reshape(lead)


def disco_score(topk: Tensor, scalars: list[Tensor], divisors: list[float], logs: list[bool],
                weights: tuple[Tensor, Tensor, Tensor, float], prior: tuple[int, float, float],
                sigmoid: bool = True, hidden: Tensor | None = None, hidden_w: Tensor | None = None) -> Tensor | None:
    """[N] DISCO scores in one native call (``predictors.disco.DiscoPolicy.score``): inputs [topk [N, k], the entropy
    of the renormalised top-k, each scalar column [N] (or [1]) divided by its divisor or, where ``logs``, log(max(v,
    1e-9))], then ReLU(x w1^T + b1) . w2 + b2 (``weights``: the standardisation folded into w1 [H, D], b1 [H]; w2 [H];
    b2) plus ``prior`` (index, scale, bias: scale * logit(x[index]) + bias, index -1 for none), through a sigmoid
    when ``sigmoid``; with ``hidden`` [N, Hd] (any float dtype) and ``hidden_w`` [Hd] also hidden . hidden_w (SPRINTER's
    linear term on the draft's hidden state). None when the native path does not apply (not a float32 CPU top-k, no
    build) or an input is not finite (the torch path then names the column)."""
    if topk.device.type != "cpu" or topk.dtype != torch.float32 or topk.dim() != 2:
        return None
    mod = _load()
    if mod is None:
        return None
    w1, b1, w2, b2 = weights
    try:
        return mod.disco_score(topk if topk.is_contiguous() else topk.contiguous(), scalars, divisors, logs, w1, b1,
                               w2, b2, prior[0], prior[1], prior[2], sigmoid, hidden, hidden_w)
    except RuntimeError:
        return None


def _rows(t: Tensor, v: int) -> Tensor:
    """[N, V] contiguous float32 view (or copy) of [..., V] logits."""
    t = t.reshape(-1, v)
    t = t if t.dtype == torch.float32 else t.float()
    return t if t.is_contiguous() else t.contiguous()


def sample_tokens(logits: Tensor, temperature: float, generator: torch.Generator | None = None) -> Tensor | None:
    """[..., V] logits -> [...] int64: one draw per row from softmax(logits / temperature) (temperature > 0), by
    inversion of one uniform per row from ``generator`` against block sums (no [..., V] probabilities, no
    ``torch.multinomial``). None when the native path does not apply."""
    if logits.device.type != "cpu" or temperature <= 0:
        return None
    mod = _load()
    if mod is None:
        return None
    lead = logits.shape[:-1]
    z = _rows(logits, logits.shape[-1])
    u = torch.rand(z.shape[0], generator=generator, dtype=torch.float64)
    return mod.sample_tokens(z, u, float(temperature)).reshape(lead)
