"""The CUDA path checked on a GPU host in one command: install what the host lacks from carried wheels, run the
``cuda`` tests, the smoke main job and the smoke benchmark on the GPU, and write a summary.

The GPU host has no network and takes the working tree plus at most 64 MiB of files along. Its python3 has torch
(CUDA), transformers, Lightning, pandas, pyarrow and scikit-learn; ``--prepare`` (here, with PyPI) puts the rest into
``.device-wheels/`` (gitignored, carried with the tree; ``scripts/device_wheels.py``), and the run installs it with pip
``--no-index``. Steps, in order, each under its own time limit within one budget (``DEVICE_CHECK_BUDGET`` seconds,
default 480), a failed step never stopping the next:

1. ``install``: the missing packages from ``.device-wheels/``;
2. ``pytest``: ``python -m pytest -m cuda tests/test_cuda.py`` (its smoke-benchmark test left to step 4, which runs
   the same command);
3. ``train``: the smoke main job (configs/smoke.yaml) with ``--data.models.device cuda`` and every predictor fitted by
   Lightning on the GPU;
4. ``benchmark``: the smoke benchmark (configs/benchmark-smoke.yaml) with ``--models.device cuda``; a row whose
   outputs differ from target-only's fails it.

The summary (``device-check.json`` and ``device-check.md``: the GPU, torch and CUDA versions, each step's status,
seconds and details, pytest's counts, the tail of each error) and each step's log go to ``$OUT`` (default
``outputs/device-check``), rewritten after every step, so that they can be stored under ``results/``. The commit is
read from git where the tree has it, else from ``DEVICE_CHECK_COMMIT`` (``--dry-run`` prints the command with it).
Native CPU kernels are off (``SPECSTOP_NATIVE=0``: the CUDA path uses none, and building them would cost minutes).

Usage::

    bash scripts/device_check.sh --prepare      # here, with PyPI: fill .device-wheels/
    bash scripts/device_check.sh --dry-run      # what would be carried and run; exits 0
    bash scripts/device_check.sh                # on the GPU host; without a GPU: one line, exit 2
    DEVICE_CHECK_DEVICE=cpu bash scripts/device_check.sh    # every step on the CPU: checks the script itself
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import device_wheels

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".device-wheels"
CARRY_LIMIT_MIB = 64
"""What the device machine takes along: the working tree and the carried paths together."""
CARRY_BUDGET_MIB = 60
BENCH_TEST = "tests/test_cuda.py::test_the_smoke_benchmark_runs_on_the_device"
LOG_TAIL_BYTES = 2_000_000
"""Each step's log copied to $OUT is cut to its last bytes (the device machine returns files of at most 16 MiB)."""
PROBE = """
import importlib.metadata as md, json, platform
facts = {"python": platform.python_version()}
for name in ("torch", "transformers", "pytorch-lightning", "lightning", "mlflow-skinny", "datasets", "pytest"):
    try:
        facts[name] = md.version(name)
    except md.PackageNotFoundError:
        facts[name] = None
try:
    import torch
    facts["torch_cuda"] = torch.version.cuda
    facts["cuda_available"] = torch.cuda.is_available()
    if facts["cuda_available"]:
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
except Exception as e:
    facts["cuda_available"] = False
    facts["torch_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(facts))
"""


@dataclass
class Step:
    """One step of the check: its command, time limit and outcome."""

    name: str
    cap: int
    argv: list[str]
    status: str = "not run"
    seconds: float = 0.0
    returncode: int | None = None
    tail: str = ""
    details: dict = field(default_factory=dict)


def work_dir() -> Path:
    return Path(os.environ.get("DEVICE_CHECK_WORK", "/tmp/specstop-device-check"))


def out_dir() -> Path:
    return Path(os.environ.get("OUT") or ROOT / "outputs" / "device-check")


def plan(py: str, device: str) -> list[Step]:
    """The steps on ``device`` (cuda, or cpu to check the script), with ``py`` as the Python."""
    work, accel = work_dir(), ("gpu" if device.startswith("cuda") else "cpu")
    uri = f"sqlite:///{work}/mlflow.db"
    fits = [a for kind in ("disco", "sprinter", "sv") for a in (f"--{kind}.accelerator", accel)]
    return [
        Step("install", 120, [py, "scripts/device_wheels.py", "install", str(WHEELS)]),
        Step("pytest", 240, [py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py",
                             "--deselect", BENCH_TEST, "--junitxml", str(work / "pytest.xml")]),
        Step("train", 240, [py, "-m", "pipelines.train", "--config", "configs/smoke.yaml", "--data.models.device",
                            device, *fits, "--out_dir", str(work / "train"), "--data.out_dir", str(work / "data"),
                            "--tracking_uri", uri]),
        Step("benchmark", 180, [py, "-m", "pipelines.benchmark", "--config", "configs/benchmark-smoke.yaml",
                                "--models.device", device, "--out_dir", str(work / "benchmark"), "--tracking_uri",
                                uri]),
    ]


