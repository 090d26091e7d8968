// One model's softmax(z / T) per row, read in blocks of kBlock logits without materialising the probabilities: the
// stop decision's statistics (entropy, q(token), the top-k probabilities) and one draw by inversion. The kernels of
// compute/csrc/draft_stats.cpp, which includes this header (and pair_rows.h) into its one translation unit: hence the
// internal linkage (an anonymous namespace), as when they lived in that file.
//
// Per row: pass 1 takes the maxima of 128-element blocks (and a finiteness probe); the k largest values lie in the k
// blocks with the largest maxima, so a partial sort of those gives the top-k logits. Pass 2 sums e = exp(z - m) and
// e * (z - m) per block in float (SIMD lanes) and across blocks in double. Then with S = sum e and T = sum e (z - m):
// entropy = log S - T / S (both terms >= 0, no cancellation), p_i = exp(z_i - m) / S, max p = 1 / S.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "fast_math.h"

namespace {

constexpr int64_t kBlock = 128;
// A single row at least this wide is shared among the threads (below, waking them costs more than it saves).
constexpr int64_t kSharedRow = 32768;


// Whether the logits are divided by T, and T: temperature 0 (greedy) and 1 read the logits as they are.
struct Scaling {
  bool on;
  float temp;
};

inline Scaling scaling_of(double temperature) {
  const bool on = temperature > 0.0 && temperature != 1.0;
  return {on, on ? static_cast<float>(temperature) : 1.0f};
}

// z / T, the scaling a separate instantiation so that no loop branches on it.
template <bool kScale>
inline float load(const float* x, int64_t i, float temp) {
  if constexpr (kScale) {
    return x[i] / temp;
  } else {
    return x[i];
  }
}

// Pass 1 over blocks [j0, j1): each block's maximum into bmax[j]; returns the finiteness probe (NaN when a logit is
// NaN or +-inf: x * 0).
template <bool kScale>
__attribute__((always_inline)) inline float block_maxima(const float* x, int64_t V, float temp, int64_t j0,
                                                         int64_t j1, float* bmax) {
  float probe = 0.0f;
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t lo = j * kBlock, hi = std::min(V, lo + kBlock);
    float mx = -std::numeric_limits<float>::infinity();
    float pr = 0.0f;
#pragma omp simd reduction(max : mx) reduction(+ : pr)
    for (int64_t i = lo; i < hi; ++i) {
      const float z = load<kScale>(x, i, temp);
      mx = z > mx ? z : mx;  // (std::max does not vectorise here; NaN is the probe's)
      pr += z * 0.0f;
    }
    bmax[j] = mx;
    probe += pr;
  }
  return probe;
}

// Pass 2 over blocks [j0, j1): each block's float sums of e = exp(z - m) and e * (z - m) into s[j], t[j] (added
// across blocks in double, in block order, by the caller: the same sums however the blocks were shared out).
template <bool kScale>
__attribute__((always_inline)) inline void block_sums(const float* x, int64_t V, float temp, float m, int64_t j0,
                                                      int64_t j1, float* s, float* t) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t lo = j * kBlock, hi = std::min(V, lo + kBlock);
    float sj = 0.0f, tj = 0.0f;
#pragma omp simd reduction(+ : sj, tj)
    for (int64_t i = lo; i < hi; ++i) {
      const float d = (load<kScale>(x, i, temp)) - m;
      const float e = specstop::exp_nonpositive(d);
      sj += e;
      tj += e * d;
    }
    s[j] = sj;
    t[j] = tj;
  }
}

// Per-row scratch: block maxima and sums, the blocks' order, the top-k candidates.
struct Scratch {
  std::vector<float> bmax, bs, bt, cand;
  std::vector<int64_t> order;
  explicit Scratch(int64_t nb) : bmax(nb), bs(nb), bt(nb) {}
};

