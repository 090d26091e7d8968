"""Thin LightningModules around the predictor modules: one shared ``_step`` for train / val / test.

- :class:`DiscoModule`: BCE (pos_weight) on greedy-match labels [+ tv_weight * MSE on the TV distance]; Adam.
- :class:`SprinterModule`: BCE (pos_weight) on q/p <= lambda labels; Adam.
- :class:`SVTableModule`: no gradients (``automatic_optimization = False``): one training epoch accumulates
  (S, A_c, accept_prob), the table is fitted at the epoch's end (gathered across processes under DDP).

Batches are ``(x [B, D], y [B], tv [B])`` from ``predictors.datamodule.ShardDataModule``. Each epoch logs
``{stage}_loss``; the binary modules also log ``val_auc`` (scikit-learn) at the end of each validation epoch.
"""
from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score
from torch import Tensor

from predictors.disco import DiscoNet
from predictors.sprinter import SprinterNet
from predictors.sv import SVTable

__all__ = ["BinaryPredictorModule", "DiscoModule", "SprinterModule", "SVTableModule"]


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    if len(np.unique(labels)) < 2:
        return float("nan")
    return float(roc_auc_score(labels, scores))


class BinaryPredictorModule(pl.LightningModule):
    """Shared training logic of the gradient-trained binary predictors (subclasses create ``self.net``)."""

    net: torch.nn.Module

    def __init__(self, lr: float, weight_decay: float, pos_weight: float, tv_weight: float = 0.0) -> None:
        super().__init__()
        self.lr, self.weight_decay, self.tv_weight = lr, weight_decay, tv_weight
        self.register_buffer("pos_weight", torch.tensor(float(pos_weight)), persistent=False)
        self._val_scores: list[Tensor] = []
        self._val_labels: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _step(self, batch: tuple[Tensor, Tensor, Tensor], stage: str) -> Tensor:
        x, y, tv = batch
        if hasattr(self.net, "forward_all"):
            logits, tv_hat = self.net.forward_all(x)
        else:
            logits, tv_hat = self.net(x), None
        loss = F.binary_cross_entropy_with_logits(logits, y, pos_weight=self.pos_weight)
        if tv_hat is not None and self.tv_weight > 0:
            tv_loss = F.mse_loss(tv_hat, tv)
            self.log(f"{stage}_tv_mse", tv_loss, on_step=False, on_epoch=True, sync_dist=True)
            loss = loss + self.tv_weight * tv_loss
        self.log(f"{stage}_loss", loss, on_step=False, on_epoch=True, prog_bar=stage == "val", sync_dist=True,
                 batch_size=x.shape[0])
        if stage != "train":
            self._val_scores.append(torch.sigmoid(logits).detach())
            self._val_labels.append(y.detach())
        return loss

    def training_step(self, batch, batch_idx: int) -> Tensor:
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> Tensor:
        return self._step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> Tensor:
        return self._step(batch, "test")

    def _log_auc(self, stage: str) -> None:
        if not self._val_scores:
            return
        scores, labels = torch.cat(self._val_scores), torch.cat(self._val_labels)
        self._val_scores.clear()
        self._val_labels.clear()
        if self.trainer.world_size > 1:  # DistributedSampler pads to equal sizes, so all_gather works
            scores, labels = self.all_gather(scores).flatten(), self.all_gather(labels).flatten()
        auc = roc_auc(scores.float().cpu().numpy(), labels.float().cpu().numpy())
        self.log(f"{stage}_auc", auc, rank_zero_only=True)

    def on_validation_epoch_end(self) -> None:
        self._log_auc("val")

    def on_test_epoch_end(self) -> None:
        self._log_auc("test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.net.parameters(), lr=self.lr, weight_decay=self.weight_decay)


class DiscoModule(BinaryPredictorModule):
    """DISCO FFN training (greedy-match labels; optional TV regression head)."""

    def __init__(
        self,
        in_dim: int,
        hidden_size: int = 64,
        dropout: float = 0.0,
        tv_weight: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        pos_weight: float = 1.0,
        hidden_dim: int = 0,
        hidden_rank: int = 0,
        prior_index: int = -1,
    ) -> None:
        super().__init__(lr, weight_decay, pos_weight, tv_weight)
        self.save_hyperparameters()
        self.net = DiscoNet(in_dim, hidden_size, dropout, tv_head=tv_weight > 0, hidden_dim=hidden_dim,
                            hidden_rank=hidden_rank, prior_index=prior_index)


class SprinterModule(BinaryPredictorModule):
    """SPRINTER verifier training (q/p <= lambda labels)."""

    def __init__(
        self,
        hidden_size: int,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        pos_weight: float = 1.0,
        prior_index: int = -1,
    ) -> None:
        super().__init__(lr, weight_decay, pos_weight)
        self.save_hyperparameters()
        self.net = SprinterNet(hidden_size, prior_index)


class SVTableModule(pl.LightningModule):
    """Fits an :class:`SVTable` in one pass without gradients (run with ``max_epochs=1``)."""

    def __init__(self, s_bins: int = 20, a_bins: int = 10, prior_count: float = 5.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.net = SVTable(s_bins, a_bins, prior_count)
        self._seen: list[Tensor] = []
        self.train_information: dict[str, float] = {}

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def _step(self, batch: tuple[Tensor, Tensor, Tensor], stage: str) -> Tensor | None:
        x, y, _ = batch
        if stage == "train":
            self._seen.append(torch.cat([x.double(), y.double()[:, None]], dim=1).detach())  # [B, 3]
            return None
        pred = self.net(x).clamp(1e-6, 1 - 1e-6)
        loss = F.binary_cross_entropy(pred, y.float())  # cross-entropy against the soft label min(1, p/q)
        self.log(f"{stage}_loss", loss, on_step=False, on_epoch=True, sync_dist=True, batch_size=x.shape[0])
        self.log(f"{stage}_mse", F.mse_loss(pred, y.float()), on_step=False, on_epoch=True, sync_dist=True,
                 batch_size=x.shape[0])
        return loss

    def training_step(self, batch, batch_idx: int) -> None:
        self._step(batch, "train")

    def validation_step(self, batch, batch_idx: int) -> Tensor | None:
        return self._step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> Tensor | None:
        return self._step(batch, "test")

    def on_train_epoch_end(self) -> None:
        if not self._seen:
            return
        data = torch.cat(self._seen)
        self._seen.clear()
        if self.trainer.world_size > 1:
            data = self.all_gather(data).reshape(-1, 3)
        info = self.net.fit(data[:, 0], data[:, 1], data[:, 2])
        self.train_information = info
        self.log_dict({f"train_{k}": v for k, v in info.items()}, rank_zero_only=True)

    def configure_optimizers(self) -> None:
        return None
