"""The CPU compute path: packed linears equal eager ones, packed models decode the same tokens, bad options are
named."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compute import compute_path as cp
from compute import cpu, path_choice
from compute.models import ModelSpec, load_model, model_fingerprint
from tests.kernel_isas import KERNEL_ISAS, use_isa

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 16])
def test_packed_linear_fp32_equals_eager(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias)
    x = torch.randn(2, rows, 96)
    ref = lin(x)
    packed = cp.PackedLinear(lin, torch.float32)
    out = packed(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert packed.weight.shape == lin.weight.shape  # shape-only stand-in for callers that read it


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN without bf16")
def test_packed_linear_bf16_returns_fp32_close_to_eager() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(256, 128)
    x = torch.randn(5, 256)
    out = cp.PackedLinear(lin, torch.bfloat16)(x)
    ref = nn.functional.linear(x.bfloat16(), lin.weight.bfloat16()).float() + lin.bias
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert (out - lin(x)).abs().max() < 0.05


BF16_ONEDNN = pytest.param("packed-bf16+onednn", marks=pytest.mark.skipif(
    not cp.native_bf16(), reason="oneDNN without bf16"))
"""packed-bf16 on oneDNN's kernels (``native_gemm=False``)."""
BF16 = [pytest.param(f"packed-bf16@{isa.values[0]}", marks=isa.marks) for isa in KERNEL_ISAS]
"""packed-bf16 on specstop's kernel of each ISA this CPU runs (``@isa``: SPECSTOP_ISA)."""
BF16_INT8 = [pytest.param(f"packed-bf16+int8@{isa.values[0]}", marks=isa.marks) for isa in KERNEL_ISAS]
"""packed-bf16 on specstop's kernel of each ISA with int8 weights (``int8_weights=True``, what draft-side models
get)."""


