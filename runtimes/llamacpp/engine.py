"""llama.cpp as a runtime of the pair, through llama-cpp-python (an optional extra, ``bash scripts/setup.sh
--llamacpp``): loading the two GGUF files (:func:`load_pair`, refused before any work when their vocabularies
differ: :func:`check_same_vocab`), greedy decoding with ``Llama.generate`` (:func:`generate_greedy`), and the
verification curve of llama.cpp's own forward passes (:func:`measure_llamacpp_curve`) in the cost file format of
:class:`compute.timing.CostModel` with ``runtime="llamacpp"``.

The curve times what a speculative round costs in llama.cpp: the draft's one-token step over a KV cache, and the
target's forward of L = 1..17 new tokens (a round of 16 drafts verifies 17) over a cached prefix of random tokens
(``Llama.eval`` of L tokens, then the cache rolled back by setting ``Llama.n_tokens``: ``eval`` begins by removing
every cached position from ``n_tokens`` on). The target is loaded with ``logits_all=True``, as llama-cpp-python's
speculative decoding needs (the logits of every verified position), so each forward also copies its L rows of
logits, as verification does.

Usage::

    draft, target = load_pair(Path("draft.gguf"), Path("target.gguf"), n_threads=2, n_ctx=512)
    cm = measure_llamacpp_curve(draft, target, repeats=3)
    cm.to_json("outputs/cost_model.llamacpp.json")
"""
from __future__ import annotations

import importlib.util
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np
from gguf import LlamaFileType

from compute.cpu import cpu_model, cpuinfo_fields
from compute.timing import CostModel

log = logging.getLogger(__name__)

__all__ = ["INSTALL_COMMAND", "LlamaCppMissing", "llama_cpp_module", "llama_cpp_available",
           "check_same_vocab", "GGUFVocab", "load_llama", "load_pair", "prefill", "generate_greedy", "file_type",
           "measure_llamacpp_curve"]

INSTALL_COMMAND = "bash scripts/setup.sh --llamacpp"
"""How llama-cpp-python is installed (the version pyproject.toml's ``llamacpp`` extra pins, built from source once for
this CPU)."""


class LlamaCppMissing(ValueError):
    """llama-cpp-python is not importable; the message names the install command."""


def llama_cpp_available() -> bool:
    """llama-cpp-python is installed (found without importing it, which loads its native library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_module() -> ModuleType:
    """The ``llama_cpp`` module, imported on first use with llama.cpp's own log lines silenced (failures raise);
    :class:`LlamaCppMissing` naming :data:`INSTALL_COMMAND` when it is absent."""
    try:
        import llama_cpp  # optional dependency (the llamacpp extra): loads llama.cpp's native library
    except ImportError as e:
        raise LlamaCppMissing(f"llama-cpp-python is not installed ({e}); install it (built from source for this CPU) "
                              f"with: {INSTALL_COMMAND}") from e
    # its log callback prints what it maps at or above this level, and maps llama.cpp's warnings to ERROR;
    # Llama(verbose=False) sets ERROR again but silences its own loading: this quiets the vocabulary-only loads
    logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
    return llama_cpp


class Vocabulary(Protocol):
    """What the vocabulary check reads: the size and each token's text."""

    def n_vocab(self) -> int: ...

    def token_text(self, token: int) -> bytes: ...


def check_same_vocab(draft: Vocabulary, target: Vocabulary, draft_name: str, target_name: str,
                     samples: int = 4096) -> None:
    """ValueError naming both files when the vocabularies differ: their sizes, or the text of any of ``samples``
    token ids (the first and last 256, where special tokens live, and a fixed random draw of the rest)."""
    n_d, n_t = draft.n_vocab(), target.n_vocab()
    if n_d != n_t:
        raise ValueError(f"the draft {draft_name} and the target {target_name} have different vocabularies "
                         f"({n_d} vs {n_t} tokens): speculative decoding needs one tokenizer for both")
    ids = set(range(min(256, n_d))) | set(range(max(0, n_d - 256), n_d))
    rest = max(0, min(samples, n_d) - len(ids))
    ids |= set(np.random.default_rng(0).integers(0, n_d, rest).tolist()) if n_d else set()
    for i in sorted(ids):
        a, b = draft.token_text(i), target.token_text(i)
        if a != b:
            raise ValueError(f"the draft {draft_name} and the target {target_name} have different vocabularies "
                             f"(token {i} is {a!r} in one and {b!r} in the other): speculative decoding needs one "
                             "tokenizer for both")


