// Softmax statistics without materialising the probabilities. draft_stats: one pass-pair over a draft's logits for the
// stop decision (entropy, q(token) and the top-k probabilities of softmax(z / T) per row). pair_stats: the draft
// against the target or companion for the labels (the other's probability of the token, its entropy and argmax, TV and
// overlap with the draft). disco_score: DISCO's inputs built from those statistics and its network in one call (the
// rest of a stop decision). Built on first use by compute/draft_stats.py
// (torch.utils.cpp_extension.load); the Python fallback computes the same quantities with torch ops.
//
// Per row: pass 1 takes the maxima of 128-element blocks (and a finiteness probe); the k largest values lie in the k
// blocks with the largest maxima, so a partial sort of those gives the top-k logits. Pass 2 sums e = exp(z - m) and
// e * (z - m) per block in float (SIMD lanes) and across blocks in double. Then with S = sum e and T = sum e (z - m):
// entropy = log S - T / S (both terms >= 0, no cancellation), p_i = exp(z_i - m) / S, max p = 1 / S.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
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

// The rows' statistics for the tokens tp, or (tp null: greedy) for each row's first argmax, returned as the picks, with
// an error on the first row whose logits hold NaN or inf (the given tokens' rows get NaN statistics instead).
std::tuple<torch::Tensor, torch::Tensor> stats_rows(const torch::Tensor& logits, const int64_t* tp, int64_t k,
                                                     double temperature) {
  const bool pick = tp == nullptr;
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "draft_stats: logits must be a contiguous float32 CPU tensor [N, V]");
  TORCH_CHECK(k >= 1, "draft_stats: k must be >= 1");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto out = torch::empty({N, 2 + k}, logits.options());
  auto picks = torch::empty({pick ? N : 0}, logits.options().dtype(torch::kLong));
  const float* xp = logits.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t* pp = pick ? picks.data_ptr<int64_t>() : nullptr;
  const Scaling s = scaling_of(temperature);
  const int64_t nb = (V + kBlock - 1) / kBlock;
  if (N == 1 && V >= kSharedRow && at::get_num_threads() > 1 && !at::in_parallel_region()) {
    Scratch sc(nb);  // one row (a decode step): its blocks shared among the threads
    row_stats_shared(xp, V, s.temp, s.on, pick ? -1 : tp[0], k, op, pp, sc);
  } else {
    at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
      Scratch sc(nb);
      for (int64_t r = begin; r < end; ++r)
        row_stats_any(xp + r * V, V, s.temp, s.on, pick ? -1 : tp[r], k, op + r * (2 + k), pick ? pp + r : nullptr,
                      sc);
    });
  }
  if (pick)
    for (int64_t r = 0; r < N; ++r) TORCH_CHECK(!std::isnan(op[r * (2 + k)]), "non-finite logits in row ", r);
  return {out, picks};
}

// logits [N, V] float32 contiguous, tokens [N] int64, k >= 1, temperature (0 or 1: none) -> [N, 2 + k] float32:
// entropy, q(token), top-k probabilities (descending; zeros past V); NaN in rows with NaN or inf logits.
torch::Tensor draft_stats(torch::Tensor logits, torch::Tensor tokens, int64_t k, double temperature) {
  TORCH_CHECK(logits.dim() == 2, "draft_stats: logits must be a contiguous float32 CPU tensor [N, V]");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == logits.size(0) && tokens.scalar_type() == torch::kLong,
              "draft_stats: tokens must be int64 [N]");
  auto tok = tokens.contiguous();
  const int64_t* tp = tok.data_ptr<int64_t>();
  for (int64_t r = 0; r < tok.size(0); ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < logits.size(1), "draft_stats: token id out of range");
  return std::get<0>(stats_rows(logits, tp, k, temperature));
}

// Greedy decoding's draft step: logits [N, V] -> (the first argmax per row [N] int64 as the drafted token, the
// statistics of draft_stats for it [N, 2 + k]): the argmax read off the same two passes, no separate torch.argmax;
// an error naming the first row with NaN or inf logits.
std::tuple<torch::Tensor, torch::Tensor> greedy_stats(torch::Tensor logits, int64_t k) {
  auto [out, picks] = stats_rows(logits, nullptr, k, 0.0);
  return {picks, out};
}

