"""End-to-end decoding benchmark: target-only, transformers assisted generation, and the engine with every stop policy.

On the same prompts (held-out HumanEval and MT-Bench by default) and in one run:
- target-only decoding (``target.generate``): the exact reference output and the speed baseline;
- transformers assisted generation with the same pair (``assistant_model=draft``): ``hf:static:K`` (num_assistant_tokens K,
  constant schedule, no confidence threshold), ``hf:heuristic`` (+2 / -1 schedule from 5) and ``hf:default`` (20 tokens,
  confidence threshold 0.4 with online ROC re-tuning: transformers' defaults);
- ``decoding.engine.SpeculativeDecoder`` with every policy in ``policies`` and every predictor in ``predictors``
  (export folders or ``models:/<name>@champion``); ``hfp:<policy>`` rows run a policy inside transformers' generate
  through ``decoding.hf_integration``.

Per row: tokens/s, speedup over target-only, mean accepted length, target calls per token, draft tokens wasted per
token, stop-decision cost as a fraction of one draft forward, exactness (greedy: outputs equal to target-only's), and
ROUGE-L against the target-only output (the quality measure of approximate policies such as SPRINTER). Writes
``benchmark.md``, ``benchmark.json``, ``speedup.png`` and the resolved ``config.yaml`` to ``out_dir``; logs them to MLflow.

Usage:
    python -m pipelines.benchmark --config configs/benchmark.yaml
    python -m pipelines.benchmark --config configs/benchmark-smoke.yaml --n_prompts 2
"""
from __future__ import annotations

import json
import logging
import re
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from data_gen.generate import ModelsConfig
from data_gen.prompts import PromptSourceConfig

log = logging.getLogger(__name__)

HF_ROWS = ("static:K", "heuristic", "default")


@dataclass
class BenchmarkConfig:
    """Everything ``python -m pipelines.benchmark`` does; configs/benchmark*.yaml mirror it."""

    out_dir: str = "outputs/benchmark"
    """Folder for benchmark.md / .json, speedup.png and config.yaml (created)."""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    """Draft / target / companion model names, dtype and device."""
    prompts: list[PromptSourceConfig] = field(
        default_factory=lambda: [PromptSourceConfig("humaneval"), PromptSourceConfig("mtbench")]
    )
    """Prompt sources (see data_gen.prompts); prompts are filtered to ``split`` and taken round-robin across sources."""
    prompt_texts: list[str] | None = None
    """Plain prompt strings used instead of ``prompts`` (no split filter)."""
    split: str | None = "test"
    """Keep only prompts of this split (train / val / test by prompt id; held-out = test); None keeps all."""
    n_prompts: int = 6
    """Number of prompts benchmarked."""
    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    max_prompt_tokens: int = 512
    """Prompts longer than this are left-truncated."""
    max_new_tokens: int = 128
    """New tokens per prompt."""
    temperature: float = 0.0
    """0 = greedy (exactness checked against target-only); > 0 = sampling."""
    top_p: float = 1.0
    """Nucleus mass for sampling."""
    max_draft_len: int = 40
    """Hard cap on draft tokens per round for the engine."""
    top_k_features: int = 10
    """Top-k draft probabilities in the features (match the predictors' training data)."""
    policies: list[str] = field(
        default_factory=lambda: ["static:5", "heuristic", "max_confidence", "svip:0.3", "adaedl"]
    )
    """Engine policies (decoding.policies.build_policy specs); ``hfp:<spec>`` runs the spec inside transformers' generate."""
    predictors: list[str] = field(default_factory=list)
    """Learned predictors for the engine: export folders or models:/<name>@champion."""
    hf_rows: list[str] = field(default_factory=lambda: ["static:5", "heuristic", "default"])
    """transformers assisted-generation rows: static:K, heuristic, default."""
    batch_size: int = 1
    """Engine rows decode this many prompts per batch (left padding, per-sequence draft lengths)."""
    latency_file: str | None = None
    """Latency table JSON for SV and the oracle estimate (decoding.latency); profiled on this machine when missing."""
    force: bool = False
    """Load predictors trained for another draft model anyway."""
    warmup: bool = True
    """Run each path once on a short generation before timing."""
    seed: int = 0
    """Sampling seed (per prompt: seed + index)."""
    tracking: bool = True
    """Log parameters, metrics and artefacts to MLflow."""
    tracking_uri: str | None = None
    """MLflow tracking URI (default sqlite:///mlflow.db)."""
    experiment: str = "specstop-benchmark"
    """MLflow experiment name."""

    def __post_init__(self) -> None:
        if self.n_prompts < 1:
            raise ValueError(f"n_prompts={self.n_prompts}: must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size}: must be >= 1")
        for r in self.hf_rows:
            if r not in ("heuristic", "default") and not re.fullmatch(r"static:\d+", r):
                raise ValueError(f"hf_rows: {r!r} is not one of static:K, heuristic, default")
        if self.prompt_texts is not None and not [t for t in self.prompt_texts if t.strip()]:
            raise ValueError("prompt_texts: give at least one non-empty prompt (or null to use prompts)")


