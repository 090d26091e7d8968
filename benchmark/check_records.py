"""The replay check's records: the benchmark's prompts labelled along target-only's output with the data generator's
code (``data_gen.continuation_labels.label_continuation``: teacher-forced records of origin ``target``, and in greedy
mode the draft's rollouts from every branch point), an approximate row's along its own output
(:func:`own_output_rows`), each kept in the benchmark's folder for a later check with the same inputs
(:func:`labelled_records`)."""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import time
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from benchmark.check_inputs import BenchFolder
from compute.models import load_model
from data_gen.config import ModelsConfig
from data_gen.continuation_labels import label_continuation
from data_gen.labelling import LabelModels, LabelOptions
from predictors.base import StopPolicy

log = logging.getLogger("pipelines.replay_check")


RECORDS = "replay_check_records.npz"
"""The labelled records of a check, kept in the benchmark's folder: a second check (another statistic) reuses them."""


def label_prompts(folder: BenchFolder, models: LabelModels, opts: LabelOptions, rollout_len: int,
                  gen_batch_size: int = 8, label_batch_tokens: int = 4096, outputs: list[list[int]] | None = None,
                  what: str = "target-only's output") -> tuple[dict[str, np.ndarray], int]:
    """Records along each prompt's target-only output (``outputs``: another row's, labelled without rollouts) and the
    draft's rollouts from its branch points (greedy mode), logging each prompt with an ETA; returns (columns,
    rollouts)."""
    branches = outputs is None and folder.mode == "greedy"
    outputs = folder.continuations if outputs is None else outputs
    todo = [(i, ids, c) for i, (ids, c) in enumerate(zip(folder.prompts, outputs)) if c]
    total, done_tokens, rollouts = sum(len(c) for _, _, c in todo), 0, 0
    gen = torch.Generator().manual_seed(folder.decoding.seed)
    parts: list[dict[str, list]] = []
    t0 = time.perf_counter()
    for k, (i, ids, cont) in enumerate(todo):
        name = folder.names[i] if i < len(folder.names) else str(i)
        recs, st = label_continuation(models, ids, cont, opts, sample_id=f"{i}:{name}", rollout_len=rollout_len,
                                      branches=branches, source="benchmark",
                                      gen_batch_size=gen_batch_size, label_batch_tokens=label_batch_tokens,
                                      generator=gen)
        parts.append(recs)
        done_tokens += len(cont)
        rollouts += st.rollouts
        spent = time.perf_counter() - t0
        log.info("replay check: labelled prompt %d/%d along %s (%d positions, %d draft rollouts, %d records) in "
                 "%.0fs; ETA %.0fs", k + 1, len(todo), what, len(cont), st.rollouts, st.records, spent,
                 spent / done_tokens * (total - done_tokens))
    if not parts:
        raise ValueError(f"{folder.path / 'benchmark.json'}: {what} is empty for every prompt: nothing to replay")
    columns = {k: np.asarray(list(itertools.chain.from_iterable(p[k] for p in parts))) for k in parts[0]}
    return columns, rollouts


def own_output_rows(folder: BenchFolder, policies: list[tuple[dict[str, Any], StopPolicy | None, str]],
                    models: LabelModels, opts: LabelOptions, gen_batch_size: int = 8, label_batch_tokens: int = 4096
                    ) -> dict[str, dict[str, np.ndarray]]:
    """Row name -> records along that row's own output, for the approximate rows (``SEQUENTIAL``, SPRINTER) of a
    greedy benchmark: the engine takes a round's drafts unverified, so its output leaves target-only's at the first
    mismatch it takes, and every round it drafts reads a prefix of its own output: the drafted tokens are that output's
    tokens, and a round's checked last token is the output's token there (the bonus) or the draft's, replaced by the
    target's (the correction). Labelled teacher-forced along the output (no rollouts), the replay follows the engine's
    rounds exactly. Cached in the folder like the main records."""
    if folder.mode != "greedy":
        return {}
    out: dict[str, dict[str, np.ndarray]] = {}
    for row, pol, _ in policies:
        outputs = row.get("output_ids")
        if pol is None or pol.exact or not outputs:
            continue
        out[row["row"]] = labelled_records(folder, models, opts, 0, gen_batch_size, label_batch_tokens, outputs,
                                           f"{row['row']}'s output",
                                           f"replay_check_records-{_slug(row['row'])}.npz")[0]
    return out


def labelled_records(folder: BenchFolder, models: LabelModels, opts: LabelOptions, rollout_len: int,
                     gen_batch_size: int = 8, label_batch_tokens: int = 4096, outputs: list[list[int]] | None = None,
                     what: str = "target-only's output", name: str = RECORDS) -> tuple[dict[str, np.ndarray], int]:
    """(columns, rollouts) of :func:`label_prompts` along target-only's output (``outputs``: another row's, named
    ``what`` in the log), read from the folder's file ``name`` when it holds them for the same inputs, else labelled
    and stored there."""
    cached = _cached_records(folder, opts, rollout_len, models, name, outputs)
    if cached is not None:
        return cached
    columns, rollouts = label_prompts(folder, models, opts, rollout_len, gen_batch_size, label_batch_tokens, outputs,
                                      what)
    _store_records(folder, opts, rollout_len, models, columns, rollouts, name, outputs)
    return columns, rollouts


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def _records_key(folder: BenchFolder, opts: LabelOptions, rollout_len: int, models: LabelModels,
                 outputs: list[list[int]] | None = None) -> str:
    """What the labelled records depend on: the prompts, the outputs labelled (target-only's), the options and the
    models."""
    names = [str(getattr(m.config, "name_or_path", "")) for m in (models.draft, models.target, models.companion)
             if m is not None]
    blob = json.dumps([folder.prompts, folder.continuations if outputs is None else outputs, rollout_len, repr(opts),
                       names], default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _cached_records(folder: BenchFolder, opts: LabelOptions, rollout_len: int, models: LabelModels,
                    name: str = RECORDS, outputs: list[list[int]] | None = None
                    ) -> tuple[dict[str, np.ndarray], int] | None:
    path = folder.path / name
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as z:
        if str(z["_key"]) != _records_key(folder, opts, rollout_len, models, outputs):
            return None
        log.info("replay check: reusing the labelled records in %s", path)
        return {k: z[k] for k in z.files if not k.startswith("_")}, int(z["_rollouts"])


def _store_records(folder: BenchFolder, opts: LabelOptions, rollout_len: int, models: LabelModels,
                   columns: dict[str, np.ndarray], rollouts: int, name: str = RECORDS,
                   outputs: list[list[int]] | None = None) -> None:
    arrays = {k: (v.astype(str) if v.dtype == object else v) for k, v in columns.items()}  # strings without pickle
    tmp = folder.path / (name + ".tmp.npz")
    np.savez(tmp, _key=_records_key(folder, opts, rollout_len, models, outputs), _rollouts=rollouts, **arrays)
    tmp.replace(folder.path / name)  # nothing half-written


def load_companion(models: ModelsConfig) -> PreTrainedModel | None:
    """The benchmark's companion model (None when it names none)."""
    if not models.companion:
        return None  # the engine refused such rows too: they are reported as not replayed
    return load_model(models.spec(models.companion, "companion"))[0]
