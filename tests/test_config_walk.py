"""scripts/config_walk.py: the walk of the benchmark's config counts what its docstring says, on a planted project and
on this one.

On this repository the walk is held to bounds that keep the config read where the run is put together
(``benchmark/run.py``): fewer than 6 climbs back up a layer (half of the 12 it made when the benchmark was
one module, fd1b1be, under the same definition) and at most 40 stops (44 then). A part that takes the whole config
instead of the settings it uses adds its internals to the walk and breaks the bounds.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # as `python scripts/config_walk.py` runs it: its folder on the path
import config_walk  # noqa: E402

PYPROJECT = """[tool.importlinter]
root_packages = ["low", "pipelines"]

[[tool.importlinter.contracts]]
type = "layers"
layers = ["pipelines", "low"]
"""
BENCHMARK = """from dataclasses import dataclass

from low.util import consume, unrelated
from pipelines.other import Holder, parse


@dataclass
class BenchmarkConfig:
    n: int = 1


def main(argv=None):
    cfg = parse(BenchmarkConfig, argv)
    unrelated(3)
    run(cfg)
    run(cfg)


def run(cfg: BenchmarkConfig) -> None:
    consume(cfg.n)
    holder = Holder(cfg, model=None)
    holder.go()
    unrelated(holder.model)
"""
OTHER = """from dataclasses import dataclass

from low.util import consume
from pipelines.benchmark import BenchmarkConfig


def parse(cls, argv):
    return cls()


@dataclass
class Holder:
    cfg: BenchmarkConfig
    model: object

    def go(self) -> None:
        consume(self.cfg.n)
"""
UTIL = """def consume(n):
    return n


def unrelated(x):
    return x
"""


def planted(tmp_path: Path) -> Path:
    files = {"pyproject.toml": PYPROJECT, "pipelines/__init__.py": "", "pipelines/benchmark.py": BENCHMARK,
             "pipelines/other.py": OTHER,
             "low/__init__.py": "", "low/util.py": UTIL}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_walk_counts_a_planted_project(tmp_path):
    result = config_walk.walk_config(planted(tmp_path))
    # main, parse (given the class), run (once: a depth-first walk), consume (a read: not walked), the carrier Holder
    # built with the config and its method; unrelated() gets no config (holder.model is not the config)
    assert result.step_list == [("pipelines/benchmark.py", "main"), ("pipelines/other.py", "parse"),
                                ("pipelines/benchmark.py", "run"), ("low/util.py", "consume"),
                                ("pipelines/other.py", "Holder"), ("pipelines/other.py", "Holder.go")]
    assert result.trail == ["pipelines/benchmark.py", "pipelines/other.py", "pipelines/benchmark.py", "low/util.py",
                            "pipelines/other.py"]
    assert (result.stops, result.files, result.climbs, result.returns) == (5, 3, 1, 2)
    assert result.visits == {"pipelines/benchmark.py": 2, "pipelines/other.py": 2, "low/util.py": 1}
    back = config_walk.walk_config(tmp_path, config_walk.Rules(back=True, repeats=True))
    assert back.trail[:4] == ["pipelines/benchmark.py", "pipelines/other.py", "pipelines/benchmark.py", "low/util.py"]
    assert back.stops > result.stops and back.climbs > result.climbs


def test_the_walk_runs_on_this_repository():
    result = config_walk.walk_config(ROOT)
    print(result.summary())
    assert result.entry == "pipelines/benchmark.py" and result.trail[0] == result.entry
    assert result.stops == result.files + result.returns == sum(result.visits.values())
    assert 0 < result.climbs < result.stops and result.files <= result.steps
    layers = {rel.split("/")[0] for rel in result.visits}
    assert {"pipelines", "compute", "data_gen", "decoding"} <= layers
    assert ("benchmark/run.py", "run_benchmark") in result.step_list
    assert result.climbs < 6 and result.stops <= 40, result.summary()
