"""A runtime's speculative settings tuned for a model pair and a machine: its own rule (``predictors.runtime_rules``)
replayed over labelled draft tokens under a measured curve, the fastest setting on validation chosen, and it, the
runtime's defaults, the learned policies and the oracle scored on test. The main job and the llama.cpp benchmark run it
too.

Usage: python -m pipelines.recommend --data_dir outputs/default/data --runtime all
"""
from __future__ import annotations

import copy
import itertools
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from compute.gguf_files import GGUF_SUBDIR, PACKAGED_PREFIX
from compute.packaged import get_packaged
from compute.timing import BATCH_CURVES, CostModel
from data_gen.progress import Heartbeat
from data_gen.shards import read_data_config
from decoding.policies import GOODPUT_PREFIX, build_policy
from evaluation.data import load_columns
from evaluation.replay.rounds import ReplayResult, replay_policy
from evaluation.replay.scores import scores_for
from evaluation.replay.sequences import ReplayConfig, ReplayData, prepare_replay_data
from main_job.verify import replay_records
from predictors.base import StopPolicy
from predictors.baselines import Oracle
from predictors.runtime_rules import RUNTIMES, LlamaCppRule, RuntimeRule, TransformersRule, VllmRule, runtime_rule
from runtimes.vllm.settings import MARGINAL, BatchPick, acceptance_picks, measured_survival, paste_lines

log = logging.getLogger("pipelines.recommend")

__all__ = ["Recommendation", "recommend", "tune_rule", "coarse_rules", "SPECULATE_MIN", "RecommendConfig",
           "recommend_runtimes", "draft_name", "write_recommendations", "recommendation_records"]

SPECULATE_MIN = 1.0
"""Replayed speedup over target-only on validation a setting must exceed to be recommended (else: do not speculate)."""

Progress = Callable[[int, int], None]
"""Called with (settings replayed, settings to replay) while tuning."""


def coarse_rules(runtime: str) -> list[RuntimeRule]:
    """The first grid of a runtime's settings (the runtime's defaults included)."""
    if runtime == "llamacpp":
        rules: list[RuntimeRule] = [LlamaCppRule(n, 0, p) for n, p in itertools.product(
            (1, 2, 3, 4, 5, 6, 8, 10, 12, 16), (0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95))]
    elif runtime == "transformers":
        rules = [TransformersRule(n, s, t) for n, s, t in itertools.product(
            (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20), ("constant", "heuristic"), (0.0, 0.2, 0.4, 0.6, 0.8))]
    elif runtime == "vllm":
        rules = [VllmRule(k) for k in range(1, 17)]
    else:
        raise ValueError(f"runtime={runtime!r}: use one of {', '.join(RUNTIMES)}")
    default = runtime_rule(runtime)
    if all(r.settings() != default.settings() for r in rules):
        rules.append(default)
    return rules


def fine_rules(best: RuntimeRule) -> list[RuntimeRule]:
    """Settings around the best coarse one: llama.cpp's minimum draft and a finer probability floor, transformers'
    length one either side, none for vLLM."""
    if isinstance(best, LlamaCppRule):
        ps = sorted({round(min(max(best.p_min + d, 0.0), 0.99), 3) for d in (-0.05, -0.025, 0.0, 0.025, 0.05)})
        return [LlamaCppRule(best.n_max, m, p) for m, p in itertools.product(range(0, min(best.n_max, 3) + 1), ps)]
    if isinstance(best, TransformersRule):
        s = best.settings()
        return [TransformersRule(n, s["num_assistant_tokens_schedule"], s["assistant_confidence_threshold"])
                for n in (best.initial_tokens - 1, best.initial_tokens + 1) if n >= 1]
    return []


def tune_rule(runtime: str, data: ReplayData, cm: CostModel, mode: str = "greedy",
              progress: Progress | None = None) -> tuple[RuntimeRule, float, list[dict[str, Any]]]:
    """(fastest setting, its replayed speedup, one row per setting tried) of ``runtime`` over ``data``: a coarse grid,
    then a finer one around its best."""
    rows: list[dict[str, Any]] = []
    scores: dict[str, np.ndarray | None] = {}

    def run(rules: list[RuntimeRule]) -> None:
        total = len(rows) + len(rules)
        for rule in rules:
            if rule.kind not in scores:  # a rule's score does not depend on its settings: computed once
                scores[rule.kind] = scores_for(rule, data, None)
            r = replay_policy(copy.deepcopy(rule), data, cm, mode, scores=scores[rule.kind])
            rows.append({"rule": rule, "spec": rule.spec(), **rule.settings(), **r.as_row()})
            if progress is not None:
                progress(len(rows), total)

    run(coarse_rules(runtime))
    best = max(rows, key=lambda r: r["speedup"])["rule"]
    tried = {r["spec"] for r in rows}
    run([r for r in fine_rules(best) if r.spec() not in tried])
    top = max(rows, key=lambda r: r["speedup"])
    return top["rule"], float(top["speedup"]), rows


