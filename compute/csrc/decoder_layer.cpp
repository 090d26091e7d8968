// One decoder layer of a packed Qwen2 / Llama-family model in one native call: the same ATen operations, in the same
// order and on the same values, as transformers' eager layer on specstop's compute path (RMSNorm, the fused q/k/v
// GEMM and its bias, rotary embedding, the KV cache's concatenation, the row-invariant attention, o_proj, the gated
// MLP in row chunks, the residual adds), so a layer returns the same bits as the Python one (tested), without its
// ~2,000 Python calls a step (module calls, attribute and config lookups, wrappers): a large share of a small draft's
// one-token step (compute/native_layers.py).
//
// The GEMM and the attention are the kernels of bf16_gemm.cpp (or, built with -DSPECSTOP_GEMM_AVX2 and the AVX2
// flags, bf16_gemm_avx2.cpp) and row_attention.cpp, compiled into this extension (their bindings left out) and called
// directly.
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fast_math.h"
// every header the included kernels use, at global scope (inside the namespaces below their guards make them no-ops)
#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define SPECSTOP_NO_BINDINGS 1
namespace kernels_gemm {
#ifdef SPECSTOP_GEMM_AVX2  // the AVX2 build (compute/native_layers.py): its GEMM, the same source as bf16_gemm's AVX2
#include "bf16_gemm_avx2.cpp"
#else
#include "bf16_gemm.cpp"
#endif
}  // namespace kernels_gemm
namespace kernels_attention {
#include "row_attention.cpp"
}  // namespace kernels_attention

namespace {

using torch::Tensor;

// A PackedLinear on specstop's kernel (compute/compute_path.py): bf16 or int8 pack, optional scales and fp32 bias.
struct Packed {
  Tensor weight;
  std::optional<Tensor> scale;
  std::optional<Tensor> bias;
  int64_t out_features = 0;
  bool fp32_out = false;

  // PackedLinear.forward on [N, in] rows: rounded to bf16, the GEMM, then the bias added in fp32 (bf16 + fp32
  // promotes) or the output converted to fp32 (already fp32 with fp32_out).
  Tensor forward(const Tensor& x2) const {
    auto y = raw(x2);
    if (bias.has_value()) return at::add(y, *bias);
    return y.scalar_type() == torch::kFloat32 ? y : y.to(torch::kFloat32);
  }

  // PackedLinear.raw: the GEMM's own output (bf16, or fp32 with fp32_out).
  Tensor raw(const Tensor& x2) const {
    const auto x = (x2.scalar_type() == torch::kBFloat16 && x2.is_contiguous()) ? x2
                                                                                : x2.to(torch::kBFloat16).contiguous();
    return kernels_gemm::gemm(x, weight, out_features, scale, fp32_out);
  }
};

// Qwen2RMSNorm / LlamaRMSNorm on fp32 activations: weight * (x * rsqrt(mean(x^2) + eps)).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  auto variance = x.pow(2).mean(-1, /*keepdim=*/true);
  return at::mul(weight, at::mul(x, at::rsqrt(at::add(variance, eps))));
}

// apply_rotary_pos_emb for one of q / k: (x * cos) + (rotate_half(x) * sin), cos and sin [B, 1, L, D].
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  const int64_t d = x.size(-1), half = d / 2;
  auto rot = at::cat({at::neg(x.narrow(-1, half, d - half)), x.narrow(-1, 0, half)}, -1);
  return at::add(at::mul(x, cos), at::mul(rot, sin));
}

}  // namespace

// The tensors and sizes of one decoder layer, kept once; forward runs it.
class NativeLayer {
 public:
  NativeLayer(Tensor input_norm, double input_eps, Tensor post_norm, double post_eps, Tensor qkv,
              std::optional<Tensor> qkv_scale, std::optional<Tensor> qkv_bias, int64_t q_out, int64_t kv_out, Tensor o,
              std::optional<Tensor> o_scale, std::optional<Tensor> o_bias, int64_t hidden, Tensor gate_up,
              std::optional<Tensor> gate_up_scale, Tensor down, std::optional<Tensor> down_scale,
              int64_t intermediate, int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling,
              int64_t chunk_elements, bool attention_avx512)
      : input_norm_(std::move(input_norm)),
        post_norm_(std::move(post_norm)),
        input_eps_(input_eps),
        post_eps_(post_eps),
        q_out_(q_out),
        kv_out_(kv_out),
        intermediate_(intermediate),
        heads_(heads),
        kv_heads_(kv_heads),
        head_dim_(head_dim),
        scaling_(scaling),
        chunk_rows_(std::max<int64_t>(1, chunk_elements / intermediate)),
        attention_avx512_(attention_avx512) {
    TORCH_CHECK(heads % kv_heads == 0 && q_out == heads * head_dim && kv_out == kv_heads * head_dim,
                "NativeLayer: q / kv widths must be heads x head_dim");
    qkv_ = Packed{std::move(qkv), std::move(qkv_scale), std::move(qkv_bias), q_out + 2 * kv_out, false};
    o_ = Packed{std::move(o), std::move(o_scale), std::move(o_bias), hidden, false};
    gate_up_ = Packed{std::move(gate_up), std::move(gate_up_scale), std::nullopt, 2 * intermediate, false};
    down_ = Packed{std::move(down), std::move(down_scale), std::nullopt, hidden, false};
  }