@dataclass
class Row:
    """One benchmark row (aggregated over prompts)."""

    name: str
    method: str
    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    accepted: int = 0
    target_calls: int = 0
    draft_tokens: int = 0
    wasted: int = 0
    stop_overhead: float | None = None
    exact: bool | None = None
    exact_by_design: bool = True
    rouge_l: float | None = None
    note: str = ""
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def metrics(self, base_tps: float) -> dict[str, Any]:
        return {
            "row": self.name,
            "method": self.method,
            "tokens_per_s": round(self.tokens_per_s, 3),
            "speedup": round(self.tokens_per_s / base_tps, 3) if base_tps > 0 else None,
            "mean_accepted": round(self.accepted / self.rounds, 3) if self.rounds else None,
            "target_calls_per_token": round(self.target_calls / self.tokens, 3) if self.tokens else None,
            "wasted_per_token": round(self.wasted / self.tokens, 3) if self.tokens and self.draft_tokens else None,
            "stop_overhead": None if self.stop_overhead is None else round(self.stop_overhead, 4),
            "exact": self.exact,
            "rouge_l": None if self.rouge_l is None else round(self.rouge_l, 4),
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "note": self.note,
        }


# ----------------------------------------------------------------------------------------------------------- prompts
def load_benchmark_prompts(cfg: BenchmarkConfig, tokenizer) -> tuple[list[list[int]], list[str], dict]:
    """Token ids of the benchmark prompts, their ids, and stats."""
    from data_gen.prompts import Prompt, load_prompts, render_prompt, split_of

    if cfg.prompt_texts is not None:
        prompts = [Prompt(id=f"text:{i}", source="text", domain="chat", messages=[{"role": "user", "content": t}])
                   for i, t in enumerate(cfg.prompt_texts) if t.strip()]
        stats: dict = {"total": len(prompts)}
    else:
        loaded, stats = load_prompts(cfg.prompts, seed=cfg.seed)
        by_source: dict[str, list] = {}
        for p in loaded:
            if cfg.split is None or split_of(p.id) == cfg.split:
                by_source.setdefault(p.source, []).append(p)
        prompts = []
        queues = list(by_source.values())
        while len(prompts) < cfg.n_prompts and any(queues):
            for q in queues:
                if q and len(prompts) < cfg.n_prompts:
                    prompts.append(q.pop(0))
    prompts = prompts[: cfg.n_prompts]
    if not prompts:
        raise ValueError(f"no prompts left after the split filter split={cfg.split!r}; set split: null or add sources")
    ids, names, n_trunc = [], [], 0
    for p in prompts:
        tok_ids, truncated = render_prompt(p, tokenizer, cfg.use_chat_template, cfg.max_prompt_tokens)
        if not tok_ids:
            raise ValueError(f"prompt {p.id} renders to no tokens")
        ids.append(tok_ids)
        names.append(p.id)
        n_trunc += int(truncated)
    return ids, names, {"prompts": len(ids), "truncated": n_trunc, "load": stats}


