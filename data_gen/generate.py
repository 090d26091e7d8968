"""Generate labelled draft tokens: prompts -> mixed-origin prefixes -> draft rollouts -> one-pass labels -> shards.

This module loads the models, checks the folder and runs a rank's chunks (config in ``config``, planning in
``planning``, one chunk in ``chunk``); :func:`generate` runs it on one process or on Fabric ranks, :func:`ensure_data`
is the main job's data stage. The origins and the record: docs/methods.md.

Usage: python -m pipelines.generate --config configs/smoke.yaml
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import datasets
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from compute import kernels
from compute.compute_path import (
    gemm_resume_hint,
    precision_diffs,
    precision_option,
    use_row_invariant_attention,
)
from compute.draft_stats import native_available
from compute.models import check_same_tokenizer, load_model, model_fingerprint, share_truncated_layers
from compute.timing import measure_cost_model, read_bandwidth
from data_gen.batch_sizing import (
    fitting,
    host_read_bandwidth,
    read_bandwidth_note,
    record_gen_batch,
    recorded_gen_batch,
    resolve_gen_batch,
)
from data_gen.chunk import ChunkStats, cut_to_budget, origin_cost, produce_chunk
from data_gen.config import GenerateConfig, ModelsConfig
from data_gen.folders import check_same_config
from data_gen.labelling import LabelModels
from data_gen.planning import rng_for
from data_gen.progress import ChainProgress, Stage, plural
from data_gen.prompts import load_prompts, render_prompt
from data_gen.schema import features_schema
from data_gen.shards import (
    SHARD_GLOB,
    ShardWriter,
    config_fingerprint,
    finished_chunks,
    is_complete,
    mark_complete,
    prepare_out_dir,
    read_data_config,
    summarize,
    wait_for_out_dir,
)

log = logging.getLogger(__name__)

Progress = Callable[[dict], None]
"""The main job's progress view: called with one event dict (keys in :func:`run_generation`)."""


def load_models(cfg: GenerateConfig, device: str | None = None) -> tuple[LabelModels, PreTrainedTokenizerBase]:
    """Load draft, target and companion of ``cfg.models`` (on ``device`` if given) and check they share a tokenizer."""
    mc = dataclasses.replace(cfg.models, device=device or cfg.models.device)
    if mc.device == "cpu" and mc.compute != "eager":
        kernels.prebuild()  # the native kernels build in background threads while the weights convert and load
    draft, tok = load_model(mc.spec(mc.draft, "draft"))
    target, ttok = load_model(mc.spec(mc.target))
    toks = {f"draft ({mc.draft})": tok, f"target ({mc.target})": ttok}
    mods = {f"draft ({mc.draft})": draft, f"target ({mc.target})": target}
    companion = None
    if mc.companion:
        companion, ctok = load_model(mc.spec(mc.companion, "companion"))
        toks[f"companion ({mc.companion})"] = ctok
        mods[f"companion ({mc.companion})"] = companion
    check_same_tokenizer(toks, mods)
    if companion is not None and (depth := share_truncated_layers(companion, draft)):
        log.info("companion %s: the draft's first %d layers (shared; its states come from the draft's passes)",
                 mc.companion, depth)
    if next(draft.parameters()).device.type == "cpu":
        native_available()  # build / load the native statistics with the models, not inside the first shard's timing
    return LabelModels(draft, target, companion), tok


def load_pair(draft: str, target: str, **settings: Any) -> tuple[PreTrainedModel, PreTrainedModel,
                                                                  PreTrainedTokenizerBase]:
    """Draft, target and their tokenizer loaded as the main job loads them (int8 draft weights and bf16 heads on
    packed-bf16), so an exported predictor runs on the precision it was trained on.

    Usage::

        draft, target, tok = load_pair("packaged:qwen2.5-coder-0.5b-instruct", "packaged:qwen2.5-coder-1.5b-instruct")
    """
    fields = {f.name for f in dataclasses.fields(ModelsConfig)} - {"draft", "target", "companion"}
    unknown = sorted(set(settings) - fields)
    if unknown:
        raise ValueError(f"load_pair: unknown setting {', '.join(unknown)}; use ModelsConfig fields: "
                         f"{', '.join(sorted(fields))}")
    models = ModelsConfig(draft=draft, target=target, **settings)
    loaded, tok = load_models(GenerateConfig(models=models))
    return loaded.draft, loaded.target, tok


