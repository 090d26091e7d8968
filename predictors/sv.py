"""Speculative Verification (SV): the bin-table scorer and the policy (its round rule is ``predictors.goodput``).

Where else SV lives: its Lightning module (``predictors.lightning_modules.SVTableModule``, one counting pass), its
training branch (``predictors.training``) and its round rule, the goodput rule of ``predictors.goodput``.

**Scorer.** Mean target acceptance per (S, A_c) cell.

S = sum_v min(q(v), c(v)) (draft-companion similarity) and A_c = min(1, c(x)/q(x)) (companion acceptance) are cut into
equal-count (quantile) bins fitted on training data (10-30 bins for S, 10-20 for A_c in the paper; duplicate quantiles,
e.g. the mass of A_c at exactly 1, are merged, so a table may have fewer bins than asked for). Each cell holds the mean
target acceptance min(1, p(x)/q(x)) (``accept_prob``). Thin or empty cells are smoothed: a cell with n tokens and sum s
holds (s + m * row) / (n + m), where row is the S row's mean itself shrunk toward the global mean with the same prior
count m (``prior_count``).

Information gain (SV paper, Table 2), H(A) - H(A | S, A_c) in bits. The discretisation of A is explicit:

- ``levels=0`` (default): A is the binary accept event of exact speculative sampling, A ~ Bernoulli(accept_prob). Then
  H(A) = h2(E[accept_prob]) and H(A | cell) = h2(E[accept_prob | cell]) (h2 the binary entropy in bits), i.e. the
  expected
  binary entropy with the per-token randomness marginalised inside each cell. At most 1 bit.
- ``levels=L > 0``: A is accept_prob itself cut into L equal-width levels on [0, 1] (plug-in entropies, up to log2 L
bits;
  closer to the paper's multi-bit numbers).

Conditional entropies use the empirical cell distribution of the data they are computed on (plug-in, as in the paper).

**Round rule (goodput).** SV is the cost-aware rule of ``predictors.goodput`` (one module for the engine, the replay and
every ``goodput:`` policy) with the table's cell value as the calibrated acceptance: P(N >= n) = prod_{j <= n} a_j,
expected tokens of a round = E[accepted | n] + 1, priced by the measured verification curve.

Usage::

    table = SVTable(s_bins=20, a_bins=10, prior_count=5.0)
    table.fit(s, a_c, accept_prob)
    policy = SVPolicy(table)                  # score = cell value
    table.information_gain(s, a_c, accept_prob)
    predictors.goodput.best_prefix([0.9, 0.8, 0.3], cost)  # (best verification length, its goodput)
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from predictors.inputs import FeatureSpec, LearnedPolicy
from predictors.round_rules import GOODPUT

__all__ = ["SVTable", "SVPolicy", "quantile_edges", "binary_entropy_bits"]


def quantile_edges(x: np.ndarray, n_bins: int) -> np.ndarray:
    """Equal-count bin edges [n+1] (n <= n_bins after merging duplicate quantiles; at least one bin)."""
    if x.size == 0:
        raise ValueError("cannot fit bin edges on empty data")
    edges = np.unique(np.quantile(x.astype(np.float64), np.linspace(0.0, 1.0, n_bins + 1)))
    if edges.size < 2:
        edges = np.array([edges[0], edges[0]])
    return edges


def binary_entropy_bits(p: np.ndarray) -> np.ndarray:
    """h2(p) in bits, elementwise (0 at p in {0, 1})."""
    p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    return np.nan_to_num(h, nan=0.0)


def _entropy_bits(counts: np.ndarray) -> float:
    n = counts.sum()
    if n <= 0:
        return 0.0
    p = counts[counts > 0] / n
    return float(-(p * np.log2(p)).sum())


class SVTable(nn.Module):
    """Tensor table [s_bins, a_bins] of mean acceptance with its bin edges and counts as buffers."""

    def __init__(self, s_bins: int = 20, a_bins: int = 10, prior_count: float = 5.0) -> None:
        super().__init__()
        if s_bins < 1 or a_bins < 1:
            raise ValueError(f"SVTable needs s_bins >= 1 and a_bins >= 1, got {s_bins}, {a_bins}")
        if prior_count < 0:
            raise ValueError(f"SVTable.prior_count={prior_count} must be >= 0")
        self.s_bins, self.a_bins, self.prior_count = int(s_bins), int(a_bins), float(prior_count)
        self.register_buffer("s_edges", torch.linspace(0, 1, s_bins + 1, dtype=torch.float64))
        self.register_buffer("a_edges", torch.linspace(0, 1, a_bins + 1, dtype=torch.float64))
        self.register_buffer("table", torch.full((s_bins, a_bins), 0.5))
        self.register_buffer("counts", torch.zeros(s_bins, a_bins))
        self.register_buffer("global_mean", torch.tensor(0.5))

    def config(self) -> dict[str, Any]:
        """Constructor arguments giving this table's (fitted) shape."""
        return {"s_bins": self.s_bins, "a_bins": self.a_bins, "prior_count": self.prior_count}

    # ---- binning --------------------------------------------------------------------------------------------------
    @staticmethod
    def _bucket(x: Tensor, edges: Tensor) -> Tensor:
        # inner edges: a value equal to an edge goes to the upper bin; outside values clamp to the end bins
        return torch.bucketize(x.double().contiguous(), edges[1:-1].contiguous(), right=True)

    def cells(self, s: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """Row (S) and column (A_c) bin index of each token: two [N] long tensors, on the table's device."""
        dev = self.s_edges.device
        return self._bucket(s.to(dev), self.s_edges), self._bucket(a.to(dev), self.a_edges)

    # ---- fitting --------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def fit(self, s: Tensor | np.ndarray, a: Tensor | np.ndarray, accept: Tensor | np.ndarray) -> dict[str, float]:
        """Fit the edges (equal-count bins) and the smoothed cell means, kept on the table's device (Lightning's
        fit on a GPU validates there next); returns the training information gain."""
        s_np, a_np, y_np = (np.asarray(torch.as_tensor(v).double().cpu()).reshape(-1) for v in (s, a, accept))
        if not (s_np.size == a_np.size == y_np.size) or s_np.size == 0:
            raise ValueError(f"SVTable.fit needs equal, non-empty columns; got {s_np.size}, {a_np.size}, {y_np.size}")
        for name, v in (("companion_sim", s_np), ("companion_accept", a_np), ("accept_prob", y_np)):
            if not np.isfinite(v).all():
                raise ValueError(f"SVTable.fit: NaN or inf in {name}")
        dev = self.table.device
        s_edges, a_edges = quantile_edges(s_np, self.s_bins), quantile_edges(a_np, self.a_bins)
        self.s_bins, self.a_bins = s_edges.size - 1, a_edges.size - 1
        self.s_edges, self.a_edges = torch.from_numpy(s_edges).to(dev), torch.from_numpy(a_edges).to(dev)
        i, j = (t.cpu().numpy() for t in self.cells(torch.from_numpy(s_np), torch.from_numpy(a_np)))
        flat = i * self.a_bins + j
        n_cells = self.s_bins * self.a_bins
        counts = np.bincount(flat, minlength=n_cells).reshape(self.s_bins, self.a_bins).astype(np.float64)
        sums = np.bincount(flat, weights=y_np, minlength=n_cells).reshape(self.s_bins, self.a_bins)
        g, m = float(y_np.mean()), self.prior_count
        row = (sums.sum(1) + m * g) / np.maximum(counts.sum(1) + m, 1e-12)  # [s_bins]
        table = (sums + m * row[:, None]) / np.maximum(counts + m, 1e-12)
        table = np.where(counts + m > 0, table, row[:, None])  # m = 0 and an empty cell: the row mean
        self.table = torch.from_numpy(table).float().to(dev)
        self.counts = torch.from_numpy(counts).float().to(dev)
        self.global_mean = torch.tensor(g, dtype=torch.float32, device=dev)
        return self.information_gain(s_np, a_np, y_np)

    # ---- scoring / analysis -----------------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        """[N, 2] (S, A_c) -> [N] cell value (estimated acceptance probability)."""
        i, j = self.cells(x[:, 0], x[:, 1])
        return self.table[i, j]

    def information_gain(
        self, s: Tensor | np.ndarray, a: Tensor | np.ndarray, accept: Tensor | np.ndarray, levels: int = 0
    ) -> dict[str, float]:
        """H(A) - H(A | S, A_c) in bits over this table's cells (see the module docstring for A's discretisation).

        Returns:
            {"h_a_bits", "h_a_given_cells_bits", "information_gain_bits", "information_gain_frac"}.
        """
        s_t, a_t = torch.as_tensor(s).reshape(-1), torch.as_tensor(a).reshape(-1)
        y = torch.as_tensor(accept).double().cpu().numpy().reshape(-1)
        i, j = (t.cpu().numpy() for t in self.cells(s_t, a_t))
        flat = i * self.a_bins + j
        n_cells = self.s_bins * self.a_bins
        counts = np.bincount(flat, minlength=n_cells).astype(np.float64)
        w = counts / counts.sum()
        if levels <= 0:
            sums = np.bincount(flat, weights=y, minlength=n_cells)
            cell_mean = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
            h_a = float(binary_entropy_bits(y.mean()))
            h_cond = float((w * binary_entropy_bits(cell_mean)).sum())
        else:
            lv = np.clip((y * levels).astype(np.int64), 0, levels - 1)
            h_a = _entropy_bits(np.bincount(lv, minlength=levels).astype(np.float64))
            joint = np.bincount(flat * levels + lv, minlength=n_cells * levels).reshape(n_cells, levels)
            h_cond = float(
                sum(w[c] * _entropy_bits(joint[c].astype(np.float64)) for c in range(n_cells) if counts[c] > 0)
            )
        gain = h_a - h_cond
        return {
            "h_a_bits": h_a,
            "h_a_given_cells_bits": h_cond,
            "information_gain_bits": gain,
            "information_gain_frac": gain / h_a if h_a > 0 else 0.0,
        }


class SVPolicy(LearnedPolicy):
    """SV stop policy: score = the table's cell value (estimated acceptance), priced by ``predictors.goodput``."""

    kind = "sv"
    output = "prob"
    round_rule = GOODPUT

    def __init__(
        self, table: SVTable, spec: FeatureSpec | None = None, threshold: float = 0.5, max_draft_len: int = 40
    ) -> None:
        spec = spec or FeatureSpec.for_sv()
        if spec.kind != "sv":
            raise ValueError(f"SVPolicy needs an sv FeatureSpec, got {spec.kind}")
        super().__init__(table, spec, threshold, max_draft_len)
        self._lists: tuple[list[float], list[float], list[list[float]]] | None = None

    def reset(self) -> None:
        """A sequence starts: the table's inner edges and cells as Python lists for :meth:`score_list`."""
        super().reset()
        t = self.net
        self._lists = (t.s_edges[1:-1].tolist(), t.a_edges[1:-1].tolist(), t.table.tolist())

    def score_list(self, features: Mapping[str, Tensor]) -> list[float]:
        """The engine's per-token call: the cell values looked up in Python lists (``bisect``, the cells ``forward``'s
        ``bucketize`` finds) for a few CPU rows, instead of about ten tensor operations, each several times its warm
        cost right after a draft forward; the tensor path otherwise (no reset yet, NaN, a GPU)."""
        s, a = features.get("companion_sim"), features.get("companion_accept")
        if (self._lists is not None and isinstance(s, Tensor) and isinstance(a, Tensor) and s.device.type == "cpu"
                and 0 < s.numel() <= 8 and s.shape == a.shape and not self.net.training):
            s_in, a_in, table = self._lists
            ss, aa = s.reshape(-1).tolist(), a.reshape(-1).tolist()
            if all(math.isfinite(x) for x in ss + aa):
                return [table[bisect.bisect_right(s_in, x)][bisect.bisect_right(a_in, y)] for x, y in zip(ss, aa)]
        return super().score_list(features)