  // h [B, L, H] float32; cos, sin [B, L, D]; mask [B|1, 1, L, T] bool or empty (causal); keys, values: the layer's
  // cache so far ([B, Hkv, S, D], or empty) -> (h after the layer, keys and values with the L new positions).
  std::tuple<Tensor, Tensor, Tensor> forward(const Tensor& h, const Tensor& cos, const Tensor& sin, const Tensor& mask,
                                             const Tensor& keys, const Tensor& values) const {
    TORCH_CHECK(h.dim() == 3 && h.scalar_type() == torch::kFloat32 && h.device().is_cpu(),
                "NativeLayer.forward: hidden states [B, L, H] float32 on the CPU");
    const int64_t B = h.size(0), L = h.size(1), H = h.size(2);
    // self-attention
    auto x = rms_norm(h, input_norm_, input_eps_);
    auto qkv = qkv_.forward(x.reshape({-1, H})).reshape({B, L, q_out_ + 2 * kv_out_});
    auto q = qkv.narrow(-1, 0, q_out_).view({B, L, -1, head_dim_}).transpose(1, 2);
    auto k = qkv.narrow(-1, q_out_, kv_out_).view({B, L, -1, head_dim_}).transpose(1, 2);
    auto v = qkv.narrow(-1, q_out_ + kv_out_, kv_out_).view({B, L, -1, head_dim_}).transpose(1, 2);
    const auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    q = rotary(q, c, s);
    k = rotary(k, c, s);
    auto all_k = at::cat({keys, k}, -2);
    auto all_v = at::cat({values, v}, -2);
    auto attn = kernels_attention::row_attention(q, all_k, all_v, mask, scaling_, attention_avx512_);  // [B, L, H, D]
    auto o = o_.forward(attn.reshape({B, L, -1}).contiguous().reshape({-1, q_out_})).reshape({B, L, H});
    auto h1 = at::add(h, o);
    // gated MLP (GatedMLP: silu(gate) * up in row chunks, rounded into down's bf16 input)
    x = rms_norm(h1, post_norm_, post_eps_);
    auto y = gate_up_.raw(x.reshape({-1, H}));  // [N, 2I]: gate | up
    const int64_t N = y.size(0), I = intermediate_;
    auto act = at::empty({N, I}, y.options());
    for (int64_t r = 0; r < N; r += chunk_rows_) {
      const int64_t n = std::min(chunk_rows_, N - r);
      auto g = y.narrow(0, r, n).narrow(1, 0, I).to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
      at::silu_(g);
      act.narrow(0, r, n).copy_(g.mul_(y.narrow(0, r, n).narrow(1, I, I)));
    }
    auto mlp = down_.forward(act).reshape({B, L, H});
    return {at::add(h1, mlp), all_k, all_v};
  }

 private:
  Tensor input_norm_, post_norm_;
  double input_eps_, post_eps_;
  Packed qkv_, o_, gate_up_, down_;
  int64_t q_out_, kv_out_, intermediate_, heads_, kv_heads_, head_dim_;
  double scaling_;
  int64_t chunk_rows_;
  bool attention_avx512_;  // row_attention's allow_avx512 (the Python attention passes the same)
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &kernels_gemm::available, "this CPU runs the compiled-in bf16 GEMM (AVX512-BF16, or AVX2)");
  // module_local: the AVX2 build of this file registers its own NativeLayer in the same process
  pybind11::class_<NativeLayer>(m, "NativeLayer", pybind11::module_local())
      .def(pybind11::init<Tensor, double, Tensor, double, Tensor, std::optional<Tensor>, std::optional<Tensor>,
                          int64_t, int64_t, Tensor, std::optional<Tensor>, std::optional<Tensor>, int64_t, Tensor,
                          std::optional<Tensor>, Tensor, std::optional<Tensor>, int64_t, int64_t, int64_t, int64_t,
                          double, int64_t, bool>())
      .def("forward", &NativeLayer::forward,
           "(h [B, L, H], cos, sin [B, L, D], mask bool or empty, keys, values) -> (h, keys, values)");
}