def step_env(device: str) -> dict[str, str]:
    """The environment of every step: the tree importable, nothing fetched, caches and MLflow under the work dir."""
    work = work_dir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", MPLBACKEND="Agg", HF_HOME=str(work / "hf"),
               MLFLOW_TRACKING_URI=f"sqlite:///{work}/mlflow.db")
    env.setdefault("SPECSTOP_NATIVE", "0")
    if not device.startswith("cuda"):
        env["SPECSTOP_TEST_DEVICE"] = device
    return env


def run_command(argv: list[str], env: dict[str, str], log: Path, limit: float) -> tuple[int | None, float]:
    """Run ``argv`` in the tree root, its output to ``log``, killed (its whole process group) after ``limit``
    seconds; (exit code or None when it was killed, seconds)."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=grace)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            f.write(f"\n[killed after {limit:.0f} s]\n")
    return code, time.monotonic() - t0


def log_tail(log: Path, chars: int = 3000) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return text[-chars:]


def pytest_details(work: Path) -> dict:
    """pytest's counts from its JUnit XML."""
    path = work / "pytest.xml"
    if not path.is_file():
        return {}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    if suite is None:
        return {}
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    return {**counts, "failed": failed}


def train_details(work: Path) -> dict:
    """Each predictor's validation and test AUC from the main job's results.json."""
    path = work / "train" / "results.json"
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text()).get("results", [])
    return {"predictors": {r["predictor"]: {k: r.get(k) for k in ("status", "val_auc", "test_auc")}
                           for r in rows if isinstance(r.get("val_auc"), float)}}


def benchmark_details(work: Path) -> dict:
    """The rows of the benchmark and those whose outputs are not target-only's."""
    path = work / "benchmark" / "benchmark.json"
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text()).get("rows", [])
    return {"rows": len(rows), "exact": sum(r.get("exact") is True for r in rows),
            "not_exact": [r["row"] for r in rows if r.get("exact") is False],
            "tokens_per_s": {r["row"]: round(float(r.get("tokens_per_s") or 0), 1) for r in rows}}


def install_details(log: Path) -> dict:
    """The install step's own JSON line (what it installed, what is still missing, how)."""
    lines = [ln for ln in log_tail(log, 20000).splitlines() if ln.startswith("{")]
    try:
        return json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {}


def details_of(step: Step, work: Path, log: Path) -> dict:
    if step.name == "install":
        return install_details(log)
    if step.name == "pytest":
        return pytest_details(work)
    if step.name == "train":
        return train_details(work)
    if step.name == "benchmark":
        return benchmark_details(work)
    return {}


def run_step(step: Step, env: dict[str, str], deadline: float) -> None:
    """Run one step within its cap and what is left of the budget; fills its outcome."""
    work, out = work_dir(), out_dir()
    left = deadline - time.monotonic() - 5
    if left < 20:
        step.status, step.tail = "skipped", "the check's time budget (DEVICE_CHECK_BUDGET) was spent"
        return
    log = work / f"{step.name}.log"
    step.returncode, step.seconds = run_command(step.argv, env, log, min(step.cap, left))
    step.details = details_of(step, work, log)
    ok = step.returncode == 0 and not step.details.get("not_exact") and not step.details.get("still_missing")
    step.status = "timeout" if step.returncode is None else ("pass" if ok else "fail")
    if step.status != "pass":
        step.tail = log_tail(log)
    data = log.read_bytes()[-LOG_TAIL_BYTES:]
    (out / f"{step.name}.log").write_bytes(data)


def commit_facts() -> dict:
    """The commit the tree is at and whether it differs: DEVICE_CHECK_COMMIT / DEVICE_CHECK_DIRTY when set (a copied
    tree may carry a .git of another commit, or none), else git."""
    if os.environ.get("DEVICE_CHECK_COMMIT"):
        return {"commit": os.environ["DEVICE_CHECK_COMMIT"],
                "dirty": os.environ.get("DEVICE_CHECK_DIRTY", "unknown").lower() == "true"}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=20)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=60).stdout.strip() != ""
            return {"commit": head.stdout.strip(), "dirty": dirty}
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"commit": "unknown", "dirty": "unknown"}


