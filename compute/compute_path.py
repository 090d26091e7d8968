"""The CPU compute path: every large linear layer of a loaded model runs on one prepacked weight (oneDNN's, or
specstop's bf16 GEMM).

Why: on x86 CPUs fp32 ``F.linear`` goes straight to the BLAS sgemm, whose small-M path reads the weights once per few
rows, so a target forward of 4 or 8 new tokens costs 2-3x one token and verification pays it on every round (see
DESIGN.md, "The compute path on CPU"). oneDNN packs a weight once into its blocked layout, valid for every row count M,
and its kernels keep a forward of up to ~8 rows close to the memory-bound cost of one row.

Paths (``ModelSpec.compute`` / ``--models.compute``):

- ``auto`` (default): on CPU ``packed-bf16`` when the CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16, and
  oneDNN says so), else ``packed``; on any other device ``eager``.
- ``packed``: fp32 weights in oneDNN's layout; same dtype as eager, results equal to eager up to summation order.
- ``packed-bf16``: weights packed in bfloat16; activations, norms, attention and the KV cache stay fp32 (inputs are
  rounded to bfloat16 at each linear, oneDNN accumulates in fp32 and rounds its output to bfloat16, which comes back
  as fp32). Half the weight bytes: about twice as fast
  per token and the 1.5B target fits in half the memory. It changes q and p slightly, so a data folder records the path
  it was labelled with (``compute_path`` in its config) and the decoder warns when a predictor's data used another.
- ``eager``: the model as transformers builds it (torch's default kernels).

Only ``nn.Linear`` layers with at least ``MIN_PACK_ELEMENTS`` weights are packed (tiny test models keep eager
numerics), and sibling layers that read the same input (q, k, v; gate, up: :data:`FUSED_GROUPS`) are packed as one
GEMM each, with the same bits as separate packs; the original weight is freed, so ``packed`` costs no extra memory
and ``packed-bf16`` halves the linears' (a tied LM head keeps the embedding it shares and adds its packed copy).

On ``packed-bf16`` the packs run on specstop's own GEMM (:mod:`compute.bf16_gemm`, AVX512-BF16) where the CPU has
it: it streams the weights once for up to 16 rows, where oneDNN's bf16 kernels slow down past 6 (the 1.5B target's
forward of 8 new tokens 73.7 against 84.9 ms, one token 55.1 against 64.3 ms, Zen 5); on a CPU with AMX-BF16 it runs
on the tile unit, and a target forward of 16 new tokens costs 1.13x one token (Intel Xeon with AMX, 2 threads).
``native_gemm=False`` keeps oneDNN's; the fingerprint records which (``gemm``). There, draft-side models
(``int8_weights``) store their weights as int8 with per-channel scales: half the bytes of a draft step, which reading
them bounds (the fingerprint's ``weights``).

Exactness: on both packed paths a forward is batch-invariant, i.e. a position's logits have the same bits whether it
is computed in a one-token step, in a verification forward of L tokens or in the prompt. specstop's bf16 GEMM is so by
construction; on oneDNN PackedLinear keeps every row count on one kernel (padding fewer than ``MIN_ROWS`` rows); and
the model's attention is switched to :func:`row_invariant_attention`. So greedy speculative decoding reproduces the
path's own one-token decoding token for token, in bfloat16 too.

Usage::

    from compute.compute_path import apply_compute_path, resolve_compute_path
    path = resolve_compute_path("auto", torch.device("cpu"))        # e.g. "packed-bf16"
    stats = apply_compute_path(model, path)                         # {"packed_layers": 197, ...}
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from compute import bf16_gemm, cpu, native_layers
from compute.native import NativeExtension

log = logging.getLogger(__name__)

__all__ = [
    "COMPUTE_PATHS",
    "MIN_PACK_ELEMENTS",
    "MIN_ROWS",
    "ROW_INVARIANT_ATTENTION",
    "PackedLinear",
    "FUSED_GROUPS",
    "FusedLinears",
    "GatedMLP",
    "PackedSlice",
    "pack_layout_of",
    "precision_diffs",
    "PRECISION_DEFAULTS",
    "PRECISION_OPTIONS",
    "precision_option",
    "gemm_resume_hint",
    "apply_compute_path",
    "head_dtype_of",
    "compute_path_of",
    "gemm_of",
    "weights_of",
    "cpu_info",
    "native_bf16",
    "resolve_compute_path",
    "auto_cpu_path",
    "row_invariant_attention",
    "use_row_invariant_attention",
]

COMPUTE_PATHS = ("auto", "packed", "packed-bf16", "eager")
MIN_PACK_ELEMENTS = 1 << 18
"""Linear layers with fewer weights than this stay eager (262,144: a 512 x 512 layer)."""
MIN_ROWS = 4
"""PackedLinear pads a call of fewer rows to this many on oneDNN's kernels (specstop's bf16 GEMM needs no padding).
Any value >= 2 makes a forward batch-invariant (oneDNN's one-row GEMV sums in another order); 4 because on AMD EPYC
Zen 4 (avx512_bf16, 2 threads) the whole 1.5B target's one-token step took 150 ms padded to 4 rows, 199 ms padded to 2
and 174 ms unpadded (bf16; fp32 196 / 304 / 238 ms), oneDNN's kernels for 1-3 rows being slower than for 4 there; on
the Intel host of issue 12 1-4 rows cost the same."""


def cpu_info() -> dict[str, Any]:
    """:func:`cpu_model`, the torch threads in use now (a thread count set later is not missed) and the instructions
    specstop's bf16 GEMM runs on here (``bf16_chain``: amx, avx512-bf16, avx2 or none, :func:`compute.bf16_gemm.chain`;
    ``SPECSTOP_ISA`` counts)."""
    model = cpu.cpu_model()
    # a CPU with neither kernel ISA runs no chain: no build of a kernel just to say so (where the flags are unknown, no
    # /proc/cpuinfo, bf16_gemm.isa asks the kernels)
    chain = "none" if bf16_gemm.isa() == "none" else bf16_gemm.chain()
    return {**model, "threads": torch.get_num_threads(), "bf16_chain": chain}


def native_bf16() -> bool:
    """True when this CPU computes bfloat16 dot products in hardware (AVX512-BF16 or AMX-BF16) and oneDNN uses it."""
    flags = set(cpu.cpu_model()["simd_flags"])
    has_isa = bool(flags & {"avx512_bf16", "amx_bf16"})
    return has_isa and torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_compute_path(path: str, device: torch.device | str) -> str:
    """The concrete path for ``path`` on ``device``: ``auto`` picks (:func:`auto_cpu_path` on the CPU); an explicit
    path is checked.

    Raises:
        ValueError: an unknown path, or a packed path asked for on a device or CPU that lacks it (the message names
            the option ``--models.compute`` and the value that works), or a ``SPECSTOP_ISA`` this CPU lacks.
    """
    if path not in COMPUTE_PATHS:
        raise ValueError(f"models.compute={path!r}: use one of {', '.join(COMPUTE_PATHS)}")
    dev = torch.device(device)
    if path == "auto":
        return auto_cpu_path() if dev.type == "cpu" else "eager"
    if path == "eager":
        return path
    if dev.type != "cpu":
        raise ValueError(f"models.compute={path!r} is a CPU path but models.device={dev}; use --models.compute eager "
                         f"(or auto) on {dev.type}")
    if not torch.backends.mkldnn.is_available():
        raise ValueError(f"models.compute={path!r} needs oneDNN (mkldnn), which this torch build lacks; use "
                         f"--models.compute eager")
    if path == "packed-bf16" and not (bf16_gemm.available() or native_bf16()):
        raise ValueError(f"models.compute=packed-bf16 needs specstop's bf16 kernel (a CPU with AVX512-BF16, or AVX2 "
                         f"with FMA, and a C++ compiler: {bf16_gemm.unavailable_reason()}) or oneDNN's bf16 "
                         f"(AVX512-BF16 or AMX-BF16); this CPU ({cpu.cpu_model()['model_name'] or 'unknown'}) has "
                         f"neither: use --models.compute packed (or eager)")
    return path


def auto_cpu_path() -> str:
    """The fastest exact path this CPU runs: ``packed-bf16`` on specstop's kernel (AVX512-BF16 / AMX, or AVX2) or on
    oneDNN's bf16, else ``packed`` (oneDNN fp32), else ``eager``; a path other than specstop's kernel is said in one
    log line (with the reason)."""
    if not torch.backends.mkldnn.is_available():
        path, why = "eager", "this torch build has no oneDNN"
    elif bf16_gemm.available():
        return "packed-bf16"
    elif native_bf16():
        path, why = "packed-bf16", f"oneDNN's bf16; specstop's kernel is unavailable: {bf16_gemm.unavailable_reason()}"
    else:
        path, why = "packed", f"oneDNN fp32: {bf16_gemm.unavailable_reason()}"
    _say_once(f"compute path auto: {path} ({why})")
    return path


@functools.lru_cache(maxsize=8)
def _say_once(message: str) -> None:
    log.info(message)


class PackedLinear(nn.Module):
    """``nn.Linear`` whose weight lives once in oneDNN's blocked layout (fp32 or bfloat16), for inference.

    The forward takes and returns the activations' own dtype (fp32); with a bfloat16 pack the input is rounded to
    bfloat16 and the output, accumulated in fp32 and rounded to bfloat16 by the kernel, comes back as fp32
    (``fp32_out``, on specstop's kernel: the fp32 sums unrounded, for LM heads). Each row's
    result has the same bits whatever the number of rows in the call (fewer than ``MIN_ROWS`` are zero-padded).
    No autograd.
    """

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, native: bool = False, int8: bool = False,
                 fp32_out: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.pack_dtype = dtype
        # the bf16 pack runs on specstop's kernel (compute.bf16_gemm) when asked and this CPU has it, else oneDNN's
        self.kernel = "specstop" if native and dtype == torch.bfloat16 and linear.in_features % 2 == 0 else "onednn"
        # the kernel's ISA (avx512 or avx2), fixed at packing: the pack is that kernel's
        self.isa = bf16_gemm.isa() if self.kernel == "specstop" else None
        # an LM head on specstop's kernel returns its fp32 sums unrounded (logits keep fp32 resolution)
        self.fp32_out = bool(fp32_out and self.kernel == "specstop")
        # int8 weights (per-output-channel scales) exist on specstop's kernel only; activations stay bf16
        self.weights = "int8" if int8 and self.kernel == "specstop" else str(dtype).removeprefix("torch.")
        scale = None
        if self.weights == "int8":
            packed, scale = bf16_gemm.pack_int8(linear.weight, self.isa)
        elif self.kernel == "specstop":
            packed = bf16_gemm.pack(linear.weight.detach().to(dtype).contiguous(), self.isa)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach().to(dtype).contiguous(), None)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("weight_scale", scale, persistent=False)
        # the bias is added in the activations' dtype (fp32) after the GEMM, so a bf16 pack rounds only x and W
        b = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", b, persistent=False)
        self._out_dtype = linear.weight.dtype

    @property
    def weight(self) -> torch.Tensor:
        """A shape-only stand-in (meta tensor): callers read ``weight.shape``; the data is in ``packed_weight``."""
        return torch.empty((self.out_features, self.in_features), dtype=self._out_dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [N, in] (pack dtype, at least MIN_ROWS rows) -> oneDNN -> [N, out] -> [..., out]
        lead = x.shape[:-1]
        x2, n = self._rows(x.reshape(-1, self.in_features))
        return self._gemm(x2, n).reshape(*lead, self.out_features)

    def raw(self, x2: torch.Tensor) -> torch.Tensor:
        """[N, in] -> [N, out] in the pack's dtype, as oneDNN returns it (no bias: for layers without one), for a
        caller that works on the GEMM's own output (:class:`GatedMLP`)."""
        if self.bias is not None:
            raise ValueError("PackedLinear.raw is for layers without a bias")
        x2, n = self._rows(x2)
        return self._pack_gemm(x2)[:n]

    def _rows(self, x2: torch.Tensor) -> tuple[torch.Tensor, int]:
        """([max(N, MIN_ROWS), in] in the pack's dtype, contiguous; N) for the GEMM."""
        n = x2.shape[0]
        if n < MIN_ROWS and self.kernel == "onednn":
            # oneDNN runs one row on a GEMV kernel whose summation order differs from its kernel for 2+ rows (which
            # gives every row the same bits whatever M is); zero rows keep one-token steps on that kernel, so a
            # verification forward of L tokens reproduces L one-token steps bit for bit. Padding to 4 rather than 2:
            # measured faster (see MIN_ROWS). One zero buffer and one converting copy: the per-call work outside
            # the GEMM is most of a decoding step's non-GEMM time in a 0.5B draft
            padded = x2.new_zeros((MIN_ROWS, self.in_features), dtype=self.pack_dtype)
            padded[:n] = x2
            x2 = padded
        elif x2.dtype != self.pack_dtype or not x2.is_contiguous():
            x2 = x2.to(self.pack_dtype).contiguous()
        return x2, n

    def _gemm(self, x2: torch.Tensor, n: int) -> torch.Tensor:
        """[N, in] (pack dtype, contiguous) -> the first ``n`` rows of [N, out], activations' dtype, bias added."""
        if self.pack_dtype == self._out_dtype:  # fp32 pack: bias fused into the GEMM
            return torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight, self.bias, "none", [], "")[:n]
        y = self._pack_gemm(x2)[:n]
        if self.bias is not None:  # bf16 + fp32 promotes to fp32: the same bits as converting first, one op less
            return torch.add(y, self.bias)
        return y.to(self._out_dtype)  # fp32_out: already fp32, returned as it is

    def _pack_gemm(self, x2: torch.Tensor) -> torch.Tensor:
        """[N, in] (pack dtype, contiguous) -> [N, out] in the pack's dtype (fp32 with ``fp32_out``), no bias, on the
        pack's own kernel."""
        if self.kernel == "specstop":
            return bf16_gemm.gemm(x2, self.packed_weight, self.out_features, self.weight_scale, self.fp32_out,
                                  self.isa)
        return torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight, None, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, pack={self.pack_dtype}, "
                f"kernel={self.kernel}{'-' + self.isa if self.isa else ''}, weights={self.weights}"
                + (", fp32_out" if self.fp32_out else ""))


FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linears that read the same input (attention's q, k, v; the MLP's gate and up, in Llama / Qwen / Mistral
naming) and are packed as one GEMM: on AMD EPYC Zen 4 (avx512_bf16, 2 threads) one bfloat16 call for q, k and v
took 115 us against 234 us for three (0.5B draft shapes) and 204 against 344 (1.5B target); gate and up 640 against
697 and 2435 against 2554 us. The fused output has the same bits as the separate layers' (tested)."""


class FusedLinears:
    """One :class:`PackedLinear` over the concatenated weights of sibling linears that read the same input; each
    sibling is replaced by a :class:`PackedSlice` that returns its columns of the one GEMM.

    The first slice called with an input runs the GEMM and keeps its output until every slice has read its part
    (the model calls them one after another with the same tensor); a slice called with another input, a second time
    or after an in-place change of it (tracked outside inference mode) runs the GEMM again, so the result is right
    however the model calls its layers.
    """

    def __init__(self, linears: list[nn.Linear], dtype: torch.dtype, native: bool = False, int8: bool = False
                 ) -> None:
        whole = nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears),
                          bias=linears[0].bias is not None)
        with torch.no_grad():
            whole.weight.copy_(torch.cat([lin.weight.detach() for lin in linears]))
            if whole.bias is not None:
                whole.bias.copy_(torch.cat([lin.bias.detach() for lin in linears]))
        self.packed = PackedLinear(whole, dtype, native, int8)
        bounds = [0]
        for lin in linears:
            bounds.append(bounds[-1] + lin.out_features)
        self.bounds = bounds
        self._key: tuple[torch.Tensor, int] | None = None
        self._out: torch.Tensor | None = None
        self._unread: set[int] = set()

    def part(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Columns of sibling ``i`` in the fused output for input ``x``."""
        version = -1 if x.is_inference() else x._version  # inference tensors keep no version counter
        if self._key is None or self._key[0] is not x or self._key[1] != version or i not in self._unread:
            self._out, self._key, self._unread = self.packed(x), (x, version), set(range(len(self.bounds) - 1))
        out = self._out
        self._unread.discard(i)
        if not self._unread:  # every sibling has its part: let go of the input and the output
            self._key, self._out = None, None
        return out[..., self.bounds[i] : self.bounds[i + 1]]


class PackedSlice(nn.Module):
    """A sibling linear's place in the model once fused (:class:`FusedLinears`): same call, same output columns."""

    def __init__(self, fused: FusedLinears, index: int, in_features: int, out_features: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.fused, self.index = fused, index
        self.in_features, self.out_features, self.pack_dtype = in_features, out_features, dtype
        if index == 0:  # the first slice owns the packed GEMM, so that it moves and counts with the model
            self.gemm = fused.packed

    @property
    def weight(self) -> torch.Tensor:
        """A shape-only stand-in (meta tensor), as :attr:`PackedLinear.weight`."""
        return torch.empty((self.out_features, self.in_features), dtype=torch.float32, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(self.index, x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, part {self.index} of "
                f"{len(self.fused.bounds) - 1}, pack={self.pack_dtype}")


GATED_MLPS = ("Qwen2MLP", "Qwen3MLP", "LlamaMLP", "MistralMLP")
"""MLP classes whose forward is ``down_proj(silu(gate_proj(x)) * up_proj(x))``: with gate and up fused they run as
:class:`GatedMLP`."""


class GatedMLP(nn.Module):
    """``down_proj(silu(gate) * up)`` of a gated MLP whose gate and up are one packed GEMM, the activation worked in
    row chunks that stay in cache.

    transformers' MLP converts the whole [N, 2I] GEMM output to fp32, then makes silu(gate) and the product as two more
    [N, I] fp32 tensors, which ``down_proj`` rounds to its pack's dtype: five passes over memory-sized tensors (a
    labelling pass of 1,176 tokens through the 1.5B target: 35 ms a layer, 28 layers, ~20% of the pass). Here each
    chunk of rows converts its gate to fp32, applies silu and multiplies by up in place (the bf16 up is promoted to
    fp32 exactly) and is rounded into the down GEMM's input: the same operations on the same values, so the same bits
    (tested), in 4.2 ms a layer at that size (AMD EPYC Zen 5).
    """

    CHUNK_ELEMENTS = 1 << 19
    """Intermediate values per chunk (2 MiB in fp32): rows = CHUNK_ELEMENTS // I (58 for the 1.5B target's 8,960)."""

    def __init__(self, gate_up: PackedLinear, down_proj: PackedLinear, intermediate: int) -> None:
        super().__init__()
        self.gate_up, self.down_proj, self.intermediate = gate_up, down_proj, intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, i = x.shape[:-1], self.intermediate
        y = self.gate_up.raw(x.reshape(-1, x.shape[-1]))  # [N, 2I] in the pack's dtype: gate | up
        h = torch.empty(y.shape[0], i, dtype=y.dtype, device=y.device)
        step = max(1, self.CHUNK_ELEMENTS // i)
        for r in range(0, y.shape[0], step):
            g = y[r : r + step, :i].to(torch.float32, copy=True)
            nn.functional.silu(g, inplace=True)
            h[r : r + step] = g.mul_(y[r : r + step, i:])
        return self.down_proj(h).reshape(*lead, self.down_proj.out_features)

    def extra_repr(self) -> str:
        return f"silu(gate) * up in chunks of {max(1, self.CHUNK_ELEMENTS // self.intermediate)} rows"


def _gated_mlps(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, mlp) of every :data:`GATED_MLPS` module whose gate and up are one fused pack without bias and
    whose down is packed in the same dtype."""
    out = []
    for parent in model.modules():
        for name, mlp in parent.named_children():
            if type(mlp).__name__ not in GATED_MLPS or type(getattr(mlp, "act_fn", None)).__name__ not in (
                    "SiLUActivation", "SiLU"):
                continue
            gate, up, down = (getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj"))
            if not (isinstance(gate, PackedSlice) and isinstance(up, PackedSlice) and gate.fused is up.fused
                    and (gate.index, up.index) == (0, 1) and isinstance(down, PackedLinear)):
                continue
            if gate.fused.packed.bias is None and down.pack_dtype == gate.pack_dtype:
                out.append((parent, name, mlp))
    return out


ROW_INVARIANT_ATTENTION = "specstop_row_invariant"
"""The attention implementation packed models run with (registered with transformers' ``AttentionInterface``)."""


def row_invariant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention whose output for a query row depends only on that row and the keys it sees.

    transformers' SDPA path computes a forward of q new tokens with kernels and reduction lengths chosen by q (a GEMV
    and grouped heads for q = 1, masked blocks of the whole key length for q > 1), so the same position gets other
    bits in a verification forward of L tokens than in a one-token step: logits differ by ~3e-5 in fp32 and ~0.1
    with bfloat16 GEMM outputs, enough to flip near-tie argmaxes. Here each row attends over exactly the keys before it
    (length ``T - q + i + 1``) in sums whose order depends on that row alone, so rows computed alone, in a chunk or in
    the prompt get the same bits: with :class:`PackedLinear` a whole forward is batch-invariant and speculative
    decoding reproduces one-token decoding exactly. On the CPU all rows of a layer are one native call
    (``csrc/row_attention.cpp``); elsewhere, or without a compiler, one SDPA call per row with the grouped query heads
    as rows (~40 us a call and layer plus its slicing: ~10 ms of the 1.5B target's forward of 8 new tokens).

    Shapes: query [B, H, q, d]; key, value [B, Hkv, T, d] (the last q keys are the queries' own); attention_mask None
    or [B|1, 1, q, T] (bool, True = attend, or additive float). Returns ([B, q, H, d], None) as transformers expects.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, h, q, d = query.shape
    hkv, t_all = key.shape[1], key.shape[2]
    if module.training or dropout > 0 or h % hkv or (attention_mask is not None and attention_mask.shape[-1] != t_all):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    native = _native_attention(query, key, value, attention_mask)
    if native is not None:
        mask = query.new_empty(0, dtype=torch.bool) if attention_mask is None else attention_mask
        scale = float(d**-0.5 if scaling is None else scaling)
        return native.row_attention(query, key, value, mask, scale, cpu.avx512_allowed()), None
    if attention_mask is None:  # causal without padding (each row's key slice is its causal window); a bool mask
        # is passed anyway so that every forward takes the same SDPA path
        attention_mask = torch.ones(1, 1, q, t_all, dtype=torch.bool, device=query.device)
    out = query.new_empty(b, q, h, d)
    for i in range(q):
        t = t_all - q + i + 1
        qi = query[:, :, i].reshape(b, hkv, h // hkv, d)  # query head j reads key head j // (h / hkv)
        mi = attention_mask[:, :, i : i + 1, :t]  # [B|1, 1, 1, t]
        oi = torch.nn.functional.scaled_dot_product_attention(qi, key[:, :, :t], value[:, :, :t], attn_mask=mi,
                                                              scale=scaling)
        out[:, i] = oi.reshape(b, h, d)
    return out, None


_ATTENTION = NativeExtension("specstop_row_attention", "row_attention.cpp", "native decoding attention")


def _native_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      mask: torch.Tensor | None) -> Any:
    """The native kernel (``csrc/row_attention.cpp``: all rows of a layer in one call, each summed as if alone) when
    it applies to these tensors (fp32 CPU, bool or no mask, key and value laid out alike), else None."""
    if query.device.type != "cpu" or not (query.dtype == key.dtype == value.dtype == torch.float32):
        return None
    if mask is not None and mask.dtype != torch.bool:
        return None
    if key.stride(-1) != 1 or key.stride() != value.stride():
        return None
    return _ATTENTION.module()


@functools.lru_cache(maxsize=1)
def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ROW_INVARIANT_ATTENTION, row_invariant_attention)
    AttentionMaskInterface.register(ROW_INVARIANT_ATTENTION, sdpa_mask)  # SDPA's bool masks (None: causal, no padding)


def use_row_invariant_attention(model: nn.Module, on: bool = True) -> bool:
    """Switch a packed model's attention to :func:`row_invariant_attention` (``on``, as loaded) or back to SDPA;
    returns whether the model now runs it. Eager models, and models whose attention is neither SDPA nor eager, keep
    their own.

    Work that needs no batch invariance may turn it off: one SDPA call per row costs ~15% of a long teacher-forced
    pass (target, 4 x 320 tokens: 16.8 s against 14.5 s with SDPA, AMD EPYC Zen 4); in decoding it is ~7% of the time.
    """
    cfg = getattr(model, "config", None)
    if compute_path_of(model) == "eager" or cfg is None or not hasattr(model, "set_attn_implementation"):
        return False
    current = getattr(cfg, "_attn_implementation", None)
    if not on:
        if current == ROW_INVARIANT_ATTENTION:
            native_layers.uninstall(model)  # they run the row-invariant kernel: back to transformers' layers
            model.set_attn_implementation("sdpa")
        return False
    if current not in ("sdpa", "eager", ROW_INVARIANT_ATTENTION):
        return False
    _register_attention()
    model.set_attn_implementation(ROW_INVARIANT_ATTENTION)
    if getattr(model, "specstop_native_layers", False) and not native_layers.installed(model):
        native_layers.install(model)
    return True


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]


def apply_compute_path(
    model: nn.Module, path: str, bf16_head: bool = False, min_elements: int = MIN_PACK_ELEMENTS, fuse: bool = True,
    native_gemm: bool = True, int8_weights: bool = False, fp32_logits: bool = False, native_layers_on: bool = True,
) -> dict[str, Any]:
    """Swap the model's large ``nn.Linear`` layers for :class:`PackedLinear` (in place) for a resolved ``path``.

    Args:
        model: a model on the CPU, in eval mode, in float32 (the packed paths keep fp32 activations).
        path: ``packed``, ``packed-bf16`` or ``eager`` (no change); resolve ``auto`` first.
        bf16_head: with ``packed-bf16``, pack the LM head in bfloat16 too (int8 with ``int8_weights``). On specstop's
            kernel the head returns its fp32 sums (``head_dtype`` ``bfloat16-fp32-logits``): only the final hidden
            state and the weights are rounded, as in every other layer of the bf16 path. oneDNN rounds its bf16
            outputs, which for logits of magnitude 16-32 is a step of 0.125 (probabilities off by up to a few %,
            more argmax ties; ``head_dtype`` ``bfloat16``). The head is 43% of the bytes a 0.5B draft step reads
            (draft step 81.1 -> 67.3 ms on oneDNN) and a fifth of the 1.5B target's step (83.0 -> 68.9 ms on
            specstop's kernel, AMD EPYC Zen 5); ``load_model`` turns it on per role (``ModelSpec.bf16_head``).
        fp32_logits: the head must keep fp32 resolution (the target's: its logits are the output): a bf16 head only
            where it returns fp32 sums (specstop's kernel), else the head stays fp32.
        min_elements: layers with fewer weights stay eager (tests pass 0 to pack tiny models); a fused group counts
            its members' weights together.
        fuse: pack each :data:`FUSED_GROUPS` of sibling linears as one GEMM (:class:`FusedLinears`): one call
            instead of three (q, k, v) or two (gate, up) per layer, measured 5% of a 0.5B draft's decoding step.
        native_gemm: with ``packed-bf16``, run the bf16 packs on specstop's kernel (:mod:`compute.bf16_gemm`) where
            this CPU has it (AVX512-BF16), else on oneDNN's. Another summation order: a data folder records which
            (``gemm`` in the fingerprint).
        int8_weights: on specstop's kernel, store the bf16 packs' weights as int8 with one scale per output channel
            (:func:`compute.bf16_gemm.pack_int8`): half the bytes a step streams, activations still bf16. For
            draft-side models only (``ModelSpec.int8_weights``): their proposals never change what exact decoding
            emits. Ignored where the kernel does not run (fp32 path, oneDNN, no AVX512-BF16): the model keeps its
            pack dtype, and ``weights_of`` says which it got (``weights`` in the fingerprint).
        native_layers_on: run each decoder layer whose structure :mod:`compute.native_layers` reproduces as one native
            call (with ``fuse``, on specstop's kernel, while the row-invariant attention is on): the same bits without
            the Python around the layer, a third of a 0.5B draft's one-token step.
    Returns:
        stats: packed layer count (fused members included), fused groups, weight bytes before and after, the path.
    Raises:
        ValueError: for ``auto`` / unknown paths or a model not in float32 on the CPU.
        MemoryError: when packing runs out of memory (the message says how much was needed and how to turn it off).
    """
    if path == "eager":
        return {"compute_path": "eager", "packed_layers": 0}
    if path not in ("packed", "packed-bf16"):
        raise ValueError(f"apply_compute_path: resolve {path!r} first (packed, packed-bf16 or eager)")
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype != torch.float32:
        raise ValueError(f"compute path {path!r} needs a float32 model on the CPU (got {p.dtype} on {p.device}); "
                         f"load with --models.dtype float32 or use --models.compute eager")
    dtype = torch.bfloat16 if path == "packed-bf16" else torch.float32
    native = bool(native_gemm and dtype == torch.bfloat16 and bf16_gemm.available())
    if dtype == torch.bfloat16 and not native and not native_bf16():
        raise ValueError(f"compute path packed-bf16 on oneDNN needs oneDNN's bf16 (AVX512-BF16 or AMX-BF16), which "
                         f"this CPU lacks; use --models.native_gemm true (specstop's kernel: "
                         f"{bf16_gemm.unavailable_reason() or 'available'}) or --models.compute packed")
    int8 = bool(int8_weights and native)
    stats = {"compute_path": path, "packed_layers": 0, "bytes_before": 0, "bytes_after": 0,
             "gemm": bf16_gemm.gemm_name() if native else "onednn",
             "weights": "int8" if int8 else str(dtype).removeprefix("torch.")}
    wbytes = 1 if int8 else dtype.itemsize
    tied = _tied_output_weight(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    sums_out = native and isinstance(head, nn.Linear) and head.in_features % 2 == 0  # the head's fp32 sums returned
    head_bf16 = bool(bf16_head and dtype == torch.bfloat16 and (sums_out or not fp32_logits))
    if fuse:
        stats["fused_groups"] = 0
        for parent, group in _fusable_groups(model, min_elements):
            lins = [getattr(parent, n) for n in group]
            need = sum(lin.weight.numel() for lin in lins) * wbytes
            fused = _pack_or_explain(model, "+".join(group), need, FusedLinears, lins, dtype, native, int8)
            for i, (n, lin) in enumerate(zip(group, lins)):
                setattr(parent, n, PackedSlice(fused, i, lin.in_features, lin.out_features, dtype))
                stats["bytes_before"] += lin.weight.numel() * lin.weight.element_size()
            stats["fused_groups"] += 1
            stats["packed_layers"] += len(group)
            stats["bytes_after"] += need
    for parent, name, lin in _linears(model):
        if lin.weight.numel() < min_elements:
            continue
        fp32_head = lin is head and not head_bf16
        layer_dtype = torch.float32 if fp32_head else dtype
        need = lin.weight.numel() * (layer_dtype.itemsize if fp32_head else wbytes)
        packed = _pack_or_explain(model, f"{name} {tuple(lin.weight.shape)}", need, PackedLinear, lin, layer_dtype,
                                  native, int8 and not fp32_head, lin is head)
        setattr(parent, name, packed)
        stats["packed_layers"] += 1
        stats["bytes_before"] += 0 if lin.weight is tied else lin.weight.numel() * lin.weight.element_size()
        stats["bytes_after"] += need
    if fuse:
        for parent, name, mlp in _gated_mlps(model):
            setattr(parent, name, GatedMLP(mlp.gate_proj.fused.packed, mlp.down_proj, mlp.gate_proj.out_features))
    if stats["packed_layers"]:  # read back by compute_path_of; a model with nothing packed computes as eager
        model.specstop_compute_path = path
        model.specstop_pack_layout = "fused" if stats.get("fused_groups") else "per-layer"
        model.specstop_head_dtype = _head_dtype(model.get_output_embeddings() if head is not None else None)
        model.specstop_gemm = stats["gemm"]
        model.specstop_weights = stats["weights"]
        _detach_from_file(model)  # first: a native layer keeps its norms' tensors, which must not hold the file
        model.specstop_native_layers = bool(native_layers_on and fuse)
        stats["row_invariant_attention"] = use_row_invariant_attention(model)
        stats["native_layers"] = native_layers.installed(model)
    else:
        stats["compute_path"] = "eager"
    return stats


def _fusable_groups(model: nn.Module, min_elements: int) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(parent, names) of every :data:`FUSED_GROUPS` whose members are plain linears over one input width with the
    same bias presence and at least ``min_elements`` weights together."""
    out = []
    for parent in model.modules():
        for group in FUSED_GROUPS:
            lins = [getattr(parent, n, None) for n in group]
            if not all(type(lin) is nn.Linear for lin in lins):
                continue
            if len({lin.in_features for lin in lins}) != 1 or len({lin.bias is None for lin in lins}) != 1:
                continue
            if sum(lin.weight.numel() for lin in lins) >= min_elements:
                out.append((parent, group))
    return out


def _pack_or_explain(model: nn.Module, what: str, need: int, pack: Any, *args: Any) -> Any:
    """``pack(*args)``, with oneDNN's allocation failure turned into a MemoryError that says how much and how to turn
    the path off."""
    try:
        return pack(*args)
    except RuntimeError as e:  # oneDNN reports allocation failures as RuntimeError
        if "memory" not in str(e).lower() and "alloc" not in str(e).lower():
            raise
        raise MemoryError(
            f"packing {type(model).__name__}.{what} needs {need / 2**20:.0f} MiB more memory than is free; free memory "
            f"or turn the path off with --models.compute eager"
        ) from e


def _detach_from_file(model: nn.Module) -> None:
    """Copy the remaining weights (embeddings, norms, small layers) into the process's own memory.

    transformers maps a safetensors file and its tensors are views into that mapping: while any of them lives, the
    whole file stays mapped and the pages the packing read stay resident (counted in the RSS though reclaimable). Once
    nothing points into the file, the mapping goes with it.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, PackedLinear):  # its buffers are copies already
                continue
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if t.device.type == "cpu":
                    t.data = t.data.clone()


def _tied_output_weight(model: nn.Module) -> torch.Tensor | None:
    """The LM head's weight when it is shared with the input embedding (freed only with the embedding)."""
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    emb, head = get_in(), get_out()
    if isinstance(head, nn.Linear) and emb is not None and head.weight is emb.weight:
        return head.weight
    return None


def compute_path_of(model: nn.Module) -> str:
    """The compute path a model was loaded with (``eager`` when none was applied)."""
    return str(getattr(model, "specstop_compute_path", "eager"))


def pack_layout_of(model: nn.Module) -> str:
    """``fused`` (q/k/v and gate/up as one GEMM each, :data:`FUSED_GROUPS`), ``per-layer`` (packed models loaded
    before fusion existed, or with ``fuse=False``) or ``eager``. Fusing packs small k/v layers that per-layer packing
    left eager, so the two layouts differ in bits for a model with such layers (the 0.5B draft)."""
    if compute_path_of(model) == "eager":
        return "eager"
    return str(getattr(model, "specstop_pack_layout", "per-layer"))


def gemm_of(model: nn.Module) -> str:
    """The kernel its packed linears run on: ``specstop`` (:mod:`compute.bf16_gemm`), ``onednn`` or ``eager``."""
    if compute_path_of(model) == "eager":
        return "eager"
    return str(getattr(model, "specstop_gemm", "onednn"))


def weights_of(model: nn.Module) -> str:
    """What its packed linears store: ``int8`` (draft-side models on specstop's kernel), the pack dtype
    (``bfloat16``, ``float32``), or ``eager``."""
    if compute_path_of(model) == "eager":
        return "eager"
    return str(getattr(model, "specstop_weights", _PACK_DTYPES.get(compute_path_of(model), "")))


_PACK_DTYPES = {"packed": "float32", "packed-bf16": "bfloat16", "eager": "eager"}
PRECISION_DEFAULTS = {"head_dtype": "float32", "pack_layout": "per-layer", "gemm": "onednn"}
"""What a fingerprint without these keys computed with (written before they were recorded; ``weights``: the pack
dtype of its compute path)."""
PRECISION_OPTIONS = {"dtype": "--models.dtype", "compute_path": "--models.compute",
                     "head_dtype": "--models.bf16_draft_head", "pack_layout": "--models.fuse_linears",
                     "gemm": "--models.native_gemm", "weights": "--models.int8_draft"}
"""The option that sets each precision field of a model fingerprint (a draft-side model's; :func:`precision_option`
names the target's)."""


def precision_option(key: str, role: str = "draft") -> str:
    """The option that sets precision field ``key`` of the model in ``role`` (draft, target or companion)."""
    if key == "head_dtype" and role == "target":
        return "--models.bf16_target_head"
    return PRECISION_OPTIONS[key]


def gemm_resume_hint(was: str, now: str) -> str | None:
    """How to compute again with the specstop kernel ISA a folder's ``gemm`` names (``specstop``: AVX512-BF16,
    ``specstop-avx2``) when this process runs another kernel; None when the ISA is not what differs (the option
    ``--models.native_gemm`` then says it)."""
    wanted = bf16_gemm.isa_of_gemm(was)
    if wanted is None or wanted == bf16_gemm.isa_of_gemm(now) or (now == "onednn" and wanted == bf16_gemm.isa()):
        return None
    flags = cpu.cpu_model()["simd_flags"]
    if flags and wanted not in cpu.isas_of(flags):
        model = cpu.cpu_model()["model_name"] or "unknown"
        return f"its {cpu.ISA_NAMES[wanted]} kernel does not run on this CPU ({model}): label it on a CPU that has it"
    also = " and pass --models.native_gemm true" if now == "onednn" else ""
    return f"set SPECSTOP_ISA={wanted}{also} to resume it"


def precision_diffs(stored: dict, current: dict) -> dict[str, tuple[str, str]]:
    """key -> (stored, current) for each precision field of two model fingerprints that differs (``dtype``,
    ``compute_path``, ``head_dtype``, ``pack_layout``, ``gemm``, ``weights``); keys missing from an older packed
    fingerprint read as :data:`PRECISION_DEFAULTS`. Nothing when either side has no ``compute_path``."""
    if not stored.get("compute_path") or not current.get("compute_path"):
        return {}
    out = {}
    for key in ("dtype", "compute_path", "head_dtype", "pack_layout", "gemm", "weights"):
        default = PRECISION_DEFAULTS.get(key)
        if key in ("pack_layout", "gemm") and stored["compute_path"] == "eager":
            default = "eager"
        if key == "weights":
            default = _PACK_DTYPES.get(stored["compute_path"])
        was, now = stored.get(key, default), current.get(key)
        if was and now and was != now:
            out[key] = (str(was), str(now))
    if "compute_path" in out:  # another path packs (or not) otherwise anyway
        out.pop("pack_layout", None)
        out.pop("gemm", None)
        out.pop("weights", None)
    return out


def _head_dtype(head: nn.Module | None) -> str:
    """What a packed model's LM head computes in: ``float32``, ``bfloat16`` (bf16 GEMM, logits rounded to bf16:
    oneDNN) or ``bfloat16-fp32-logits`` (bf16 or int8 weights on specstop's kernel, fp32 sums returned)."""
    if not isinstance(head, PackedLinear) or head.pack_dtype != torch.bfloat16:
        return "float32"
    return "bfloat16-fp32-logits" if head.fp32_out else "bfloat16"


def head_dtype_of(model: nn.Module) -> str:
    """The dtype its LM head computes in (``_head_dtype``: ``float32``, ``bfloat16`` or ``bfloat16-fp32-logits`` on
    packed-bf16 per ``bf16_head``), else the model's own."""
    own = str(next(model.parameters()).dtype).removeprefix("torch.")
    return str(getattr(model, "specstop_head_dtype", own))