// Between the passes: the top-k logits (the k largest lie in the k blocks with the largest maxima) into sc.cand,
// sorted; returns the maximum m.
template <bool kScale>
inline float top_candidates(const float* x, int64_t V, float temp, int64_t k, Scratch& sc) {
  const int64_t nb = static_cast<int64_t>(sc.bmax.size()), kb = std::min(k, nb);
  const auto& bmax = sc.bmax;
  sc.order.resize(nb);
  for (int64_t j = 0; j < nb; ++j) sc.order[j] = j;
  std::partial_sort(sc.order.begin(), sc.order.begin() + kb, sc.order.end(),
                    [&](int64_t a, int64_t b) { return bmax[a] > bmax[b] || (bmax[a] == bmax[b] && a < b); });
  sc.cand.clear();
  for (int64_t j = 0; j < kb; ++j) {
    const int64_t lo = sc.order[j] * kBlock, hi = std::min(V, lo + kBlock);
    for (int64_t i = lo; i < hi; ++i) sc.cand.push_back(load<kScale>(x, i, temp));
  }
  const int64_t kk = std::min<int64_t>(k, static_cast<int64_t>(sc.cand.size()));
  std::partial_sort(sc.cand.begin(), sc.cand.begin() + kk, sc.cand.end(), std::greater<float>());
  return sc.cand[0];
}

// After the passes: entropy = log S - T / S, q(token), the top-k probabilities; tok < 0 picks the first maximum as
// the token (as torch.argmax: the first block holding it, then in it) into *pick.
template <bool kScale>
inline void finish_row(const float* x, int64_t V, float temp, int64_t tok, int64_t k, float m, float* out,
                       int64_t* pick, const Scratch& sc) {
  const int64_t nb = static_cast<int64_t>(sc.bmax.size());
  double S = 0.0, T = 0.0;
  for (int64_t j = 0; j < nb; ++j) {
    S += sc.bs[j];
    T += sc.bt[j];
  }
  if (tok < 0) {
    int64_t j = 0;
    while (sc.bmax[j] != m) ++j;
    int64_t i = j * kBlock;
    while (load<kScale>(x, i, temp) != m) ++i;
    tok = i;
    *pick = i;
  }
  const float sf = static_cast<float>(S);
  out[0] = static_cast<float>(std::log(S) - T / S);
  out[1] = specstop::exp_nonpositive(load<kScale>(x, tok, temp) - m) / sf;
  const int64_t kk = std::min<int64_t>(k, static_cast<int64_t>(sc.cand.size()));
  for (int64_t j = 0; j < k; ++j) out[2 + j] = j < kk ? specstop::exp_nonpositive(sc.cand[j] - m) / sf : 0.0f;
}

inline void mark_non_finite(int64_t k, float* out, int64_t* pick) {
  for (int64_t j = 0; j < 2 + k; ++j) out[j] = std::numeric_limits<float>::quiet_NaN();
  if (pick != nullptr) *pick = -1;
}

// One row on one thread: both passes over every block.
template <bool kScale>
__attribute__((always_inline)) inline void row_stats(const float* x, int64_t V, float temp, int64_t tok, int64_t k,
                                                     float* out, int64_t* pick, Scratch& sc) {
  const int64_t nb = static_cast<int64_t>(sc.bmax.size());
  if (!std::isfinite(block_maxima<kScale>(x, V, temp, 0, nb, sc.bmax.data()))) {
    mark_non_finite(k, out, pick);
    return;
  }
  const float m = top_candidates<kScale>(x, V, temp, k, sc);
  block_sums<kScale>(x, V, temp, m, 0, nb, sc.bs.data(), sc.bt.data());
  finish_row<kScale>(x, V, temp, tok, k, m, out, pick, sc);
}

SPECSTOP_CLONES
void row_stats_any(const float* x, int64_t V, float temp, bool scale, int64_t tok, int64_t k, float* out,
                   int64_t* pick, Scratch& sc) {
  if (scale) {
    row_stats<true>(x, V, temp, tok, k, out, pick, sc);
  } else {
    row_stats<false>(x, V, temp, tok, k, out, pick, sc);
  }
}