def _on_isa(path: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``path`` without its ``@isa``, whose kernels this test then runs."""
    path, _, isa = path.partition("@")
    if isa:
        use_isa(monkeypatch, isa)
    return path


def _greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=256, eos_token_id=None)
    return out[0, ids.shape[1]:].tolist()


def test_packed_model_decodes_the_same_tokens_as_eager() -> None:
    eager, _ = load_model(ModelSpec("tiny:2:32:3", compute="eager"))
    packed, _ = load_model(ModelSpec("tiny:2:32:3", compute="eager"))
    stats = cp.apply_compute_path(packed, "packed", min_elements=0)
    assert stats["packed_layers"] == 3 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    assert cp.compute_path_of(packed) == "packed" and cp.compute_path_of(eager) == "eager"
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)
    assert _greedy(packed, ids, 24) == _greedy(eager, ids, 24)


def test_load_model_keeps_tiny_models_eager_and_the_fingerprint_reads_a_packed_head() -> None:
    model, tok = load_model(ModelSpec("tiny:1"))  # auto: resolves to a packed path on CPU, tiny layers stay eager
    assert not any(isinstance(m, cp.PackedLinear) for m in model.modules())
    fp = model_fingerprint(model, tok)
    assert fp["compute_path"] == "eager" and fp["dtype"] == "float32"
    cp.apply_compute_path(model, "packed", min_elements=0)
    assert fp["pack_layout"] == "eager" and fp["gemm"] == "eager" and fp["weights"] == "eager"
    assert model_fingerprint(model, tok) == {**fp, "compute_path": "packed", "pack_layout": "fused", "gemm": "onednn",
                                             "weights": "float32"}


def test_auto_picks_the_fastest_path_this_cpu_runs(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """specstop's kernel where it runs, else oneDNN's bf16, else oneDNN fp32, else eager; anything but the kernel is
    said in one log line."""
    monkeypatch.setattr(cp.bf16_gemm, "available", lambda which=None: True)
    assert cp.resolve_compute_path("auto", "cpu") == "packed-bf16"
    monkeypatch.setattr(cp.bf16_gemm, "available", lambda which=None: False)
    monkeypatch.setattr(cp.bf16_gemm, "unavailable_reason", lambda which=None: "no compiler")
    monkeypatch.setattr(path_choice, "native_bf16", lambda: True)
    with caplog.at_level("INFO", logger="compute.path_choice"):
        assert cp.resolve_compute_path("auto", "cpu") == "packed-bf16"
        monkeypatch.setattr(path_choice, "native_bf16", lambda: False)
        assert cp.resolve_compute_path("auto", "cpu") == "packed"
        assert cp.resolve_compute_path("auto", "cpu") == "packed"
    said = [r.getMessage() for r in caplog.records]
    assert said == ["compute path auto: packed-bf16 (oneDNN's bf16; specstop's kernel is unavailable: no compiler)",
                    "compute path auto: packed (oneDNN fp32: no compiler)"]  # one line each, not one per model
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert cp.resolve_compute_path("auto", "cpu") == "eager"
    assert cp.resolve_compute_path("auto", "cuda:0") == "eager"
    assert cp.resolve_compute_path("eager", "cuda:0") == "eager"


def _fake_cpu(monkeypatch: pytest.MonkeyPatch, name: str, flags: list[str], x86: bool = True) -> None:
    """Make this process see another CPU: its model name, SIMD flags and architecture (SPECSTOP_ISA unset)."""
    monkeypatch.setattr(cpu, "cpu_model", lambda: {"model_name": name, "simd_flags": flags,
                                                   "torch_cpu_capability": "", "torch": torch.__version__})
    monkeypatch.setattr(cpu, "is_x86", lambda: x86)
    monkeypatch.delenv("SPECSTOP_ISA", raising=False)


def test_a_cpu_with_neither_kernel_gets_a_path_that_exists(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """An aarch64 CPU (no x86 flags, no kernel): auto says packed in one line, packed-bf16 is refused naming packed,
    SPECSTOP_ISA is refused naming what the CPU is."""
    _fake_cpu(monkeypatch, "Neoverse-N1", [], x86=False)
    monkeypatch.setattr(path_choice, "native_bf16", lambda: False)
    assert cp.bf16_gemm.isa() == "none" and not cp.bf16_gemm.available() and cp.bf16_gemm.chain() == "none"
    with caplog.at_level("INFO", logger="compute.path_choice"):
        assert cp.resolve_compute_path("auto", "cpu") == "packed"
    assert "compute path auto: packed (oneDNN fp32: Neoverse-N1 is not x86-64)" in caplog.text
    assert cp.cpu_info()["bf16_chain"] == "none"
    with pytest.raises(ValueError, match="Neoverse-N1.*has neither: use --models.compute packed"):
        cp.resolve_compute_path("packed-bf16", "cpu")
    monkeypatch.setenv("SPECSTOP_ISA", "avx2")
    with pytest.raises(ValueError, match="SPECSTOP_ISA=avx2 needs an x86-64 CPU.*leave it unset"):
        cp.bf16_gemm.isa()


def test_specstop_isa_names_what_the_cpu_has(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cpu(monkeypatch, "AMD EPYC 7B13", ["avx", "avx2", "fma"])
    assert cp.bf16_gemm.isa() == "avx2" and cp.bf16_gemm.gemm_name() == "specstop-avx2"
    monkeypatch.setenv("SPECSTOP_ISA", "avx512")
    with pytest.raises(ValueError, match=r"SPECSTOP_ISA=avx512 needs AVX512-BF16 .*AMD EPYC 7B13\) lacks avx512f, "
                                         r"avx512bw, avx512vl, avx512_bf16 and has AVX2 with FMA: use "
                                         r"SPECSTOP_ISA=avx2"):
        cp.bf16_gemm.isa()
    monkeypatch.setenv("SPECSTOP_ISA", "avx3")
    with pytest.raises(ValueError, match="SPECSTOP_ISA='avx3': use avx512 or avx2"):
        cp.resolve_compute_path("auto", "cpu")
    _fake_cpu(monkeypatch, "Intel Atom", ["avx"])
    monkeypatch.setenv("SPECSTOP_ISA", "avx2")
    with pytest.raises(ValueError, match="lacks avx2, fma and has neither kernel ISA: leave it unset"):
        cp.bf16_gemm.isa()


def test_bad_compute_paths_name_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="models.compute='fast'.*auto, packed, packed-bf16, eager"):
        cp.resolve_compute_path("fast", "cpu")
    with pytest.raises(ValueError, match="--models.compute eager"):
        cp.resolve_compute_path("packed", "cuda:0")
    monkeypatch.setattr(path_choice, "native_bf16", lambda: False)
    monkeypatch.setattr(cp.bf16_gemm, "available", lambda which=None: False)
    with pytest.raises(ValueError, match="AVX512-BF16, or AVX2 with FMA.*AMX-BF16.*--models.compute packed"):
        cp.resolve_compute_path("packed-bf16", "cpu")
    with pytest.raises(ValueError, match="compute='turbo'"):
        ModelSpec("tiny:1", compute="turbo")
    with pytest.raises(ValueError, match="dtype float32"):
        load_model(ModelSpec("tiny:1", dtype="bfloat16", compute="packed"))


def test_cpu_info_names_the_model_and_flags() -> None:
    info = cp.cpu_info()
    assert set(info) >= {"model_name", "simd_flags", "torch_cpu_capability", "threads", "torch", "bf16_chain"}
    assert info["torch"] == torch.__version__ and info["bf16_chain"] in ("amx", "avx512-bf16", "avx2", "none")


def test_without_cpu_flags_the_kernel_names_its_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /proc/cpuinfo is missing (the flags unknown) the bf16 chain is the kernel's own answer, not 'none'."""
    _fake_cpu(monkeypatch, "", [])
    monkeypatch.setattr(cp.bf16_gemm, "chain", lambda which=None: "avx512-bf16")
    if cp.bf16_gemm.isa() != "none":  # the kernels built and ran here
        assert cp.cpu_info()["bf16_chain"] == "avx512-bf16"
    _fake_cpu(monkeypatch, "x", ["avx2"])  # no FMA: neither kernel, and no build to say so
    assert cp.cpu_info()["bf16_chain"] == "none"


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_the_fingerprint_and_the_machine_name_the_kernels_isa(isa: str, monkeypatch: pytest.MonkeyPatch) -> None:
    use_isa(monkeypatch, isa)
    model, tok = load_model(ModelSpec("tiny:1", compute="eager"))
    cp.apply_compute_path(model, "packed-bf16", min_elements=0)
    assert model_fingerprint(model, tok)["gemm"] == ("specstop" if isa == "avx512" else "specstop-avx2")
    assert cp.cpu_info()["bf16_chain"] in (("amx", "avx512-bf16") if isa == "avx512" else ("avx2",))


def test_a_predictor_from_data_of_another_precision_is_warned_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    from predictors.export import check_fingerprint

    stored = {"name": "d", "vocab_size": 10, "hidden_size": 4, "dtype": "float32", "compute_path": "eager"}
    with caplog.at_level("WARNING"):
        check_fingerprint(stored, {**stored, "compute_path": "packed-bf16"}, where="disco")
    assert "compute_path 'eager' (its data) vs 'packed-bf16' (in use)" in caplog.text
    assert "--models.compute" in caplog.text


def _labelled_folder(path, fingerprints: dict) -> None:
    """A data folder with one (empty) shard, labelled with these models' fingerprints."""
    import json

    (path / "shard-00000.parquet").write_bytes(b"")
    (path / "config.json").write_text(json.dumps({"resolved": {"fingerprints": fingerprints}}))


def test_a_data_folder_is_not_resumed_on_another_compute_path(tmp_path) -> None:
    from data_gen.generate import check_same_precision

    fp = {"draft": {"compute_path": "packed-bf16"}, "target": {"compute_path": "packed-bf16"}}
    _labelled_folder(tmp_path, fp)
    check_same_precision(tmp_path, fp)  # same path: fine
    with pytest.raises(FileExistsError, match="--models.compute packed-bf16"):
        check_same_precision(tmp_path, {**fp, "target": {"compute_path": "packed"}})


def test_a_data_folder_is_not_resumed_with_another_head_dtype(tmp_path) -> None:
    """A folder labelled with float32 heads: a bf16-head draft or target may not add to it."""

    from data_gen.generate import check_same_precision

    old = {"draft": {"compute_path": "packed-bf16", "head_dtype": "float32"},
           "target": {"compute_path": "packed-bf16", "head_dtype": "float32"}}
    _labelled_folder(tmp_path, old)
    now = {"draft": {"compute_path": "packed-bf16", "head_dtype": "bfloat16"},
           "target": {"compute_path": "packed-bf16", "head_dtype": "float32"}}
    with pytest.raises(FileExistsError, match="--models.bf16_draft_head false"):
        check_same_precision(tmp_path, now)
    check_same_precision(tmp_path, {**now, "draft": {**now["draft"], "head_dtype": "float32"}})
    with pytest.raises(FileExistsError, match="--models.bf16_target_head false"):  # the target's own option
        check_same_precision(tmp_path, {**now, "draft": {**now["draft"], "head_dtype": "float32"},
                                        "target": {**now["target"], "head_dtype": "bfloat16-fp32-logits"}})


def test_a_data_folder_with_rounded_bf16_logits_is_not_resumed_with_fp32_logits(tmp_path) -> None:
    """Before specstop's kernel returned its fp32 sums, bf16 heads rounded the logits: no head option reproduces
    that on the kernel, and the message says what does."""
    from data_gen.generate import check_same_precision

    old = {"draft": {"compute_path": "packed-bf16", "head_dtype": "bfloat16", "gemm": "specstop"}}
    _labelled_folder(tmp_path, old)
    with pytest.raises(FileExistsError, match="native_gemm false gives rounded bf16 logits"):
        check_same_precision(tmp_path, {"draft": {**old["draft"], "head_dtype": "bfloat16-fp32-logits"}})


@pytest.mark.parametrize("role,recorded,key,now,option,same", [
    ("target", {"pack_layout": "fused", "gemm": "onednn"}, "gemm", "specstop", "--models.native_gemm false", "onednn"),
    ("draft", {"gemm": "specstop", "weights": "bfloat16"}, "weights", "int8", "--models.int8_draft false", "bfloat16"),
])
def test_a_data_folder_is_not_resumed_with_another_gemm_kernel_or_weight_type(
        tmp_path, role: str, recorded: dict, key: str, now: str, option: str, same: str) -> None:
    """A folder labelled on oneDNN's kernel, or with bfloat16 weights: a model on specstop's kernel or with int8
    weights may not add to it."""
    from data_gen.generate import check_same_precision

    old = {"compute_path": "packed-bf16", **recorded}
    _labelled_folder(tmp_path, {role: old})
    with pytest.raises(FileExistsError, match=option):
        check_same_precision(tmp_path, {role: {**old, key: now}})
    check_same_precision(tmp_path, {role: {**old, key: same}})


def test_a_data_folder_is_not_resumed_on_another_kernel_isa(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder labelled on the AVX2 kernel names SPECSTOP_ISA=avx2 to an AVX-512 process, and the other way round;
    on a CPU without the folder's ISA it says so."""
    from data_gen.generate import check_same_precision

    fp = {"compute_path": "packed-bf16", "pack_layout": "fused", "gemm": "specstop-avx2"}
    _fake_cpu(monkeypatch, "AMD EPYC 9B14", ["avx2", "avx512bw", "avx512f", "avx512vl", "avx512_bf16", "fma"])
    _labelled_folder(tmp_path, {"target": fp})
    check_same_precision(tmp_path, {"target": fp})
    with pytest.raises(FileExistsError, match="set SPECSTOP_ISA=avx2 to resume it"):
        check_same_precision(tmp_path, {"target": {**fp, "gemm": "specstop"}})
    with pytest.raises(FileExistsError, match="SPECSTOP_ISA=avx2 and pass --models.native_gemm true"):
        check_same_precision(tmp_path, {"target": {**fp, "gemm": "onednn"}})
    _labelled_folder(tmp_path, {"target": {**fp, "gemm": "specstop"}})
    monkeypatch.setenv("SPECSTOP_ISA", "avx2")
    with pytest.raises(FileExistsError, match="set SPECSTOP_ISA=avx512 to resume it"):
        check_same_precision(tmp_path, {"target": fp})
    _fake_cpu(monkeypatch, "AMD EPYC 7B13", ["avx", "avx2", "fma"])
    with pytest.raises(FileExistsError, match="its AVX512-BF16 kernel does not run on this CPU"):
        check_same_precision(tmp_path, {"target": fp})


def test_precision_compares_the_fields_both_fingerprints_record() -> None:
    assert cp.precision_diffs({"compute_path": "eager"}, {"compute_path": "eager", "gemm": "eager"}) == {}
    assert cp.precision_diffs({"compute_path": "packed", "gemm": "onednn"}, {"compute_path": "packed",
                                                                             "gemm": "specstop"}) == {
        "gemm": ("onednn", "specstop")}
    assert cp.precision_diffs({"compute_path": "eager"}, {"compute_path": "packed", "weights": "float32"}) == {
        "compute_path": ("eager", "packed")}


@pytest.mark.parametrize("isa", KERNEL_ISAS)
def test_int8_weights_pack_every_linear_of_a_draft_and_stay_close_to_bf16(isa: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every packed layer (LM head included with bf16_head) stores int8; logits within the int8 rounding of bf16's;
    a target-side head kept fp32 keeps fp32 weights; the fingerprint records ``weights``."""
    use_isa(monkeypatch, isa)
    bf16, tok = load_model(ModelSpec("tiny:3:64:2", compute="eager"))
    int8, _ = load_model(ModelSpec("tiny:3:64:2", compute="eager"))
    cp.apply_compute_path(bf16, "packed-bf16", bf16_head=True, min_elements=0)
    stats = cp.apply_compute_path(int8, "packed-bf16", bf16_head=True, min_elements=0, int8_weights=True)
    packs = [m for m in int8.modules() if isinstance(m, cp.PackedLinear)]
    assert packs and all(m.weights == "int8" and m.packed_weight.dtype == torch.int8 for m in packs)
    assert stats["bytes_after"] == sum(m.out_features * m.in_features for m in packs)  # one byte a weight
    assert model_fingerprint(int8, tok)["weights"] == "int8" and model_fingerprint(bf16, tok)["weights"] == "bfloat16"
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 44, 18]])
    with torch.no_grad():
        a, b = int8(ids).logits, bf16(ids).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    head_fp32, _ = load_model(ModelSpec("tiny:3:64:2", compute="eager"))
    cp.apply_compute_path(head_fp32, "packed-bf16", min_elements=0, int8_weights=True)
    assert head_fp32.get_output_embeddings().weights == "float32"
    plain, _ = load_model(ModelSpec("tiny:3:64:2", compute="eager"))
    if not cp.native_bf16():  # an AVX2-only CPU: oneDNN has no bf16, refused in one line naming specstop's kernel
        with pytest.raises(ValueError, match="native_gemm true"):
            cp.apply_compute_path(plain, "packed-bf16", min_elements=0, native_gemm=False, int8_weights=True)
        return
    assert cp.apply_compute_path(plain, "packed-bf16", min_elements=0, native_gemm=False,
                                 int8_weights=True)["weights"] == "bfloat16"  # oneDNN: no int8, nothing else changes


def test_a_data_folder_is_not_resumed_with_another_pack_layout(tmp_path) -> None:
    """A folder whose draft packed every linear on its own ("per-layer"): a fused draft may not add to it."""

    from data_gen.generate import check_same_precision

    old = {"draft": {"compute_path": "packed-bf16", "pack_layout": "per-layer"}}
    _labelled_folder(tmp_path, old)
    with pytest.raises(FileExistsError, match="--models.fuse_linears false"):
        check_same_precision(tmp_path, {"draft": {"compute_path": "packed-bf16", "pack_layout": "fused"}})
    check_same_precision(tmp_path, {"draft": {"compute_path": "packed-bf16", "pack_layout": "per-layer"}})


@pytest.mark.parametrize("path", ["packed", *BF16])
def test_fused_siblings_compute_the_bits_of_separate_packs(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v and gate/up as one GEMM each: same logits, bit for bit, as every linear packed on its own, in a prompt
    forward and in one-token steps over a cache."""
    from transformers import DynamicCache

    path = _on_isa(path, monkeypatch)
    fused, _ = load_model(ModelSpec("tiny:2:32:3", compute="eager"))
    separate, _ = load_model(ModelSpec("tiny:2:32:3", compute="eager"))
    stats = cp.apply_compute_path(fused, path, min_elements=0)
    cp.apply_compute_path(separate, path, min_elements=0, fuse=False)
    assert stats["fused_groups"] == 3 * 2 and stats["packed_layers"] == 3 * 7 + 1
    assert cp.pack_layout_of(fused) == "fused" and cp.pack_layout_of(separate) == "per-layer"
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.k_proj, cp.PackedSlice) and attn.k_proj.weight.shape == (attn.k_proj.out_features, 32)
    assert isinstance(fused.model.layers[0].mlp, cp.GatedMLP) and not isinstance(separate.model.layers[0].mlp,
                                                                                   cp.GatedMLP)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 44, 18]])
    with torch.inference_mode():
        assert torch.equal(fused(ids).logits, separate(ids).logits)
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, separate(ids).logits)
        caches = DynamicCache(), DynamicCache()
        fused(ids, past_key_values=caches[0])
        separate(ids, past_key_values=caches[1])
        for tok in (7, 99, 3):
            step = torch.tensor([[tok]])
            assert torch.equal(fused(step, past_key_values=caches[0]).logits,
                               separate(step, past_key_values=caches[1]).logits)


