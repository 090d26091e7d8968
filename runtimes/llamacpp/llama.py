"""llama.cpp as a runtime of the pair, through llama-cpp-python (``bash scripts/setup.sh --llamacpp``): loading two GGUF
files (refused when their vocabularies differ), greedy decoding, llama.cpp's own verification curve as a ``CostModel``
with ``runtime="llamacpp"``, and a check that the installed build decodes on this CPU.

The curve times a draft step and the target's forward of L = 1..17 new tokens with ``logits_all`` (as speculative
verification reads every position), the cache rolled back through ``Llama.n_tokens``. The build check and its message:
docs/llamacpp.md.

Usage: python -m pipelines.measure_costs --runtime llamacpp --data_dir outputs/default/data
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import logging
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType

from compute.cpu import cpu_model, cpuinfo_fields
from compute.timing import CostModel

log = logging.getLogger(__name__)

__all__ = ["INSTALL_COMMAND", "LlamaCppMissing", "llama_cpp_module", "llama_cpp_available",
           "check_same_vocab", "GGUFVocab", "load_llama", "load_pair", "prefill", "generate_greedy", "file_type",
           "measure_llamacpp_curve", "BUILD_STAMP", "LlamaCppBuildBroken", "build_stamp", "host_isa",
           "rebuild_command", "write_check_gguf", "decode_in_child", "broken_message", "check_llama_build"]

INSTALL_COMMAND = "bash scripts/setup.sh --llamacpp"
"""How llama-cpp-python is installed (the pinned version, built from source for this CPU)."""


class LlamaCppMissing(ValueError):
    """llama-cpp-python is not importable; the message names the install command."""


def llama_cpp_available() -> bool:
    """llama-cpp-python is installed (found without importing it, which loads its native library)."""
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_module() -> ModuleType:
    """The ``llama_cpp`` module, imported on first use with llama.cpp's log silenced; :class:`LlamaCppMissing` naming
    the install command when absent."""
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
    """ValueError naming both files when the vocabularies differ: in size, or in the text of ``samples`` token ids (both
    ends, where special tokens live, and a fixed random draw)."""
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
    """A ``llama_cpp.Llama`` on ``path`` with ``n_threads`` threads, its log silenced; ``logits_all`` keeps every
    position's logits for verification."""
    lib = llama_cpp_module()
    return lib.Llama(model_path=str(path), n_ctx=int(n_ctx), n_threads=int(n_threads), n_threads_batch=int(n_threads),
                     logits_all=logits_all, verbose=False)


def load_pair(draft: Path, target: Path, n_threads: int, n_ctx: int) -> tuple[Any, Any]:
    """(draft, target) Llama objects of two GGUF files, the target with ``logits_all``: vocabularies compared before any
    weights load, the build checked once per process."""
    check_llama_build(int(n_threads))
    with GGUFVocab(draft) as d_vocab, GGUFVocab(target) as t_vocab:
        check_same_vocab(d_vocab, t_vocab, str(draft), str(target))
    return load_llama(draft, n_threads, n_ctx), load_llama(target, n_threads, n_ctx, logits_all=True)