// draft and other logits [N, V] float32 contiguous, tokens [N] int64, temperature -> ([N, 4] float32: other(token),
// other's entropy, TV, overlap; [N] int64: first argmax of the other's raw logits). NaN and argmax -1 in a row whose
// logits hold NaN or inf.
std::tuple<torch::Tensor, torch::Tensor> pair_stats(torch::Tensor draft, torch::Tensor other, torch::Tensor tokens,
                                                    double temperature) {
  TORCH_CHECK(draft.dim() == 2 && draft.sizes() == other.sizes() && draft.scalar_type() == torch::kFloat32 &&
                  other.scalar_type() == torch::kFloat32 && draft.is_contiguous() && other.is_contiguous() &&
                  draft.device().is_cpu() && other.device().is_cpu(),
              "pair_stats: draft and other logits must be contiguous float32 CPU tensors of one shape [N, V]");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == draft.size(0) && tokens.scalar_type() == torch::kLong,
              "pair_stats: tokens must be int64 [N]");
  const int64_t N = draft.size(0), V = draft.size(1);
  auto out = torch::empty({N, 4}, draft.options());
  auto amax = torch::empty({N}, tokens.options());
  auto tok = tokens.contiguous();
  const float* qp = draft.data_ptr<float>();
  const float* opp = other.data_ptr<float>();
  const int64_t* tp = tok.data_ptr<int64_t>();
  float* outp = out.data_ptr<float>();
  int64_t* ap = amax.data_ptr<int64_t>();
  const Scaling sc = scaling_of(temperature);
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "pair_stats: token id out of range");
  if (N == 1 && V >= kSharedRow && at::get_num_threads() > 1) {  // a decode step's row: its blocks shared
    pair_row_any(qp, opp, V, sc.temp, sc.on, tp[0], outp, ap, true);
    return {out, amax};
  }
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      pair_row_any(qp + r * V, opp + r * V, V, sc.temp, sc.on, tp[r], outp + r * 4, ap + r, false);
  });
  return {out, amax};
}

// logits [N, V] float32 contiguous, u [N] float64 uniforms in [0, 1), temperature > 0 -> [N] int64: one draw per row
// from softmax(logits / T) (inversion sampling).
torch::Tensor sample_tokens(torch::Tensor logits, torch::Tensor u, double temperature) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "sample_tokens: logits must be a contiguous float32 CPU tensor [N, V]");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == logits.size(0) && u.scalar_type() == torch::kDouble,
              "sample_tokens: u must be float64 [N]");
  const int64_t N = logits.size(0), V = logits.size(1);
  auto out = torch::empty({N}, logits.options().dtype(torch::kLong));
  auto uc = u.contiguous();
  const float* xp = logits.data_ptr<float>();
  const double* up = uc.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const Scaling sc = scaling_of(temperature);
  at::parallel_for(0, N, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> bsum((V + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) op[r] = sample_row_any(xp + r * V, V, sc.temp, sc.on, up[r], bsum);
  });
  return out;
}