def attention_for_labelling(models: LabelModels) -> None:
    """Run the generator's models on SDPA, which is faster on long teacher-forced passes; labels need no batch
    invariance (call it after measuring the cost model, which must run as decoding does)."""
    for model in (models.draft, models.target, models.companion):
        if model is not None:
            use_row_invariant_attention(model, False)


def check_same_precision(out_dir: Path, fingerprints: dict[str, dict]) -> None:
    """Refuse to add shards labelled at another precision (compute path, head dtype, pack layout, GEMM, weights) than
    the folder's, so no folder mixes two (``compute: auto`` may resolve differently on two hosts)."""
    stored = read_data_config(out_dir)
    if stored is None or not any(out_dir.glob("shard-*.parquet")):
        return
    old = stored.get("resolved", {}).get("fingerprints", {})
    value = {"compute_path": lambda was: was,  # the option's value that computes as the folder's data did
             "head_dtype": lambda was: str(was != "float32").lower(),
             "pack_layout": lambda was: str(was == "fused").lower(),
             "gemm": lambda was: str(was == "specstop").lower(),
             "weights": lambda was: str(was == "int8").lower()}
    for role, fp in fingerprints.items():
        diffs = precision_diffs(old.get(role, {}), fp)
        for key in value:  # dtype has its own config check
            if key in diffs:
                was, now = diffs[key]
                if key == "head_dtype" and "float32" not in (was, now):  # both bf16: rounded logits, or fp32 sums
                    fix = "--models.native_gemm false gives rounded bf16 logits, fp32 sums need specstop's kernel"
                elif key == "gemm" and gemm_resume_hint(was, now):  # another ISA of specstop's kernel
                    fix = str(gemm_resume_hint(was, now))
                else:
                    opt = precision_option(key, role)
                    fix = f"pass {opt} {value[key](was)} (in the main job: --data.{opt[2:]}) to resume it"
                raise FileExistsError(
                    f"{out_dir} was labelled with the {role} at {key} {was!r}, this run computes it at {now!r}: {fix}, "
                    f"or use another out_dir"
                )



def run_generation(cfg: GenerateConfig, rank: int = 0, world_size: int = 1, device: str | None = None,
                   progress: Progress | None = None) -> dict:
    """Generate (or resume) the shards of ``cfg.out_dir``; returns the summary (rank 0) or this rank's counts.

    Each rank takes the chunks congruent to its rank and an even share of the budget. ``progress`` replaces the bar: it
    gets a dict after each shard (``chunk``, ``chunks``, ``records``, ``have``, ``budget``, ``new_records``,
    ``seconds``) and, with the key ``in_shard``, after each batch inside a shard (with its ``phase``).
    """
    out_dir = Path(cfg.out_dir)
    models, tok = load_models(cfg, device)
    prompts, rendered, prompt_stats, truncated = _ordered_prompts(cfg, tok)
    recorded = recorded_gen_batch(out_dir, cfg.data_config())  # before the run rewrites the folder's config.json
    fingerprints, features = _prepare_folder(cfg, models, tok, out_dir, rank)
    attention_for_labelling(models)
    cfg = _sized(cfg, models, recorded, out_dir, rank)
    writer = ShardWriter(out_dir, features)
    per_shard = cfg.prompts_per_shard
    chunks = [list(range(i, min(i + per_shard, len(prompts)))) for i in range(0, len(prompts), per_shard)]
    done = finished_chunks(out_dir, owns=lambda c: c % world_size == rank)  # never another rank's partial shard
    run = _RankRun.start(cfg, len(chunks), done, rank, world_size, progress)
    per_position = 2 if cfg.sample_draw else 1  # records of one labelled position (the budget keeps whole positions)
    for c in range(rank, len(chunks), world_size):
        if run.budget is not None and run.budget - run.have < per_position:
            break
        if c in done:
            continue
        t_chunk = time.perf_counter()
        shard = functools.partial(_shard, models=models, tok=tok, prompts=prompts, rendered=rendered,
                                  indices=chunks[c], chunk=c, on_step=run.in_shard(c))
        (records, st), fit = fitting(cfg, shard, f"shard {c}")
        if fit is not cfg:  # lowered after an allocation failure: the later shards keep the smaller batch
            cfg = fit
            if rank == 0:
                record_gen_batch(out_dir, cfg.gen_batch_size)
        if records:
            run.write(writer, c, records, st, t_chunk)
    run.bar.close()
    elapsed = time.perf_counter() - run.t_start
    run_stats = {
        "rank": rank,
        "gen_batch_size": cfg.gen_batch_size,
        "new_records": run.new_records,
        "seconds": elapsed,
        "labelled_tokens_per_s": run.new_records / elapsed if elapsed > 0 else 0.0,
        "prompts": prompt_stats,
        "truncated_prompts": truncated,
        "text_fallbacks": run.totals.text_fallbacks,
        "origin_cost": origin_cost(run.totals),
    }
    if rank != 0:
        return run_stats
    summary = summarize(out_dir, {"last_run": run_stats, "fingerprints": fingerprints})
    log.info("labelled %d new records in %.0fs (%.1f records/s); total %d", run.new_records, elapsed,
             run_stats["labelled_tokens_per_s"], summary["overall"]["records"])
    return summary


