"""The draft statistics of a stop decision in one native call (``csrc/draft_stats.cpp``): entropy, q(token) and top-k of
softmax(z / T) without materialising the probabilities, and DISCO's score on them.

Right after a draft forward every small torch op costs several times its warm cost, so one call with two passes over the
vocabulary replaces a dozen kernels. Each function returns None where the native path does not apply (not a CPU tensor,
no compiler, ``SPECSTOP_NATIVE=0``) and callers use the torch ops of ``data_gen.features``.

Usage::

    stats = draft_stats(logits, tokens, k=10, temperature=0.0)   # [N, 2 + k]: entropy, q, top-k; or None
    tokens, stats = greedy_draft_stats(logits, k=10)              # the argmax and its statistics at once
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
    """[..., V] logits, [...] tokens -> [..., 2 + k] float32: entropy, q(token), top-k probabilities of softmax(logits /
    T) (NaN where a row holds NaN or inf); None when the native path does not apply."""
    if logits.device.type != "cpu" or k < 1:
        return None
    mod = _load()
    if mod is None:
        return None
    lead = logits.shape[:-1]
    out = mod.draft_stats(_rows(logits, logits.shape[-1]), tokens.reshape(-1).long(), int(k), float(temperature))
    return out.reshape(*lead, 2 + k)


def greedy_draft_stats(logits: Tensor, k: int, name: str = "draft") -> tuple[Tensor, Tensor] | None:
    """Greedy decoding's draft step: [B, V] logits -> ([B] first argmax, [B, 2 + k] its :func:`draft_stats`) in one
    call; FloatingPointError naming ``name`` for a non-finite row, None when not native."""
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
    """The draft against another model on the same positions: ([..., 4] the other's p(token), entropy, TV and overlap
    sum min(p, q); [...] its argmax), no [..., V] temporaries; None when not native."""
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
    """[N] DISCO scores in one native call (``DiscoPolicy.score``): the top-k features through the folded MLP, plus
    ``prior`` and SPRINTER's ``hidden . hidden_w`` term, through a sigmoid when ``sigmoid``. None when not native or an
    input is not finite (the torch path then names the column)."""
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
    """[..., V] logits -> [...] int64: one draw per row from softmax(logits / temperature) by inversion against block
    sums; None when not native."""
    if logits.device.type != "cpu" or temperature <= 0:
        return None
    mod = _load()
    if mod is None:
        return None
    lead = logits.shape[:-1]
    z = _rows(logits, logits.shape[-1])
    u = torch.rand(z.shape[0], generator=generator, dtype=torch.float64)
    return mod.sample_tokens(z, u, float(temperature)).reshape(lead)
