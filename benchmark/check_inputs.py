"""What the replay check reads: its config (:class:`ReplayCheckConfig`), a finished benchmark's folder
(:class:`BenchFolder`) and each engine row's policy rebuilt from its spec and threshold (:func:`row_policies`)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from benchmark.bench import DecodeSettings, sample_units
from benchmark.config import BenchmarkConfig
from benchmark.curve import CURVE_DURING_ROWS, HF_CURVE
from benchmark.rows import HF_METHOD
from compute.timing import STATISTICS, CostModel
from data_gen.config import ModelsConfig
from decoding.policies import build_policy
from evaluation.replay import with_threshold
from predictors.base import StopPolicy
from predictors.runtime_rules import TransformersRule
from predictors.tracking import TrackingSwitch, TrackingURI

HF_DRAFT_CAP = 32
"""The longest round the replay follows for a transformers row: transformers caps a round only by the tokens left;
its defaults draft 20, and a heuristic schedule grows past 32 only after many fully accepted rounds in a row."""


@dataclass
class ReplayCheckConfig(TrackingURI, TrackingSwitch):
    """Everything ``python -m pipelines.replay_check`` does; ``tracking`` logs the check in one run of the benchmark's
    experiment, at ``tracking_uri`` (default: the benchmark's)."""

    bench_dir: str = "outputs/benchmark"
    """A finished benchmark's out_dir: benchmark.json, config.yaml and cost_model.json."""
    gen_batch_size: int = 8
    """Draft rollouts generated per batch."""
    label_batch_tokens: int = 4096
    """Memory budget of one labelling pass: padded tokens (batch x longest) per forward."""
    statistic: str | None = None
    """min, median or mean: summarise the benchmark's curve from its raw timings by this statistic (None: as written;
    min is the uncontended cost, median what a step typically costs on a shared machine, mean what it costs on average,
    the expectation of a row's total time; the curve probed during the rows is pooled by the mean)."""

    def __post_init__(self) -> None:
        if self.statistic is not None and self.statistic not in STATISTICS:
            raise ValueError(f"--statistic {self.statistic!r}: use {', '.join(STATISTICS)} (or leave it unset)")
        if self.gen_batch_size < 1 or self.label_batch_tokens < 1:
            raise ValueError(f"gen_batch_size={self.gen_batch_size} and label_batch_tokens={self.label_batch_tokens} "
                             "must be >= 1")


@dataclass
class BenchFolder:
    """What the check reads from a finished benchmark's folder."""

    path: Path
    decoding: DecodeSettings
    """How the benchmark decoded (its config's fields of these names)."""
    models: ModelsConfig
    """The models the benchmark loaded (the companion loads from it when a row's policy reads one)."""
    rows: list[dict[str, Any]]
    """benchmark.json's rows."""
    names: list[str]
    """Prompt ids (each once per sample, as ``prompts``)."""
    prompts: list[list[int]]
    """Prompt token ids, as the benchmark decoded them: each prompt once per sample (``samples_per_prompt``)."""
    continuations: list[list[int]]
    """target-only's output per prompt (per sample)."""
    cost_model: CostModel
    """The curve the check prices with: the benchmark's probes between its prompts pooled (``cost_model_rows.json``)
    where it took them, else the curve it measured before the rows (``cost_model.json``)."""
    cost_model_file: Path | None = None
    """The file ``cost_model`` was read from."""
    decision_cost_model: CostModel | None = None
    """The curve the benchmark's cost-aware policies decided with (``cost_model.json``; None: ``cost_model``)."""
    hf_cost_model: CostModel | None = None
    """transformers' own curve (``cost_model.transformers.json``, ``hf_curve``): the hf rows are priced with it, and
    not replayed without it."""

    @property
    def base(self) -> dict[str, Any]:
        """The target-only row."""
        return next(r for r in self.rows if r.get("row") == "target-only")

    @property
    def mode(self) -> str:
        return self.decoding.mode


def read_bench_folder(path: str | Path, read_config: Callable[[Path], BenchmarkConfig]) -> BenchFolder:
    """A finished benchmark's folder; ``read_config`` gives the config it ran with, once its files are found (the
    run's own, or its ``config.yaml`` read back by ``python -m pipelines.replay_check``); a missing file, or a
    benchmark.json without target-only's row or its output ids, is named in the error."""
    path = Path(path)
    if not path.is_dir():
        raise NotADirectoryError(f"--bench_dir {path}: no such folder; run the benchmark first (python -m "
                                 f"pipelines.benchmark --config configs/benchmark.yaml writes outputs/benchmark)")
    report = read_json(path / "benchmark.json")
    rows = report.get("rows") or []
    base = next((r for r in rows if r.get("row") == "target-only"), None)
    if base is None:
        raise ValueError(f"{path / 'benchmark.json'} has no 'target-only' row: the replay check labels target-only's "
                         f"output (the prompts it replays); rerun the benchmark")
    if "output_ids" not in base or "prompt_ids" not in report:
        raise ValueError(f"{path / 'benchmark.json'}: the 'target-only' row has no output_ids; rerun python -m "
                         f"pipelines.benchmark --config {path / 'config.yaml'}")
    before = path / "cost_model.json"
    if not before.is_file():
        raise FileNotFoundError(f"{before}: no such file (the benchmark writes the curve it measured there)")
    during = path / CURVE_DURING_ROWS  # missing for a benchmark without probes between its prompts
    decided = CostModel.from_json(before)
    cm_file, cm = (during, CostModel.from_json(during)) if during.is_file() else (before, decided)
    hf = CostModel.from_json(path / HF_CURVE) if (path / HF_CURVE).is_file() else None
    cfg = read_config(path)
    k = int(report.get("samples_per_prompt") or 1)  # target-only's output per sample: each prompt once per sample
    names = [n for n in report.get("prompts") or [] for _ in range(k)]
    return BenchFolder(path, DecodeSettings.of(cfg), cfg.models, rows, names, sample_units(report["prompt_ids"], k),
                       base["output_ids"], cm, cm_file, decided, hf)


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; run the benchmark into {path.parent} first (python -m "
                                f"pipelines.benchmark --config configs/benchmark.yaml --out_dir {path.parent})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def row_policies(folder: BenchFolder, draft: PreTrainedModel, tokenizer: PreTrainedTokenizerBase
                 ) -> list[tuple[dict[str, Any], StopPolicy | None, str]]:
    """(row, policy or None, note) for every engine row: its policy rebuilt from the recorded spec and threshold; and
    for every transformers row (``hf:``) its rule, when the folder holds transformers' curve to price it with."""
    d = folder.decoding
    out: list[tuple[dict[str, Any], StopPolicy | None, str]] = []
    if folder.hf_cost_model is not None:
        out += [(r, build_policy(r["spec"], max_draft_len=HF_DRAFT_CAP), "") for r in folder.rows
                if r.get("method") == HF_METHOD and str(r.get("spec") or "").startswith("transformers:")]
    for r in (r for r in folder.rows if r.get("method") == "engine"):
        if not r.get("spec"):
            out.append((r, None, "no policy spec in benchmark.json"))
            continue
        try:
            pol = build_policy(r["spec"], draft=draft, draft_tokenizer=tokenizer, max_draft_len=d.max_draft_len,
                               force=d.force)
        except (ValueError, KeyError, FileNotFoundError) as e:
            out.append((r, None, f"policy not rebuilt: {e}"))
            continue
        if r.get("threshold") is not None:
            pol = with_threshold(pol, float(r["threshold"]))
        if pol.round_rule.hindsight:  # the oracle's rounds as the engine runs them
            pol.drafts_failing_token = True
        out.append((r, pol, row_note(pol, d, own_output=bool(r.get("output_ids")))))
    return out


def row_note(policy: StopPolicy, decoding: DecodeSettings, own_output: bool = False) -> str:
    """Why the replay cannot follow the engine's trajectory for this row ('' when it can). ``own_output``: the row
    recorded its output (an approximate policy's in greedy decoding, replayed along it: :func:`own_output_rows`)."""
    notes = []
    if policy.round_rule.hindsight and decoding.temperature > 0:
        notes.append("sampling oracle: the replay drafts the expected acceptable run, the engine's time is estimated")
    elif not policy.exact and not (own_output and decoding.temperature == 0):
        notes.append("approximate policy: rounds checked at their last token as the engine checks them, along "
                     "target-only's output, which the engine leaves at a mismatch it takes unverified")
    if decoding.batch_size > 1:
        notes.append("engine batched: the replay runs one sequence a round")
    if decoding.temperature > 0:
        notes.append("sampling: expected acceptance along target-only's sampled output")
    return "; ".join(notes)


def rollout_length(policies: list[StopPolicy], max_draft_len: int) -> int:
    """The longest draft a policy can make in the engine (``max_draft_len`` caps every round), or in transformers (a
    transformers rule: :data:`HF_DRAFT_CAP`)."""
    def cap(p: StopPolicy) -> int:
        if isinstance(p, TransformersRule):
            return HF_DRAFT_CAP
        online = type(p).update is not StopPolicy.update  # its cap may move between rounds: the widest
        return min(p.max_draft_len, max_draft_len) if online else p.round_cap(max_draft_len)

    return max((cap(p) for p in policies), default=max_draft_len) or 1