def _shard(cfg: GenerateConfig, *, models: LabelModels, tok: PreTrainedTokenizerBase, prompts: list,
           rendered: list[list[int]], indices: list[int], chunk: int,
           on_step: Callable[[str, int], None] | None) -> tuple[dict[str, list], ChunkStats]:
    """One chunk's records at ``cfg``'s batch sizes (what :func:`data_gen.batch_sizing.fitting` retries smaller)."""
    return produce_chunk(cfg, models, tok, prompts, rendered, indices, chunk, on_step=on_step)


def _sized(cfg: GenerateConfig, models: LabelModels, recorded: int | None, out_dir: Path,
           rank: int) -> GenerateConfig:
    """``cfg`` with the rollout batch resolved (the folder's recorded value, else this host's step curve) and recorded;
    says in one line when memory sets the pace."""
    sized = resolve_gen_batch(cfg, models, recorded)
    if rank != 0:
        return sized
    record_gen_batch(out_dir, int(sized.gen_batch_size))
    if next(models.draft.parameters()).device.type == "cpu":
        note = read_bandwidth_note(host_read_bandwidth(out_dir, lambda: read_bandwidth(mib=256, repeats=3)))
        if note:
            log.warning("%s", note)
    return sized


def _ordered_prompts(cfg: GenerateConfig, tok: PreTrainedTokenizerBase) -> tuple[list, list[list[int]], dict, int]:
    """(prompts in the run's seeded order, their token ids, the sources' stats, how many were left-truncated)."""
    prompts, prompt_stats = load_prompts(cfg.prompts, seed=cfg.seed)
    if not prompts:
        raise ValueError(f"no usable prompts from {[p.name for p in cfg.prompts]} (stats: {prompt_stats})")
    order = rng_for(cfg.seed, "prompt-order").permutation(len(prompts))
    prompts = [prompts[i] for i in order]
    rendered, truncated = [], 0
    for p in prompts:
        ids, cut = render_prompt(p, tok, cfg.use_chat_template, cfg.max_prompt_tokens)
        rendered.append(ids)
        truncated += int(cut)
    if truncated:
        log.warning("%d prompts longer than max_prompt_tokens=%d were left-truncated", truncated, cfg.max_prompt_tokens)
    return prompts, rendered, prompt_stats, truncated


