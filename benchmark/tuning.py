"""Thresholds and static lengths tuned on validation data under the run's curve: ``static:best`` and
``<baseline>:tuned`` (:func:`tune_on_validation`) and thresholded learned exports (:func:`tune_predictors`), each by
replay of the validation split of ``tune_data_dir`` (``evaluation.replay``)."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmark.bench import Bench
from benchmark.config import needs_tuning
from decoding.policies import build_policy, policy_label
from evaluation.data import load_columns, subset
from evaluation.replay import (
    ReplayConfig,
    missing_columns,
    prepare_replay_data,
    replay_policy,
    tune_threshold,
    with_threshold,
)
from main_job.recommend import tune_rule
from predictors.labels import draw_mask
from predictors.runtime_rules import RuntimeRule

log = logging.getLogger("pipelines.benchmark")


def tune_on_validation(specs: Sequence[str], bench: Bench, data_dir: str | None,
                       max_static: int = 10) -> dict[str, tuple[Any, str, dict[str, Any]]]:
    """``static:best`` (lengths 1..``max_static``) and ``<baseline>:tuned`` specs -> (policy, label, how to rebuild
    it: {"spec", "threshold"}) chosen by replay of the validation split of ``data_dir`` (``tune_data_dir``) under the
    bench's cost model (greedy: argmax draws; sampling: sampled draws)."""
    wanted = [s for s in specs if needs_tuning(s)]
    if not wanted:
        return {}
    cm, max_draft_len = bench.cost_model, bench.decoding.max_draft_len
    assert cm is not None and data_dir is not None
    if not Path(data_dir).is_dir():  # checked here, not in the config: the main job may write it later
        raise ValueError(f"--tune_data_dir {data_dir}: no such folder; run the main job first (python -m "
                         f"pipelines.train --config configs/default.yaml writes outputs/default/data) or give a data "
                         f"folder written by pipelines.generate")
    mode, cols = _validation_columns(bench, data_dir)
    out: dict[str, tuple[Any, str, dict[str, Any]]] = {}
    for spec in wanted:
        if spec == "static:best":
            data = prepare_replay_data(cols, ReplayConfig(mode=mode, origins=("target",)))
            speed = {k: replay_policy(build_policy(f"static:{k}"), data, cm, mode).speedup
                     for k in range(1, max_static + 1)}
            k = max(speed, key=speed.get)
            log.info("static:best = static:%d (replayed speedups on val: %s)", k,
                     ", ".join(f"{j}: {v:.2f}" for j, v in speed.items()))
            out[spec] = (build_policy(f"static:{k}"), f"static:{k} (val-best)", {"spec": f"static:{k}"})
            continue
        kind = spec.split(":")[0]
        pol = build_policy(kind, max_draft_len=max_draft_len)
        thr, sp = tune_threshold(pol, cols, cm, split=None, mode=mode)
        log.info("%s tuned on val: threshold %.4g (replayed speedup %.2f)", kind, thr, sp)
        tuned = with_threshold(pol, thr)
        # the label is the spec that builds this policy again (svip's spec takes h = 1 - its threshold)
        param = tuned.h if kind == "svip" else thr
        out[spec] = (tuned, f"{kind}:{param:.3g} (val-tuned)", {"spec": kind, "threshold": thr})
    return out


def tune_runtime(runtime: str, bench: Bench, data_dir: str | None) -> RuntimeRule:
    """``runtime``'s own rule at the setting that replays fastest on the validation split of ``data_dir``
    under the bench's cost model, transformers' own for transformers when measured (``hf_curve``; the replay:
    ``main_job.recommend.tune_rule``)."""
    cm = bench.hf_cost_model if runtime == "transformers" and bench.hf_cost_model is not None else bench.cost_model
    assert cm is not None
    mode, cols = _validation_columns(bench, data_dir)
    data = prepare_replay_data(cols, ReplayConfig(mode=mode, origins=("target",)))
    rule, speed, _ = tune_rule(runtime, data, cm, mode)
    log.info("%s recommended on val: %s (replayed speedup %.2f)", runtime, rule.spec(), speed)
    return rule


def _validation_columns(bench: Bench, data_dir: str | None,
                        extra: tuple[str, ...] = ()) -> tuple[str, dict[str, np.ndarray]]:
    """(decoding mode, the validation split of ``data_dir`` with one draw per position, as the replay reads: argmax
    draws for greedy decoding, sampled ones for sampling), ``extra`` columns included when present."""
    assert data_dir is not None
    mode = bench.decoding.mode
    cols = load_columns(data_dir, splits=["val"], extra_columns=extra)
    mask = draw_mask(cols, "greedy" if mode == "greedy" else "sample")
    return mode, subset(cols, mask) if mask is not None else cols


def tune_predictors(specs: Sequence[str], bench: Bench, data_dir: str) -> dict[str, tuple[Any, str, dict[str, Any]]]:
    """Thresholded learned predictors (export folders, registry refs) -> (policy at the threshold that replays fastest
    on the validation split under the bench's cost model, label, how to rebuild it), as :func:`tune_on_validation`
    tunes the training-free ones (an approximate policy as if every drafted token were verified, as the main job does:
    ``evaluation.replay.tune_threshold``). Cost-aware and transformers rows have no threshold and are left out."""
    cm, d = bench.cost_model, bench.decoding
    assert cm is not None
    pols = {}
    for spec in specs:
        if spec.startswith(("hfp:", "goodput:")):
            continue
        pol = build_policy(spec, draft=bench.draft, draft_tokenizer=bench.tokenizer, max_draft_len=d.max_draft_len,
                           force=d.force)
        if pol.has_threshold and pol.round_rule.sends_all and not pol.round_rule.hindsight:
            pols[spec] = pol
    if not pols:
        return {}
    extra = tuple(sorted({c for p in pols.values() for c in p.required_columns}))
    mode, cols = _validation_columns(bench, data_dir, extra)
    out: dict[str, tuple[Any, str, dict[str, Any]]] = {}
    for spec, pol in pols.items():
        miss = missing_columns(pol, cols)
        if miss:
            log.warning("%s keeps its export's threshold %.4g: the validation data in %s lacks %s", spec,
                        pol.threshold, data_dir, miss)
            continue
        thr, sp = tune_threshold(pol, cols, cm, split=None, mode=mode)
        log.info("%s tuned on val under this run's curve: threshold %.4g (export's %.4g; replayed speedup %.2f)",
                 spec, thr, pol.threshold, sp)
        base = policy_label(spec, pol)
        label = f"{base[:-1]}, val-tuned {thr:.3g})" if base.endswith(")") else f"{base} (val-tuned {thr:.3g})"
        out[spec] = (with_threshold(pol, thr), label, {"spec": spec, "threshold": thr})
    return out