@dataclass
class Recommendation:
    """A runtime's tuned setting and its test-split worth beside its defaults, the learned policies and the oracle
    (speedups over target-only under one curve)."""

    runtime: str
    rule: RuntimeRule
    """The fastest setting on the validation split."""
    val_speedup: float
    test: ReplayResult
    default: RuntimeRule
    default_test: ReplayResult
    compare: dict[str, ReplayResult] = field(default_factory=dict)
    """Learned (and cost-aware) policies replayed on the test split under the same curve, by name."""
    oracle: ReplayResult | None = None
    warnings: list[str] = field(default_factory=list)
    tried: list[dict[str, Any]] = field(default_factory=list)
    per_batch: list[BatchPick] = field(default_factory=list)
    """vLLM with its own per-batch curve: the K tuned at each batch size (``vllm_batch_picks``)."""
    max_num_seqs: int = 8
    """vLLM's ``max_num_seqs`` the per-batch schedule's last range ends at."""

    @property
    def speculate(self) -> bool:
        """The tuned setting beats target-only on the validation split."""
        return self.val_speedup > SPECULATE_MIN

    def best_compare(self) -> tuple[str, ReplayResult] | None:
        if not self.compare:
            return None
        return max(self.compare.items(), key=lambda kv: kv[1].speedup)

    def lines(self, draft: str = "DRAFT") -> list[str]:
        """What to paste and what it is worth, one fact a line."""
        out = [f"warning: {w}" for w in self.warnings]
        head = f"{self.runtime}:"
        if not self.speculate:
            out.append(f"{head} do not speculate on this pair and machine: the best setting "
                       f"({self.rule.spec()}) replays at {self.val_speedup:.2f}x target-only on the validation "
                       f"split; run the target alone" + (" (no -md)" if self.runtime == "llamacpp" else ""))
        else:
            out.append(f"{head} {self.rule.paste(draft)}")
        mine = self.speedup
        what = "the recommendation (target-only)" if not self.speculate else "the tuned setting"
        out.append(f"{head} replayed on the test split: {what} {mine:.2f}x target-only; the runtime's defaults "
                   f"({self.default.spec()}) {self.default_test.speedup:.2f}x, so {what} is "
                   f"{mine / self.default_test.speedup:.2f}x the defaults")
        best = self.best_compare()
        if best is not None:
            out.append(f"{head} {best[0]} (the best learned policy given) {best[1].speedup:.2f}x: {what} is "
                       f"{mine / best[1].speedup:.2f}x of it")
        if self.oracle is not None:
            out.append(f"{head} the oracle {self.oracle.speedup:.2f}x: {what} is {mine / self.oracle.speedup:.2f}x "
                       f"of it")
        if self.per_batch:
            out += [f"{head} {line}" for line in paste_lines(self.per_batch, draft, self.max_num_seqs)]
        return out

    @property
    def speedup(self) -> float:
        """Replayed speedup of what is recommended on the test split (1.0 when that is target-only)."""
        return self.test.speedup if self.speculate else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "runtime": self.runtime, "speculate": self.speculate, "speedup": self.speedup,
            "settings": self.rule.settings(),
            "spec": self.rule.spec(), "paste": self.rule.paste(), "val_speedup": self.val_speedup,
            "test": self.test.as_row(), "default": {"spec": self.default.spec(), **self.default_test.as_row()},
            "compare": {k: v.as_row() for k, v in self.compare.items()},
            "oracle": self.oracle.as_row() if self.oracle is not None else None, "warnings": self.warnings,
            "tried": [{k: v for k, v in r.items() if k != "rule"} for r in self.tried],
            "per_batch": [p.to_dict() for p in self.per_batch] or None,
        }