# ----------------------------------------------------------------------------------------------------------- runners
def _eos(tokenizer, target) -> list[int]:
    eos = target.generation_config.eos_token_id
    out = set([eos] if isinstance(eos, int) else list(eos or []))
    if tokenizer.eos_token_id is not None:
        out.add(int(tokenizer.eos_token_id))
    return sorted(out)


def _new_tokens(seq: torch.Tensor, prompt_len: int, eos: list[int]) -> list[int]:
    new = seq[prompt_len:].tolist()
    for j, t in enumerate(new):
        if t in eos:
            return new[: j + 1]
    return new


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _gen_kwargs(cfg: BenchmarkConfig, tokenizer, eos: list[int]) -> dict[str, Any]:
    kw: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens, "eos_token_id": eos,
                          "pad_token_id": tokenizer.pad_token_id}
    if cfg.temperature > 0:
        kw.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=None)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    return kw


def run_target_only(target, prompts, cfg, tokenizer, eos) -> Row:
    row = Row("target-only", "target.generate", note="reference")
    kw = _gen_kwargs(cfg, tokenizer, eos)
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids], device=target.device)
        torch.manual_seed(cfg.seed + i)
        _sync(target.device)
        t0 = time.perf_counter()
        out = target.generate(x, attention_mask=torch.ones_like(x), **kw)
        _sync(target.device)
        row.seconds += time.perf_counter() - t0
        new = _new_tokens(out[0], len(ids), eos)
        row.outputs.append(new)
        row.tokens += len(new)
        row.target_calls += len(new)
    return row


@contextmanager
def _hf_round_recorder(stats: dict):
    """Record (candidates, matches) per round of transformers' assisted generation."""
    from transformers.generation.candidate_generator import AssistedCandidateGenerator

    orig = AssistedCandidateGenerator.update_candidate_strategy

    def wrapped(self, input_ids, scores, num_matches):
        stats["rounds"] += 1
        stats["drafted"] += int(scores.shape[1] - 1)
        stats["accepted"] += int(num_matches)
        return orig(self, input_ids, scores, num_matches)

    AssistedCandidateGenerator.update_candidate_strategy = wrapped
    try:
        yield stats
    finally:
        AssistedCandidateGenerator.update_candidate_strategy = orig


def run_hf(kind: str, draft, target, prompts, cfg, tokenizer, eos) -> Row:
    """transformers assisted generation with the draft's generation_config set for ``kind``."""
    gc = draft.generation_config
    saved = {k: getattr(gc, k, None) for k in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                                                 "assistant_confidence_threshold")}
    if kind.startswith("static:"):
        settings = {"num_assistant_tokens": int(kind.split(":")[1]), "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.0}
    elif kind == "heuristic":
        settings = {"num_assistant_tokens": 5, "num_assistant_tokens_schedule": "heuristic",
                    "assistant_confidence_threshold": 0.0}
    else:  # transformers' defaults
        settings = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                    "assistant_confidence_threshold": 0.4}
    row = Row(f"hf:{kind}", "transformers assisted")
    kw = _gen_kwargs(cfg, tokenizer, eos)
    stats = {"rounds": 0, "drafted": 0, "accepted": 0}
    try:
        with _hf_round_recorder(stats):
            for i, ids in enumerate(prompts):
                for k, v in settings.items():
                    setattr(gc, k, v)
                x = torch.tensor([ids], device=target.device)
                torch.manual_seed(cfg.seed + i)
                _sync(target.device)
                t0 = time.perf_counter()
                out = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=draft, **kw)
                _sync(target.device)
                row.seconds += time.perf_counter() - t0
                new = _new_tokens(out[0], len(ids), eos)
                row.outputs.append(new)
                row.tokens += len(new)
    finally:
        for k, v in saved.items():
            setattr(gc, k, v)
    row.rounds = row.target_calls = stats["rounds"]
    row.accepted, row.draft_tokens = stats["accepted"], stats["drafted"]
    row.wasted = stats["drafted"] - stats["accepted"]
    return row


