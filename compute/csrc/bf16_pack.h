// The packed weight layout both bf16 GEMM kernels read (bf16_gemm.cpp: AVX512-BF16 and AMX; bf16_gemm_avx2.cpp: AVX2
// and FMA) and the argument checks of their gemm(): one definition of what a pack is.
//
// A pack stores W [N, K] as [ceil(N / 16)][K / 2][16][2]: for 16 output columns, the weights of inputs 2p and 2p + 1
// side by side ("VNNI" pairs), zero columns past N. bfloat16 packs are the weights rounded once; int8 packs hold each
// output row rounded to integers in [-127, 127] with one fp32 scale per column (symmetric, max|w| / 127).
#pragma once

#include "torch_ext.h"

#include <cstdint>
#include <optional>
#include <tuple>

namespace bf16_pack {

constexpr int64_t kCols = 16;  // output columns per block

// [N, K] -> [ceil(N / 16), K / 2, 16, 2], zero columns past N.
inline torch::Tensor to_pairs(torch::Tensor w) {
  const int64_t N = w.size(0), K = w.size(1), nb = (N + kCols - 1) / kCols;
  if (nb * kCols != N) w = torch::cat({w, torch::zeros({nb * kCols - N, K}, w.options())});
  return w.view({nb, kCols, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

inline void check_weight(const torch::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), what, ": W must be a 2-d CPU tensor [N, K]");
  TORCH_CHECK(w.size(1) % 2 == 0, what, ": K = ", w.size(1), " must be even");
}

// W [N, K] (float32 or bfloat16) -> the bfloat16 pack.
inline torch::Tensor pack_bf16(const torch::Tensor& w) {
  check_weight(w, "bf16_gemm.pack");
  return to_pairs(w.to(torch::kBFloat16).contiguous());
}

// W [N, K] -> (int8 [ceil(N / 16), K / 2, 16, 2], fp32 scales [ceil(N / 16) * 16]): each output row of W rounded to
// integers in [-127, 127] times its own scale max|w| / 127 (scale 1 for a zero row or past N).
inline std::tuple<torch::Tensor, torch::Tensor> pack_int8(const torch::Tensor& w) {
  check_weight(w, "bf16_gemm.pack_int8");
  auto wf = w.to(torch::kFloat32).contiguous();
  auto scale = wf.abs().amax(1) / 127.0f;
  scale = torch::where(scale > 0, scale, torch::ones_like(scale));
  auto q = torch::round(wf / scale.unsqueeze(1)).clamp(-127, 127).to(torch::kChar);
  const int64_t N = w.size(0), npad = (N + kCols - 1) / kCols * kCols;
  if (npad != N) scale = torch::cat({scale, torch::ones({npad - N}, scale.options())});
  return {to_pairs(q), scale.contiguous()};
}

// gemm()'s arguments: x [M, K] contiguous bfloat16, a pack of x's K and N, the int8 pack's scales (and only its).
// Returns whether the pack is int8.
inline bool check_gemm(const torch::Tensor& x, const torch::Tensor& wp, int64_t N,
                       const std::optional<torch::Tensor>& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "bf16_gemm.gemm: x must be a contiguous bfloat16 CPU tensor [M, K]");
  TORCH_CHECK(wp.dim() == 4 && wp.is_contiguous() && wp.size(2) == kCols && wp.size(3) == 2 &&
                  wp.size(1) * 2 == x.size(1) && wp.size(0) * kCols >= N && wp.size(0) * kCols < N + kCols,
              "bf16_gemm.gemm: packed weight of shape [ceil(N/16), K/2, 16, 2] for x's K and N expected");
  const bool int8 = wp.scalar_type() == torch::kChar;
  TORCH_CHECK(int8 || wp.scalar_type() == torch::kBFloat16,
              "bf16_gemm.gemm: the packed weight must be bfloat16 or int8");
  TORCH_CHECK(int8 == scale.has_value(), "bf16_gemm.gemm: an int8 weight needs its scales, a bfloat16 one none");
  if (int8)
    TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() &&
                    scale->numel() == wp.size(0) * kCols,
                "bf16_gemm.gemm: the scales of pack_int8 (float32, ceil(N/16)*16) expected");
  return int8;
}

}  // namespace bf16_pack