def host_facts(py: str) -> dict:
    """Python, torch, CUDA and package versions (a probe in ``py``), and nvidia-smi's GPU line."""
    try:
        probe = subprocess.run([py, "-c", PROBE], capture_output=True, text=True, timeout=180)
        lines = probe.stdout.strip().splitlines()
        facts = json.loads(lines[-1]) if probe.returncode == 0 and lines else {
            "cuda_available": False, "torch_error": (probe.stderr.strip().splitlines() or ["probe failed"])[-1]}
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        facts = {"cuda_available": False, "torch_error": f"{type(e).__name__}: {e}"}
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        facts["nvidia_smi"] = smi.stdout.strip() if smi.returncode == 0 else f"nvidia-smi failed: {smi.stderr.strip()}"
    return facts


def step_line(step: Step) -> str:
    """A step's details in a few words, for the Markdown table."""
    d = step.details
    if step.name == "install":
        done = ", ".join(d.get("installed", [])) or "nothing"
        missing = f"; still missing: {', '.join(d['still_missing'])}" if d.get("still_missing") else ""
        return f"installed {done} ({d.get('how', '?')}){missing}" if d else ""
    if step.name == "pytest" and d:
        failed = f"; failed: {', '.join(d['failed'])}" if d.get("failed") else ""
        return (f"{d['passed']} passed, {d['failures']} failed, {d['errors']} errors, {d['skipped']} skipped"
                f"{failed}")
    if step.name == "train" and d.get("predictors"):
        return ", ".join(f"{k} val AUC {v['val_auc']:.3f}" for k, v in d["predictors"].items())
    if step.name == "benchmark" and d:
        wrong = f"; NOT exact: {', '.join(d['not_exact'])}" if d.get("not_exact") else ""
        return f"{d['rows']} rows, {d['exact']} exact (outputs equal target-only's){wrong}"
    return ""


