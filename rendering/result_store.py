"""Small summaries of finished runs, kept in ``results/`` and rendered into the README and docs/results.md.

A summary is one JSON file: what was run (kind, config, command, config hash), its provenance as the run recorded it
(``compute.code_version``: the commit at its start and whether the tree was dirty, start and end time, duration,
host), where (CPU model, family and model number, SIMD flags, torch, threads, compute path) and the figures the docs
quote: for the main job each predictor's test AUC on its own label beside the best training-free score and the
cross-validated difference with its interval; for the benchmark each row's tokens/s and speedups with their intervals
over prompts, and the per-prompt records they are computed from (``benchmark.records``; ``python -m pipelines.results
--verify`` recomputes the figures). The docs never carry a hand-typed figure: ``python -m pipelines.results`` renders
them from these files.

Usage::

    from rendering.result_store import summarize_main_job, write_summary
    write_summary(summarize_main_job("outputs/default/train", command="python -m pipelines.train ..."), "results")
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from compute.code_version import in_history, run_code
from compute.cpu import cpuinfo_fields

log = logging.getLogger(__name__)

SCHEMA = "specstop-results/1"
KINDS = ("main_job", "benchmark", "vllm_benchmark", "device_check")
REQUIRED = {
    "main_job": ("schema", "kind", "config", "command", "date", "machine", "pair", "compute_path", "predictors"),
    "benchmark": ("schema", "kind", "config", "command", "date", "machine", "pair", "compute_path", "rows",
                  "n_prompts", "max_new_tokens", "temperature"),
    "vllm_benchmark": ("schema", "kind", "config", "command", "date", "machine", "pair", "compute_path", "rows",
                       "n_prompts", "max_new_tokens", "batch_sizes"),
    "device_check": ("schema", "kind", "config", "command", "date", "machine", "pair", "compute_path", "steps"),
}
ITEMS = {"main_job": ("predictors", ("predictor",)), "benchmark": ("rows", ("row", "tokens_per_s")),
         "vllm_benchmark": ("rows", ("row", "batch", "tokens_per_s")), "device_check": ("steps", ("step", "status"))}
"""Per kind, the list a summary must hold and the fields of each entry."""
PREDICTOR_FIELDS = ("predictor", "label", "test_auc", "best_free", "test_auc_best_free", "cv_diff", "cv_diff_lo",
                    "cv_diff_hi", "test_speedup", "decoding", "ece_greedy", "ece_sampling")
ROW_FIELDS = ("row", "method", "kind", "tokens_per_s", "speedup", "speedup_lo", "speedup_hi", "vs_best_entropy",
              "vs_best_entropy_lo", "vs_best_entropy_hi", "exact", "identical_prompts", "mean_accepted",
              "mean_drafted", "thresholded", "verification", "spec", "note", "vs_defaults", "vs_defaults_lo",
              "vs_defaults_hi", "rouge_l", "humaneval_pass", "vs_best_thresholded", "vs_best_thresholded_lo",
              "vs_best_thresholded_hi", "estimated", "reference", "records")
CHECK_FIELDS = ("row", "measured_tokens_per_s", "predicted_tokens_per_s", "ratio", "measured_mean_accepted",
                "predicted_mean_accepted", "note")
"""What a summary keeps of each row of a benchmark's replay check."""


class SummaryError(ValueError):
    """A summary file that cannot be read: the message names the file and the field."""


@dataclass(frozen=True)
class Summary:
    """One stored run: its file and its parsed content."""

    path: Path
    data: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.data["kind"]

    @property
    def group(self) -> tuple[str, str, str]:
        """Runs that may be compared: same model pair, same compute path, same CPU kind (never averaged across)."""
        pair = f"{self.data['pair']['draft']} -> {self.data['pair']['target']}"
        return pair, self.data["compute_path"], cpu_label(self.data["machine"])


def machine_facts(machine: dict[str, Any]) -> dict[str, Any]:
    """The run's machine record (from its cost model) plus this CPU's vendor, family and model number."""
    ids = cpuinfo_fields()
    return {**machine, "vendor": ids.get("vendor_id", ""), "family": ids.get("cpu family", ""),
            "model": ids.get("model", "")}


INTEL_GENERATIONS = {143: "Sapphire Rapids", 207: "Emerald Rapids", 173: "Granite Rapids", 174: "Granite Rapids"}
"""Intel family 6 models of the Xeons with AMX."""