def run_hf_policy(spec: str, draft, target, prompts, cfg, tokenizer, eos) -> Row:
    """A stop policy inside transformers' generate (decoding.hf_integration)."""
    from decoding.hf_integration import generate_with_policy
    from decoding.policies import build_policy

    policy = build_policy(spec, draft=draft, draft_tokenizer=tokenizer, max_draft_len=cfg.max_draft_len, force=cfg.force)
    row = Row(f"hfp:{spec}", "transformers + policy")
    kw = _gen_kwargs(cfg, tokenizer, eos)
    stop_time = 0.0
    for i, ids in enumerate(prompts):
        x = torch.tensor([ids], device=target.device)
        torch.manual_seed(cfg.seed + i)
        _sync(target.device)
        t0 = time.perf_counter()
        out, st = generate_with_policy(target, draft, x, policy, cfg.top_k_features,
                                       attention_mask=torch.ones_like(x), **kw)
        _sync(target.device)
        row.seconds += time.perf_counter() - t0
        new = _new_tokens(out[0], len(ids), eos)
        row.outputs.append(new)
        row.tokens += len(new)
        rounds = [(d, a) for d, a in zip(st["draft_lengths"], st["accepted_lengths"]) if d > 0]
        row.rounds += len(rounds)
        row.target_calls += len(st["accepted_lengths"])
        row.draft_tokens += sum(d for d, _ in rounds)
        row.accepted += sum(a for _, a in rounds)
        stop_time += st["stop_time"]
    row.wasted = row.draft_tokens - row.accepted
    row.note = f"stop time {stop_time:.3f}s"
    return row


def run_engine(spec: str, draft, target, companion, prompts, cfg, tokenizer, eos, latency) -> Row:
    from decoding.policies import build_decoder, policy_label

    dec = build_decoder(
        draft, target, spec, draft_tokenizer=tokenizer, target_tokenizer=tokenizer, companion=companion,
        force=cfg.force, temperature=cfg.temperature, top_p=cfg.top_p, max_draft_len=cfg.max_draft_len,
        top_k_features=cfg.top_k_features, cost_model=latency,
    )
    row = Row(policy_label(spec, dec.policy), "engine", exact_by_design=dec.policy.exact)
    total = None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    for start in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[start : start + cfg.batch_size]
        width = max(len(p) for p in chunk)
        x = torch.full((len(chunk), width), pad, dtype=torch.long)
        m = torch.zeros_like(x)
        for b, p in enumerate(chunk):
            x[b, width - len(p) :] = torch.tensor(p)
            m[b, width - len(p) :] = 1
        _sync(target.device)
        out, st = dec.generate(x, m, cfg.max_new_tokens, eos, cfg.seed + start)
        _sync(target.device)
        total = st if total is None else total + st
        for b in range(len(chunk)):
            row.outputs.append(_new_tokens(out[b], width, eos))
    assert total is not None
    row.tokens = sum(len(o) for o in row.outputs)
    row.seconds = total.wall_time
    row.rounds, row.accepted, row.target_calls = total.rounds, total.accepted, total.target_calls
    row.draft_tokens, row.wasted, row.stop_overhead = total.draft_tokens, total.wasted, total.stop_overhead
    if total.analysis_time > 0:  # oracle: replace the look-ahead by the profiled cost of one verification per round
        assert latency is not None
        est = total.wall_time - total.analysis_time - total.target_time
        est += sum(latency.target_time(k + 1) for k in total.draft_lengths)
        row.seconds = est
        row.note = "analysis only: time estimated (look-ahead replaced by profiled verification)"
    if not dec.policy.exact:
        row.note = "approximate (sequential verification)"
    return row