@pytest.mark.parametrize("path", ["packed", *BF16])
def test_the_gated_mlp_in_row_chunks_computes_the_bits_of_the_models_own_mlp(path: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """silu(gate) * up worked in chunks of a few rows, from the GEMM's own dtype: the same logits, bit for bit, as
    transformers' MLP on the same fused packs, for a prompt that spans several chunks and for one-token steps."""
    from transformers import DynamicCache

    path = _on_isa(path, monkeypatch)
    gated, _ = load_model(ModelSpec("tiny:2:32:3", compute="eager"))
    own, _ = load_model(ModelSpec("tiny:2:32:3", compute="eager"))
    cp.apply_compute_path(gated, path, min_elements=0)
    with monkeypatch.context() as m:
        m.setattr(cp, "_gated_mlps", lambda model: [])  # the model's own MLP class over the same fused packs
        cp.apply_compute_path(own, path, min_elements=0)
    mlp = gated.model.layers[1].mlp
    assert isinstance(mlp, cp.GatedMLP) and isinstance(own.model.layers[1].mlp.gate_proj, cp.PackedSlice)
    monkeypatch.setattr(cp.GatedMLP, "CHUNK_ELEMENTS", 3 * mlp.intermediate)  # chunks of 3 rows
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 44, 18, 3, 3, 90, 41, 7, 8, 11, 64]])
    with torch.no_grad():
        caches = DynamicCache(), DynamicCache()
        assert torch.equal(gated(ids, past_key_values=caches[0]).logits, own(ids, past_key_values=caches[1]).logits)
        for tok in (7, 99, 3):
            step = torch.tensor([[tok]])
            assert torch.equal(gated(step, past_key_values=caches[0]).logits,
                               own(step, past_key_values=caches[1]).logits)


