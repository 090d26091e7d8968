"""Training of the learned predictors with a Lightning Trainer (early stopping, best checkpoint, fixed seeds): one
predictor from a folder of shards to ``(policy, metrics)``; the caller exports and registers it. The distributed setup
is config (``accelerator``, ``strategy``, ``devices`` go to the Trainer as given).

Usage: python -m pipelines.train --config configs/smoke.yaml
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger
from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score, roc_auc_score

from data_gen.shards import DataPath
from predictors.base import StopPolicy
from predictors.datamodule import ShardDataModule
from predictors.disco import PRIOR_COLUMNS, DiscoPolicy
from predictors.inputs import DISCO_EXTRAS
from predictors.labels import LABEL_FAMILIES, label_name
from predictors.lightning_modules import DiscoModule, SprinterModule, SVTableModule, roc_auc
from predictors.sprinter import SprinterPolicy
from predictors.sv import SVPolicy

log = logging.getLogger(__name__)

__all__ = [
    "TrainConfig",
    "DiscoConfig",
    "SprinterConfig",
    "SVTableConfig",
    "CONFIGS",
    "make_datamodule",
    "fit_predictor",
    "binary_metrics",
    "baseline_aucs",
]

PAPER_LAMBDAS = (1.0, 1.2, 1.5)
MONITORS = {"val_loss": "min", "val_auc": "max"}
"""Metrics a training run can select its checkpoint by, with their direction."""


@dataclass
class TrainConfig:
    """Settings shared by every predictor's training."""

    lr: float = 1e-3
    """Adam learning rate."""
    weight_decay: float = 0.0
    """Adam weight decay."""
    batch_size: int = 256
    """Training and evaluation batch size."""
    max_epochs: int = 30
    """Most training epochs (EarlyStopping usually stops earlier)."""
    patience: int = 3
    """EarlyStopping patience in epochs without a lower val_loss."""
    label_family: str = "greedy"
    """Label family (``predictors.labels``): greedy, ratio (q/p <= lam) or soft (min(1, p/q))."""
    lam: float = 1.0
    """Lambda of the ratio family (SPRINTER: 1, 1.2 or 1.5; larger accepts more)."""
    pos_weight: float | None = None
    """BCE weight of the positive class; None = n_neg / n_pos of the training split (balanced); 1.0 = unweighted."""
    threshold: float = 0.5
    """Decision threshold of the exported policy (keep drafting while score >= threshold); tuned later on validation."""
    max_draft_len: int = 40
    """Hard cap on the draft length of the policy."""
    seed: int = 0
    """Seed of everything (lightning.seed_everything, data shuffling)."""
    accelerator: str = "cpu"
    """Lightning accelerator: cpu, gpu, auto..."""
    strategy: str = "auto"
    """Lightning strategy: auto, ddp, ddp_spawn, fsdp..."""
    devices: int | str = 1
    """Lightning devices: a count, a list string like "0,1", or "auto"."""
    num_nodes: int = 1
    """Lightning num_nodes (multi-node DDP)."""
    num_workers: int = 0
    """DataLoader worker processes."""
    deterministic: bool = True
    """Lightning deterministic mode."""
    monitor: str = "val_loss"
    """Checkpoint and early-stopping metric: ``val_loss`` (lower is better) or ``val_auc`` (higher is better)."""
    prior: str | None = None
    """DISCO / SPRINTER: start from a training-free score (``q`` or ``draft_max_prob``, among the explicit inputs); the
    untrained predictor ranks as it, and keeps those weights if no epoch beats it."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size={self.batch_size} must be > 0")
        if self.max_epochs <= 0:
            raise ValueError(f"max_epochs={self.max_epochs} must be > 0")
        if self.patience < 0:
            raise ValueError(f"patience={self.patience} must be >= 0")
        if self.label_family not in LABEL_FAMILIES:
            raise ValueError(f"label_family={self.label_family!r}: use one of {LABEL_FAMILIES}")
        if self.lam <= 0:
            raise ValueError(f"lam={self.lam} must be > 0")
        if self.pos_weight is not None and self.pos_weight <= 0:
            raise ValueError(f"pos_weight={self.pos_weight} must be > 0 (or None for balanced)")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold={self.threshold} must be in [0, 1]")
        if self.max_draft_len <= 0:
            raise ValueError(f"max_draft_len={self.max_draft_len} must be > 0")
        if self.num_workers < 0:
            raise ValueError(f"num_workers={self.num_workers} must be >= 0")
        if self.monitor not in MONITORS:
            raise ValueError(f"monitor={self.monitor!r}: use one of {tuple(MONITORS)}")
        if self.prior is not None and self.prior not in PRIOR_COLUMNS:
            raise ValueError(f"prior={self.prior!r}: use one of {PRIOR_COLUMNS} (or null for none)")

    def _check_prior(self, extra: tuple[str, ...], field: str) -> None:
        if self.prior is not None and self.prior not in extra:
            raise ValueError(
                f"prior={self.prior!r} must also be an explicit input: add it to {field} (now {list(extra)})"
            )

    def trainer_kwargs(self) -> dict[str, Any]:
        """Trainer arguments of the distributed setup."""
        return {"accelerator": self.accelerator, "strategy": self.strategy, "devices": self.devices,
                "num_nodes": self.num_nodes, "deterministic": self.deterministic}


@dataclass
class DiscoConfig(TrainConfig):
    """DISCO FFN: 2 layers on top-k probabilities + their entropy + position [+ explicit training-free scores]."""

    hidden_size: int = 64
    """Width of the FFN's hidden layer."""
    dropout: float = 0.0
    """Dropout after the hidden layer."""
    top_k: int = 10
    """Top-k width of the input; must equal the data's draft_topk width."""
    position_scale: float = 40.0
    """The position enters as position / position_scale."""
    extra_features: tuple[str, ...] = ()
    """Training-free scores appended as explicit inputs: draft_max_prob, draft_entropy, q, log_max_prob, log_q."""
    tv_weight: float = 0.0
    """Weight of the TV-distance regression term (0 = BCE only); adds a TV head."""
    hidden_rank: int = 0
    """> 0: hybrid head, the draft's hidden state projected to this many values joins the inputs (needs draft_hidden).
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size <= 0:
            raise ValueError(f"hidden_size={self.hidden_size} must be > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.top_k <= 0:
            raise ValueError(f"top_k={self.top_k} must be > 0")
        if self.position_scale <= 0:
            raise ValueError(f"position_scale={self.position_scale} must be > 0")
        self.extra_features = tuple(self.extra_features)
        bad = [e for e in self.extra_features if e not in DISCO_EXTRAS]
        if bad:
            raise ValueError(f"extra_features has unknown entries {bad}; allowed: {DISCO_EXTRAS}")
        if self.tv_weight < 0:
            raise ValueError(f"tv_weight={self.tv_weight} must be >= 0")
        if self.hidden_rank < 0:
            raise ValueError(f"hidden_rank={self.hidden_rank} must be >= 0 (0: no hidden state)")
        if self.label_family == "soft":
            raise ValueError("label_family='soft' is not a binary label; DISCO uses greedy (or ratio)")
        self._check_prior(self.extra_features, "extra_features")


@dataclass
class SprinterConfig(TrainConfig):
    """SPRINTER verifier: one linear layer + sigmoid on the draft's last hidden state."""

    label_family: str = "ratio"
    """Label family; SPRINTER uses ratio: q/p <= lam."""
    lr: float = 1e-2
    """Adam learning rate (a single linear layer tolerates a larger step)."""
    hidden_size: int | None = None
    """Hidden-state width; None = read from the data (a number is checked against the data)."""
    disco_features: bool = False
    """Also feed the DISCO features (top-k, entropy, position and the extra_features) to the linear verifier."""
    extra_features: tuple[str, ...] = ("draft_max_prob", "draft_entropy")
    """With disco_features: training-free scores appended as explicit inputs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.label_family == "soft":
            raise ValueError("label_family='soft' is not a binary label; SPRINTER uses ratio (q/p <= lam)")
        if self.label_family == "ratio" and self.lam not in PAPER_LAMBDAS:
            log.warning("SPRINTER lam=%s is outside the paper's values %s", self.lam, PAPER_LAMBDAS)
        if self.hidden_size is not None and self.hidden_size <= 0:
            raise ValueError(f"hidden_size={self.hidden_size} must be > 0 (or None to read it from the data)")
        self.extra_features = tuple(self.extra_features)
        if self.prior is not None and not self.disco_features:
            raise ValueError(
                f"prior={self.prior!r} needs disco_features: true (the prior is read from the explicit inputs)"
            )
        self._check_prior(self.extra_features, "extra_features")


@dataclass
class SVTableConfig(TrainConfig):
    """SV bin table over (S, A_c), fitted in one pass without gradients."""

    label_family: str = "soft"
    """The cell value is the mean of this label; SV uses soft: min(1, p/q)."""
    batch_size: int = 4096
    """Batch size of the one counting pass."""
    max_epochs: int = 1
    """One pass (the table is fitted at the end of the epoch); must be 1."""
    s_bins: int = 20
    """Equal-count bins of the draft-companion similarity S (paper: 10-30)."""
    a_bins: int = 10
    """Equal-count bins of the companion acceptance A_c (paper: 10-20)."""
    prior_count: float = 5.0
    """Smoothing: pseudo-count pulling a cell toward its S row's mean (the row toward the global mean)."""
    ig_levels: int = 0
    """A's discretisation for the information gain: 0 = binary accept event ~ Bernoulli(accept_prob); L = L levels."""
    auc_label: str = "greedy"
    """Binary label the reported val_auc of the cell values is computed against (greedy, or ratio with lam)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_epochs != 1:
            raise ValueError(f"max_epochs={self.max_epochs}: the SV table is fitted in one pass, use 1")
        if not 1 <= self.s_bins <= 1000:
            raise ValueError(f"s_bins={self.s_bins} must be in [1, 1000] (paper: 10-30)")
        if not 1 <= self.a_bins <= 1000:
            raise ValueError(f"a_bins={self.a_bins} must be in [1, 1000] (paper: 10-20)")
        if self.prior_count < 0:
            raise ValueError(f"prior_count={self.prior_count} must be >= 0")
        if self.ig_levels < 0:
            raise ValueError(f"ig_levels={self.ig_levels} must be >= 0")
        if self.auc_label not in ("greedy", "ratio"):
            raise ValueError(f"auc_label={self.auc_label!r}: use greedy or ratio")
        if self.prior is not None:
            raise ValueError(f"prior={self.prior!r}: the SV table has no prior (set it on disco or sprinter)")
        if self.auc_label == "ratio" and self.lam < 1:
            raise ValueError(
                f"lam={self.lam}: auc_label='ratio' derives q/p <= lam from min(1, p/q), which needs lam >= 1"
            )


CONFIGS: dict[str, type[TrainConfig]] = {"disco": DiscoConfig, "sprinter": SprinterConfig, "sv": SVTableConfig}


def binary_metrics(scores: np.ndarray, labels: np.ndarray, threshold: float, prefix: str = "val_") -> dict[str, float]:
    """AUC (scikit-learn), unweighted BCE, accuracy, precision, recall and F1 at ``threshold``."""
    y = (np.asarray(labels) > 0.5).astype(int)
    s = np.asarray(scores, dtype=np.float64)
    pred = (s >= threshold).astype(int)
    out = {
        "auc": float(roc_auc_score(y, s)) if len(np.unique(y)) == 2 else float("nan"),
        "bce": float(F.binary_cross_entropy(torch.from_numpy(s).clamp(1e-6, 1 - 1e-6), torch.from_numpy(y).double())),
        "accuracy": float(accuracy_score(y, pred)),
        "precision": float(precision_score(y, pred, zero_division=0)),
        "recall": float(recall_score(y, pred, zero_division=0)),
        "f1": float(f1_score(y, pred, zero_division=0)),
    }
    return {prefix + k: v for k, v in out.items()}


def baseline_aucs(raw: dict[str, np.ndarray], labels: np.ndarray, prefix: str = "val_") -> dict[str, float]:
    """AUC of the training-free scores on the same labels (top-1 probability, -entropy): the bars a learned predictor
    should beat."""
    y = (np.asarray(labels) > 0.5).astype(int)
    out: dict[str, float] = {}
    if len(np.unique(y)) < 2:
        return out
    if "draft_max_prob" in raw:
        out[f"{prefix}auc_max_prob"] = float(roc_auc_score(y, raw["draft_max_prob"].astype(np.float64)))
    if "q" in raw:  # the drafted token's own probability (transformers' confidence criterion); = top-1 on greedy draws
        out[f"{prefix}auc_draft_prob"] = float(roc_auc_score(y, raw["q"].astype(np.float64)))
    if "draft_entropy" in raw:
        out[f"{prefix}auc_neg_entropy"] = float(roc_auc_score(y, -raw["draft_entropy"].astype(np.float64)))
    return out


def _trainer(
    cfg: TrainConfig, out_dir: Path, logger: Any, callbacks: list, max_epochs: int, n_batches: int, single: bool = False
):
    if logger is None:
        logger = CSVLogger(str(out_dir), name="logs")
    kwargs = cfg.trainer_kwargs()
    if single:  # no parameters to synchronise (the SV table): one process, whatever the configured strategy
        kwargs.update(strategy="auto", devices=1, num_nodes=1)
    return pl.Trainer(
        max_epochs=max_epochs,
        callbacks=callbacks,
        logger=logger,
        default_root_dir=str(out_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=max(1, min(50, n_batches)),
        **kwargs,
    )


def make_datamodule(kind: str, cfg: TrainConfig, data_dir: DataPath, **kwargs: Any) -> ShardDataModule:
    """The :class:`~predictors.datamodule.ShardDataModule` a predictor of ``kind`` trains on with ``cfg``; ``kwargs`` go
    to it."""
    options: dict[str, Any] = {}
    if isinstance(cfg, DiscoConfig):
        options = {"top_k": cfg.top_k, "position_scale": cfg.position_scale, "extra": cfg.extra_features,
                   "with_hidden": cfg.hidden_rank > 0}
    elif isinstance(cfg, SprinterConfig):
        options = {"hidden_size": cfg.hidden_size, "with_disco": cfg.disco_features,
                   "extra": tuple(cfg.extra_features) if cfg.disco_features else ()}
    return ShardDataModule(
        data_dir, kind, cfg.label_family, cfg.lam, batch_size=cfg.batch_size, num_workers=cfg.num_workers,
        seed=cfg.seed, tv_target=isinstance(cfg, DiscoConfig) and cfg.tv_weight > 0, feature_options=options, **kwargs,
    )


def fit_predictor(
    kind: str, cfg: TrainConfig, data_dir: DataPath, out_dir: str | Path, logger: Any = None, datamodule: Any = None,
    on_epoch: Callable[[int, int], None] | None = None,
) -> tuple[StopPolicy, dict[str, float]]:
    """Train one predictor of ``kind`` (disco, sprinter, sv) with its config on the shards under ``data_dir``;
    checkpoints and, without a ``logger``, CSV logs go to ``out_dir``.

    Use one logger (one MLflow run) per predictor: MLflow refuses to change a param within a run. ``on_epoch`` gets
    (epochs done, max epochs). Returns (policy with the best weights, ``cfg.threshold`` and ``train_info``; metrics:
    ``val_auc``, ``val_loss``, ``best_epoch``, the training-free scores' AUC, and for SV the information gain).
    """
    if kind not in CONFIGS:
        raise ValueError(f"unknown predictor kind {kind!r}; use one of {sorted(CONFIGS)}")
    if not isinstance(cfg, CONFIGS[kind]):
        raise TypeError(f"fit_predictor({kind!r}) needs a {CONFIGS[kind].__name__}, got {type(cfg).__name__}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    dm = datamodule if datamodule is not None else make_datamodule(kind, cfg, data_dir)
    dm.setup("fit")
    assert dm.spec is not None
    x_tr, y_tr, _ = dm.tensors["train"]
    x_val, y_val, _ = dm.tensors["val"]
    n_batches = max(1, -(-x_tr.shape[0] // cfg.batch_size))
    metrics: dict[str, float] = {"n_train": float(x_tr.shape[0]), "n_val": float(x_val.shape[0]),
                                 "train_pos_rate": float(y_tr.mean()), "val_pos_rate": float(y_val.mean())}
    ckpt_dir = out_dir / "checkpoints"

    if kind == "sv":
        policy, m = _fit_sv(cfg, dm, out_dir, logger, n_batches, ckpt_dir)  # type: ignore[arg-type]
    else:
        policy, m = _fit_binary(kind, cfg, dm, out_dir, logger, n_batches, ckpt_dir, on_epoch)
    checkpoint = str(m.pop("_checkpoint", ""))
    metrics.update(m)
    policy.train_info = {
        "config": asdict(cfg),
        "label": {"family": cfg.label_family, "lam": cfg.lam, "name": label_name(cfg.label_family, cfg.lam)},
        "metrics": metrics,
        "data_dir": [str(data_dir)] if isinstance(data_dir, (str, Path)) else [str(d) for d in data_dir],
        "checkpoint": checkpoint,
    }
    resolved = {"kind": kind, "feature_spec": dm.spec.to_dict(), **policy.train_info}
    (out_dir / "resolved_config.json").write_text(json.dumps(_jsonable(resolved), indent=2, sort_keys=True))
    if logger is not None:
        logger.log_metrics({f"final_{k}": v for k, v in metrics.items() if np.isfinite(v)})
    return policy, metrics


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


class EpochProgress(pl.Callback):
    """Calls ``on_epoch(epochs done, max epochs)`` at the end of every training epoch."""

    def __init__(self, on_epoch: Callable[[int, int], None], max_epochs: int) -> None:
        self.on_epoch, self.max_epochs = on_epoch, max_epochs

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_epoch(trainer.current_epoch + 1, self.max_epochs)


def _fit_binary(kind, cfg, dm, out_dir, logger, n_batches, ckpt_dir,
                on_epoch: Callable[[int, int], None] | None = None) -> tuple[StopPolicy, dict[str, Any]]:
    x_tr, y_tr, _ = dm.tensors["train"]
    n_pos = float(y_tr.sum())
    pos_weight = cfg.pos_weight if cfg.pos_weight is not None else (y_tr.numel() - n_pos) / n_pos
    prior_index = dm.spec.names.index(cfg.prior) if cfg.prior is not None else -1
    if kind == "disco":
        module = DiscoModule(dm.spec.width, cfg.hidden_size, cfg.dropout, cfg.tv_weight, cfg.lr, cfg.weight_decay,
                             pos_weight, hidden_dim=dm.spec.hidden_width, hidden_rank=cfg.hidden_rank,
                             prior_index=prior_index)
    else:
        module = SprinterModule(dm.spec.width, cfg.lr, cfg.weight_decay, pos_weight, prior_index=prior_index)
    module.net.norm.fit(x_tr)
    mode = MONITORS[cfg.monitor]
    x_val, y_val, _ = dm.tensors["val"]
    initial = None
    if prior_index >= 0:  # the prior alone is a candidate: its metric and weights, kept if no epoch beats them
        initial = (_val_metric(_val_logits(module.net, x_val), y_val, cfg.monitor, module.pos_weight),
                   {k: v.clone() for k, v in module.state_dict().items()})
    ckpt = ModelCheckpoint(dirpath=str(ckpt_dir), filename=f"{kind}-best", monitor=cfg.monitor, mode=mode,
                           save_top_k=1, enable_version_counter=False)
    stop = EarlyStopping(monitor=cfg.monitor, mode=mode, patience=cfg.patience)
    extra = [EpochProgress(on_epoch, cfg.max_epochs)] if on_epoch is not None else []
    trainer = _trainer(cfg, out_dir, logger, [ckpt, stop, *extra], cfg.max_epochs, n_batches)
    trainer.fit(module, datamodule=dm)
    best = ckpt.best_model_path
    best_epoch = trainer.current_epoch - 1
    if best:
        saved = torch.load(best, map_location="cpu", weights_only=False)
        module.load_state_dict(saved["state_dict"])
        best_epoch = int(saved.get("epoch", best_epoch))
    best_score = float(ckpt.best_model_score) if ckpt.best_model_score is not None else None
    kept_prior = initial is not None and (
        best_score is None or (best_score < initial[0] if mode == "max" else best_score > initial[0]))
    if kept_prior:  # no epoch beat the training-free score the predictor started from: keep its ranking
        module.load_state_dict(initial[1])
        best_epoch, best_score = -1, initial[0]
        log.info("%s: no epoch beat the prior %s on %s (%.4f); keeping the initial weights",
                 kind, cfg.prior, cfg.monitor, initial[0])
    module.cpu()
    net = module.net.eval()
    logits = _val_logits(net, x_val)
    m: dict[str, Any] = binary_metrics(torch.sigmoid(logits).numpy(), y_val.numpy(), cfg.threshold)
    m.update(baseline_aucs(dm.raw["val"], y_val.numpy()))
    m["val_loss"] = _val_metric(logits, y_val, "val_loss", module.pos_weight)  # the kept weights' weighted BCE
    m.update({"pos_weight": float(pos_weight), "epochs_run": float(trainer.current_epoch),
              "best_epoch": float(max(best_epoch, 0)), "_checkpoint": "" if kept_prior else best})
    if prior_index >= 0:
        m["kept_prior"] = float(kept_prior)
    policy_cls = DiscoPolicy if kind == "disco" else SprinterPolicy
    return policy_cls(net, dm.spec, cfg.threshold, cfg.max_draft_len), m


def _val_logits(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The net's logits on the validation inputs, in eval mode (the net's own mode restored)."""
    training = net.training
    with torch.no_grad():
        logits = net.eval()(x)
    net.train(training)
    return logits


def _val_metric(logits: torch.Tensor, y: torch.Tensor, monitor: str, pos_weight: torch.Tensor) -> float:
    """A monitored metric from validation logits: val_auc, or val_loss (BCE with the training pos_weight)."""
    if monitor == "val_auc":
        return roc_auc(torch.sigmoid(logits).numpy(), y.numpy())
    return float(F.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight))


