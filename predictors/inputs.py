"""Input features of the learned predictors, built from record columns: the same code serves numpy batches in training
and the decoder's tensors, so a predictor sees identical inputs on both paths.

An input is parts concatenated in order: ``disco`` (top-k, their entropy, scaled position, optional training-free
scores), ``hidden`` (the draft's hidden state), ``sv`` (companion similarity and acceptance). :class:`LearnedPolicy` is
the StopPolicy the learned predictors share.

Usage::

    spec = FeatureSpec.for_disco(top_k=10)
    x = build_features(spec, columns)   # [N, spec.width] float32
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from predictors.base import StopPolicy

__all__ = [
    "FeatureSpec",
    "build_features",
    "extra_column",
    "disco_columns",
    "disco_scalars",
    "topk_entropy",
    "LearnedPolicy",
    "FEATURE_KINDS",
    "PARTS",
    "DISCO_EXTRAS",
]

FEATURE_KINDS = ("disco", "sprinter", "sv")
PARTS = ("disco", "hidden", "sv")
"""Building blocks of an input, with the builder of each."""
DEFAULT_PARTS = {"disco": ("disco",), "sprinter": ("hidden",), "sv": ("sv",)}
DISCO_EXTRAS = ("draft_max_prob", "draft_entropy", "q", "log_max_prob", "log_q")
"""Training-free scores the DISCO input may append; ``log_<col>`` is the log of the column floored at 1e-9 (q/p <=
lambda is linear in log q)."""
LOG_PREFIX = "log_"


def extra_column(name: str) -> str:
    """Record column an explicit input reads (``log_q`` reads ``q``; ``log_max_prob`` reads ``draft_max_prob``)."""
    if not name.startswith(LOG_PREFIX):
        return name
    base = name[len(LOG_PREFIX):]
    return "draft_max_prob" if base == "max_prob" else base


def disco_columns(extra: Sequence[str]) -> tuple[str, ...]:
    """Record columns the ``disco`` part reads: the top-k, the position and each explicit input's column, once."""
    return ("draft_topk", "position", *dict.fromkeys(extra_column(e) for e in extra))


def disco_scalars(spec: FeatureSpec) -> tuple[tuple[str, ...], list[float], list[bool]]:
    """The ``disco`` part's scalar inputs in :func:`build_features`' order: (columns, divisors, log flags), the
    arguments of the native ``disco_score``."""
    return (("position", *(extra_column(e) for e in spec.extra)), [spec.position_scale, *(1.0 for _ in spec.extra)],
            [False, *(e.startswith(LOG_PREFIX) for e in spec.extra)])


