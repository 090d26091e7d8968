"""Prose claims no measurement: outside the blocks `pipelines.results` renders from stored runs, README and docs carry
no speedup, interval, step time or throughput, only the constants of the rules they describe."""
from __future__ import annotations

import re
from pathlib import Path

from rendering.result_tables import block_pattern

ROOT = Path(__file__).resolve().parents[1]
MEASURED = re.compile(r"\d+\.\d+x|\[\s*[-+]?\d+\.\d+,\s*[-+]?\d+\.\d+\]"
                      r"|\d+(\.\d+)? ?(ms|GB/s|tok/s|tokens/s)\b")
"""What reads as a measured figure: a ratio, an interval, a step time, a bandwidth or a throughput."""
RULE_CONSTANTS = {
    ("docs/compute-path.md", "1.15x"),  # the generator's batch sizing: a step at most 1.15x the one-row step
    ("docs/compute-path.md", "24 GB/s"),  # the read bandwidth under which the slow-memory path is taken
    ("docs/vllm.md", "1.15x"),  # the recommendation's margin: a K predicted at least 1.15x the target alone
}


def figures_outside_rendered_blocks(path: Path) -> list[tuple[int, str]]:
    """(line, figure) of every measured-looking figure of ``path`` outside its ``<!-- results:... -->`` blocks (the
    renderer's own markers, each block's body blanked line for line)."""
    prose = block_pattern(r"[\w-]+").sub(lambda m: m.group(1) + "\n" * m.group(2).count("\n") + m.group(3),
                                         path.read_text())
    return [(number, m.group(0)) for number, line in enumerate(prose.splitlines(), 1) for m in MEASURED.finditer(line)]


def test_no_measured_figure_outside_a_rendered_block():
    stray = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        name = str(path.relative_to(ROOT))
        stray += [f"{name}:{line}: {fig}" for line, fig in figures_outside_rendered_blocks(path)
                  if (name, fig) not in RULE_CONSTANTS]
    assert not stray, "figures outside a rendered block (render them from results/ or remove them): " + "; ".join(stray)


def test_a_figure_inside_a_rendered_block_is_not_reported(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("ran 1.04x [1.01, 1.07]\n<!-- results:x -->\n1.50x\n<!-- /results:x -->\n12 ms a step\n")
    assert figures_outside_rendered_blocks(doc) == [(1, "1.04x"), (1, "[1.01, 1.07]"), (5, "12 ms")]