class GGUFVocab:
    """A GGUF file's vocabulary read by llama.cpp alone (``vocab_only``: no weights), as a context manager."""

    def __init__(self, path: Path) -> None:
        self.lib = llama_cpp_module()
        self.lib.llama_backend_init()  # what Llama() runs first (idempotent)
        params = self.lib.llama_model_default_params()
        params.vocab_only = True
        self.model = self.lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not read the vocabulary of {path}")
        self.vocab = self.lib.llama_model_get_vocab(self.model)

    def n_vocab(self) -> int:
        return int(self.lib.llama_vocab_n_tokens(self.vocab))

    def token_text(self, token: int) -> bytes:
        return bytes(self.lib.llama_vocab_get_text(self.vocab, token) or b"")

    def __enter__(self) -> GGUFVocab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.lib.llama_model_free(self.model)


def load_llama(path: Path, n_threads: int, n_ctx: int, logits_all: bool = False) -> Any:
    """A ``llama_cpp.Llama`` on ``path`` with ``n_threads`` threads for decoding and prompt batches alike, its own log
    silenced; ``logits_all`` keeps every position's logits (a speculative target's verification reads them)."""
    lib = llama_cpp_module()
    return lib.Llama(model_path=str(path), n_ctx=int(n_ctx), n_threads=int(n_threads), n_threads_batch=int(n_threads),
                     logits_all=logits_all, verbose=False)


def load_pair(draft: Path, target: Path, n_threads: int, n_ctx: int) -> tuple[Any, Any]:
    """(draft, target) ``llama_cpp.Llama`` objects of two GGUF files, the target with ``logits_all=True``; their
    vocabularies are compared first (ValueError naming both files, before any weights load)."""
    with GGUFVocab(draft) as d_vocab, GGUFVocab(target) as t_vocab:
        check_same_vocab(d_vocab, t_vocab, str(draft), str(target))
    return load_llama(draft, n_threads, n_ctx), load_llama(target, n_threads, n_ctx, logits_all=True)


def prefill(llm: Any, prompt: Sequence[int]) -> None:
    """Read the prompt into a reset ``logits_all`` ``llm`` (a speculative target) with the last position's logits
    only: ``Llama.generate`` would compute and copy every prompt position's, which nothing reads and llama.cpp's own
    speculative decoding does not compute. ``generate`` then samples from the cached prompt; the prompt is read in
    one pass, as target-only's ``generate`` reads it (the same numbers: a pass split elsewhere can flip a near-tie)."""
    llm.reset()
    if not prompt or not getattr(llm, "_logits_all", False):
        return
    llm._logits_all = False  # llama-cpp-python's switch (no public one): eval's batches ask for their last logits only
    try:
        llm.eval(list(prompt))
    finally:
        llm._logits_all = True


def generate_greedy(llm: Any, prompt: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int],
                    first_token_at: list[float] | None = None) -> list[int]:
    """Greedy decoding with ``Llama.generate`` from a reset state (with the llm's ``draft_model``, if set; the prompt
    read as :func:`prefill` does): the new tokens up to ``max_new_tokens``, cut after the first of ``stop_ids``
    (included). ``first_token_at`` gets the ``time.perf_counter()`` of the first new token (the prompt's pass ends
    there)."""
    prefill(llm, prompt)
    stop, out = set(int(t) for t in stop_ids), []
    for tok in llm.generate(list(prompt), temp=0.0, reset=True):
        if not out and first_token_at is not None:
            first_token_at.append(time.perf_counter())
        out.append(int(tok))
        if out[-1] in stop or len(out) >= max_new_tokens:
            break
    return out


def file_type(llm: Any) -> str:
    """The GGUF file type of a loaded model (``q8_0``, ``q6_k``...), '' when its metadata does not say."""
    raw = getattr(llm, "metadata", {}).get("general.file_type")
    try:
        return LlamaFileType(int(raw)).name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()
    except (TypeError, ValueError):
        return ""


def _time_draft(llm: Any, prompt: list[int], steps: int, repeats: int, rng: np.random.Generator,
                vocab: int) -> list[float]:
    """Raw seconds of the draft's one-token steps over a cache of ``prompt``: ``repeats`` times a fresh prefill, a
    warm-up step and ``steps`` timed ones."""
    times = []
    for _ in range(repeats):
        llm.reset()
        llm.eval(prompt)
        llm.eval([int(rng.integers(0, vocab))])  # warm-up step
        for _ in range(steps):
            tok = [int(rng.integers(0, vocab))]
            t0 = time.perf_counter()
            llm.eval(tok)
            times.append(time.perf_counter() - t0)
    return times


