// Causal attention of q new rows over a KV cache in one call, each row computed exactly as if it were alone: the
// decoding attention of the packed compute paths (compute/compute_path.py, row_invariant_attention). Built on first
// use by compute/native.py; without it the Python loop of one SDPA call per row gives the same kind of result.
//
// Per (batch, row i, key head g) one task: the G query heads that read key head g, over keys j < T - q + i + 1 allowed
// by the mask row. Scores s = scale * q . k_j (d-long dot products), m = max s, e = exp(s - m), l = sum e, then
// out = sum_j e_j v_j / l; keys masked out (or all keys of a fully masked row: out = 0) contribute nothing. The order
// of every sum is fixed by the task alone, so a row has the same bits in a one-token step, a verification forward of
// L rows or a prompt (tested), which transformers' SDPA path does not give (its kernels and blockings depend on q).
//
// Why: one SDPA call per row and layer costs a call and its slicing per row, a large share of a verification forward
// of several new tokens; here all rows of a layer are one call, its tasks spread over torch's threads.
//
// On AVX-512 hosts, heads of 16k <= 128 dims run attend_avx512: each key's dims held in registers for the G heads'
// dot products (independent chains instead of one reduction per dot) and the weighted values summed in registers for
// two heads at a time, about twice as fast as the portable loops. A process under SPECSTOP_ISA=avx2 passes
// allow_avx512 = false and runs the portable loops, as an AVX2 host does.
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "fast_math.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

// Softmax weights in place for G rows of t scores (scratch [G][t]): exp(s - max) and inv[h] = 1 / sum; a row with no
// key allowed (all -inf) becomes zeros with inv 0 (it attends to nothing).
__attribute__((always_inline)) inline void softmax_in_place(float* scratch, int64_t G, int64_t t, float* inv) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t h = 0; h < G; ++h) {
    float* s = scratch + h * t;
    float m = kNegInf;
    for (int64_t j = 0; j < t; ++j) m = s[j] > m ? s[j] : m;
    if (m == kNegInf) {
      std::fill(s, s + t, 0.0f);
      inv[h] = 0.0f;
      continue;
    }
    float l = 0.0f;
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < t; ++j) {
      const float e = specstop::exp_nonpositive(s[j] - m);
      s[j] = e;
      l += e;
    }
    inv[h] = 1.0f / l;
  }
}

// The G heads of one row over keys [0, t): q rows at q (head stride qh), keys / values at k / v (key stride ks, last
// dim contiguous), mask row (nullptr: every key allowed), output rows at out (head stride oh). scratch: G * t floats
// of scores, then G for the softmax's inverse sums.
SPECSTOP_CLONES
void attend(const float* q, int64_t qh, const float* k, const float* v, int64_t ks, int64_t t, const bool* mask,
            int64_t G, int64_t d, float scale, float* out, int64_t oh, float* scratch) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < t; ++j) {  // scores, key by key for all heads (the key read once)
    const float* kj = k + j * ks;
    for (int64_t h = 0; h < G; ++h) {
      if (mask != nullptr && !mask[j]) {
        scratch[h * t + j] = kNegInf;
        continue;
      }
      const float* qr = q + h * qh;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < d; ++c) acc += qr[c] * kj[c];
      scratch[h * t + j] = acc * scale;
    }
  }
  float* inv = scratch + G * t;
  softmax_in_place(scratch, G, t, inv);
  for (int64_t h = 0; h < G; ++h) std::fill(out + h * oh, out + h * oh + d, 0.0f);
  for (int64_t j = 0; j < t; ++j) {  // weighted values, key by key for all heads
    const float* vj = v + j * ks;
    for (int64_t h = 0; h < G; ++h) {
      const float e = scratch[h * t + j];
      float* o = out + h * oh;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) o[c] += e * vj[c];
    }
  }
  for (int64_t h = 0; h < G; ++h) {
    float* o = out + h * oh;
    const float w = inv[h];
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) o[c] *= w;
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#define SPECSTOP_AVX512_ATTENTION 1
#define AVX512_TARGET __attribute__((target("avx512f,avx512dq")))

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