def test_a_fused_slice_called_alone_or_out_of_order_still_gives_its_own_columns() -> None:
    torch.manual_seed(0)
    lins = [nn.Linear(16, n) for n in (8, 4, 4)]
    group = cp.FusedLinears(lins, torch.float32)
    slices = [cp.PackedSlice(group, i, 16, lin.out_features, torch.float32) for i, lin in enumerate(lins)]
    x, y = torch.randn(3, 16), torch.randn(3, 16)
    with torch.no_grad():
        for s, lin, inp in ((slices[1], lins[1], x), (slices[1], lins[1], y), (slices[0], lins[0], x),
                            (slices[2], lins[2], y)):
            torch.testing.assert_close(s(inp), lin(inp), rtol=1e-5, atol=1e-5)
        x2 = x.clone()
        slices[0](x2)
        x2.mul_(2)  # changed in place: the kept output is stale
        torch.testing.assert_close(slices[1](x2), lins[1](x2), rtol=1e-5, atol=1e-5)
        for s in slices:  # every part read: the input is let go
            s(x)
    assert group._out is None and group._key is None


def test_models_config_packs_draft_side_heads_in_bf16_and_weights_in_int8_only() -> None:
    from data_gen.config import ModelsConfig

    mc = ModelsConfig(compute="packed-bf16")
    assert mc.spec("d", "draft").bf16_head and mc.spec("c", "companion").bf16_head
    assert not mc.spec("d", "draft").fp32_logits and mc.spec("t").fp32_logits and mc.spec("t", "target").fp32_logits
    assert mc.spec("t", "target").bf16_head  # fp32 logits: a bf16 head only where the kernel returns its sums
    assert not ModelsConfig(bf16_target_head=False).spec("t", "target").bf16_head
    assert not ModelsConfig(bf16_draft_head=False).spec("d", "draft").bf16_head
    assert mc.spec("d", "draft").int8_weights and mc.spec("c", "companion").int8_weights
    assert not mc.spec("t", "target").int8_weights
    assert not ModelsConfig(int8_draft=False).spec("d", "draft").int8_weights
    with pytest.raises(ValueError, match="role='verifier'"):
        mc.spec("x", "verifier")


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN without bf16")
def test_bf16_head_is_recorded_in_the_fingerprint() -> None:
    from compute.models import model_fingerprint

    model, tok = load_model(ModelSpec("tiny:1", compute="eager"))
    assert model_fingerprint(model, tok)["head_dtype"] == "float32"
    cp.apply_compute_path(model, "packed-bf16", bf16_head=True, min_elements=0, native_gemm=False)
    assert model_fingerprint(model, tok)["head_dtype"] == "bfloat16"  # oneDNN: logits rounded to bf16
    assert model.get_output_embeddings().pack_dtype == torch.bfloat16




