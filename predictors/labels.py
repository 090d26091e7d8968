"""Label families derived from the stored raw quantities (no regeneration to change lambda).

- ``greedy``: draft token == target argmax (DISCO; greedy decoding acceptance).
- ``ratio``: q(x)/p(x) <= lambda (SPRINTER), lambda in {1, 1.2, 1.5}; larger lambda accepts more.
- ``soft``: min(1, p(x)/q(x)) (SV, SpecDec++), the acceptance probability under exact speculative sampling.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

LABEL_FAMILIES = ("greedy", "ratio", "soft")


def label_draw(family: str) -> str:
    """The draw a family's labels judge: greedy match judges argmax tokens (greedy decoding); q/p <= lambda and min(1,
    p/q) judge sampled ones."""
    if family not in LABEL_FAMILIES:
        raise ValueError(f"unknown label family {family!r}; use one of {LABEL_FAMILIES}")
    return "greedy" if family == "greedy" else "sample"


def draw_mask(columns: Mapping[str, object], draw: str) -> np.ndarray | None:
    """Row mask of the records drawn as ``draw``; None when every row is used (no ``draw`` column, or only other draws).
    """
    if "draw" not in columns:
        return None
    d = np.asarray(columns["draw"]).astype(str)
    mask = d == draw
    return mask if mask.any() else None


def derive_label(columns: Mapping[str, object], family: str, lam: float = 1.0) -> np.ndarray:
    """Label array for ``family`` (float32: 0/1 for greedy and ratio, in [0, 1] for soft)."""
    if family == "greedy":
        return np.asarray(columns["greedy_match"], dtype=np.float32)
    if family == "ratio":
        if lam <= 0:
            raise ValueError(f"label lambda must be > 0, got {lam}")
        q = np.asarray(columns["q"], dtype=np.float64)
        p = np.asarray(columns["p"], dtype=np.float64)
        return (q <= lam * p).astype(np.float32)  # q/p <= lambda without dividing by p = 0
    if family == "soft":
        return np.asarray(columns["accept_prob"], dtype=np.float32)
    raise ValueError(f"unknown label family {family!r}; use one of {LABEL_FAMILIES}")


def label_name(family: str, lam: float = 1.0) -> str:
    """Human-readable name, e.g. 'q/p<=1.2'."""
    return {"greedy": "greedy match", "ratio": f"q/p<={lam:g}", "soft": "min(1,p/q)"}[family]