def recommend(runtime: str, columns: Mapping[str, object], cm: CostModel, *,
              compare: Mapping[str, StopPolicy] | None = None, mode: str = "greedy",
              progress: Progress | None = None) -> Recommendation:
    """Tune ``runtime``'s setting on the ``val`` rows under ``cm`` and score it, the defaults, the ``compare`` policies
    and the oracle on ``test``; vLLM's K uses vLLM's measured acceptance where ``cm`` holds it."""
    splits = set(np.asarray(columns.get("split", np.array([]))).astype(str).tolist())
    missing = [s for s in ("val", "test") if s not in splits]
    if missing:
        raise ValueError(f"the data has no {' or '.join(missing)} rows to tune and score on; generate the data with "
                         f"pipelines.generate (it splits prompts into train / val / test)")
    val = prepare_replay_data(columns, ReplayConfig(mode=mode, split="val"))
    test = prepare_replay_data(columns, ReplayConfig(mode=mode, split="test"))
    warnings = [w for w in (cm.runtime_mismatch(runtime),) if w]
    rule, val_speedup, tried = tune_rule(runtime, val, cm, mode, progress)
    survival = measured_survival(cm, mode) if runtime == "vllm" else None
    if survival:  # vLLM's own acceptance on validation prompts prices its K (runtimes.vllm.settings)
        pick = acceptance_picks(survival, {1: cm})[0]
        if pick.k:
            rule, val_speedup = VllmRule(pick.k), pick.val_speedup
    default = runtime_rule(runtime)

    def on_test(policy: StopPolicy, cap: int | None = None) -> ReplayResult:
        return replay_policy(copy.deepcopy(policy), test, cm, mode, max_draft_len=cap)

    # the learned policies and the oracle draft no longer than the curve was measured for (a verification of L tokens
    # verifies L - 1 drafts): past it the curve is extrapolated, and a flat tail would make any long round look cheap
    cap = max(1, max(int(length) for length in cm.target_s) - 1)
    compared = {name: on_test(p, cap) for name, p in (compare or {}).items()}
    return Recommendation(runtime=runtime, rule=rule, val_speedup=val_speedup, test=on_test(rule), default=default,
                          default_test=on_test(default), compare=compared,
                          oracle=on_test(Oracle(), cap) if mode == "greedy" else None, warnings=warnings,
                          tried=tried)


RUNTIME_COST_FILES = {"llamacpp": ("cost_model.llamacpp.json",),
                      "transformers": ("cost_model.transformers.json", "cost_model.json"),
                      "vllm": ("cost_model.vllm.json", "cost_model.json")}
"""The curves beside a data folder a runtime's recommendation is priced with, first found first: its own
(``cost_model.R.json``), else the data's specstop curve (a warning for any runtime but transformers)."""


@dataclass
class RecommendConfig:
    """Arguments of ``python -m pipelines.recommend``."""

    data_dir: str
    """A folder written by pipelines.generate: its val split tunes, its test split scores."""
    runtime: str = "all"
    """llamacpp, transformers, vllm, or all (each runtime whose curve is found)."""
    cost_file: str | None = None
    """The curve to price rounds with (default: the runtime's own beside ``data_dir``, else ``cost_model.json``; another
    runtime's warns)."""
    train_dir: str | None = None
    """A main job's output folder whose DISCO export (and cost-aware form) the settings are compared with (default:
    ``train`` beside data_dir)."""
    compare: list[str] = field(default_factory=list)
    """More policy specs to compare with (decoding.policies.build_policy)."""
    mode: str = "greedy"
    """greedy (exact token matches) or sampling (expected acceptance)."""
    draft: str | None = None
    """The draft model's path or name in the printed settings (default: the data folder's draft)."""
    out: str | None = None
    """JSON file for the recommendations (default: none)."""

    def __post_init__(self) -> None:
        if self.runtime != "all" and self.runtime not in RUNTIMES:
            raise ValueError(f"--runtime {self.runtime!r}: use one of {', '.join(RUNTIMES)} or all")
        if read_data_config(self.data_dir) is None:
            raise ValueError(f"--data_dir {self.data_dir}: no config.json there; give a folder written by "
                             f"pipelines.generate")
        if self.cost_file is not None and not Path(self.cost_file).is_file():
            raise ValueError(f"--cost_file {self.cost_file}: no such file (python -m pipelines.measure_costs writes "
                             f"one)")


def cost_file_for(cfg: RecommendConfig, runtime: str) -> Path | None:
    """The curve a runtime's recommendation is priced with: the one given, else the first of :data:`RUNTIME_COST_FILES`
    found."""
    if cfg.cost_file is not None:
        return Path(cfg.cost_file)
    data = Path(cfg.data_dir)
    for name in RUNTIME_COST_FILES.get(runtime, ("cost_model.json",)):
        if (data / name).is_file():
            return data / name
    return None


def compare_policies(cfg: RecommendConfig) -> dict[str, StopPolicy]:
    """The policies compared with: the training folder's DISCO export at its tuned threshold, its cost-aware form, and
    ``cfg.compare``."""
    train = Path(cfg.train_dir) if cfg.train_dir else Path(cfg.data_dir).parent / "train"
    specs: dict[str, str] = {}
    export = train / "disco" / "export"
    if export.is_dir():
        specs = {"DISCO": str(export), "goodput DISCO": GOODPUT_PREFIX + str(export)}
    elif cfg.train_dir:
        raise ValueError(f"--train_dir {cfg.train_dir}: no disco/export there; give a main job's out_dir")
    specs.update({s: s for s in cfg.compare})
    out: dict[str, StopPolicy] = {}
    for name, spec in specs.items():
        try:
            out[name] = build_policy(spec, max_draft_len=40)
        except ValueError as e:  # an export without calibration maps has no cost-aware form
            if spec in cfg.compare:
                raise
            log.warning("not compared with %s: %s", name, e)
    return out


