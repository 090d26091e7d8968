"""The benchmark's llama.cpp rows (``python -m pipelines.llamacpp_bench``): side by side on the same prompts, greedy,
on the pair's GGUF files through llama-cpp-python:

- ``llama.cpp target-only``: ``Llama.generate`` with no draft model (the reference output and speed);
- ``llamacpp:3,0,0.0 (default)``: llama.cpp's speculative decoding at its defaults, its draft-simple rule
  (``predictors.runtime_rules.LlamaCppRule``) in the draft hook (``runtimes.llamacpp.draft``);
- with ``recommend_data``, the setting ``pipelines.recommend --runtime llamacpp`` tunes under this run's curve
  (``... (tuned)``); the recommended row is it, or target-only when it cannot beat target-only;
- every ``settings`` entry (``llamacpp:N_MAX,N_MIN,P_MIN``);
- every ``policies`` entry: a specstop policy (``decoding.policies.build_policy`` specs: ``adaedl:0.6``, an export
  folder, ``goodput:<export>``) stopping the same hook's drafts.

Every speculative row keeps llama.cpp's own verification. The prompts are rendered by the pair's transformers
tokenizer (``data_gen.prompts``, as ``pipelines.benchmark`` does) and handed to llama.cpp as token ids, so both
runtimes read the same ids. The rows run through the benchmark's own loop (``benchmark.plan.run_rows``:
``order: prompt``, each row ``repeats`` times a prompt in a seeded shuffled order, pass-adjusted, the outputs checked
equal), and are reported with its rows, intervals and tables (``benchmark.rows``, ``report``): tokens/s,
speedup over target-only with its paired bootstrap interval, identical outputs, rounds and acceptance, the hook's
stop-decision cost; then each row against llama.cpp's defaults and each policy against the recommended row. The
replay check (``replay_check``, ``runtimes.llamacpp.replay_check``) sets each row's replayed tokens/s beside it.

Models loaded: the draft, the target with ``logits_all`` (llama-cpp-python's verification reads every position's
logits) and the target again without it for target-only (its one-token steps, as llama.cpp decodes alone); the GGUF
weights are memory-mapped once. torch runs the hook's per-token feature work on one thread, leaving the cores to
llama.cpp's threads.
"""
from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmark.bench import Bench, DecodeSettings, RunOrder, load_benchmark_prompts
from benchmark.config import BenchmarkConfig, HarnessConfig
from benchmark.plan import Runner, run_rows
from benchmark.records import bootstrap_indices
from benchmark.report import finish_rows, markdown_table
from benchmark.rows import Row, ratio_ci
from compute.code_version import new_run
from compute.cpu import cpuinfo_fields
from compute.gguf_files import ensure_gguf, gguf_stop_ids, gguf_tokenizer
from compute.timing import CostModel
from data_gen.config import ModelsConfig
from data_gen.shards import read_data_config
from decoding.policies import build_policy, policy_label
from decoding.stats import DecodeStats
from main_job.recommend import RecommendConfig, recommend_runtimes
from predictors.base import StopPolicy
from predictors.runtime_rules import LlamaCppRule
from runtimes.llamacpp.draft import SpecstopDraftModel, check_policy
from runtimes.llamacpp.llama import file_type, generate_greedy, load_llama, load_pair, measure_llamacpp_curve
from runtimes.llamacpp.replay_check import check_lines, run_llamacpp_check

log = logging.getLogger("pipelines.benchmark")

STATE = "llamacpp"
"""Key of the loaded llama.cpp models in ``Bench.shared`` (every per-prompt view of the bench shares them)."""
TARGET_ONLY = "llama.cpp target-only"
COST_FILE = "cost_model.llamacpp.json"
"""llama.cpp's curve in ``out_dir`` (the rows, the recommendation and the replay check are priced with it)."""
DEFAULT_SPEC = LlamaCppRule().spec()
"""llama.cpp's default draft-simple settings as a spec (n_max 3, n_min 0, p_min 0.0)."""


