"""The packed layers of the CPU compute path: a linear on one prepacked weight, sibling linears as one GEMM and a gated
MLP over a fused gate/up; ``compute_path.apply_compute_path`` puts them in a model.

Usage::

    packed = PackedLinear(linear, torch.bfloat16, native=True)    # specstop's bf16 GEMM where the CPU has it
    y = packed(x)                                                 # fp32 in, fp32 out
"""
from __future__ import annotations

import torch
from torch import nn

from compute import bf16_gemm

__all__ = ["FUSED_GROUPS", "GATED_MLPS", "MIN_ROWS", "FusedLinears", "GatedMLP", "PackedLinear", "PackedSlice"]

MIN_ROWS = 4
"""Rows a call is zero-padded to on oneDNN's kernels, whose one-row GEMV sums in another order (any value >= 2 keeps a
forward batch-invariant; 4 is oneDNN's fastest small size)."""


class PackedLinear(nn.Module):
    """``nn.Linear`` for inference whose weight lives once in a kernel's layout (oneDNN's fp32/bf16, or specstop's
    bf16/int8 GEMM); fp32 in and out, each row's bits independent of the row count. No autograd."""

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
        """[N, in] -> [N, out] in the pack's dtype, without bias, for a caller working on the GEMM's own output."""
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
            # verification forward of L tokens reproduces L one-token steps bit for bit (see MIN_ROWS for why 4).
            # One zero buffer and one converting copy: the per-call work outside the GEMM is most of a decoding
            # step's non-GEMM time in a small draft
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
        """[N, in] -> [N, out] on the pack's own kernel, in the pack's dtype (fp32 with ``fp32_out``), no bias."""
        if self.kernel == "specstop":
            return bf16_gemm.gemm(x2, self.packed_weight, self.out_features, self.weight_scale, self.fp32_out,
                                  self.isa)
        return torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight, None, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, pack={self.pack_dtype}, "
                f"kernel={self.kernel}{'-' + self.isa if self.isa else ''}, weights={self.weights}"
                + (", fp32_out" if self.fp32_out else ""))


FUSED_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linears that read one input (q, k, v; gate, up), packed as one GEMM that reads the input once; the same bits
as separate layers (tested)."""


class FusedLinears:
    """One :class:`PackedLinear` over sibling linears' concatenated weights, each sibling replaced by a
    :class:`PackedSlice`; the GEMM's output is reused until every slice has read its part, and recomputed for another
    input."""

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
"""MLP classes computing ``down_proj(silu(gate_proj(x)) * up_proj(x))``; with gate and up fused they run as
:class:`GatedMLP`."""


class GatedMLP(nn.Module):
    """A gated MLP over a fused gate/up whose silu(gate) * up runs in cache-sized row chunks, in place, into the down
    GEMM's input: transformers' operations on the same values (same bits, tested) without four passes over large
    tensors."""

    CHUNK_ELEMENTS = 1 << 19
    """Intermediate values per chunk (2 MiB in fp32); rows = CHUNK_ELEMENTS // I."""

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
