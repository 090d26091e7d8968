// The draft's softmax(z / T) against another model's on one row (pair_stats: the labels' statistics), in three passes
// over blocks of logits. Included by compute/csrc/draft_stats.cpp after softmax_rows.h (kBlock, load), into
// its one translation unit: hence the internal linkage (an anonymous namespace).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fast_math.h"
#include "softmax_rows.h"

namespace {

// The draft (q) against another model (o) on one row: o(token), o's entropy, TV = 1/2 sum |o - q| and the overlap
// sum min(o, q) of softmax(z / T) of each; the first argmax of o's raw logits into *amax. Three passes over blocks of
// kBlock logits, no [V] temporaries: each pass leaves one partial per block (float, summed in SIMD order within the
// block) and the partials are combined in block order (double), so a row gives the same bits whether its blocks run
// on one thread or are shared among several (pair_row_any's `shared`, for a decode step's single wide row).
template <bool kScale>
__attribute__((always_inline)) inline void pair_block_max(const float* q, const float* o, int64_t V, float temp,
                                                          int64_t j0, int64_t j1, float* bq, float* bo, float* bp) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t lo = j * kBlock, hi = std::min(V, lo + kBlock);
    float a = -std::numeric_limits<float>::infinity(), b = a, pr = 0.0f;
#pragma omp simd reduction(max : a, b) reduction(+ : pr)
    for (int64_t i = lo; i < hi; ++i) {
      const float zq = load<kScale>(q, i, temp);
      a = zq > a ? zq : a;
      b = o[i] > b ? o[i] : b;
      pr += zq * 0.0f + o[i] * 0.0f;
    }
    bq[j] = a, bo[j] = b, bp[j] = pr;
  }
}

template <bool kScale>
__attribute__((always_inline)) inline void pair_block_sums(const float* q, const float* o, int64_t V, float temp,
                                                           float mq, float so_max, int64_t j0, int64_t j1, float* sq_,
                                                           float* so_, float* to_) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t lo = j * kBlock, hi = std::min(V, lo + kBlock);
    float sq = 0.0f, so = 0.0f, to = 0.0f;
#pragma omp simd reduction(+ : sq, so, to)
    for (int64_t i = lo; i < hi; ++i) {
      sq += specstop::exp_nonpositive(load<kScale>(q, i, temp) - mq);
      const float d = load<kScale>(o, i, temp) - so_max;
      const float e = specstop::exp_nonpositive(d);
      so += e;
      to += e * d;
    }
    sq_[j] = sq, so_[j] = so, to_[j] = to;
  }
}

template <bool kScale>
__attribute__((always_inline)) inline void pair_block_overlap(const float* q, const float* o, int64_t V, float temp,
                                                              float mq, float so_max, float sqf, float sof, int64_t j0,
                                                              int64_t j1, float* tv_, float* ov_) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t lo = j * kBlock, hi = std::min(V, lo + kBlock);
    float tv = 0.0f, ov = 0.0f;
#pragma omp simd reduction(+ : tv, ov)
    for (int64_t i = lo; i < hi; ++i) {
      const float pq = specstop::exp_nonpositive(load<kScale>(q, i, temp) - mq) / sqf;
      const float po = specstop::exp_nonpositive(load<kScale>(o, i, temp) - so_max) / sof;
      tv += std::fabs(po - pq);
      ov += po < pq ? po : pq;
    }
    tv_[j] = tv, ov_[j] = ov;
  }
}

// The three passes over blocks [j0, j1), compiled for each instruction set (the blocks' loops are the work).
SPECSTOP_CLONES
void pair_max_any(const float* q, const float* o, int64_t V, float temp, bool scale, int64_t j0, int64_t j1, float* bq,
                  float* bo, float* bp) {
  if (scale) {
    pair_block_max<true>(q, o, V, temp, j0, j1, bq, bo, bp);
  } else {
    pair_block_max<false>(q, o, V, temp, j0, j1, bq, bo, bp);
  }
}