// out[h] = sum_j s[h][j] v_j * inv[h] for NH (1 or 2) heads from h0, the d / 16 <= 8 chunks of each in registers.
template <int NH>
AVX512_TARGET inline void weighted_values(const float* v, int64_t ks, int64_t t, int64_t nc, const float* s0,
                                          const float* s1, float inv0, float inv1, float* o0, float* o1) {
  __m512 a0[8], a1[8];
  for (int64_t c = 0; c < nc; ++c) {
    a0[c] = _mm512_setzero_ps();
    a1[c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < t; ++j) {
    const float* vj = v + j * ks;
    const __m512 e0 = _mm512_set1_ps(s0[j]);
    const __m512 e1 = NH == 2 ? _mm512_set1_ps(s1[j]) : e0;
    for (int64_t c = 0; c < nc; ++c) {
      const __m512 vc = _mm512_loadu_ps(vj + 16 * c);
      a0[c] = _mm512_fmadd_ps(e0, vc, a0[c]);
      if constexpr (NH == 2) a1[c] = _mm512_fmadd_ps(e1, vc, a1[c]);
    }
  }
  for (int64_t c = 0; c < nc; ++c) {
    _mm512_storeu_ps(o0 + 16 * c, _mm512_mul_ps(a0[c], _mm512_set1_ps(inv0)));
    if constexpr (NH == 2) _mm512_storeu_ps(o1 + 16 * c, _mm512_mul_ps(a1[c], _mm512_set1_ps(inv1)));
  }
}

// attend() for d a multiple of 16, at most 128, on AVX-512: the same result up to the order of each dot product's
// sum (a fixed order per task, so rows keep their bits whatever q is).
AVX512_TARGET void attend_avx512(const float* q, int64_t qh, const float* k, const float* v, int64_t ks, int64_t t,
                                 const bool* mask, int64_t G, int64_t d, float scale, float* out, int64_t oh,
                                 float* scratch) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t nc = d / 16;
  for (int64_t j = 0; j < t; ++j) {  // scores: key j's dims loaded once for the G heads' dot products
    if (mask != nullptr && !mask[j]) {
      for (int64_t h = 0; h < G; ++h) scratch[h * t + j] = kNegInf;
      continue;
    }
    const float* kj = k + j * ks;
    __m512 kc[8];
    for (int64_t c = 0; c < nc; ++c) kc[c] = _mm512_loadu_ps(kj + 16 * c);
    for (int64_t h = 0; h < G; ++h) {
      const float* qr = q + h * qh;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qr), kc[0]);
      for (int64_t c = 1; c < nc; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), kc[c], acc);
      scratch[h * t + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  float* inv = scratch + G * t;
  softmax_in_place(scratch, G, t, inv);
  int64_t h = 0;
  for (; h + 2 <= G; h += 2)
    weighted_values<2>(v, ks, t, nc, scratch + h * t, scratch + (h + 1) * t, inv[h], inv[h + 1], out + h * oh,
                       out + (h + 1) * oh);
  if (h < G) weighted_values<1>(v, ks, t, nc, scratch + h * t, nullptr, inv[h], 0.0f, out + h * oh, nullptr);
}
#else
#define SPECSTOP_AVX512_ATTENTION 0
#endif

}  // namespace

// query [B, H, q, d], key / value [B, Hkv, T, d] (float32, last dim contiguous), mask [Bm, 1, q, T] bool with Bm in
// {1, B} or an empty tensor (causal, no padding), scale -> [B, q, H, d] float32. allow_avx512: attend_avx512 may run
// where the CPU has AVX-512 (false under SPECSTOP_ISA=avx2, so that a forced AVX2 process computes as an AVX2 host).
torch::Tensor row_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, torch::Tensor mask,
                            double scale, bool allow_avx512) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "row_attention: 4-d query, key and value");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key.scalar_type() == torch::kFloat32 &&
                  value.scalar_type() == torch::kFloat32 && query.device().is_cpu() && key.device().is_cpu() &&
                  value.device().is_cpu(),
              "row_attention: float32 CPU tensors");
  const int64_t B = query.size(0), H = query.size(1), q = query.size(2), d = query.size(3);
  const int64_t Hkv = key.size(1), T = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.sizes() == key.sizes() && key.size(3) == d && H % Hkv == 0 && q <= T,
              "row_attention: key/value [B, Hkv, T, d] with H a multiple of Hkv and T >= q");
  TORCH_CHECK(key.stride(3) == 1 && value.stride(3) == 1 && key.strides() == value.strides(),
              "row_attention: key and value with the same strides and a contiguous last dim");
  const bool has_mask = mask.numel() > 0;
  if (has_mask) {
    TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 4 && (mask.size(0) == 1 || mask.size(0) == B) &&
                    mask.size(2) == q && mask.size(3) == T,
                "row_attention: mask [1 or B, 1, q, T] bool");
  }
  auto qc = query.contiguous();
  auto mc = has_mask ? mask.contiguous() : mask;
  auto out = torch::empty({B, q, H, d}, query.options());
  const int64_t G = H / Hkv;
  const float* qp = qc.data_ptr<float>();
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const bool* mp = has_mask ? mc.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t kb = key.stride(0), kh = key.stride(1), ks = key.stride(2);
  const int64_t mb = has_mask && mask.size(0) == B ? q * T : 0;
  const float sc = static_cast<float>(scale);
#if SPECSTOP_AVX512_ATTENTION
  static const bool avx512 = cpu_has_avx512();
  const bool fast = allow_avx512 && avx512 && d % 16 == 0 && d <= 128;
#else
  const bool fast = false;
#endif
  at::parallel_for(0, B * q * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(G * T + G);  // scores and inverse sums of one task (attend)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task % Hkv, i = (task / Hkv) % q, b = task / (Hkv * q);
      const int64_t t = T - q + i + 1;
      const float* qr = qp + ((b * H + g * G) * q + i) * d;  // head g * G at row i; next head q * d further
      const bool* mrow = mp ? mp + b * mb + i * T : nullptr;
      float* orow = op + ((b * q + i) * H + g * G) * d;
#if SPECSTOP_AVX512_ATTENTION
      if (fast) {
        attend_avx512(qr, q * d, kp + b * kb + g * kh, vp + b * kb + g * kh, ks, t, mrow, G, d, sc, orow, d,
                      scratch.data());
        continue;
      }
#endif
      attend(qr, q * d, kp + b * kb + g * kh, vp + b * kb + g * kh, ks, t, mrow, G, d, sc, orow, d, scratch.data());
    }
  });
  return out;
}

#ifndef SPECSTOP_NO_BINDINGS  // decoder_layer.cpp compiles this file in without its bindings
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_attention", &row_attention, "causal attention of q rows over a KV cache, each row as if alone",
        pybind11::arg("query"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("mask"),
        pybind11::arg("scale"), pybind11::arg("allow_avx512") = true);
}
#endif