def prefill(llm: Any, prompt: Sequence[int]) -> None:
    """Read the prompt into a reset ``logits_all`` target in one pass keeping only the last position's logits, as
    llama.cpp's speculative decoding does (``generate`` would copy every row)."""
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
    """Greedy decoding with ``Llama.generate`` from a reset state (with its ``draft_model``, if set), up to
    ``max_new_tokens``, cut after the first of ``stop_ids``; ``first_token_at`` gets the first token's time."""
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
    """Raw seconds of the draft's one-token steps over a cache of ``prompt``, ``repeats`` times after a fresh prefill.
    """
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
    """Raw seconds of the target's forward of L new tokens over the cached ``prompt``, by L, the lengths interleaved so
    load spreads over all."""
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
    """llama.cpp's verification curve on this machine: the draft's step and catch-up, the target's forward of each L
    over ``prompt_len`` cached tokens, the minimum of ``repeats``, made non-decreasing in L.

    The contexts must hold ``prompt_len + max(lengths) + decode_steps + 2`` tokens; ``draft_name`` / ``target_name``
    name the models as the run does, for :meth:`CostModel.mismatch`.
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


BUILD_STAMP = ".specstop-llamacpp"
"""The file under ``sys.prefix`` where ``scripts/setup.sh`` records the build's version, CMake flags, CPU and ISA."""
ISA_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi")
"""The /proc/cpuinfo flags a build depends on, as ``scripts/setup.sh`` records them (``isa=``)."""
CHECK_WIDTHS = {"hidden": 1536, "ffn": 8960, "heads": 12, "kv_heads": 2, "layers": 2, "vocab": 1024}
"""The check GGUF's shape: Qwen2.5-Coder-1.5B's widths (the packaged target), two layers, a small vocabulary."""
CHECK_PROMPT = 48
"""Tokens of the check's prompt pass: more than 2 x 16 rows, so ggml's AMX tile kernel runs where it is built."""
_CHILD = """
import json, sys
import numpy as np
import llama_cpp
path, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = llama_cpp.Llama(model_path=path, n_ctx=128, n_batch=64, n_threads=threads, n_threads_batch=threads,
                      verbose=False)
last = lambda: np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),)).copy()
prompt = list(range(3, 3 + n))
llm.eval(prompt)
batched = last()
llm.reset()
llm.eval(prompt[:-1])
llm.eval(prompt[-1:])
stepped = last()
for t in (7, 8, 9):
    llm.eval([t])
out = last()
print(json.dumps({"finite": bool(np.isfinite(out).all() and np.isfinite(batched).all()), "argmax": int(out.argmax()),
                  "batch_vs_step": float(np.abs(batched - stepped).max() / (batched.std() or 1.0))}))
"""
"""The check's child: the prompt in one batch, its last token again alone, three steps; prints whether the logits are
finite, the last argmax and the batch-vs-step difference."""


class LlamaCppBuildBroken(ValueError):
    """The installed llama-cpp-python dies decoding on this CPU; the message names its flags and the rebuild command."""


def build_stamp() -> dict[str, str]:
    """What ``scripts/setup.sh`` recorded of the installed build; empty when it kept none (built by hand)."""
    path = Path(sys.prefix) / BUILD_STAMP
    if not path.is_file():
        return {}
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def host_isa() -> str:
    """This CPU's build-relevant /proc/cpuinfo flags, sorted and space-separated, as ``scripts/setup.sh`` records them.
    """
    return " ".join(sorted(f for f in cpuinfo_fields().get("flags", "").split() if f.startswith(ISA_PREFIXES)))


def rebuild_command(stamp: dict[str, str]) -> str:
    """The command that rebuilds llama-cpp-python to run here: the setup script, or one changing the flags of a build
    made here."""
    here = stamp.get("isa") == host_isa() and stamp.get("cpu") == cpuinfo_fields().get("model name", "")
    if not stamp or not here:
        return INSTALL_COMMAND
    if "GGML_NATIVE=ON" in stamp.get("cmake_args", ""):
        return f"SPECSTOP_AMX=1 {INSTALL_COMMAND} (CMAKE_ARGS unset: ggml's AMX kernels left out)"
    return f"CMAKE_ARGS=-DGGML_NATIVE=OFF {INSTALL_COMMAND} (a build for any x86-64 CPU with AVX2)"