def _prepare_folder(cfg: GenerateConfig, models: LabelModels, tok: PreTrainedTokenizerBase, out_dir: Path,
                    rank: int) -> tuple[dict[str, dict], datasets.Features]:
    """Check and prepare ``out_dir`` (rank 0 creates it, the others wait) and measure its cost model once; returns the
    models' fingerprints and the shards' schema."""
    resolved = dataclasses.asdict(cfg)
    fingerprints = {"draft": model_fingerprint(models.draft, tok), "target": model_fingerprint(models.target, tok)}
    if models.companion is not None:
        fingerprints["companion"] = model_fingerprint(models.companion, tok)
    check_same_precision(out_dir, fingerprints)
    if rank == 0:
        prepare_out_dir(out_dir, cfg.data_config(), {**resolved, "fingerprints": fingerprints}, cfg.overwrite)
    else:  # the other ranks write only into the folder rank 0 has created and checked
        wait_for_out_dir(out_dir, cfg.data_config())
    features = features_schema(
        cfg.top_k, models.draft.config.hidden_size if cfg.store_hidden else None, models.companion is not None
    )
    if rank == 0 and cfg.measure_costs and not (out_dir / "cost_model.json").exists():
        # first, so that an interrupted run still leaves the replay its cost model (the data's speedup model)
        measure_cost_model(models.draft, models.target, models.companion).to_json(out_dir / "cost_model.json")
    return fingerprints, features


@dataclass
class _RankRun:
    """One rank's pass over its chunks: the budget, the records written, the progress shown."""

    rank: int
    chunks: int
    budget: int | None
    have: int
    """Records of this rank in the folder (finished shards included)."""
    progress: Progress | None
    bar: tqdm
    new_records: int = 0
    totals: ChunkStats = field(default_factory=ChunkStats)
    t_start: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, cfg: GenerateConfig, chunks: int, done: dict[int, int], rank: int, world_size: int,
              progress: Progress | None) -> _RankRun:
        budget = None
        if cfg.max_records is not None:  # split evenly, the first ranks one more
            budget = cfg.max_records // world_size + (rank < cfg.max_records % world_size)
        have = sum(n for c, n in done.items() if c % world_size == rank)
        bar = tqdm(total=budget, initial=min(have, budget or have), unit="tok", desc=f"labelling (rank {rank})",
                   disable=True if progress else None)
        return cls(rank, chunks, budget, have, progress, bar)

    def in_shard(self, c: int) -> Callable[[str, int], None] | None:
        """The in-shard callback of chunk ``c`` for ``produce_chunk`` (None without a progress view)."""
        return functools.partial(self._report_in_shard, c) if self.progress else None

    def _report_in_shard(self, c: int, phase: str, records: int) -> None:
        assert self.progress is not None
        self.progress({"chunk": c, "chunks": self.chunks, "in_shard": records, "phase": phase,
                       "have": self.have + records, "budget": self.budget, "new_records": self.new_records + records,
                       "seconds": time.perf_counter() - self.t_start})

    def write(self, writer: ShardWriter, c: int, records: dict[str, list], st: ChunkStats, t_chunk: float) -> None:
        """Write chunk ``c``'s records as its shard (cut to the budget left), count them and report the shard."""
        n = labelled = len(records["draft_token"])
        if self.budget is not None and self.have + n > self.budget:
            records = cut_to_budget(records, self.budget - self.have)
            n = len(records["draft_token"])
            st.records_by_origin = Counter(records["origin"])  # kept records; the seconds were spent on all
        writer.write(c, records, cost={"records": n, "dropped_by_budget": labelled - n,
                                       "wall_s": round(time.perf_counter() - t_chunk, 3), "rank": self.rank,
                                       "origin": origin_cost(st),
                                       "label_s_by_model": {m: round(v, 3) for m, v in st.label_seconds.items()}})
        self.have += n
        self.new_records += n
        for o, k in st.records_by_origin.items():
            self.totals.records_by_origin[o] += k
            self.totals.gen_seconds_by_origin[o] += st.gen_seconds_by_origin[o]
            self.totals.gen_tokens_by_origin[o] += st.gen_tokens_by_origin[o]
            self.totals.label_seconds_by_origin[o] += st.label_seconds_by_origin[o]
        self.totals.text_fallbacks += st.text_fallbacks
        self._report_shard(c, n)

    def _report_shard(self, c: int, n: int) -> None:
        elapsed = time.perf_counter() - self.t_start
        rate = self.new_records / elapsed
        self.bar.update(n)
        self.bar.set_postfix(rec_s=f"{rate:.1f}", chunk=f"{c + 1}/{self.chunks}")
        budget = self.budget
        eta = f", ETA {(budget - self.have) / rate / 60:.0f} min" if budget is not None and rate > 0 else ""
        log.info("shard %d: %d records (%d/%s labelled, %.1f records/s%s)", c, n, self.have, budget or "all", rate, eta)
        if self.progress:
            self.progress({"chunk": c, "chunks": self.chunks, "records": n, "have": self.have, "budget": budget,
                           "new_records": self.new_records, "seconds": elapsed})