@dataclass
class LlamaCppBenchConfig(HarnessConfig):
    """What ``python -m pipelines.llamacpp_bench`` runs (the shared fields: ``benchmark.config.HarnessConfig``);
    configs/benchmark-llamacpp.yaml mirrors it."""

    out_dir: str = "outputs/benchmark-llamacpp"
    """Folder for benchmark.md / .json, cost_model.llamacpp.json and config.yaml (created)."""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    """models.draft / models.target: packaged:<name> (joined once into <cache_dir>/gguf) or .gguf paths; the
    tokenizer is the target's (transformers). The other fields are not used."""
    prompt_texts: list[str] | None = None
    """Plain prompt strings used instead of ``prompts``."""
    settings: list[str] = field(default_factory=list)
    """llama.cpp draft-simple settings to run beside its defaults: ``llamacpp:N_MAX,N_MIN,P_MIN``."""
    recommend_data: str | None = None
    """A data folder written by pipelines.generate (the main job's <out_dir>/data): llama.cpp's settings are tuned on
    its validation split under this run's curve (``pipelines.recommend --runtime llamacpp``) and the recommendation
    runs as a row; when it is not to speculate, target-only is the recommended row. None: no recommendation."""
    replay_check: bool = True
    """After the rows: label the prompts with llama.cpp's logits and set each row's replayed tokens/s beside the
    measured one (``runtimes.llamacpp.replay_check``)."""
    policies: list[str] = field(default_factory=lambda: ["adaedl:0.6"])
    """specstop policies stopping the draft inside llama.cpp (decoding.policies specs; threshold, goodput and prefix
    kinds; goodput ones price rounds with llama.cpp's curve)."""
    calibration_dir: str | None = None
    """Folder of calibrated training-free exports for ``goodput:<score name>`` (the main job's
    <out_dir>/train/calibrated)."""
    max_draft_len: int = 16
    """Cap on one round's drafts for the specstop policies (a llamacpp:N_MAX row drafts up to N_MAX)."""
    top_k_features: int = 10
    """Top-k draft probabilities in the features (match the predictors' training data)."""
    threads: int | None = None
    """llama.cpp's threads (default: torch's thread count)."""
    n_ctx: int = 0
    """Context of the llama.cpp models; 0: the longest prompt + max_new_tokens + drafts, at least 512."""
    order: str = "prompt"
    """prompt: every row on one prompt before the next (drift hits all rows alike); row: one row over all prompts."""
    warmup: bool = True
    """Decode a few tokens with every model before timing."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for spec in self.settings:
            if not spec.startswith("llamacpp:"):
                raise ValueError(f"settings: {spec!r} is not llamacpp:N_MAX,N_MIN,P_MIN (specstop policies go to "
                                 "policies)")
        if self.max_draft_len < 1 or self.n_ctx < 0:
            raise ValueError(f"max_draft_len={self.max_draft_len} must be >= 1 and n_ctx={self.n_ctx} >= 0")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads}: must be >= 1")
        self.benchmark_config()  # the shared checks (prompts, repeats, order, cost_file...)

    def benchmark_config(self) -> BenchmarkConfig:
        """The benchmark config its shared code reads (prompts, repeats, order, intervals): greedy, no torch rows."""
        return BenchmarkConfig(
            out_dir=self.out_dir, models=self.models, prompts=self.prompts, prompt_texts=self.prompt_texts,
            split=self.split, n_prompts=self.n_prompts, use_chat_template=self.use_chat_template,
            max_prompt_tokens=self.max_prompt_tokens, max_new_tokens=self.max_new_tokens, temperature=0.0,
            max_draft_len=self.max_draft_len, top_k_features=self.top_k_features, policies=[], hf_rows=[],
            reference_compute=None, order=self.order, repeats=self.repeats, cost_file=self.cost_file,
            n_boot=self.n_boot, curve_probes=False, resume=False, warmup=self.warmup, seed=self.seed, tracking=False)


@dataclass
class LlamaModels:
    """The loaded llama.cpp models and the hooks of the speculative rows (``Bench.shared[STATE]``)."""

    draft: Any
    target: Any
    """The target with ``logits_all`` (speculative rows)."""
    plain: Any
    """The target without it (target-only)."""
    paths: dict[str, Path]
    threads: int
    hooks: dict[str, SpecstopDraftModel] = field(default_factory=dict)
    specs: dict[str, str] = field(default_factory=dict)
    recommended: str | None = None
    """The row that runs the recommended settings (target-only's when the verdict is not to speculate)."""
    recommendation: list[str] = field(default_factory=list)
    """The recommendation's lines, as pipelines.recommend prints them."""
    policies: dict[str, StopPolicy] = field(default_factory=dict)
    """Each speculative row's policy as built, before its hook ran (the replay check replays these)."""


def row_policies(cfg: LlamaCppBenchConfig) -> list[tuple[str, str, StopPolicy]]:
    """(row name, spec, policy) of every speculative row, built and checked before any model loads."""
    out = []
    for spec in [DEFAULT_SPEC, *cfg.settings, *cfg.policies]:
        pol = build_policy(spec, max_draft_len=cfg.max_draft_len, calibration_dir=cfg.calibration_dir)
        check_policy(pol)
        name = spec if spec.startswith("llamacpp:") else policy_label(spec, pol)
        name = f"{name} (default)" if spec == DEFAULT_SPEC else name
        if name in [n for n, _, _ in out]:
            raise ValueError(f"row {name!r} is given twice (settings / policies)")
        out.append((name, spec, pol))
    return out


def load_llamacpp_bench(cfg: LlamaCppBenchConfig) -> tuple[Bench, list[str]]:
    """The prompts (the target's tokenizer), the llama.cpp models, the curve and one hook per speculative row."""
    rows = row_policies(cfg)
    if cfg.recommend_data is not None and read_data_config(cfg.recommend_data) is None:
        raise ValueError(f"recommend_data: {cfg.recommend_data} has no config.json; give the main job's data folder "
                         f"(python -m pipelines.train writes <out_dir>/data) or set recommend_data: null")
    tok = gguf_tokenizer(cfg.models.target, cfg.models.cache_dir)
    inner = cfg.benchmark_config()
    prompts, names, _ = load_benchmark_prompts(inner, tok)
    paths = {role: ensure_gguf(getattr(cfg.models, role), cfg.models.cache_dir) for role in ("draft", "target")}
    threads = cfg.threads or torch.get_num_threads()
    n_ctx = cfg.n_ctx or max(512, max(len(p) for p in prompts) + cfg.max_new_tokens + 2 * cfg.max_draft_len + 16)
    draft, target = load_pair(paths["draft"], paths["target"], threads, n_ctx)
    models = LlamaModels(draft, target, load_llama(paths["target"], threads, n_ctx), paths, threads)
    torch.set_num_threads(1)  # the hook's per-token feature work: one thread, the cores left to llama.cpp
    if cfg.cost_file:
        cost = CostModel.from_json(cfg.cost_file)
    else:
        log.info("measuring llama.cpp's curve (no cost_file given)")
        cost = measure_llamacpp_curve(draft, target, lengths=range(1, cfg.max_draft_len + 2), repeats=3,
                                      n_threads=threads, draft_name=cfg.models.draft, target_name=cfg.models.target)
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    cost.to_json(Path(cfg.out_dir) / COST_FILE)  # the curve the rows and the recommendation are priced with
    if cfg.recommend_data:
        rows += recommended_row(cfg, models, rows)
    for name, spec, pol in rows:
        models.policies[name] = copy.deepcopy(pol)
        models.hooks[name] = SpecstopDraftModel(draft, pol, cost_model=cost, max_draft_len=cfg.max_draft_len,
                                                top_k=cfg.top_k_features)
        models.specs[name] = spec
    eos = sorted(set(gguf_stop_ids(cfg.models.target, cfg.models.cache_dir, tok)) | {int(target.token_eos())})
    # no torch models: the rows hold llama.cpp's in ``shared``
    bench = Bench(DecodeSettings.of(inner), None, None, None, tok, prompts, eos, cost_model=cost,  # type: ignore[arg-type]
                  shared={STATE: models})
    return bench, names


def recommended_row(cfg: LlamaCppBenchConfig, models: LlamaModels,
                    rows: list[tuple[str, str, StopPolicy]]) -> list[tuple[str, str, StopPolicy]]:
    """llama.cpp's settings tuned on ``cfg.recommend_data``'s validation split under this run's curve (the
    ``out_dir``'s cost file, as ``pipelines.recommend --cost_file`` reads it): the row to add for the tuned setting
    (none when a row given runs it), which runs also when the verdict is not to speculate so that the verdict is
    measured; ``models.recommended`` names the recommended row: the tuned one, or target-only."""
    assert cfg.recommend_data is not None
    rcfg = RecommendConfig(data_dir=cfg.recommend_data, runtime="llamacpp",
                           cost_file=str(Path(cfg.out_dir) / COST_FILE), draft=str(models.paths["draft"]))
    rec = recommend_runtimes(rcfg)["llamacpp"]
    models.recommendation = rec.lines(str(models.paths["draft"]))
    for line in models.recommendation:
        log.info(line)
    spec = rec.rule.spec()
    given = next((name for name, s, _ in rows if s == spec), None)
    name = given or f"{spec} (tuned)"
    models.recommended = name if rec.speculate else TARGET_ONLY
    if given:
        return []
    return [(name, spec, build_policy(spec, max_draft_len=cfg.max_draft_len))]  # measured even when not recommended


def run_target_only(view: Bench) -> Row:
    """``Llama.generate`` with no draft model on the view's prompts."""
    m: LlamaModels = view.shared[STATE]
    row = Row(TARGET_ONLY, "llamacpp", note="reference")
    for ids in view.prompts:
        first: list[float] = []
        t0 = time.perf_counter()
        out = generate_greedy(m.plain, ids, view.decoding.max_new_tokens, view.eos, first_token_at=first)
        row.seconds.append(time.perf_counter() - t0)
        row.prefill_seconds.append(first[0] - t0 if first else 0.0)  # the prompt's pass, which gives the first token
        row.outputs.append(out)
        row.count_prompt(0, 0, 0)
    row.target_calls = row.tokens
    return row


def run_hooked(view: Bench, name: str) -> Row:
    """``Llama.generate`` of the logits_all target with row ``name``'s draft hook; a prompt on which the hook drafts
    nothing from the start (a cost-aware policy that no round can pay) runs the target alone, as its user would."""
    m: LlamaModels = view.shared[STATE]
    hook = m.hooks[name]
    pol = hook.policy
    row = Row(name, "llamacpp", kind=pol.kind, spec=m.specs[name], verification=pol.verification)
    m.target.draft_model = hook
    try:
        for ids in view.prompts:
            hook.begin(end=len(ids) + view.decoding.max_new_tokens)
            alone = hook.drafts_nothing(len(ids))
            first: list[float] = []
            t0 = time.perf_counter()
            out = generate_greedy(m.plain if alone else m.target, ids, view.decoding.max_new_tokens, view.eos,
                                  first_token_at=first)
            wall = time.perf_counter() - t0
            if alone:  # one target step a token, the prompt's pass to the first token
                pre = first[0] - t0 if first else 0.0
                st = DecodeStats(rounds=len(out), tokens=len(out), wall_time=wall, target_calls=len(out),
                                 prefill_time=pre, target_time=wall - pre)
            else:
                hook.finish([*ids, *out])
                st = hook.decode_stats(t0, wall, len(out))
            row.decode = st if row.decode is None else row.decode + st
            row.seconds.append(wall)
            row.outputs.append(out)
            row.prefill_seconds.append(st.prefill_time)
            row.count_prompt(st.rounds, int(st.drafted), int(st.accepted))
    finally:
        m.target.draft_model = None
    assert row.decode is not None
    d = row.decode
    row.rounds, row.accepted, row.target_calls = d.rounds, int(d.accepted), d.target_calls
    row.draft_tokens = int(d.drafted)
    return row


def row_plan(bench: Bench) -> list[tuple[str, Runner]]:
    """Target-only first, then llama.cpp's defaults, the settings and the specstop policies, in config order."""
    m: LlamaModels = bench.shared[STATE]
    return [(TARGET_ONLY, run_target_only), *[(name, lambda b, n=name: run_hooked(b, n)) for name in m.hooks]]


def warm_up(bench: Bench) -> None:
    """A few tokens of the first prompt through every model (llama.cpp's first calls allocate its buffers)."""
    m: LlamaModels = bench.shared[STATE]
    short = bench.with_new_tokens(8, prompts=1)
    run_target_only(short)
    run_hooked(short, next(iter(m.hooks)))


def comparisons(rows: list[Row], boot: np.ndarray, recommended: str | None = None) -> list[dict[str, Any]]:
    """Every row against llama.cpp's defaults (target-only too), and each specstop policy against the recommended row
    (``recommended``, its name; None: the fastest ``llamacpp:`` row but the default, the default itself when none
    ran): ratio of tokens/s, 95% paired interval. The recommended row is named so (``(recommended)``)."""
    default = next(r for r in rows if r.spec == DEFAULT_SPEC)  # the first row at the defaults: the one named so
    if recommended is not None:
        ref = next(r for r in rows if r.name == recommended)
    else:
        settings = [r for r in rows if r.kind == LlamaCppRule.kind and r is not default]
        ref = max(settings, key=lambda r: r.tokens_per_s) if settings else default

    def label(r: Row) -> str:
        return f"{r.name} (recommended)" if r.name == recommended and "(recommended)" not in r.name else r.name

    out = []
    for r in rows:
        alone = r.kind == LlamaCppRule.kind or r is rows[0] or ref is default  # rows[0]: target-only
        refs = [default] if alone else [default, ref]
        for x in refs:
            if r is not x:
                point, lo, hi = ratio_ci(r, x, boot)
                out.append({"row": label(r), "against": label(x), "ratio": point, "lo": lo, "hi": hi,
                            "rows": [r.name, x.name]})
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (the shorter one's length when one is a prefix), None if equal."""
    j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return j if j is not None or len(a) == len(b) else min(len(a), len(b))


def comparison_lines(comps: list[dict[str, Any]]) -> list[str]:
    return [f"{c['row']} against {c['against']}: {c['ratio']:.3f}x [{c['lo']:.3f}, {c['hi']:.3f}]" for c in comps
            if c["ratio"] is not None]


@dataclass
class LlamaCppReport:
    """What the llama.cpp report holds beside the prompts and the models."""

    table: list[dict[str, Any]]
    """The rows' report entries (``benchmark.rows.Row.metrics`` and ``first_difference``)."""
    comparisons: list[dict[str, Any]]
    recommendation: list[str] = field(default_factory=list)
    replay_check: dict[str, Any] | None = None


def write_llamacpp_report(rep: LlamaCppReport, bench: Bench, names: list[str], out_dir: Path) -> None:
    """``benchmark.md`` and ``benchmark.json`` of the llama.cpp rows."""
    d, cm, m = bench.decoding, bench.cost_model, bench.shared[STATE]
    cpu = cpuinfo_fields()
    where = (f"CPU {cpu.get('model name', '?')} (family {cpu.get('cpu family', '?')}, model {cpu.get('model', '?')}), "
             f"{m.threads} llama.cpp threads")
    lib = {"draft": f"{m.paths['draft'].name} ({file_type(m.draft)})",
           "target": f"{m.paths['target'].name} ({file_type(m.target)})"}
    md = ["# llama.cpp benchmark\n",
          f"draft {lib['draft']}, target {lib['target']}; {len(names)} prompts ({', '.join(names)}), "
          f"{d.max_new_tokens} new tokens, greedy; {where}; measured {time.strftime('%Y-%m-%d')}.\n",
          "speedup = tokens/s over llama.cpp target-only [95% paired bootstrap interval over prompts]; "
          "identical_prompts = prompts whose output equals target-only's; mean_accepted / mean_drafted per round "
          "(one round per draft hook call); stop_overhead = one stop decision / one draft forward.\n",
          markdown_table(rep.table), "", *[f"- {x}" for x in comparison_lines(rep.comparisons)]]
    if rep.recommendation:
        md += ["\n## Recommendation under this run's curve\n", *[f"- {x}" for x in rep.recommendation]]
    if rep.replay_check is not None:
        md += check_lines(rep.replay_check)
    if cm is not None:
        md += ["\n```", cm.curve_table(), "```"]
    (out_dir / "benchmark.md").write_text("\n".join(md) + "\n")
    report = {"rows": rep.table, "comparisons": rep.comparisons, "recommended": m.recommended,
              "recommendation": rep.recommendation, "replay_check": rep.replay_check, "prompts": names,
              "prompt_ids": bench.prompts, "cpu": cpu, "models": {k: str(v) for k, v in m.paths.items()}}
    (out_dir / "benchmark.json").write_text(json.dumps(report, indent=2))


def run_llamacpp_benchmark(cfg: LlamaCppBenchConfig) -> LlamaCppReport:
    """Load, warm up, run every row on every prompt, check the replay against them, write the report; returns it."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    new_run(out_dir)  # every run starts over: its code is this start's
    bench, names = load_llamacpp_bench(cfg)
    if cfg.warmup:
        warm_up(bench)
    log.info("llama.cpp benchmark: %d prompts x %d new tokens, %d rows", len(bench.prompts), cfg.max_new_tokens,
             len(row_plan(bench)))
    rows = run_rows(row_plan(bench), bench, RunOrder.of(cfg.benchmark_config()))
    table = finish_rows(rows, bench, cfg.n_boot)
    # where each output leaves target-only's: llama.cpp's forward of several tokens is not its one-token forward bit for
    # bit, so a near-tie of the target's top two tokens can flip under speculative decoding
    for t, r in zip(table[1:], rows[1:]):
        t["first_difference"] = [first_difference(a, b) for a, b in zip(r.outputs, rows[0].outputs)]
        if r.outputs != rows[0].outputs:
            t["output_ids"] = r.outputs
    boot = bootstrap_indices(cfg.seed, cfg.n_boot, len(bench.prompts))
    m: LlamaModels = bench.shared[STATE]
    rep = LlamaCppReport(table, comparisons(rows, boot, m.recommended), m.recommendation)
    write_llamacpp_report(rep, bench, names, out_dir)  # the rows are kept before the check runs
    if cfg.replay_check:
        check = run_llamacpp_check(bench, cfg.models, table, m.policies, rows[0].outputs, names, out_dir)
        rep.replay_check = {**check, "cost_model": str(out_dir / COST_FILE)}
        write_llamacpp_report(rep, bench, names, out_dir)
    return rep