def cpu_generation(machine: dict[str, Any]) -> str:
    """A readable CPU generation from vendor / family / model where known (Zen 3-5, the Xeons with AMX), else ''."""
    vendor, family, model = machine.get("vendor", ""), machine.get("family", ""), machine.get("model", "")
    if not family.isdigit() or not model.isdigit():
        return ""
    fam, mod = int(family), int(model)
    if vendor == "GenuineIntel":
        return INTEL_GENERATIONS.get(mod, "") if fam == 6 else ""
    if vendor != "AuthenticAMD":
        return ""
    if fam == 25:
        return "Zen 4" if 0x10 <= mod <= 0x1F or 0x60 <= mod <= 0xAF else "Zen 3"
    return {23: "Zen 2", 26: "Zen 5"}.get(fam, "")


def isa_label(flags: list[str]) -> str:
    """The instruction set class that decides specstop's compute path."""
    fl = set(flags)
    if "amx_bf16" in fl:
        return "AMX-BF16"
    if "avx512_bf16" in fl:
        return "AVX-512 BF16"
    if "avx512f" in fl:
        return "AVX-512"
    if "avx2" in fl:
        return "AVX2"
    return "no AVX2"


def cpu_label(machine: dict[str, Any]) -> str:
    """``AMD EPYC (Zen 4, AVX-512 BF16)``: model name, generation where known, ISA class."""
    name = " ".join((machine.get("model_name") or "unknown CPU").replace("(R)", "").replace("(TM)", "").split())
    return f"{name} ({cpu_kind(machine)})"


def cpu_kind(machine: dict[str, Any]) -> str:
    """``Zen 4, AVX-512 BF16``: the CPU's generation where known and its ISA class."""
    isa = machine.get("isa") or isa_label(machine.get("simd_flags", []))
    return ", ".join(x for x in (cpu_generation(machine), isa) if x)


ESTIMATED_NOTE = ("\\* estimated, not measured: the row's time is the curve's price of its rounds (an analysis-only "
                  "row), and so are its ratios.")
"""The footnote under a table with an estimated row."""


def estimated(row: dict[str, Any]) -> bool:
    """A row whose seconds are estimated rather than measured (the sampling oracle's analysis-only time)."""
    return bool(row.get("estimated"))


def tokens_cell(row: dict[str, Any]) -> str:
    """A row's tokens/s as the tables write it: ``31.13``, ``31.13*`` when estimated (:data:`ESTIMATED_NOTE`)."""
    return f"{row['tokens_per_s']:.2f}" + ("*" if estimated(row) else "")


def interval_text(mid: Any, lo: Any = None, hi: Any = None, spec: str = ".2f", suffix: str = "x") -> str:
    """``1.52x [1.41, 1.63]``: a figure with its interval as the rendered tables write it ('' without a figure, the
    figure alone without both bounds)."""
    if mid is None:
        return ""
    if lo is None or hi is None:
        return f"{mid:{spec}}{suffix}"
    return f"{mid:{spec}}{suffix} [{lo:{spec}}, {hi:{spec}}]"


def config_hash(config: dict[str, Any]) -> str:
    """A short, stable hash of a resolved config (sorted JSON)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise SummaryError(f"{path}: missing (is the run finished?)") from e
    except json.JSONDecodeError as e:
        raise SummaryError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from e


def _pick(record: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {k: record[k] for k in fields if k in record}


def _cost_facts(cost_file: Path) -> tuple[dict[str, Any], str]:
    cost = _read_json(cost_file)
    return machine_facts(cost.get("machine") or {}), cost.get("compute_path", "unknown")


def curve_facts(cost_file: Path) -> dict[str, float] | None:
    """A run's curve in milliseconds (None without one): a draft step, the draft's catch-up (a second token read at
    once, 0 when not measured), and the target's forward of one and of two new tokens."""
    if not cost_file.is_file():
        return None
    cost = _read_json(cost_file)  # the file's fields (compute.timing.CostModel), read without loading torch
    target = cost.get("target_s") or {}
    if "1" not in target or "2" not in target:
        return None
    return {"draft_ms": round(1e3 * cost["draft_s_per_token"], 2),
            "catchup_ms": round(1e3 * cost.get("draft_catchup_s", 0.0), 2),
            "target_ms_L1": round(1e3 * target["1"], 2), "target_ms_L2": round(1e3 * target["2"], 2)}