@dataclass(frozen=True)
class FeatureSpec:
    """What a predictor's input is made of; stored in the export metadata and checked at load and score time."""

    kind: str
    """Which builder: disco, sprinter or sv."""
    width: int
    """Number of input features (columns of the [N, width] matrix)."""
    top_k: int = 10
    """DISCO: number of top draft probabilities (width of the ``draft_topk`` column)."""
    position_scale: float = 40.0
    """DISCO: the position enters as position / position_scale."""
    extra: tuple[str, ...] = ()
    """DISCO: training-free scores appended as explicit inputs (from DISCO_EXTRAS)."""
    hidden_size: int = 0
    """Width of the ``draft_hidden`` column (the ``hidden`` part)."""
    names: tuple[str, ...] = field(default=())
    """Human-readable name of each input feature (filled in by the constructors)."""
    parts: tuple[str, ...] = ()
    """Parts of the input in order (from PARTS); empty: the kind's default (DEFAULT_PARTS)."""

    def __post_init__(self) -> None:
        if self.kind not in FEATURE_KINDS:
            raise ValueError(f"FeatureSpec.kind={self.kind!r}: use one of {FEATURE_KINDS}")
        if self.width <= 0:
            raise ValueError(f"FeatureSpec.width={self.width} must be > 0")
        if self.position_scale <= 0:
            raise ValueError(f"FeatureSpec.position_scale={self.position_scale} must be > 0")
        bad = [e for e in self.extra if e not in DISCO_EXTRAS]
        if bad:
            raise ValueError(f"FeatureSpec.extra has unknown columns {bad}; allowed: {DISCO_EXTRAS}")
        object.__setattr__(self, "extra", tuple(self.extra))
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "parts", tuple(self.parts) or DEFAULT_PARTS[self.kind])
        bad = [p for p in self.parts if p not in PARTS]
        if bad or len(set(self.parts)) != len(self.parts):
            raise ValueError(f"FeatureSpec.parts={self.parts}: use distinct parts from {PARTS}")
        if "hidden" in self.parts and self.hidden_size <= 0:
            raise ValueError(
                "FeatureSpec with a hidden part needs hidden_size > 0 (the data has no draft_hidden column?)"
            )

    # ---- constructors -------------------------------------------------------------------------------------------
    @staticmethod
    def _disco_names(top_k: int, extra: Sequence[str]) -> tuple[str, ...]:
        if top_k <= 0:
            raise ValueError(f"top_k={top_k} must be > 0")
        return tuple(f"draft_topk_{i}" for i in range(top_k)) + ("topk_entropy", "position_scaled") + tuple(extra)

    @staticmethod
    def _hidden_names(hidden_size: int) -> tuple[str, ...]:
        if hidden_size <= 0:
            raise ValueError(f"hidden_size={hidden_size} must be > 0 (the data has no draft_hidden column?)")
        return tuple(f"draft_hidden_{i}" for i in range(hidden_size))

    @classmethod
    def for_disco(
        cls, top_k: int = 10, position_scale: float = 40.0, extra: Sequence[str] = (), hidden_size: int = 0
    ) -> FeatureSpec:
        """DISCO input: top-k, their entropy, scaled position, optional explicit scores; then the hidden state when
        ``hidden_size`` > 0."""
        names = cls._disco_names(top_k, extra) + (cls._hidden_names(hidden_size) if hidden_size else ())
        return cls("disco", len(names), top_k=top_k, position_scale=position_scale, extra=tuple(extra),
                   hidden_size=hidden_size, names=names, parts=("disco", "hidden") if hidden_size else ("disco",))

    @classmethod
    def for_sprinter(
        cls, hidden_size: int, top_k: int = 0, position_scale: float = 40.0, extra: Sequence[str] = ()
    ) -> FeatureSpec:
        """SPRINTER input: the draft's last hidden state; with ``top_k`` > 0 the DISCO features follow."""
        names = cls._hidden_names(hidden_size) + (cls._disco_names(top_k, extra) if top_k else ())
        return cls("sprinter", len(names), top_k=top_k or 10, position_scale=position_scale, extra=tuple(extra),
                   hidden_size=hidden_size, names=names, parts=("hidden", "disco") if top_k else ("hidden",))

    @classmethod
    def for_sv(cls) -> FeatureSpec:
        """SV input: draft-companion similarity S and companion acceptance A_c."""
        return cls("sv", 2, names=("companion_sim", "companion_accept"))

    # ---- (de)serialisation --------------------------------------------------------------------------------------
    @property
    def columns(self) -> tuple[str, ...]:
        """Record columns this spec reads."""
        cols = {"disco": disco_columns(self.extra), "hidden": ("draft_hidden",),
                "sv": ("companion_sim", "companion_accept")}
        return tuple(c for p in self.parts for c in cols[p])

    @property
    def vector_columns(self) -> dict[str, int]:
        """Columns holding one vector per token, with their width."""
        vec = {"disco": {"draft_topk": self.top_k}, "hidden": {"draft_hidden": self.hidden_size}, "sv": {}}
        return {k: v for p in self.parts for k, v in vec[p].items()}

    @property
    def hidden_width(self) -> int:
        """Width of the hidden part when it closes the input (DISCO's hybrid head), else 0."""
        return self.hidden_size if self.parts[-1] == "hidden" and len(self.parts) > 1 else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["extra"], d["names"], d["parts"] = list(self.extra), list(self.names), list(self.parts)
        d["columns"] = list(self.columns)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FeatureSpec:
        keys = {"kind", "width", "top_k", "position_scale", "extra", "hidden_size", "names", "parts"}
        kw = {k: v for k, v in d.items() if k in keys}
        for k in ("extra", "names", "parts"):  # JSON lists as the tuples the spec holds
            kw[k] = tuple(kw.get(k, ()))
        return cls(**kw)


def _to_tensor(name: str, value: object) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    try:
        arr = np.asarray(value)
        if arr.dtype == object:  # list of arrays (e.g. pandas column of vectors)
            arr = np.stack([np.asarray(v) for v in value])  # type: ignore[union-attr]
        return torch.from_numpy(np.ascontiguousarray(arr))
    except (TypeError, ValueError) as e:
        raise TypeError(f"column {name!r} cannot be converted to a numeric tensor: {e}") from e


def _get(columns: Mapping[str, object], spec: FeatureSpec, name: str) -> Tensor:
    if name not in columns:
        missing = [c for c in spec.columns if c not in columns]
        raise KeyError(
            f"{spec.kind} input needs the columns {list(spec.columns)}; missing: {missing} "
            f"(available: {sorted(columns)})"
        )
    return _to_tensor(name, columns[name])


def _float(t: Tensor) -> Tensor:
    """``t.float()`` without a dispatch when it is float32 already (per-token decisions count their ops)."""
    return t if t.dtype == torch.float32 else t.float()


def _vector(columns: Mapping[str, object], spec: FeatureSpec, name: str, width: int) -> Tensor:
    t = _float(_get(columns, spec, name))
    if t.dim() == 1:  # a single token
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"column {name!r} must be [N, {width}], got shape {tuple(t.shape)}")
    if t.shape[1] != width:
        raise ValueError(
            f"feature width mismatch: column {name!r} has width {t.shape[1]} but this {spec.kind} predictor was "
            f"trained with width {width}"
        )
    return t