// DISCO's score per row, as predictors.inputs.build_features and DiscoNet's eval forward compute it in torch ops: the
// inputs [top-k probabilities, entropy of the renormalised top-k, scalar columns (each divided by its divisor, or
// log(max(v, 1e-9)))], a standardisation folded into the first layer (w1, b1), ReLU, the output layer (w2, b2), plus
// prior_scale * logit(clamp(x[prior_index], 1e-6, 1 - 1e-6)) + prior_bias when prior_index >= 0; sigmoid of it all
// when `sigmoid`. One call instead of about twenty torch ops: right after a draft forward each op costs several times
// its warm cost. A row with a non-finite input is refused (the caller's torch path then names the column).
torch::Tensor disco_score(const torch::Tensor& topk, const std::vector<torch::Tensor>& scalars,
                          const std::vector<double>& divs, const std::vector<bool>& logs, const torch::Tensor& w1,
                          const torch::Tensor& b1, const torch::Tensor& w2, double b2, int64_t prior_index,
                          double prior_scale, double prior_bias, bool sigmoid,
                          const std::optional<torch::Tensor>& hidden, const std::optional<torch::Tensor>& hidden_w) {
  TORCH_CHECK(topk.dim() == 2 && topk.scalar_type() == torch::kFloat32 && topk.is_contiguous() && topk.is_cpu(),
              "disco_score: topk must be a contiguous float32 CPU tensor [N, k]");
  const int64_t n = topk.size(0), k = topk.size(1), ns = static_cast<int64_t>(scalars.size());
  const int64_t d = k + 1 + ns, h = w1.size(0);
  TORCH_CHECK(static_cast<int64_t>(divs.size()) == ns && static_cast<int64_t>(logs.size()) == ns,
              "disco_score: one divisor and one log flag per scalar column");
  TORCH_CHECK(w1.dim() == 2 && w1.size(1) == d && w1.scalar_type() == torch::kFloat32 && w1.is_contiguous() &&
                  b1.numel() == h && b1.scalar_type() == torch::kFloat32 && b1.is_contiguous() && w2.numel() == h &&
                  w2.scalar_type() == torch::kFloat32 && w2.is_contiguous(),
              "disco_score: float32 contiguous w1 [H, ", d, "], b1 [H], w2 [H] expected");
  TORCH_CHECK(prior_index < d, "disco_score: prior_index ", prior_index, " >= input width ", d);
  std::vector<torch::Tensor> cols;
  for (const auto& c : scalars) {
    auto f = c.scalar_type() == torch::kFloat32 ? c.contiguous() : c.to(torch::kFloat32).contiguous();
    TORCH_CHECK(f.is_cpu() && (f.numel() == n || f.numel() == 1), "disco_score: a scalar column has ", f.numel(),
                " values for ", n, " rows");
    cols.push_back(f);
  }
  // optional linear term on the draft's hidden state (SPRINTER's: hidden [N, Hd] . hidden_w [Hd], added to the logit)
  torch::Tensor hf, hw;
  TORCH_CHECK(hidden.has_value() == hidden_w.has_value(), "disco_score: hidden and hidden_w come together");
  if (hidden.has_value()) {
    hf = hidden->to(torch::kFloat32).contiguous();
    hw = hidden_w->to(torch::kFloat32).contiguous();
    TORCH_CHECK(hf.is_cpu() && hf.dim() == 2 && hf.size(0) == n && hw.dim() == 1 && hw.size(0) == hf.size(1),
                "disco_score: hidden [N, Hd] and hidden_w [Hd] expected");
  }
  const int64_t hd = hidden.has_value() ? hf.size(1) : 0;
  auto out = torch::empty({n}, topk.options());
  const float* tp = topk.data_ptr<float>();
  const float* w1p = w1.data_ptr<float>();
  const float* b1p = b1.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<float> x(d);
  for (int64_t r = 0; r < n; ++r) {
    const float* t = tp + r * k;
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += t[j];
    const float denom = std::max(sum, 1e-12f);
    float ent = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      x[j] = t[j];
      const float u = t[j] / denom;
      ent += u > 0.0f ? -u * std::log(u) : (u == 0.0f ? 0.0f : -std::numeric_limits<float>::infinity());
    }
    x[k] = ent;
    for (int64_t c = 0; c < ns; ++c) {
      const float v = cols[c].data_ptr<float>()[cols[c].numel() == 1 ? 0 : r];
      x[k + 1 + c] = logs[c] ? std::log(std::max(v, 1e-9f)) : v / static_cast<float>(divs[c]);
    }
    for (int64_t j = 0; j < d; ++j)
      TORCH_CHECK(std::isfinite(x[j]), "disco_score: non-finite input ", j, " in row ", r);
    float logit = static_cast<float>(b2);
    for (int64_t i = 0; i < h; ++i) {
      const float* wi = w1p + i * d;
      float a = b1p[i];
      for (int64_t j = 0; j < d; ++j) a += wi[j] * x[j];
      logit += w2p[i] * std::max(a, 0.0f);
    }
    if (hd) {
      const float* hr = hf.data_ptr<float>() + r * hd;
      const float* wr = hw.data_ptr<float>();
      float dot = 0.0f;
      for (int64_t j = 0; j < hd; ++j) {
        TORCH_CHECK(std::isfinite(hr[j]), "disco_score: non-finite hidden input ", j, " in row ", r);
        dot += hr[j] * wr[j];
      }
      logit += dot;
    }
    if (prior_index >= 0) {
      const float v = std::min(std::max(x[prior_index], 1e-6f), 1.0f - 1e-6f);
      logit += static_cast<float>(prior_scale) * std::log(v / (1.0f - v)) + static_cast<float>(prior_bias);
    }
    op[r] = sigmoid ? 1.0f / (1.0f + std::exp(-logit)) : logit;
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("disco_score", &disco_score, "DISCO's inputs and network on the draft statistics, one call");
  m.def("sample_tokens", &sample_tokens, "one draw per row from softmax(logits / T)");
  m.def("draft_stats", &draft_stats, "draft stop-decision statistics");
  m.def("greedy_stats", &greedy_stats, "greedy draft step: first argmax and its stop-decision statistics");
  m.def("pair_stats", &pair_stats, "draft against another model: its probability of the token, entropy, TV, overlap");
}
