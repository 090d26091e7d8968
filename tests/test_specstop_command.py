"""The ``specstop`` command: one name for every entry point, dispatching to the same ``pipelines.<command>.main``."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

from pipelines.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


def test_every_entry_point_is_a_command():
    """The commands are the modules of pipelines/ with a main() (the shared cli helper and the dispatcher aside)."""
    entries = set()
    for path in (ROOT / "pipelines").glob("*.py"):
        tree = ast.parse(path.read_text())
        if path.stem != "__main__" and any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
            entries.add(path.stem)
    assert entries == set(COMMANDS)


def test_the_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["specstop"] == "pipelines.__main__:main"


def test_help_lists_the_commands_and_an_unknown_one_is_named(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err


def test_a_command_runs_its_entry_point():
    """``specstop results --check true`` is ``python -m pipelines.results --check true`` (the stored tables agree)."""
    assert main(["results", "--check", "true"]) == 0
    proc = subprocess.run([sys.executable, "-m", "pipelines", "train", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "--crossval_folds" in proc.stdout, proc.stderr[-2000:]