SPECSTOP_CLONES
float block_maxima_any(const float* x, int64_t V, float temp, bool scale, int64_t j0, int64_t j1, float* bmax) {
  return scale ? block_maxima<true>(x, V, temp, j0, j1, bmax) : block_maxima<false>(x, V, temp, j0, j1, bmax);
}

SPECSTOP_CLONES
void block_sums_any(const float* x, int64_t V, float temp, bool scale, float m, int64_t j0, int64_t j1, float* s,
                    float* t) {
  if (scale) {
    block_sums<true>(x, V, temp, m, j0, j1, s, t);
  } else {
    block_sums<false>(x, V, temp, m, j0, j1, s, t);
  }
}

// One row with its blocks shared among the threads (a decode step's single row): the same values as row_stats (the
// blocks' sums are added in block order either way).
void row_stats_shared(const float* x, int64_t V, float temp, bool scale, int64_t tok, int64_t k, float* out,
                      int64_t* pick, Scratch& sc) {
  const int64_t nb = static_cast<int64_t>(sc.bmax.size());
  const int64_t grain = std::max<int64_t>(64, nb / std::max(1, at::get_num_threads()) + 1);
  std::atomic<bool> finite{true};
  at::parallel_for(0, nb, grain, [&](int64_t j0, int64_t j1) {
    if (!std::isfinite(block_maxima_any(x, V, temp, scale, j0, j1, sc.bmax.data()))) finite = false;
  });
  if (!finite) {
    mark_non_finite(k, out, pick);
    return;
  }
  const float m = scale ? top_candidates<true>(x, V, temp, k, sc) : top_candidates<false>(x, V, temp, k, sc);
  at::parallel_for(0, nb, grain, [&](int64_t j0, int64_t j1) {
    block_sums_any(x, V, temp, scale, m, j0, j1, sc.bs.data(), sc.bt.data());
  });
  if (scale) {
    finish_row<true>(x, V, temp, tok, k, m, out, pick, sc);
  } else {
    finish_row<false>(x, V, temp, tok, k, m, out, pick, sc);
  }
}

// One draw from softmax(z / T) by inversion: u * S against the running sum of the blocks' sums, then within the block
// found. u in [0, 1); the last token of positive probability if rounding runs past the end.
template <bool kScale>
__attribute__((always_inline)) inline int64_t sample_row(const float* x, int64_t V, float temp, double u,
                                                         std::vector<float>& bsum) {
  const int64_t nb = (V + kBlock - 1) / kBlock;
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < V; ++i) {
    const float z = load<kScale>(x, i, temp);
    m = z > m ? z : m;
  }
  double S = 0.0;
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t lo = j * kBlock, hi = std::min(V, lo + kBlock);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = lo; i < hi; ++i) s += specstop::exp_nonpositive(load<kScale>(x, i, temp) - m);
    bsum[j] = s;
    S += s;
  }
  const double target = u * S;
  double cum = 0.0;
  for (int64_t j = 0; j < nb; ++j) {
    if (cum + bsum[j] <= target) {  // the draw lies past this block
      cum += bsum[j];
      continue;
    }
    const int64_t lo = j * kBlock, hi = std::min(V, lo + kBlock);
    for (int64_t i = lo; i < hi; ++i) {
      const float e = specstop::exp_nonpositive(load<kScale>(x, i, temp) - m);
      cum += e;
      if (e > 0.0f && cum > target) return i;
    }  // the elements' sum fell short of the block's float sum (rounding): go on with the next block
  }
  for (int64_t i = V - 1; i > 0; --i)  // rounding ran past the end: the last token of positive probability
    if (specstop::exp_nonpositive(load<kScale>(x, i, temp) - m) > 0.0f) return i;
  return 0;
}

SPECSTOP_CLONES
int64_t sample_row_any(const float* x, int64_t V, float temp, bool scale, double u, std::vector<float>& bsum) {
  return scale ? sample_row<true>(x, V, temp, u, bsum) : sample_row<false>(x, V, temp, u, bsum);
}

}  // namespace
