"""Native decoder layers (compute/native_layers.py): the bits of transformers' layers on the packed-bf16 path, every
test once per kernel ISA this CPU runs (each ISA has its own build of the layer)."""
from __future__ import annotations

import copy

import pytest
import torch

from compute import compute_path as cp
from compute import native_layers
from compute.models import tiny_model
from tests.kernel_isas import KERNEL_ISAS, use_isa


@pytest.fixture(params=KERNEL_ISAS, autouse=True)
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test of this module runs on each kernel ISA (SPECSTOP_ISA)."""
    use_isa(monkeypatch, request.param)
    return request.param


def _pair(int8: bool = False, hidden: int = 64, layers: int = 3) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(native, transformers' layers) of one tiny Qwen2 model on the packed-bf16 path."""
    base = tiny_model(3, hidden=hidden, layers=layers).eval()
    native, plain = copy.deepcopy(base), copy.deepcopy(base)
    stats = cp.apply_compute_path(native, "packed-bf16", bf16_head=True, min_elements=0, int8_weights=int8)
    cp.apply_compute_path(plain, "packed-bf16", bf16_head=True, min_elements=0, int8_weights=int8,
                          native_layers_on=False)
    assert stats["native_layers"] == layers and native_layers.installed(plain) == 0
    return native, plain


def _steps(model: torch.nn.Module, prompt: torch.Tensor, tail: torch.Tensor, mask: torch.Tensor | None = None,
           chunk: int = 1) -> torch.Tensor:
    """Logits of the prompt's forward and of the tail fed ``chunk`` tokens at a time over the cache, concatenated."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = [model(prompt, attention_mask=mask, past_key_values=cache).logits]
    for i in range(0, tail.shape[1], chunk):
        t = tail[:, i : i + chunk]
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(t)], 1)
        out.append(model(t, attention_mask=mask, past_key_values=cache).logits)
    return torch.cat(out, 1)


def _count_native_calls(model: torch.nn.Module) -> dict[str, int]:
    """Count the calls that reach the layers' native objects (a fallback to transformers' layers counts none)."""
    calls = {"n": 0}
    for layer in model.modules():
        nat = getattr(layer, "specstop_native", None)
        if nat is not None:
            def counted(*args, _forward=nat.forward):
                calls["n"] += 1
                return _forward(*args)
            nat.forward = counted
    return calls


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
def test_native_layers_compute_the_bits_of_transformers_layers(int8: bool, chunk: int) -> None:
    native, plain = _pair(int8)
    calls = _count_native_calls(native)
    prompt = torch.tensor([[1, 5, 9, 33, 70, 2, 44, 18]])
    tail = torch.tensor([[7, 99, 3, 250, 12, 61, 8]])
    with torch.inference_mode():
        assert torch.equal(_steps(native, prompt, tail, chunk=chunk), _steps(plain, prompt, tail, chunk=chunk))
    assert calls["n"] == 3 * (1 + -(-tail.shape[1] // chunk))  # every layer of every forward ran natively


def test_generate_runs_the_native_layers() -> None:
    """transformers' generate (and the model's forward it calls) reaches the native layers, whatever keyword this
    transformers version passes the layers their cache by (``cache`` from 5.24, ``past_key_values`` before)."""
    native, plain = _pair()
    calls = _count_native_calls(native)
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    with torch.inference_mode():
        a = native.generate(ids, max_new_tokens=4, do_sample=False)
        b = plain.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(a, b) and calls["n"] == 3 * 4


def test_native_layers_take_a_left_padded_batch_and_keep_hidden_state_capture() -> None:
    native, plain = _pair()
    ids = torch.tensor([[256, 256, 1, 5, 9, 33], [4, 8, 15, 16, 23, 42]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    tail = torch.tensor([[7, 99], [3, 250]])
    with torch.inference_mode():
        assert torch.equal(_steps(native, ids, tail, mask), _steps(plain, ids, tail, mask))
        a = native(ids, attention_mask=mask, output_hidden_states=True).hidden_states
        b = plain(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))  # the layers' forward hooks still run


def test_the_layer_output_tap_of_a_companion_sees_the_native_layers() -> None:
    from compute.models import layer_output

    native, plain = _pair()
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    seen = {}
    with torch.inference_mode():
        for name, model in (("native", native), ("plain", plain)):
            with layer_output(model.model.layers, 2) as s:
                model(ids)
            seen[name] = s[-1]
    assert torch.equal(seen["native"], seen["plain"])


def test_native_layers_leave_with_the_row_invariant_attention_and_come_back_with_it() -> None:
    native, plain = _pair()
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    cp.use_row_invariant_attention(native, False)  # SDPA (labelling): transformers' layers
    assert native_layers.installed(native) == 0
    with torch.inference_mode():
        cp.use_row_invariant_attention(plain, False)
        assert torch.equal(native(ids).logits, plain(ids).logits)
    cp.use_row_invariant_attention(native, True)
    assert native_layers.installed(native) == 3


def test_training_mode_and_autograd_run_transformers_layers() -> None:
    native, plain = _pair()
    ids = torch.tensor([[1, 5, 9, 33, 70]])
    emb = native.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = native(inputs_embeds=emb).logits  # grad mode: the Python layers (the native one keeps no graph)
    with torch.no_grad():
        ref = plain(inputs_embeds=emb.detach()).logits
    assert torch.equal(out.detach(), ref)