def today() -> str:
    """Today's date (UTC): a new summary's ``date``."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")


def dated(data: dict[str, Any]) -> str:
    """``2026-11-26, commit 429b58c``: a run's date and the code it ran, as the run recorded it at its start
    (``+ uncommitted changes`` when the tree was dirty, ``resumed at`` the commits a stopped run was continued at);
    ``read when stored`` when the run recorded no start; ``provenance not recorded by the run`` for a summary whose
    provenance was written afterwards (a ``commit_source`` field, which no code writes); ``commit unknown`` without
    one. A commit that is not in this checkout's history is rendered with a warning (and logged)."""
    commit = data.get("commit")
    if not commit:
        return f"{data['date']}, commit unknown"
    text = f"commit {str(commit)[:7]}"
    if data.get("dirty"):
        text += " + uncommitted changes"
    if "commit_source" in data:
        text += " (provenance not recorded by the run)"
    elif data.get("code_recorded") == "at storing":
        text += " (read when stored, not at the run's start)"
    if data.get("resumed_at"):
        text += f" (resumed at {', '.join(str(c)[:7] for c in data['resumed_at'])})"
    if in_history(str(commit)) is False:
        log.warning("stored run of %s (%s %s): commit %s is not in this checkout's history", data["date"],
                    data.get("kind"), data.get("config"), commit)
        text += " (warning: not in this checkout's history)"
    return f"{data['date']}, {text}"


def provenance(out_dir: Path, duration_s: float | None, cost_file: Path | None = None) -> dict[str, Any]:
    """A summary's provenance fields, as the run in ``out_dir`` recorded them (``compute.code_version.run_code``):
    ``date`` the day it started, the duration its end record holds, else ``duration_s`` (the caller's measurement) for
    a run that recorded none; the host gets the read bandwidth its curve measured (``cost_file``), where it did."""
    code = run_code(out_dir)
    recorded = code.pop("duration_s", None)
    prov = {"date": code["started"][:10] if code.get("started") else today(), **code,
            "duration_s": recorded if recorded is not None else duration_s}
    extra = {}
    if cost_file is not None and cost_file.is_file():
        extra = _read_json(cost_file).get("extra") or {}
    if prov.get("host") and extra.get("read_bandwidth"):
        prov["host"] = {**prov["host"], "read_bandwidth_gbps": round(float(extra["read_bandwidth"]) / 1e9, 1)}
    return prov


def _data_records(out: Path, data_dir: str | None) -> int | None:
    """Records of the main job's data folder (its summary.json): the configured folder, else ``<out>/../data``."""
    for folder in ([Path(data_dir)] if data_dir else []) + [out.parent / "data"]:
        path = folder / "summary.json"
        if path.is_file():
            return _read_json(path).get("overall", {}).get("records")
    return None


def summarize_main_job(out_dir: str | Path, command: str, config_name: str = "default",
                       duration_s: float | None = None) -> dict[str, Any]:
    """The summary of a finished main job in ``out_dir`` (its results.json, resolved config and cost model)."""
    out = Path(out_dir)
    results = _read_json(out / "results.json")
    resolved = _read_json(out / "resolved_config.json")
    models = resolved.get("data", {}).get("models", {})
    machine, path = _cost_facts(out / "report" / "cost_model.json")
    rows = [_pick(r, PREDICTOR_FIELDS) for r in results.get("results", []) if "test_auc" in r or "test_speedup" in r]
    records = results.get("records") or _data_records(out, resolved.get("data", {}).get("out_dir"))
    return {
        "schema": SCHEMA, "kind": "main_job", "config": config_name, "command": command,
        **provenance(out, duration_s, out / "report" / "cost_model.json"), "config_hash": config_hash(resolved),
        "machine": machine, "compute_path": path,
        "pair": {"draft": models.get("draft", "?"), "target": models.get("target", "?")},
        "records": records, "predictors": rows,
        "recommendations": _recommendations(out / "recommend.json"),
    }


def best_of(speedups: dict[str, float]) -> tuple[str, float] | None:
    """(name, speedup) of the fastest of a recommendation's compared policies (its "best learned policy"), None
    without any."""
    return max(speedups.items(), key=lambda kv: kv[1], default=None)