def _packed_tiny(path: str, spec: str = "tiny:2:32:3"):
    model, _ = load_model(ModelSpec(spec, compute="eager"))
    path, _, kernel = path.partition("+")
    stats = cp.apply_compute_path(model, path, min_elements=0, native_gemm=kernel != "onednn",
                                  int8_weights=kernel == "int8")
    if kernel == "onednn":
        assert stats["gemm"] == "onednn"
    if kernel == "int8":
        assert stats["weights"] == "int8" == cp.weights_of(model)
    assert stats["row_invariant_attention"] and model.config._attn_implementation == cp.ROW_INVARIANT_ATTENTION
    return model


@pytest.mark.parametrize("path", ["packed", *BF16, BF16_ONEDNN, *BF16_INT8])
def test_a_packed_forward_is_batch_invariant(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A position's logits have the same bits in a one-token step, a chunk of L tokens and the prompt."""
    from transformers import DynamicCache

    path = _on_isa(path, monkeypatch)
    model = _packed_tiny(path)
    prompt = torch.tensor([[1, 5, 9, 33, 70, 2, 44, 18]])
    tail = torch.tensor([[7, 99, 3, 250, 12, 61, 8]])
    with torch.no_grad():
        whole = model(torch.cat([prompt, tail], 1)).logits[0, prompt.shape[1]:]  # every token in one forward
        cache = DynamicCache()
        model(prompt, past_key_values=cache)
        steps = torch.cat([model(tail[:, i : i + 1], past_key_values=cache).logits[0] for i in range(tail.shape[1])])
        for chunk in (2, 3, 7):
            cache = DynamicCache()
            model(prompt, past_key_values=cache)
            chunks = torch.cat([model(tail[:, i : i + chunk], past_key_values=cache).logits[0]
                                for i in range(0, tail.shape[1], chunk)])
            assert torch.equal(chunks, steps), chunk
    assert torch.equal(whole, steps)


def test_row_invariant_attention_equals_sdpa_with_left_padding_and_grouped_heads() -> None:
    """Same values as transformers' SDPA (to rounding) on a left-padded batch with 4 query heads over 2 key heads."""
    model = _packed_tiny("packed")
    reference = _packed_tiny("packed")
    reference.set_attn_implementation("sdpa")
    ids = torch.tensor([[256, 256, 1, 5, 9, 33], [4, 8, 15, 16, 23, 42]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        out, ref = model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits
    torch.testing.assert_close(out[0, 2:], ref[0, 2:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["packed", *BF16, BF16_ONEDNN, *BF16_INT8])
def test_speculative_decoding_on_a_packed_pair_reproduces_target_only_token_for_token(
        path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an int8 draft (``+int8``) the target stays bf16, as ``ModelsConfig.spec`` loads them."""
    path = _on_isa(path, monkeypatch)
    from decoding.engine import SpeculativeDecoder
    from decoding.policies import build_policy

    draft, target = _packed_tiny(path, "tiny:1"), _packed_tiny(path.removesuffix("+int8"))
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    ref = _greedy(target, ids, 40)
    for spec in ("static:3", "static:7", "max_confidence:0.5"):
        out, _ = SpeculativeDecoder(draft, target, build_policy(spec)).generate(ids, None, 40, None, 0)
        assert out[0, ids.shape[1]:].tolist() == ref, spec


def test_the_eager_path_keeps_the_models_attention() -> None:
    model, _ = load_model(ModelSpec("tiny:1", compute="eager"))
    before = model.config._attn_implementation
    assert cp.apply_compute_path(model, "eager") == {"compute_path": "eager", "packed_layers": 0}
    assert model.config._attn_implementation == before != cp.ROW_INVARIANT_ATTENTION


def test_row_invariant_attention_can_be_turned_off_and_on_for_work_that_needs_no_invariance() -> None:
    model = _packed_tiny("packed")
    cp.use_row_invariant_attention(model, False)
    assert model.config._attn_implementation == "sdpa"
    cp.use_row_invariant_attention(model, True)
    assert model.config._attn_implementation == cp.ROW_INVARIANT_ATTENTION
    eager, _ = load_model(ModelSpec("tiny:1", compute="eager"))
    cp.use_row_invariant_attention(eager, True)  # an eager model keeps its attention
    assert eager.config._attn_implementation != cp.ROW_INVARIANT_ATTENTION
