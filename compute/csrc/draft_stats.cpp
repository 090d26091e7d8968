// Softmax statistics without materialising the probabilities, the extension's entry points (argument checks, rows
// shared among the threads) and bindings. draft_stats: one pass-pair over a draft's logits for the stop decision
// (entropy, q(token) and the top-k probabilities of softmax(z / T) per row). pair_stats: the draft against the target
// or companion for the labels (the other's probability of the token, its entropy and argmax, TV and overlap with the
// draft). disco_score: DISCO's inputs built from those statistics and its network in one call (the rest of a stop
// decision). The per-row kernels are in softmax_rows.h (one model's softmax: statistics, sampling) and pair_rows.h
// (the draft against another model). Built on first use by compute/draft_stats.py (torch.utils.cpp_extension.load);
// the Python fallback computes the same quantities with torch ops.
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "softmax_rows.h"
#include "pair_rows.h"

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