def _recommendations(path: Path) -> list[dict[str, Any]]:
    """Each runtime's recommendation of a main job (``recommend.json``, ``pipelines.recommend``): the setting, its
    replayed test speedup beside the runtime's defaults', the best learned policy's and the oracle's, the curve's
    runtime when it was another's; [] when the job made none."""
    if not path.is_file():
        return []
    out = []
    for runtime, r in _read_json(path).items():
        best = best_of({name: c["speedup"] for name, c in r.get("compare", {}).items()})
        out.append({"runtime": runtime, "speculate": r["speculate"], "paste": r["paste"], "spec": r["spec"],
                    "speedup": r["speedup"], "val_speedup": r["val_speedup"], "default_spec": r["default"]["spec"],
                    "default_speedup": r["default"]["speedup"], "best_learned": best[0] if best else None,
                    "best_learned_speedup": best[1] if best else None,
                    "oracle_speedup": (r.get("oracle") or {}).get("speedup"), "warnings": r.get("warnings", [])})
    return out


def summarize_benchmark(out_dir: str | Path, command: str, config_name: str = "benchmark",
                        duration_s: float | None = None) -> dict[str, Any]:
    """The summary of a finished benchmark in ``out_dir`` (benchmark.json, config.yaml and its curve: cost_model.json,
    or cost_model.llamacpp.json for ``pipelines.llamacpp_bench``'s runs, whose ``compute_path`` is ``llamacpp``)."""
    out = Path(out_dir)
    bench = _read_json(out / "benchmark.json")
    try:
        config = yaml.safe_load((out / "config.yaml").read_text())
    except FileNotFoundError as e:
        raise SummaryError(f"{out / 'config.yaml'}: missing (is the run finished?)") from e
    curve = next((out / n for n in ("cost_model.json", "cost_model.llamacpp.json") if (out / n).is_file()),
                 out / "cost_model.json")
    machine, path = _cost_facts(curve)
    machine = {**(bench.get("cpu") or {}), **machine}
    replay = bench.get("replay_check") or {}
    return {
        "schema": SCHEMA, "kind": "benchmark", "config": config_name, "command": command,
        **provenance(out, duration_s, curve), "config_hash": config_hash(config), "machine": machine,
        "compute_path": path,
        "pair": {"draft": config["models"]["draft"], "target": config["models"]["target"]},
        "n_prompts": len(bench.get("prompt_ids") or []), "max_new_tokens": config["max_new_tokens"],
        "temperature": config.get("temperature", 0.0), "prompts_of_run": bench.get("prompts_of_run"),
        "samples_per_prompt": config.get("samples_per_prompt", 1),
        "partial": (bench.get("prompts_of_run") or 0) > len(bench.get("prompt_ids") or []),
        "n_boot": config.get("n_boot"), "seed": config.get("seed"),
        "rows": [_pick(r, ROW_FIELDS) for r in bench["rows"]],
        "replay_check": replay.get("summary"),
        "replay_rows": [_pick(r, CHECK_FIELDS) for r in replay.get("rows") or []],
        "comparisons": bench.get("comparisons") or [], "recommended": bench.get("recommended"),
        "recommendation": bench.get("recommendation") or [], "curve": curve_facts(curve),
    }


def invocation(module: str, argv: list[str] | None) -> tuple[str, str]:
    """(the command that ran, the config's name): ``python -m <module> <argv>`` without ``--results_dir``, and the
    stem of its ``--config`` file (``custom`` without one)."""
    args = list(sys.argv[1:] if argv is None else argv)
    kept, name, skip = [], "custom", False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a == "--results_dir" or a.startswith("--results_dir="):
            skip = a == "--results_dir"
            continue
        if a == "--config" and i + 1 < len(args):
            name = Path(args[i + 1]).stem
        elif a.startswith("--config="):
            name = Path(a.split("=", 1)[1]).stem
        kept.append(a)
    return shlex.join(["python", "-m", module, *kept]), name


def summary_name(summary: dict[str, Any]) -> str:
    """``benchmark-benchmark-full-zen-4-avx-512-bf16-2026-11-25.json``: kind, config, CPU kind, date."""
    slug = "-".join(cpu_kind(summary["machine"]).lower().replace(",", " ").split())
    return f"{summary['kind']}-{summary['config']}-{slug}-{summary['date']}.json"


