// How fast this machine reads memory: the bandwidth the memory floor of a forward is computed with (compute/timing.py,
// read_bandwidth). torch's reductions are bound by their own arithmetic below what a streaming GEMM reads (a floor
// computed with them can sit above a measured forward); here each thread XORs its share of a buffer far larger than
// the caches into eight independent 64-bit lanes (vectorised, one clone per ISA), which leaves the loads as the only
// limit: as fast as the bf16 GEMM reads its weights at one row, measured side by side.
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <tuple>
#include <vector>

#include "fast_math.h"

namespace {

SPECSTOP_CLONES
uint64_t fold(const uint64_t* p, int64_t n) {
  uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) a[j] ^= p[i + j];
  for (; i < n; ++i) a[0] ^= p[i];
  return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}

}  // namespace

// Seconds of the fastest of `repeats` reads of x (a contiguous CPU tensor) on torch's threads, and the XOR of its
// words (kept so that the reads are not optimised away).
std::tuple<double, int64_t> read_seconds(torch::Tensor x, int64_t repeats) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && x.nbytes() % 8 == 0,
              "read_seconds: a contiguous CPU tensor of whole 8-byte words");
  const auto* p = static_cast<const uint64_t*>(x.data_ptr());
  const int64_t n = static_cast<int64_t>(x.nbytes() / 8);
  double best = 1e30;
  uint64_t all = 0;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<uint64_t> parts(at::get_num_threads(), 0);
    at::parallel_for(0, n, 1 << 16, [&](int64_t b, int64_t e) { parts[at::get_thread_num()] ^= fold(p + b, e - b); });
    const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
    for (auto v : parts) all ^= v;
    best = std::min(best, dt.count());
  }
  return {best, static_cast<int64_t>(all)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("read_seconds", &read_seconds, "(x, repeats) -> (fastest seconds to read x, XOR of its words)");
}