def rouge_l(outputs: list[list[int]], refs: list[list[int]], tokenizer) -> float:
    """Mean ROUGE-L F1 of decoded outputs against decoded references."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    vals = []
    for o, r in zip(outputs, refs):
        a, b = tokenizer.decode(r, skip_special_tokens=True), tokenizer.decode(o, skip_special_tokens=True)
        if not a.strip() and not b.strip():
            vals.append(1.0)
            continue
        vals.append(scorer.score(a, b)["rougeL"].fmeasure)
    return sum(vals) / len(vals) if vals else 0.0


# ----------------------------------------------------------------------------------------------------------- report
def markdown_table(rows: list[dict[str, Any]]) -> str:
    cols = ["row", "method", "tokens_per_s", "speedup", "mean_accepted", "target_calls_per_token", "wasted_per_token",
            "stop_overhead", "exact", "rouge_l", "note"]
    fmt = lambda v: "" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot_speedups(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["row"] for r in rows]
    vals = [r["speedup"] or 0.0 for r in rows]
    colors = ["grey" if r["method"] == "target.generate" else "tab:orange" if r["method"].startswith("transformers")
              else "tab:blue" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows)), 4))
    ax.bar(range(len(rows)), vals, color=colors)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(range(len(rows)), names, rotation=45, ha="right")
    ax.set_ylabel("speedup over target-only")
    ax.set_title("tokens/s relative to target-only (orange: transformers, blue: engine)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------- main
def run_benchmark(cfg: BenchmarkConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Load models and prompts, run every row, write the report; returns (rows, stats)."""
    from data_gen.models import check_same_tokenizer, load_model
    from decoding.policies import build_policy, needs_companion

    t_start = time.perf_counter()
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    draft, tok = load_model(cfg.models.spec(cfg.models.draft))
    target, t_tok = load_model(cfg.models.spec(cfg.models.target))
    companion = None
    toks, models = {"draft": tok, "target": t_tok}, {"draft": draft, "target": target}
    if cfg.models.companion:
        companion, c_tok = load_model(cfg.models.spec(cfg.models.companion))
        toks["companion"], models["companion"] = c_tok, companion
    check_same_tokenizer(toks, models)
    prompts, names, p_stats = load_benchmark_prompts(cfg, tok)
    eos = _eos(tok, target)
    log.info("benchmark: %d prompts, %d new tokens, device %s, dtype %s", len(prompts), cfg.max_new_tokens,
             cfg.models.device, cfg.models.dtype)

    specs = list(cfg.policies) + list(cfg.predictors)
    latency = None
    needs_latency = any(s == "oracle" for s in specs)
    for s in specs:
        if not s.startswith("hfp:") and s != "oracle":
            pol = build_policy(s, draft=draft, draft_tokenizer=tok, max_draft_len=cfg.max_draft_len, force=cfg.force)
            needs_latency |= needs_companion(pol)
    if needs_latency:
        from data_gen.timing import CostModel, measure_cost_model

        if cfg.latency_file and Path(cfg.latency_file).is_file():
            latency = CostModel.from_json(cfg.latency_file)
        else:
            latency = measure_cost_model(draft, target, companion, lengths=(1, 2, 3, 5, 9, 17, 25, cfg.max_draft_len + 1))
        latency.to_json(out_dir / "latency.json")

    if cfg.warmup:
        short = replace(cfg, max_new_tokens=4, tracking=False)
        run_target_only(target, prompts[:1], short, tok, eos)
        run_hf("static:3", draft, target, prompts[:1], short, tok, eos)
        run_engine("static:3", draft, target, None, prompts[:1], short, tok, eos, None)

    rows: list[Row] = []

    def done(row: Row) -> None:
        rows.append(row)
        base = rows[0].tokens_per_s
        log.info("row %s: %.3f tokens/s (x%.3f), %d tokens in %.1fs, mean accepted %.2f", row.name, row.tokens_per_s,
                 row.tokens_per_s / base if base else 0.0, row.tokens, row.seconds,
                 row.accepted / row.rounds if row.rounds else 0.0)
        partial = [r.metrics(base) for r in rows]
        (out_dir / "benchmark.partial.json").write_text(json.dumps(partial, indent=2))

    done(run_target_only(target, prompts, cfg, tok, eos))
    for kind in cfg.hf_rows:
        done(run_hf(kind, draft, target, prompts, cfg, tok, eos))
    for spec in specs:
        if spec.startswith("hfp:"):
            done(run_hf_policy(spec[4:], draft, target, prompts, cfg, tok, eos))
            continue
        try:
            done(run_engine(spec, draft, target, companion, prompts, cfg, tok, eos, latency))
        except ValueError as e:
            if "companion" in str(e) and companion is None:
                log.warning("skipping %s: %s", spec, e)
                done(Row(spec, "engine", note=f"skipped: {e}"))
                continue
            raise
    ref = rows[0].outputs
    for r in rows[1:]:
        if not r.outputs:
            continue
        if cfg.temperature == 0:
            r.exact = r.outputs == ref
        r.rouge_l = rouge_l(r.outputs, ref, tok)
    base = rows[0].tokens_per_s
    table = [r.metrics(base) for r in rows]
    md = [
        "# Decoding benchmark\n",
        f"draft `{cfg.models.draft}`, target `{cfg.models.target}`, companion `{cfg.models.companion}`; "
        f"{len(prompts)} prompts ({', '.join(names)}), {cfg.max_new_tokens} new tokens, temperature {cfg.temperature}, "
        f"device {cfg.models.device}, dtype {cfg.models.dtype}, batch size {cfg.batch_size}.\n",
        "speedup = tokens/s over target-only; stop_overhead = one stop decision / one draft forward; exact = outputs "
        "equal target-only's (greedy); rouge_l against target-only's output.\n",
        markdown_table(table),
    ]
    (out_dir / "benchmark.md").write_text("\n".join(md) + "\n")
    (out_dir / "benchmark.json").write_text(json.dumps({"rows": table, "prompts": names}, indent=2))
    plot_speedups(table, out_dir / "speedup.png")
    stats = {"prompts": p_stats, "seconds": time.perf_counter() - t_start}
    return table, stats


