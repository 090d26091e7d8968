"""Does the replay predict llama.cpp? The llama.cpp benchmark's prompts labelled along llama.cpp target-only's output
with llama.cpp's own logits, every speculative row's policy replayed on those records under llama.cpp's curve, and
each row's predicted tokens/s set beside the measured one (the ``replay_check`` section of the llama.cpp report).

The labelling is the data generator's (``benchmark.check_records.labelled_records``: teacher-forced along
the output, plus the draft's greedy rollout from every point where its token leaves it), run on the GGUF models
through ``runtimes.llamacpp.causal_lm.LlamaCausalLM``: the draft loaded once more with ``logits_all`` (the benchmark's
draft keeps the last position's logits only), the benchmark's ``logits_all`` target as it is. The prediction and the
band are the engine check's (``benchmark.check``): the replay's seconds per token under the curve plus each
row's measured prompt pass. Target-only is predicted as one target step t(1) a token plus its prompt pass.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from benchmark.bench import Bench
from benchmark.check import compare_row, predicted_tokens_per_s, replay_rows, summarize, summary_line
from benchmark.check_inputs import BenchFolder, rollout_length
from benchmark.check_records import labelled_records
from data_gen.config import ModelsConfig
from data_gen.labelling import LabelModels, LabelOptions
from predictors.base import StopPolicy
from runtimes.llamacpp.causal_lm import LlamaCausalLM
from runtimes.llamacpp.llama import load_llama

log = logging.getLogger("pipelines.replay_check")

RECORDS = "llamacpp_replay_records.npz"
"""The labelled records, kept in the report's folder: a second check on the same outputs reuses them."""


def target_only_check(row: dict[str, Any], folder: BenchFolder) -> dict[str, Any]:
    """The target-only row against the curve: a target step t(1) per token plus its measured prompt pass."""
    out = compare_row(row, None, "", folder.cost_model)
    measured = row.get("tokens_per_s") or 0.0
    predicted = predicted_tokens_per_s(row, folder.cost_model.target_time(1))
    out.update(predicted_tokens_per_s=round(predicted, 3), predicted_speedup=1.0,
               ratio=round(predicted / measured, 4) if measured > 0 else None)
    return out


def run_llamacpp_check(bench: Bench, models_cfg: ModelsConfig, table: list[dict[str, Any]],
                       policies: dict[str, StopPolicy], continuations: list[list[int]], names: list[str],
                       out_dir: Path) -> dict[str, Any]:
    """Label the prompts with llama.cpp (``models_cfg``: the benchmark's models), replay each row of ``table`` whose
    policy ``policies`` holds (by row name), compare; returns the ``replay_check`` section (rows, summary, records,
    seconds; the caller names its curve)."""
    t0 = time.perf_counter()
    m, cfg, cm = bench.shared["llamacpp"], bench.decoding, bench.cost_model
    assert cm is not None
    folder = BenchFolder(out_dir, cfg, models_cfg, table, names, bench.prompts, continuations, cm)
    draft = load_llama(m.paths["draft"], m.threads, int(m.target.n_ctx()), logits_all=True)
    models = LabelModels(LlamaCausalLM(draft), LlamaCausalLM(m.target))  # type: ignore[arg-type]
    pad = bench.tokenizer.pad_token_id if bench.tokenizer.pad_token_id is not None else bench.tokenizer.eos_token_id
    opts = LabelOptions(top_k=cfg.top_k_features, store_hidden=False, temperature=0.0, pad_token_id=int(pad or 0),
                        min_shared_prefix=0)  # one sequence a pass: llama.cpp's cache keeps the shared prefix
    rollout_len = rollout_length(list(policies.values()), cfg.max_draft_len)
    columns, rollouts = labelled_records(folder, models, opts, rollout_len, gen_batch_size=1, label_batch_tokens=1,
                                         name=RECORDS)
    del draft
    replayed = [(row, policies[row["row"]], "") for row in table if row["row"] in policies]
    rows, note = replay_rows(folder, replayed, columns)
    rows.insert(0, target_only_check(table[0], folder))
    summary = summarize(rows)
    log.info(summary_line(summary))
    return {"mode": "greedy", "rows": rows, "summary": summary, "data": note, "records": len(columns["offset"]),
            "rollouts": rollouts, "rollout_len": rollout_len, "seconds": round(time.perf_counter() - t0, 1)}


def check_lines(check: dict[str, Any]) -> list[str]:
    """The check as markdown: a table of predicted against measured tokens/s, then its summary line."""
    md = ["\n## Replay check\n",
          "predicted = the replay of each row's policy on the prompts labelled with llama.cpp's logits, priced by "
          "llama.cpp's curve, plus the row's measured prompt pass; ratio = predicted / measured.\n",
          "| row | measured tokens/s | predicted tokens/s | ratio | accepted / round measured | replayed | "
          "draft ms measured | curve |",
          "|---|---|---|---|---|---|---|---|"]
    for r in check["rows"]:
        cells = [r["row"], r["measured_tokens_per_s"], r["predicted_tokens_per_s"], r["ratio"],
                 r["measured_mean_accepted"], r["predicted_mean_accepted"], r.get("measured_draft_ms"),
                 r.get("curve_draft_ms")]
        md.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    md.append(f"\n{summary_line(check['summary'])}")
    return md