def _fabric_worker(fabric, cfg: GenerateConfig) -> dict:
    device = str(fabric.device) if cfg.accelerator != "cpu" else "cpu"
    return run_generation(cfg, rank=fabric.global_rank, world_size=fabric.world_size, device=device)


def generate(cfg: GenerateConfig, progress: Callable[[dict], None] | None = None) -> dict:
    """Run generation on one process, or on ``cfg.devices`` x ``cfg.num_nodes`` Fabric ranks, each writing its own
    shards (rank 0 summarises); ``progress`` is used on one process only."""
    if cfg.devices * cfg.num_nodes <= 1:
        return run_generation(cfg, progress=progress)
    from lightning_fabric import Fabric  # heavy: only a multi-process run needs it

    fabric = Fabric(accelerator=cfg.accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, strategy="ddp_spawn")
    fabric.launch(_fabric_worker, cfg)
    # Every rank has written its shards; summarise once over all of them (resume skips every finished chunk).
    return run_generation(replace(cfg, devices=1, num_nodes=1))


def ensure_data(gens: Iterable[GenerateConfig], generate_if_missing: bool, chain: ChainProgress,
                st: Stage) -> list[Path]:
    """The data folders of ``gens``, each generated or resumed when short; the stage's summary says what was done.

    A folder already complete for the same config and budget is left alone without loading a model; unreadable shards
    are moved aside; a folder made by another data config is refused, and without ``generate_if_missing`` so is an empty
    one.
    """
    dirs, todo, have_by_dir = [], [], {}
    for gen in gens:
        data_dir = Path(gen.out_dir)
        have = sum(finished_chunks(data_dir).values()) if data_dir.exists() else 0
        fp = config_fingerprint(gen.data_config())
        if generate_if_missing:
            check_same_config(data_dir, gen, fp)
        done = (have and is_complete(data_dir, fp, gen.max_records)) or (
            gen.max_records is not None and have >= gen.max_records)
        if not done and generate_if_missing:
            todo.append((gen, fp))
        elif have == 0:
            raise FileNotFoundError(
                f"no shards ({SHARD_GLOB}) in {data_dir}; run python -m pipelines.generate "
                "or pass --generate_if_missing true"
            )
        dirs.append(data_dir)
        have_by_dir[data_dir] = have
    before = sum(have_by_dir.values())
    if not todo:
        st.reused = True
        st.summary = f"{before:,} records in {plural(len(dirs), 'folder')} reused, nothing to generate"
        return dirs
    _generate_missing(todo, have_by_dir, chain)
    after = sum(sum(finished_chunks(d).values()) for d in dirs)
    st.records, st.resumed = after - before, before > 0
    st.summary = f"{after - before:,} records" + (f" ({after:,} in {plural(len(dirs), 'folder')})" if before else "")
    return dirs


def _generate_missing(todo: list[tuple[GenerateConfig, str]], have_by_dir: dict[Path, int],
                      chain: ChainProgress) -> None:
    """Generate (or resume) each short folder under one progress meter, and mark it complete."""
    budgets = [gen.max_records for gen, _ in todo]
    if None in budgets:
        remaining = None
    else:
        remaining = sum(max(0, b - have_by_dir[Path(g.out_dir)]) for (g, _), b in zip(todo, budgets))
    meter = chain.generation(remaining)
    for gen, fp in todo:
        data_dir = Path(gen.out_dir)
        log.info("data folder %s has %d records (budget %s): generating (resumes finished shards)", data_dir,
                 have_by_dir[data_dir], "all prompts" if gen.max_records is None else f"{gen.max_records:,}")
        generate(gen, progress=meter.folder())
        mark_complete(data_dir, fp, gen.max_records)
