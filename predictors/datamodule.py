"""LightningDataModule over the Parquet shards of labelled draft tokens: the needed columns, split by prompt (a
``sample_id`` in two splits is refused), the predictor's input features and the labels of a family and lambda.

Usage::

    dm = ShardDataModule("data/shards", kind="sprinter", label_family="ratio", lam=1.2, batch_size=256)
    dm.setup("fit")
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from data_gen.prompts import fold_splits
from data_gen.shards import DataPath, read_columns
from predictors.inputs import FEATURE_KINDS, FeatureSpec, build_features, disco_columns
from predictors.labels import LABEL_FAMILIES, derive_label, draw_mask, label_draw, label_name

__all__ = ["ShardDataModule", "make_spec", "label_columns", "SPLITS"]

SPLITS = ("train", "val", "test")


def label_columns(family: str) -> tuple[str, ...]:
    """Raw columns a label family is derived from."""
    return {"greedy": ("greedy_match",), "ratio": ("q", "p"), "soft": ("accept_prob",)}[family]


def _checked_width(columns: dict[str, np.ndarray], column: str, option: str, wanted: int | None) -> int:
    width = int(columns[column].shape[1])
    if wanted and wanted != width:
        raise ValueError(
            f"feature width mismatch: {option}={wanted} in the config but the data's {column} has width {width}"
        )
    return width


def make_spec(kind: str, columns: dict[str, np.ndarray], **options: Any) -> FeatureSpec:
    """FeatureSpec for ``kind`` with widths read from the data; ``options``: top_k, position_scale, extra, with_hidden
    (DISCO), hidden_size, with_disco (SPRINTER)."""
    scale, extra = options.get("position_scale", 40.0), tuple(options.get("extra", ()))
    if kind == "disco":
        top_k = _checked_width(columns, "draft_topk", "top_k", options.get("top_k"))
        hidden = _checked_width(columns, "draft_hidden", "hidden_size", None) if options.get("with_hidden") else 0
        return FeatureSpec.for_disco(top_k, scale, extra, hidden_size=hidden)
    if kind == "sprinter":
        hidden = _checked_width(columns, "draft_hidden", "hidden_size", options.get("hidden_size"))
        top_k = _checked_width(columns, "draft_topk", "top_k", None) if options.get("with_disco") else 0
        return FeatureSpec.for_sprinter(hidden, top_k, scale, extra)
    if kind == "sv":
        return FeatureSpec.for_sv()
    raise ValueError(f"unknown predictor kind {kind!r}; use one of {FEATURE_KINDS}")


def _spec_columns(kind: str, options: dict[str, Any]) -> tuple[str, ...]:
    disco = disco_columns(options.get("extra", ()))
    if kind == "disco":
        return disco + (("draft_hidden",) if options.get("with_hidden") else ())
    if kind == "sprinter":
        return ("draft_hidden",) + (disco if options.get("with_disco") else ())
    if kind == "sv":
        return ("companion_sim", "companion_accept")
    raise ValueError(f"unknown predictor kind {kind!r}; use one of {FEATURE_KINDS}")


class ShardDataModule(pl.LightningDataModule):
    """Features + labels of one predictor kind from a folder of shards, split by prompt."""

    def __init__(
        self,
        data_dir: DataPath,
        kind: str,
        label_family: str,
        lam: float = 1.0,
        batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
        tv_target: bool = False,
        feature_options: dict[str, Any] | None = None,
        extra_columns: Sequence[str] = ("greedy_match", "accept_prob", "draft_max_prob", "draft_entropy", "q"),
        draw: str | None = None,
        folds: tuple[int, int] | tuple[int, int, float] | None = None,
        fold_within: Sequence[str] | None = None,
    ) -> None:
        """Check and keep the settings; :meth:`setup` reads the shards.

        Args:
            data_dir: folder of Parquet shards, or a list read as one data set.
            kind: disco, sprinter or sv (which input features).
            label_family, lam: the label (``predictors.labels``).
            batch_size, num_workers, seed: DataLoader settings and the train shuffle's seed.
            tv_target: also load ``tv`` (DISCO's TV regression term).
            feature_options: top_k, position_scale, extra, hidden_size, checked against the data.
            extra_columns: raw columns kept per split in ``self.raw``, when present.
            draw: train on this draw when the data holds several per position (None: the family's own).
            folds: ``(k, i)`` or ``(k, i, f)``: split by grouped k-fold over prompts instead of ``split`` (fold i test,
                i+1 val, share f of the training prompts).
            fold_within: with ``folds``, deal only these stored splits' prompts (``("train", "val")`` leaves the test
                split out).
        """
        super().__init__()
        if kind not in FEATURE_KINDS:
            raise ValueError(f"kind={kind!r}: use one of {FEATURE_KINDS}")
        if label_family not in LABEL_FAMILIES:
            raise ValueError(f"label_family={label_family!r}: use one of {LABEL_FAMILIES}")
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be > 0")
        self.data_dir, self.kind, self.label_family, self.lam = data_dir, kind, label_family, float(lam)
        self.batch_size, self.num_workers, self.seed, self.tv_target = batch_size, num_workers, seed, tv_target
        self.feature_options = dict(feature_options or {})
        self.extra_columns = tuple(extra_columns)
        self.draw = draw or label_draw(label_family)
        self.folds = folds
        self.fold_within = tuple(fold_within) if fold_within else None
        self.spec: FeatureSpec | None = None
        self.tensors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.raw: dict[str, dict[str, np.ndarray]] = {}

    # ---- loading ----------------------------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if not self.tensors:
            self._load()
        splits = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), None: ("train", "val")}
        needed = splits.get(stage, ())
        for split in needed:
            self._require(split)

    def _load(self) -> None:
        wanted = [
            "split", "sample_id", *_spec_columns(self.kind, self.feature_options), *label_columns(self.label_family)
        ]
        if self.tv_target:
            wanted.append("tv")
        cols = read_columns(self.data_dir, wanted, optional=(*self.extra_columns, "draw", "domain"))
        keep = draw_mask(cols, self.draw)
        if keep is not None:
            cols = {k: v[keep] for k, v in cols.items()}
        self.spec = make_spec(self.kind, cols, **self.feature_options)
        split = cols["split"].astype(str)
        if self.folds is not None:
            k, i, *fraction = self.folds
            within = np.isin(split, self.fold_within) if self.fold_within else np.ones(len(split), dtype=bool)
            domain = cols.get("domain")
            split = np.full(len(split), "unused", dtype="<U6")
            split[within] = fold_splits(cols["sample_id"][within], domain[within] if domain is not None else None, k,
                                        i, seed=self.seed, train_fraction=fraction[0] if fraction else 1.0)
        self._check_disjoint(cols["sample_id"].astype(str), split)
        x_all = build_features(self.spec, cols)
        y_all = torch.from_numpy(derive_label(cols, self.label_family, self.lam))
        tv_all = torch.from_numpy(cols["tv"].astype(np.float32)) if self.tv_target else torch.zeros(len(split))
        if not torch.isfinite(y_all).all():
            raise ValueError(f"NaN in the {label_name(self.label_family, self.lam)} labels")
        for s in SPLITS:
            idx = torch.from_numpy(np.flatnonzero(split == s))
            self.tensors[s] = (x_all[idx], y_all[idx].float(), tv_all[idx].float())
            self.raw[s] = {c: cols[c][idx.numpy()] for c in self.extra_columns if c in cols}
        unknown = sorted(set(np.unique(split)) - set(SPLITS) - {"unused"})  # unused: left out of a learning curve
        if unknown:
            raise ValueError(f"unknown split values {unknown} in the shards; expected {SPLITS}")

    @staticmethod
    def _check_disjoint(sample_id: np.ndarray, split: np.ndarray) -> None:
        seen: dict[str, set[str]] = {}
        for s in SPLITS:
            seen[s] = set(np.unique(sample_id[split == s]).tolist())
        for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
            both = seen[a] & seen[b]
            if both:
                raise ValueError(
                    f"prompts {sorted(both)[:5]} appear in both the {a} and {b} splits ({len(both)} in all); "
                    f"splits must be by prompt"
                )

    def _require(self, split: str) -> None:
        x, y, _ = self.tensors[split]
        if x.shape[0] == 0:
            raise ValueError(
                f"the {split} split is empty in {self.data_dir} (counts: "
                f"{ {s: int(t[0].shape[0]) for s, t in self.tensors.items()} }); generate more prompts"
            )
        if self.label_family in ("greedy", "ratio"):
            n_pos, n = int(y.sum()), int(y.numel())
            if n_pos in (0, n):
                raise ValueError(
                    f"single-class labels in the {split} split: label family {self.label_family!r} "
                    f"({label_name(self.label_family, self.lam)}, lambda={self.lam:g}) gives {n_pos} positive and "
                    f"{n - n_pos} negative of {n} tokens; a classifier needs both (change lambda or add data)"
                )

    # ---- summaries --------------------------------------------------------------------------------------------------
    def label_counts(self, split: str) -> dict[str, int]:
        """{"n", "pos"} of a split (pos: sum of the labels, rounded, for soft labels)."""
        y = self.tensors[split][1]
        return {"n": int(y.numel()), "pos": int(round(float(y.sum())))}

    # ---- loaders ----------------------------------------------------------------------------------------------------
    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self._require(split)
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            TensorDataset(*self.tensors[split]), batch_size=self.batch_size, shuffle=shuffle,
            num_workers=self.num_workers, generator=g if shuffle else None,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