def _write_config(cfg: BenchmarkConfig, path: Path) -> None:
    import yaml

    path.write_text("# python -m pipelines.benchmark --config " + str(path) + "\n" + yaml.safe_dump(asdict(cfg)))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse the config, run the benchmark, log to MLflow; returns {"rows", "stats", "out_dir"}."""
    from pipelines.cli import parse_config, setup_logging

    setup_logging()
    logging.getLogger("absl").setLevel(logging.WARNING)  # rouge-score logs once per scorer
    cfg = parse_config(BenchmarkConfig, argv, __doc__)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_config(cfg, out_dir / "config.yaml")
    if not cfg.tracking:
        rows, stats = run_benchmark(cfg)
    else:
        import mlflow

        mlflow.set_tracking_uri(cfg.tracking_uri or "sqlite:///mlflow.db")
        mlflow.set_experiment(cfg.experiment)
        with mlflow.start_run(run_name="benchmark"):
            mlflow.log_params({k: str(v)[:250] for k, v in asdict(cfg).items()})
            rows, stats = run_benchmark(cfg)
            for r in rows:
                key = re.sub(r"[^A-Za-z0-9_.\-/ ]", "_", r["row"])
                for m in ("tokens_per_s", "speedup", "mean_accepted", "target_calls_per_token", "wasted_per_token",
                          "stop_overhead", "rouge_l"):
                    if isinstance(r.get(m), (int, float)):
                        mlflow.log_metric(f"{key}/{m}", float(r[m]))
            mlflow.log_artifacts(str(out_dir))
    print((out_dir / "benchmark.md").read_text())
    return {"rows": rows, "stats": stats, "out_dir": str(out_dir)}


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