def _random_blocks(rng: np.random.Generator, qtype: GGMLQuantizationType, rows: int, cols: int,
                   scale: float) -> np.ndarray:
    """``rows x cols`` Q8_0 or Q4_K weights as GGUF bytes: random quants with every block scale ``scale``, so
    activations stay small and finite."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = np.full(2 if qtype == GGMLQuantizationType.Q4_K else 1, scale, dtype=np.float16).view(np.uint8)
    raw[:, : scales.size] = scales
    return raw.reshape(rows, cols // block * size)


def write_check_gguf(path: Path, widths: dict[str, int] | None = None, seed: int = 0) -> Path:
    """A llama-architecture GGUF of random Q4_K / Q8_0 weights at the packaged target's widths, so every matmul takes
    the kernels a real run does; its output is meaningless."""
    w = {**CHECK_WIDTHS, **(widths or {})}
    h, ffn, heads, kv, vocab = w["hidden"], w["ffn"], w["heads"], w["kv_heads"], w["vocab"]
    head_dim = h // heads
    rng = np.random.default_rng(seed)
    q4, q8 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0
    gw = GGUFWriter(str(path), "llama")
    gw.add_name("specstop llama.cpp build check")
    gw.add_context_length(512)
    gw.add_embedding_length(h)
    gw.add_feed_forward_length(ffn)
    gw.add_block_count(w["layers"])
    gw.add_head_count(heads)
    gw.add_head_count_kv(kv)
    gw.add_rope_dimension_count(head_dim)
    gw.add_layer_norm_rms_eps(1e-6)
    gw.add_file_type(int(LlamaFileType.MOSTLY_Q4_K_M))
    gw.add_tokenizer_model("llama")  # SentencePiece: control tokens, the 256 byte tokens, then plain ones
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)]]
    tokens += [f"\u2581t{i}" for i in range(vocab - len(tokens))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
    gw.add_token_list(tokens)
    gw.add_token_scores([0.0] * vocab)
    gw.add_token_types([int(t) for t in types] + [int(TokenType.NORMAL)] * (vocab - len(types)))
    gw.add_unk_token_id(0)
    gw.add_bos_token_id(1)
    gw.add_eos_token_id(2)
    gw.add_tensor("token_embd.weight", _random_blocks(rng, q8, vocab, h, 1e-3), raw_dtype=q8)
    gw.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    shapes = {"attn_q": (h, h, q4), "attn_k": (kv * head_dim, h, q4), "attn_v": (kv * head_dim, h, q4),
              "attn_output": (h, h, q4), "ffn_gate": (ffn, h, q4), "ffn_up": (ffn, h, q4), "ffn_down": (h, ffn, q8)}
    for i in range(w["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            gw.add_tensor(f"blk.{i}.{norm}.weight", np.ones(h, dtype=np.float32))
        for name, (rows, cols, qtype) in shapes.items():
            gw.add_tensor(f"blk.{i}.{name}.weight", _random_blocks(rng, qtype, rows, cols, 1e-4), raw_dtype=qtype)
    quiet = logging.getLogger("gguf.gguf_writer")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # its INFO lines name the temporary file
    try:
        gw.write_header_to_file()
        gw.write_kv_data_to_file()
        gw.write_tensors_to_file()
        gw.close()
    finally:
        quiet.setLevel(level)
    return path


def _no_core_file() -> None:
    """In the child before it runs: no core file where it dies (the check reports the death itself)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def decode_in_child(gguf: Path, n_threads: int, prompt_len: int = CHECK_PROMPT,
                    timeout_s: float = 300.0) -> dict[str, Any]:
    """Decode ``gguf`` in a child process as :data:`_CHILD` does; its result, or :class:`LlamaCppBuildBroken` where it
    dies by a signal (ValueError where it fails otherwise)."""
    cmd = [sys.executable, "-c", _CHILD, str(gguf), str(int(n_threads)), str(int(prompt_len))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, preexec_fn=_no_core_file)
    except subprocess.TimeoutExpired as e:
        raise TimeoutError(f"llama.cpp build check: decoding {gguf.name} took over {timeout_s:.0f} s") from e
    if done.returncode < 0:
        raise LlamaCppBuildBroken(broken_message(-done.returncode))
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"llama.cpp build check: decoding {gguf.name} in a child process failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def broken_message(signum: int) -> str:
    """One line: the build, how it died on this CPU, and the command that rebuilds it."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    why = " (an instruction this CPU or its kernel does not run)" if name == "SIGILL" else ""
    stamp = build_stamp()
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    built = (f"built with CMAKE_ARGS={stamp.get('cmake_args', '?')} on {stamp.get('cpu') or 'an unrecorded CPU'}"
             if stamp else f"built without a record of its flags (no {Path(sys.prefix) / BUILD_STAMP})")
    return (f"llama-cpp-python {version}, {built}, dies with {name}{why} decoding a GGUF of the packaged target's "
            f"widths on this CPU ({cpuinfo_fields().get('model name', '?')}): rebuild it with: "
            f"{rebuild_command(stamp)}")


@functools.cache
def check_llama_build(n_threads: int = 2) -> None:
    """Decode the check GGUF in a child process once per process and thread count; :class:`LlamaCppBuildBroken` (one
    line: flags, rebuild command) where the build dies here."""
    if not llama_cpp_available():
        raise LlamaCppMissing(f"llama-cpp-python is not installed; install it (built from source for this CPU) with: "
                              f"{INSTALL_COMMAND}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="specstop-llamacpp-check-") as tmp:
        decode_in_child(write_check_gguf(Path(tmp) / "check.gguf"), n_threads)
    log.info("llama.cpp build check: decodes on this CPU (%.1f s)", time.perf_counter() - t0)