def compact_json(value: Any, indent: int = 0) -> str:
    """JSON with one entry a line, but a list of plain values (a per-prompt column) on one line: a summary with
    per-prompt records stays a file one reads."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {compact_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and value and any(isinstance(v, dict | list) for v in value):
        return "[\n" + ",\n".join(inner + compact_json(v, indent + 1) for v in value) + f"\n{pad}]"
    return json.dumps(value)


MAIN_JOB_RECORDS = "records.parquet"
"""In a main job's out_dir: the per-token and per-sequence records its figures are recomputed from
(``main_job.verify``), copied beside its stored summary (:func:`sidecar_path`)."""


def sidecar_path(summary_path: Path) -> Path:
    """``results/<summary name>.records.parquet``: a stored main job's records, named after its summary."""
    return summary_path.with_name(summary_path.stem + ".records.parquet")


def main_job_records(out_dir: str | Path) -> Path | None:
    """A finished main job's records file (None when it wrote none: no evaluation)."""
    path = Path(out_dir) / MAIN_JOB_RECORDS
    return path if path.is_file() else None


def write_summary(summary: dict[str, Any], results_dir: str | Path, records: Path | None = None) -> Path:
    """Write ``summary`` into ``results_dir`` (atomically) and a main job's ``records`` beside it
    (:func:`sidecar_path`; a sidecar left from another run of that name is removed when it has none); returns the
    summary's file."""
    validate(summary, Path("<new summary>"))
    folder = Path(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / summary_name(summary)
    side = sidecar_path(path)
    if records is not None:
        tmp_side = side.with_name(side.name + ".tmp")
        shutil.copyfile(records, tmp_side)
        tmp_side.replace(side)
    elif summary["kind"] == "main_job":
        side.unlink(missing_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(compact_json(summary) + "\n")
    tmp.replace(path)
    return path


def validate(data: Any, path: Path) -> None:
    """Raise :class:`SummaryError` naming ``path`` and the first missing or malformed field."""
    if not isinstance(data, dict):
        raise SummaryError(f"{path}: not a JSON object")
    if data.get("schema") != SCHEMA:
        raise SummaryError(f"{path}: field 'schema' is {data.get('schema')!r}, expected {SCHEMA!r}")
    if data.get("kind") not in KINDS:
        raise SummaryError(f"{path}: field 'kind' is {data.get('kind')!r}, expected one of {', '.join(KINDS)}")
    for key in REQUIRED[data["kind"]]:
        if key not in data:
            raise SummaryError(f"{path}: field {key!r} missing")
    for key in ("draft", "target"):
        if not isinstance(data["pair"], dict) or key not in data["pair"]:
            raise SummaryError(f"{path}: field 'pair.{key}' missing")
    key, need = ITEMS[data["kind"]]
    items = data[key]
    if not isinstance(items, list) or not items:
        raise SummaryError(f"{path}: field {key!r} is empty")
    for i, item in enumerate(items):
        for key in need:
            if not isinstance(item, dict) or key not in item:
                raise SummaryError(f"{path}: field {key!r} missing in entry {i}")


def load_summaries(results_dir: str | Path) -> list[Summary]:
    """Every ``*.json`` summary in ``results_dir``, validated, oldest first by date then name."""
    folder = Path(results_dir)
    if not folder.is_dir():
        raise SummaryError(f"{folder}: no such results folder (pass --results_dir)")
    out = []
    for path in sorted(folder.glob("*.json")):
        data = _read_json(path)
        validate(data, path)
        out.append(Summary(path, data))
    return sorted(out, key=lambda s: (s.data["date"], s.path.name))


def newest(summaries: list[Summary], kind: str) -> Summary | None:
    """The last stored summary of ``kind`` (summaries load oldest first), or None."""
    runs = [s for s in summaries if s.kind == kind]
    return runs[-1] if runs else None


@dataclass(frozen=True)
class Disagreement:
    """A stored figure that its records do not give."""

    row: str
    field: str
    stored: Any
    recomputed: Any

    def line(self, where: str) -> str:
        return (f"{where}: row {self.row!r}, field {self.field!r}: stored {self.stored!r}, recomputed "
                f"{self.recomputed!r}")