def _time_target(llm: Any, prompt: list[int], lengths: list[int], repeats: int, rng: np.random.Generator,
                 vocab: int) -> dict[int, list[float]]:
    """Raw seconds of the target's forward of L new tokens over the cached ``prompt``, by L: ``repeats`` sweeps after
    a warm-up one, the lengths interleaved so that load spikes spread over all of them; the cache rolled back to the
    prompt before each forward."""
    llm.reset()
    llm.eval(prompt)
    new = {L: rng.integers(0, vocab, L).tolist() for L in lengths}
    raw: dict[int, list[float]] = {L: [] for L in lengths}
    for r in range(repeats + 1):  # the first sweep is a warm-up
        for L in lengths:
            llm.n_tokens = len(prompt)  # eval removes the cached positions from n_tokens on
            t0 = time.perf_counter()
            llm.eval(new[L])
            t1 = time.perf_counter()
            if r:
                raw[L].append(t1 - t0)
    llm.reset()
    return raw


def measure_llamacpp_curve(
    draft: Any, target: Any, lengths: Sequence[int] = tuple(range(1, 18)), prompt_len: int = 128, repeats: int = 5,
    decode_steps: int = 8, n_threads: int = 0, draft_name: str = "", target_name: str = "",
) -> CostModel:
    """The verification curve of llama.cpp on this machine: the draft's step, the draft's forward of two tokens over
    one of one (its catch-up after a fully accepted round: ``draft_catchup_s``) and the target's forward of each L in
    ``lengths`` over a cached prefix of ``prompt_len`` random tokens, the minimum of ``repeats`` kept and the curve
    made non-decreasing in L (:meth:`CostModel.with_statistic`), the raw timings in ``extra``.

    Args:
        draft, target: ``llama_cpp.Llama`` objects (:func:`load_pair`), their context at least ``prompt_len +
            max(lengths) + decode_steps + 2`` tokens.
        n_threads: the threads they run on (recorded in ``machine``).
        draft_name, target_name: how the run names the models (``packaged:<name>`` or the file), for
            :meth:`CostModel.mismatch`.
    """
    lengths = sorted(set(int(x) for x in lengths))
    if not lengths or lengths[0] < 1 or repeats < 1 or prompt_len < 1 or decode_steps < 1:
        raise ValueError(f"lengths {lengths} must be >= 1, and repeats ({repeats}), prompt_len ({prompt_len}) and "
                         f"decode_steps ({decode_steps}) >= 1")
    need = prompt_len + max(lengths[-1], decode_steps + 1) + 1
    if min(draft.n_ctx(), target.n_ctx()) < need:
        raise ValueError(f"the models' context ({min(draft.n_ctx(), target.n_ctx())} tokens) is shorter than the "
                         f"measurement needs ({need}): load them with a larger n_ctx")
    rng = np.random.default_rng(0)
    vocab = min(draft.n_vocab(), target.n_vocab())
    prompt = rng.integers(0, vocab, prompt_len).tolist()
    extra: dict[str, Any] = {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runtime": "llamacpp",
                             "draft_raw_s": _time_draft(draft, prompt, decode_steps, repeats, rng, vocab)}
    # the draft's forward of one and of two tokens over the same cache: the catch-up after a fully accepted round
    extra.update({f"draft_raw_s_L{L}": t for L, t in _time_target(draft, prompt, [1, 2], repeats, rng, vocab).items()})
    draft.reset()
    raw = _time_target(target, prompt, lengths, repeats, rng, vocab)
    extra.update({f"target_raw_s_L{L}": t for L, t in raw.items()})
    lib = llama_cpp_module()
    extra.update(llama_cpp_version=getattr(lib, "__version__", ""), draft_file_type=file_type(draft),
                 target_file_type=file_type(target),
                 system_info=lib.llama_print_system_info().decode(errors="replace").strip())
    cpu = cpuinfo_fields()
    machine = {**cpu_model(), "threads": int(n_threads), "cpu_family": cpu.get("cpu family", ""),
               "cpu_model_id": cpu.get("model", "")}
    cm = CostModel(
        draft_s_per_token=min(extra["draft_raw_s"]), target_s={L: min(t) for L, t in raw.items()},
        dtype=file_type(target) or "gguf", draft_name=draft_name or Path(draft.model_path).name,
        target_name=target_name or Path(target.model_path).name, prompt_len=prompt_len, compute_path="llamacpp",
        runtime="llamacpp", machine=machine, extra=extra,
        notes=(f"llama.cpp (llama-cpp-python {extra['llama_cpp_version']}): min of {repeats} repeats ({decode_steps} "
               f"draft steps each), verification times: lower monotone envelope in L; prefix of {prompt_len} random "
               "tokens; target with logits_all"),
    )
    return cm.with_statistic("min")  # the curve made non-decreasing in L from the raw timings