SPECSTOP_CLONES
void pair_sums_any(const float* q, const float* o, int64_t V, float temp, bool scale, float mq, float so_max,
                   int64_t j0, int64_t j1, float* sq, float* so, float* to) {
  if (scale) {
    pair_block_sums<true>(q, o, V, temp, mq, so_max, j0, j1, sq, so, to);
  } else {
    pair_block_sums<false>(q, o, V, temp, mq, so_max, j0, j1, sq, so, to);
  }
}

SPECSTOP_CLONES
void pair_overlap_any(const float* q, const float* o, int64_t V, float temp, bool scale, float mq, float so_max,
                      float sqf, float sof, int64_t j0, int64_t j1, float* tv, float* ov) {
  if (scale) {
    pair_block_overlap<true>(q, o, V, temp, mq, so_max, sqf, sof, j0, j1, tv, ov);
  } else {
    pair_block_overlap<false>(q, o, V, temp, mq, so_max, sqf, sof, j0, j1, tv, ov);
  }
}

void pair_row_any(const float* q, const float* o, int64_t V, float temp, bool scale, int64_t tok, float* out,
                  int64_t* amax, bool shared) {
  const int64_t nb = (V + kBlock - 1) / kBlock;
  std::vector<float> b0(nb), b1(nb), b2(nb), b3(nb);
  const int64_t grain = shared ? std::max<int64_t>(64, nb / std::max(1, at::get_num_threads()) + 1) : nb;
  auto blocks = [&](const auto& pass) {  // pass(j0, j1) over every block, shared among the threads or on this one
    if (shared) {
      at::parallel_for(0, nb, grain, pass);
    } else {
      pass(0, nb);
    }
  };
  blocks([&](int64_t j0, int64_t j1) { pair_max_any(q, o, V, temp, scale, j0, j1, b0.data(), b1.data(), b2.data()); });
  float mq = -std::numeric_limits<float>::infinity(), mo = mq, probe = 0.0f;
  int64_t first = 0;  // the first block holding o's maximum
  for (int64_t j = 0; j < nb; ++j) {
    mq = b0[j] > mq ? b0[j] : mq;
    if (b1[j] > mo) mo = b1[j], first = j;
    probe += b2[j];
  }
  if (!std::isfinite(probe)) {
    for (int j = 0; j < 4; ++j) out[j] = std::numeric_limits<float>::quiet_NaN();
    *amax = -1;
    return;
  }
  int64_t arg = first * kBlock;
  while (o[arg] != mo) ++arg;  // the first maximum, as torch.argmax
  *amax = arg;
  const float so_max = scale ? o[arg] / temp : o[arg];  // max of o / T (division is monotone), as load() reads it
  blocks([&](int64_t j0, int64_t j1) {
    pair_sums_any(q, o, V, temp, scale, mq, so_max, j0, j1, b0.data(), b1.data(), b2.data());
  });
  double Sq = 0.0, So = 0.0, To = 0.0;
  for (int64_t j = 0; j < nb; ++j) Sq += b0[j], So += b1[j], To += b2[j];
  const float sqf = static_cast<float>(Sq), sof = static_cast<float>(So);
  blocks([&](int64_t j0, int64_t j1) {
    pair_overlap_any(q, o, V, temp, scale, mq, so_max, sqf, sof, j0, j1, b0.data(), b3.data());
  });
  double TV = 0.0, OV = 0.0;
  for (int64_t j = 0; j < nb; ++j) TV += b0[j], OV += b3[j];
  const float zt = scale ? o[tok] / temp : o[tok];
  out[0] = specstop::exp_nonpositive(zt - so_max) / sof;
  out[1] = static_cast<float>(std::log(So) - To / So);
  out[2] = static_cast<float>(0.5 * TV);
  out[3] = static_cast<float>(OV);
}
}  // namespace