def _scalar(columns: Mapping[str, object], spec: FeatureSpec, name: str, n: int) -> Tensor:
    t = _float(_get(columns, spec, name))
    t = t if t.dim() == 1 else t.reshape(-1)
    if t.numel() == 1 and n != 1:
        t = t.expand(n)
    if t.numel() != n:
        raise ValueError(f"column {name!r} has {t.numel()} values, expected {n} (one per token)")
    return t


def topk_entropy(topk: Tensor) -> Tensor:
    """[N, k] top-k probabilities -> [N] natural-log entropy of the renormalised top-k."""
    return torch.special.entr(topk / topk.sum(-1, keepdim=True).clamp_min(1e-12)).sum(-1)


def _part(spec: FeatureSpec, part: str, columns: Mapping[str, object]) -> Tensor:
    """[N, width of the part] for one input part."""
    if part == "disco":
        # few torch ops: in decoding this runs once per drafted token, right after a draft forward, where each small
        # op costs several times its cost in a warm loop (the stop decision's budget is 2% of a draft step)
        topk = _vector(columns, spec, "draft_topk", spec.top_k)
        n = topk.shape[0]
        scalars = [_scalar(columns, spec, "position", n) / spec.position_scale]
        for e in spec.extra:
            v = _scalar(columns, spec, extra_column(e), n)
            scalars.append(torch.log(v.clamp_min(1e-9)) if e.startswith(LOG_PREFIX) else v)
        ent = topk_entropy(topk)
        return torch.cat([topk, torch.stack([ent, *scalars], dim=1)], dim=1)  # one device: stack says if not
    if part == "hidden":
        return _vector(columns, spec, "draft_hidden", spec.hidden_size)
    s = _get(columns, spec, "companion_sim").float().reshape(-1)
    a = _scalar(columns, spec, "companion_accept", s.numel())
    return torch.stack([s, a.to(s.device)], dim=1)


def build_features(spec: FeatureSpec, columns: Mapping[str, object]) -> Tensor:
    """[N, spec.width] float32 inputs for ``spec`` from record columns; KeyError listing missing columns, ValueError for
    a wrong vector width or NaN / inf."""
    blocks = [_part(spec, p, columns) for p in spec.parts]
    n = blocks[0].shape[0]
    if any(b.shape[0] != n for b in blocks):
        raise ValueError(
            f"{spec.kind} input parts {spec.parts} have different row counts {[b.shape[0] for b in blocks]}"
        )
    x = blocks[0] if len(blocks) == 1 else torch.cat([b.to(blocks[0].device) for b in blocks], dim=1)
    if x.shape[1] != spec.width:
        raise ValueError(
            f"feature width mismatch: built {x.shape[1]} {spec.kind} features, the predictor expects {spec.width}"
        )
    if not math.isfinite(x.sum(dtype=torch.float64)):  # one reduction; the mask only to name the bad columns
        bad = (~torch.isfinite(x)).any(0).nonzero().flatten().tolist()
        names = [spec.names[i] if i < len(spec.names) else str(i) for i in bad[:10]]
        n_rows = int((~torch.isfinite(x)).any(1).sum())
        raise ValueError(
            f"NaN or inf in {spec.kind} features {names} ({n_rows} of {x.shape[0]} tokens); refusing to score"
        )
    return x


class LearnedPolicy(StopPolicy):
    """A StopPolicy backed by a torch module on a :class:`FeatureSpec`'s inputs; subclasses set ``kind`` and ``output``
    (``logit``: the score is sigmoid(module(x)); ``prob``: the module's output)."""

    kind: ClassVar[str] = "learned"
    output: ClassVar[str] = "logit"

    def __init__(self, net: nn.Module, spec: FeatureSpec, threshold: float = 0.5, max_draft_len: int = 40) -> None:
        super().__init__(threshold=threshold, max_draft_len=max_draft_len)
        if max_draft_len <= 0:
            raise ValueError(f"max_draft_len={max_draft_len} must be > 0")
        self.net = net.eval()
        self.spec = spec
        self.required_columns = spec.columns  # type: ignore[misc]  # instance-level, per spec
        self.train_info: dict[str, Any] = {}
        """Filled by training: resolved config, label, validation metrics (exported with the weights)."""

    @property
    def vector_columns(self) -> Mapping[str, int]:
        return self.spec.vector_columns

    def inputs(self, features: Mapping[str, object]) -> Tensor:
        """[N, width] inputs (checked) for the policy's module."""
        return build_features(self.spec, features)

    def device(self) -> torch.device:
        """Device of the module's parameters / buffers."""
        t = next(itertools.chain(self.net.parameters(), self.net.buffers()), None)  # not state_dict: it copies a dict
        return t.device if t is not None else torch.device("cpu")

    def to(self, device: str | torch.device) -> LearnedPolicy:
        """Move the module (e.g. to the decoder's GPU); scores come back on the features' device."""
        self.net.to(device)
        return self

    @torch.no_grad()
    def score(self, features: Mapping[str, Tensor]) -> Tensor:
        x = self.inputs(features)
        dev = self.device()
        out = self.net(x if x.device == dev else x.to(dev))
        out = torch.sigmoid(out) if self.output == "logit" else out
        return out if out.device == x.device else out.to(x.device)