def markdown(summary: dict) -> str:
    """The summary as a short Markdown page."""
    h, c = summary["host"], summary["commit"]
    gpu = h.get("gpu") or h.get("nvidia_smi") or "no GPU"
    lines = [
        "# CUDA path check (`bash scripts/device_check.sh`)", "",
        f"- date: {summary['date']}; commit {c['commit']} (dirty: {c['dirty']}); device {summary['device']}",
        f"- GPU: {gpu}" + (f" (nvidia-smi: {h['nvidia_smi']})" if h.get("nvidia_smi") else ""),
        f"- Python {h.get('python')}, torch {h.get('torch')} (CUDA {h.get('torch_cuda')}), transformers "
        f"{h.get('transformers')}, Lightning {h.get('pytorch-lightning') or h.get('lightning')}",
        f"- result: **{summary['result']}** ({summary['passed_steps']} of {len(summary['steps'])} steps passed) in "
        f"{summary['seconds']:.0f} s of a {summary['budget_s']} s budget", "",
        "| step | status | seconds | details |", "| --- | --- | ---: | --- |",
    ]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {s['line']} |"
              for s in summary["steps"]]
    errors = [s for s in summary["steps"] if s["tail"]]
    if errors:
        lines += ["", "## Errors"]
        for s in errors:
            lines += ["", f"### {s['name']} ({s['status']})", "", "```", s["tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def utc_now() -> str:
    """The time now, UTC, as the runs' code records write it (``2026-11-30T15:04:05Z``)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_summary(steps: list[Step], facts: dict, device: str, budget: int, t0: float, started: str) -> dict:
    """device-check.json and device-check.md in $OUT, from the steps run so far (``started``: the check's start, UTC;
    ``ended`` is when this summary was written)."""
    passed = sum(s.status == "pass" for s in steps)
    summary = {
        "kind": "device_check", "date": utc_now(), "started": started, "ended": utc_now(),
        "commit": commit_facts(), "device": device, "host": facts, "budget_s": budget,
        "seconds": round(time.monotonic() - t0, 1), "passed_steps": passed,
        "result": "PASS" if passed == len(steps) else "FAIL",
        "steps": [{**asdict(s), "line": step_line(s)} for s in steps],  # line: the details as the tables print them
    }
    out = out_dir()
    (out / "device-check.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "device-check.md").write_text(markdown(summary))
    return summary


def run(py: str) -> int:
    """The check; 2 (one line) where torch sees no GPU and the device is cuda, else 0 when every step passed."""
    device = os.environ.get("DEVICE_CHECK_DEVICE", "cuda")
    facts = host_facts(py)
    if device.startswith("cuda") and not facts.get("cuda_available"):
        why = facts.get("torch_error") or "torch.cuda.is_available() is false"
        print(f"device_check: no CUDA GPU here ({why}); run it on a GPU host, or --dry-run to see the plan")
        return 2
    t0, started = time.monotonic(), utc_now()
    budget = int(os.environ.get("DEVICE_CHECK_BUDGET", "480"))
    work, out = work_dir(), out_dir()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    steps, env = plan(py, device), step_env(device)
    for step in steps:
        run_step(step, env, t0 + budget)
        print(f"device_check: {step.name}: {step.status} in {step.seconds:.0f} s {step_line(step)}", flush=True)
        write_summary(steps, facts, device, budget, t0, started)
    bench_md = work / "benchmark" / "benchmark.md"
    if bench_md.is_file():
        shutil.copy2(bench_md, out / "benchmark.md")
    summary = write_summary(steps, facts, device, budget, t0, started)
    print(f"device_check: {summary['result']} ({summary['passed_steps']}/{len(steps)} steps) in "
          f"{summary['seconds']:.0f} s; summary in {out}/device-check.md")
    return 0 if summary["result"] == "PASS" else 1


def tree_bytes() -> tuple[int, int] | None:
    """(files, bytes) of what the device machine takes of the tree: tracked files and untracked ones git does not
    ignore; None without git."""
    try:
        ls = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if ls.returncode != 0:
        return None
    paths = [ROOT / p.decode() for p in ls.stdout.split(b"\0") if p]
    files = [p for p in paths if p.is_file() and not p.is_symlink()]
    return len(files), sum(p.stat().st_size for p in files)


def dry_run(py: str) -> int:
    """Print what would be carried and run; 0."""
    mib = 2**20
    wheels = sorted(WHEELS.glob("*.whl"))
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes()
    print("device_check --dry-run: nothing is installed or run")
    if tree is None:
        print("carry: the working tree (size unknown: no git here)")
    else:
        total = (tree[1] + wheel_bytes) / mib
        verdict = "fits" if total <= CARRY_BUDGET_MIB else f"OVER the {CARRY_BUDGET_MIB} MiB budget"
        print(f"carry: the working tree ({tree[0]} files, {tree[1] / mib:.1f} MiB: tracked and untracked files git "
              f"does not ignore) + .device-wheels ({len(wheels)} wheels, {wheel_bytes / mib:.1f} MiB) = "
              f"{total:.1f} MiB of the device machine's {CARRY_LIMIT_MIB} MiB: {verdict}")
    if not wheels:
        print("wheels: none in .device-wheels/: run bash scripts/device_check.sh --prepare here first")
    else:
        print(f"wheels for: {', '.join(device_wheels.REQUIREMENTS)} (installed only where the host lacks them)")
    device = os.environ.get("DEVICE_CHECK_DEVICE", "cuda")
    budget = int(os.environ.get("DEVICE_CHECK_BUDGET", "480"))
    print(f"steps on {device}, each capped, {budget} s in all (DEVICE_CHECK_BUDGET); work dir {work_dir()}:")
    for i, step in enumerate(plan(py, device), 1):
        print(f"  {i}. {step.name} (at most {step.cap} s): {' '.join(step.argv)}")
    print(f"summary: {out_dir()}/device-check.json, device-check.md, benchmark.md and one log per step")
    c = commit_facts()
    env = f"DEVICE_CHECK_COMMIT={c['commit']} DEVICE_CHECK_DIRTY={str(c['dirty']).lower()}"
    print(f"device run tool: command \"{env} bash scripts/device_check.sh\", carry [\".device-wheels\"], timeout_s 600")
    return 0


def main(argv: list[str]) -> int:
    py = os.environ.get("DEVICE_CHECK_PYTHON", sys.executable)
    if argv == ["--prepare"]:
        return device_wheels.prepare(WHEELS)
    if argv == ["--dry-run"]:
        return dry_run(py)
    if argv:
        print(f"device_check: unknown arguments {argv}; use --prepare, --dry-run or none (the check)", file=sys.stderr)
        return 2
    return run(py)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