def recommend_runtimes(cfg: RecommendConfig, runtimes: Iterable[str] | None = None) -> dict[str, Recommendation]:
    """Tune and score each runtime whose curve is found; one without is logged with the command that measures it."""
    wanted = list(runtimes) if runtimes is not None else (list(RUNTIMES) if cfg.runtime == "all" else [cfg.runtime])
    files = {rt: cost_file_for(cfg, rt) for rt in wanted}
    for rt in [rt for rt, f in files.items() if f is None]:
        message = (f"no curve for {rt}: measure it with python -m pipelines.measure_costs --runtime {rt} "
                   f"--data_dir {cfg.data_dir}")
        if cfg.runtime == rt:
            raise ValueError(message)
        log.info(message)
    cols = load_columns(cfg.data_dir, ["val", "test"])
    compare = compare_policies(cfg)
    out: dict[str, Recommendation] = {}
    for rt, f in files.items():
        if f is None:
            continue
        cm = CostModel.from_json(f)
        with Heartbeat(log, f"recommend {rt}", unit="settings") as hb:
            out[rt] = recommend(rt, cols, cm, compare=compare, mode=cfg.mode,
                                progress=lambda done, total, h=hb: h.update(done, total))
        if rt == "vllm" and cm.extra.get(BATCH_CURVES):  # vLLM's own curve, per batch size: a K for each
            curves = {int(b): CostModel.from_dict(d) for b, d in cm.extra[BATCH_CURVES].items()}
            survival = measured_survival(cm, cfg.mode)  # vLLM's own acceptance on validation prompts, if measured
            out[rt].per_batch = (acceptance_picks(survival, curves) if survival
                                 else vllm_batch_picks(cols, curves, cfg.mode))
        for w in out[rt].warnings:
            log.warning(w)
    return out


def vllm_batch_picks(cols: Mapping[str, object], curves: dict[int, CostModel], mode: str = "greedy"
                     ) -> list[BatchPick]:
    """vLLM's K tuned at each batch size of ``curves`` on validation, 0 where no K beats the target alone by
    ``MARGINAL``."""
    picks = []
    for b in sorted(curves):
        rec = recommend("vllm", cols, curves[b], mode=mode)
        k = rec.rule.draft_cap() if rec.speculate and rec.val_speedup >= MARGINAL else 0
        picks.append(BatchPick(b, k, round(rec.val_speedup, 4), round(rec.test.speedup if k else 1.0, 4),
                               rec.rule.draft_cap()))
    return picks


def draft_name(cfg: RecommendConfig, runtime: str = "transformers") -> str:
    """The draft as the printed settings name it: ``cfg.draft``, else the data's draft, a packaged one as each runtime
    loads it (llama.cpp: its GGUF file; vLLM: its converted folder)."""
    if cfg.draft:
        return cfg.draft
    models = (read_data_config(cfg.data_dir) or {}).get("resolved", {}).get("models", {})
    draft = str(models.get("draft") or "DRAFT")
    if not draft.startswith(PACKAGED_PREFIX) or runtime not in ("llamacpp", "vllm"):
        return draft
    name = draft.removeprefix(PACKAGED_PREFIX)
    cache = Path(str(models.get("cache_dir") or "~/.cache/specstop"))
    return str(cache / GGUF_SUBDIR / f"{name}.gguf") if runtime == "llamacpp" else str(cache / get_packaged(name).name)


def recommendation_records(runtime: str, rec: Recommendation) -> list[pd.DataFrame]:
    """The per-sequence records of a recommendation's replayed figures (``main_job.verify``): the tuned setting's, the
    defaults', each compared policy's and the oracle's on the test split."""
    out = [replay_records(runtime, "speedup", rec.rule.spec(), rec.test),
           replay_records(runtime, "default_speedup", rec.default.spec(), rec.default_test)]
    out += [replay_records(runtime, f"compare:{name}", name, r) for name, r in rec.compare.items()]
    if rec.oracle is not None:
        out.append(replay_records(runtime, "oracle_speedup", "oracle", rec.oracle))
    return out


def write_recommendations(recs: dict[str, Recommendation], path: str | Path) -> Path:
    """The recommendations as JSON (settings, replayed speedups, every setting tried)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body: dict[str, Any] = {rt: r.to_dict() for rt, r in recs.items()}
    path.write_text(json.dumps(body, indent=2))
    return path