def _fit_sv(cfg: SVTableConfig, dm, out_dir, logger, n_batches, ckpt_dir) -> tuple[StopPolicy, dict[str, Any]]:
    module = SVTableModule(cfg.s_bins, cfg.a_bins, cfg.prior_count)
    # DDP cannot wrap a module without trainable parameters; the one counting pass runs in a single process (under a
    # multi-process launch every rank fits the same table from the same data).
    trainer = _trainer(cfg, out_dir, logger, [], 1, n_batches, single=True)
    trainer.fit(module, train_dataloaders=dm.train_dataloader())
    val = trainer.validate(module, dataloaders=dm.val_dataloader(), verbose=False)[0]
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / "sv-table.ckpt"
    trainer.save_checkpoint(str(path))
    table = module.net.cpu().eval()
    x_val, y_val, _ = dm.tensors["val"]  # the sampled draws: min(1, p/q) is their acceptance
    x_auc, raw_auc = x_val, dm.raw["val"]
    if cfg.auc_label == "greedy" and "greedy_match" in raw_auc:
        # greedy match judges argmax draws: with two draws per position read those rows for the AUC (the table is
        # fitted on the sampled ones), as the evaluation does; the information gain stays on the sampled rows
        greedy = make_datamodule("sv", replace(cfg, label_family="greedy"), dm.data_dir, folds=dm.folds,
                                 fold_within=dm.fold_within, draw="greedy")
        greedy.setup("validate")
        x_auc, raw_auc = greedy.tensors["val"][0], greedy.raw["val"]
        auc_labels = greedy.tensors["val"][1].numpy()
    else:  # ratio label q/p <= lam  <=>  min(1, p/q) >= 1/lam  (lam >= 1, checked in the config)
        auc_labels = (y_val.numpy() >= 1.0 / cfg.lam - 1e-6).astype(np.float32)
    with torch.no_grad():
        scores = table(x_auc).numpy()
    m: dict[str, Any] = binary_metrics(scores, auc_labels, cfg.threshold)
    m.update(baseline_aucs(raw_auc, auc_labels))
    m["val_loss"] = float(val["val_loss"])
    m["val_mse"] = float(val["val_mse"])
    x_tr, y_tr, _ = dm.tensors["train"]
    info_tr = table.information_gain(x_tr[:, 0], x_tr[:, 1], y_tr, levels=cfg.ig_levels)
    info_val = table.information_gain(x_val[:, 0], x_val[:, 1], y_val, levels=cfg.ig_levels)
    m.update({f"train_{k}": v for k, v in info_tr.items()})
    m.update({f"val_{k}": v for k, v in info_val.items()})
    m.update({"s_bins": float(table.s_bins), "a_bins": float(table.a_bins), "epochs_run": 1.0, "best_epoch": 0.0,
              "_checkpoint": str(path)})
    return SVPolicy(table, dm.spec, cfg.threshold, cfg.max_draft_len), m
