// y = x W^T for bfloat16 (or int8) packs on AVX2 + FMA, each output row computed the same way whatever the number of
// rows: the GEMM of the packed-bf16 compute path on CPUs without AVX512-BF16 (compute/bf16_gemm.py). Built on first
// use with -mavx2 -mfma -mf16c (compute/native.py, AVX2_CFLAGS) as an extension of its own, so that it holds no
// AVX-512 instruction and coexists with the AVX512-BF16 kernel in one process.
//
// Layout: the packs of bf16_pack.h. A bfloat16 pack's 32-byte load holds, for 8 columns, the pairs (w[2p], w[2p + 1])
// as one dword each: shifting the dword left by 16 gives the fp32 weights of input 2p, masking its low half those of
// input 2p + 1 (bfloat16 is the top half of fp32), so each lane holds one output column and no horizontal sum is
// needed. An int8 pack stores each input pair step of 16 columns as [2p: columns 0-7][2p + 1: columns 0-7][2p: 8-15]
// [2p + 1: 8-15] (pack_int8 reorders the pairs), which vpmovsxbd and vcvtdq2ps widen to the same lanes.
//
// Batch invariance: every output element is the chain acc = fma(w[2p], x[2p], acc); acc = fma(w[2p + 1], x[2p + 1],
// acc) over p = 0 .. K/2 - 1 in order, from zero, in fp32 (x rounded to bfloat16 by the caller, widened exactly), then
// times the column's scale for an int8 pack, then rounded to bfloat16 as torch rounds (nearest even; an LM head asks
// for the fp32 sums as they are). Row tiles, column groups, input chunks and threads change which instructions run
// together, never the chain, so a row has the same bits alone, in a verification forward or inside a prompt. It is not
// vdpbf16ps' chain: a process runs one kernel for all its packs (compute/bf16_gemm.py).
//
// Speed: a bfloat16 weight costs one FMA lane per row, so a few rows are bound by reading the weights and many by the
// two FMA pipes. Up to 5 rows run in one register tile over all of K, the weights streamed from memory once (1 row:
// four column blocks a pass, 2 rows: two, for 8 independent accumulators). More rows run as tiles of up to 5 rows over
// chunks of kPairBlock input pairs: the chunk, read from memory by the first tile, stays in L1 for the others, the
// accumulators go to a small buffer between chunks, and the weights stream once, in order, whatever the rows. From
// kGroupRows rows (labelling passes: thousands) one block a pass would re-read all of x per block from L3 or memory, so
// a group of kGroupBlocks blocks shares each chunk: the group's chunk stays in L2 while every row tile, its inputs in
// L1, runs over the group's blocks (1.04-1.5x at 256-3,072 rows on a Zen 3, the same bits).
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16_pack.h"

#if defined(__x86_64__) && defined(__GNUC__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPECSTOP_AVX2_KERNEL 1
#else
#define SPECSTOP_AVX2_KERNEL 0
#endif

namespace {

using bf16_pack::kCols;
constexpr int kMaxTile = 5;          // rows of a register tile: 10 accumulators, 4 weights and 2 inputs in 16 ymm
constexpr int64_t kPairBlock = 64;   // input pairs per chunk of the many-row path (4 KB of a bfloat16 column block)
constexpr int64_t kGroupPairs = 256; // input pairs per chunk of the grouped path (16 KB of a bfloat16 column block)
constexpr int64_t kGroupBlocks = 16; // column blocks whose chunk the grouped path keeps in L2 (256 columns)
constexpr int64_t kGroupRows = 32;   // rows from which the grouped path runs (fewer: the inputs fit L1, one block a pass)
// Software prefetch of the weights read from memory (the one-tile path, and the first tile of each chunk of the
// many-row path), into L2, this many input pairs ahead (8 KB of a bfloat16 column block): the fastest of the distances
// and hints timed on weights streamed from memory (16-256 pairs, to L1 or L2); without it rows 2-16 cost up to
// 1.3-1.5x.
constexpr int64_t kPrefetch = 128;

bool cpu_has_avx2() {
#if SPECSTOP_AVX2_KERNEL
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

#if SPECSTOP_AVX2_KERNEL

// The fp32 weights of one input pair step for the 8 columns of half h of a column block: even (input 2p), odd (2p + 1).
inline void load_half(const uint16_t* w, int h, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + h * 16));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void load_half(const int8_t* w, int h, __m256& even, __m256& odd) {
  const auto* p = reinterpret_cast<const __m128i*>(w + h * 16);
  even = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p)));
  odd = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + h * 16 + 8))));
}

// fp32 -> bfloat16 as c10::BFloat16 rounds (nearest even, NaN -> 0x7FC0), 8 lanes -> 8 uint16.
inline __m128i to_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// The fp32 sums of 8 columns -> the output (OT: uint16_t for bfloat16, float for the sums as they are), times the
// columns' scales first for an int8 pack.
template <typename WT, typename OT>
inline void store_out(OT* out, __m256 c, const float* scale) {
  if constexpr (std::is_same_v<WT, int8_t>) c = _mm256_mul_ps(c, _mm256_loadu_ps(scale));
  if constexpr (std::is_same_v<OT, float>) {
    _mm256_storeu_ps(out, c);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), to_bf16(c));
  }
}

// Where the accumulators of a tile start and where they go.
struct TileIO {
  float* acc;         // [R][ldc] fp32 spill buffer (column offset of block 0), or nullptr: start at zero, end in out
  int64_t ldc;
  bool load;          // start from acc (a later input chunk), else from zero
  bool store;         // end in out (the last input chunk), else back in acc
  void* out;          // [R][ldo] OT
  int64_t ldo;
  const float* scale; // the blocks' column scales (int8 pack), else nullptr
};

// R rows x NB column blocks over input pairs [p0, p1): x [R][ldx] fp32 (bfloat16 values), w the first block's pack at
// pair 0 (blocks wstride apart). kPf: prefetch the weights kPrefetch pairs ahead (those read from memory).
template <typename WT, typename OT, int R, int NB, bool kPf>
void micro(const float* x, int64_t ldx, const WT* w, int64_t wstride, int64_t p0, int64_t p1, const TileIO& io) {
  __m256 c[R][NB][2];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h)
        c[r][b][h] = io.load ? _mm256_loadu_ps(io.acc + r * io.ldc + b * kCols + h * 8) : _mm256_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    for (int b = 0; b < NB; ++b) {
      const WT* wp = w + b * wstride + p * 2 * kCols;
      if constexpr (kPf) _mm_prefetch(reinterpret_cast<const char*>(wp + kPrefetch * 2 * kCols), _MM_HINT_T1);
      __m256 e0, o0, e1, o1;  // both halves' weights held, so that each row's two broadcasts feed four FMAs
      load_half(wp, 0, e0, o0);
      load_half(wp, 1, e1, o1);
      for (int r = 0; r < R; ++r) {
        const __m256 xe = _mm256_broadcast_ss(x + r * ldx + 2 * p), xo = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
        c[r][b][0] = _mm256_fmadd_ps(e0, xe, c[r][b][0]);
        c[r][b][1] = _mm256_fmadd_ps(e1, xe, c[r][b][1]);
        c[r][b][0] = _mm256_fmadd_ps(o0, xo, c[r][b][0]);
        c[r][b][1] = _mm256_fmadd_ps(o1, xo, c[r][b][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      for (int h = 0; h < 2; ++h) {
        const int64_t col = b * kCols + h * 8;
        if (io.store) {
          store_out<WT>(static_cast<OT*>(io.out) + r * io.ldo + col, c[r][b][h], io.scale ? io.scale + col : nullptr);
        } else {
          _mm256_storeu_ps(io.acc + r * io.ldc + col, c[r][b][h]);
        }
      }
}

template <typename WT, typename OT>
using MicroFn = void (*)(const float*, int64_t, const WT*, int64_t, int64_t, int64_t, const TileIO&);

// The micro-kernels by row count, [R - 1]: one block a pass with (weights from memory) and without (from L1) prefetch,
// and the one-tile path's wider passes for 1 and 2 rows.
template <typename WT, typename OT>
struct Tables {
  template <int NB, bool kPf, int... Rs>
  static constexpr std::array<MicroFn<WT, OT>, sizeof...(Rs)> rows(std::integer_sequence<int, Rs...>) {
    return {&micro<WT, OT, Rs + 1, NB, kPf>...};
  }
  static constexpr auto streamed = rows<1, true>(std::make_integer_sequence<int, kMaxTile>{});
  static constexpr auto cached = rows<1, false>(std::make_integer_sequence<int, kMaxTile>{});
  static constexpr MicroFn<WT, OT> one_row_four_blocks = &micro<WT, OT, 1, 4, true>;
  static constexpr MicroFn<WT, OT> two_rows_two_blocks = &micro<WT, OT, 2, 2, true>;
};

// Up to kMaxTile rows, column blocks [b0, b1), all of K in one register tile: every weight read once, from memory.
template <typename WT, typename OT>
void one_tile(const float* x, int64_t M, int64_t K, const WT* wp, const float* scale, int64_t pairs, int64_t b0,
              int64_t b1, OT* out, int64_t ldo) {
  using T = Tables<WT, OT>;
  const int64_t wstride = pairs * 2 * kCols;
  auto io = [&](int64_t b) {
    return TileIO{nullptr, 0, false, true, out + b * kCols, ldo, scale ? scale + b * kCols : nullptr};
  };
  int64_t b = b0;
  if (M == 1)
    for (; b + 4 <= b1; b += 4) T::one_row_four_blocks(x, K, wp + b * wstride, wstride, 0, pairs, io(b));
  if (M == 2)
    for (; b + 2 <= b1; b += 2) T::two_rows_two_blocks(x, K, wp + b * wstride, wstride, 0, pairs, io(b));
  for (; b < b1; ++b) T::streamed[M - 1](x, K, wp + b * wstride, wstride, 0, pairs, io(b));
}

// More rows, column blocks [b0, b1): per group of `group` blocks and chunk of `chunk` input pairs, each row tile (up to
// kMaxTile rows, as even as possible) over every block of the group, the fp32 accumulators kept in `acc` between
// chunks (the same chain per element as one_tile). Groups of one block under kGroupRows rows, of kGroupBlocks from it.
template <typename WT, typename OT>
void tiled(const float* x, int64_t M, int64_t K, const WT* wp, const float* scale, int64_t pairs, int64_t b0,
           int64_t b1, OT* out, int64_t ldo) {
  const auto& streamed = Tables<WT, OT>::streamed;  // the first tile reads the chunk from memory
  const auto& cached = Tables<WT, OT>::cached;      // the others from L1 (one block) or L2 (a group)
  const bool many = M >= kGroupRows;
  const int64_t group = many ? kGroupBlocks : 1, chunk = many ? kGroupPairs : kPairBlock;
  const int64_t wstride = pairs * 2 * kCols, ldc = group * kCols;
  const int64_t tiles = (M + kMaxTile - 1) / kMaxTile;
  std::vector<float> acc(M * ldc);
  for (int64_t g0 = b0; g0 < b1; g0 += group) {
    const int64_t g1 = std::min(b1, g0 + group);
    for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
      const int64_t p1 = std::min(pairs, p0 + chunk);
      for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
        const int r = static_cast<int>((M - m0) / (tiles - t));  // the rows left, spread over the tiles left
        for (int64_t b = g0; b < g1; ++b) {
          const TileIO io{acc.data() + m0 * ldc + (b - g0) * kCols, ldc, p0 > 0, p1 == pairs,
                          out + m0 * ldo + b * kCols, ldo, scale ? scale + b * kCols : nullptr};
          (t == 0 ? streamed : cached)[r - 1](x + m0 * K, K, wp + b * wstride, wstride, p0, p1, io);
        }
        m0 += r;
      }
    }
  }
}

#endif  // SPECSTOP_AVX2_KERNEL

}  // namespace

bool available() { return cpu_has_avx2(); }

// The chain packs run on in this process.
std::string chain() { return "avx2"; }

// W [N, K] (float32 or bfloat16) -> [ceil(N / 16), K / 2, 16, 2] bfloat16 (bf16_pack.h); K must be even.
torch::Tensor pack(torch::Tensor w) { return bf16_pack::pack_bf16(w); }

// W [N, K] -> (int8 [ceil(N / 16), K / 2, 16, 2], fp32 scales [ceil(N / 16) * 16]) as bf16_pack.h quantizes it, each
// input pair step of 16 columns reordered to [2p: columns 0-7][2p + 1: 0-7][2p: 8-15][2p + 1: 8-15] (load_half).
std::tuple<torch::Tensor, torch::Tensor> pack_int8(torch::Tensor w) {
  auto [q, scale] = bf16_pack::pack_int8(w);
  const auto shape = q.sizes().vec();
  q = q.view({shape[0], shape[1], 2, 8, 2}).permute({0, 1, 2, 4, 3}).contiguous().view(shape);
  return {q, scale};
}

// x [M, K] bfloat16 contiguous, a weight of pack() (bfloat16) or pack_int8() (int8, with its scales), N -> [M, N]
// bfloat16 (fp32_out: float32, the fp32 sums unrounded; the same chain, so the bf16 output is this one rounded).
torch::Tensor gemm(torch::Tensor x, torch::Tensor wp, int64_t N, std::optional<torch::Tensor> scale, bool fp32_out) {
  TORCH_CHECK(cpu_has_avx2(), "bf16_gemm.gemm: this CPU has no AVX2 with FMA");
  const bool int8 = bf16_pack::check_gemm(x, wp, N, scale);
  const int64_t M = x.size(0), K = x.size(1), pairs = wp.size(1), nb = wp.size(0), npad = nb * kCols;
  auto out = torch::empty({M, npad}, x.options().dtype(fp32_out ? torch::kFloat32 : torch::kBFloat16));
#if SPECSTOP_AVX2_KERNEL
  if (M > 0) {
    const auto xf = x.to(torch::kFloat32);  // exact: the broadcasts read fp32
    const float* xp = xf.data_ptr<float>();
    const float* sc = int8 ? scale->data_ptr<float>() : nullptr;
    auto run = [&](auto* wptr, auto* op) {
      at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) {
        if (M <= kMaxTile) {
          one_tile(xp, M, K, wptr, sc, pairs, b0, b1, op, npad);
        } else {
          tiled(xp, M, K, wptr, sc, pairs, b0, b1, op, npad);
        }
      });
    };
    auto run_out = [&](auto* wptr) {
      if (fp32_out) {
        run(wptr, out.data_ptr<float>());
      } else {
        run(wptr, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
      }
    };
    if (int8) {
      run_out(static_cast<const int8_t*>(wp.data_ptr<int8_t>()));
    } else {
      run_out(reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>()));
    }
  }
#endif
  return npad == N ? out : out.narrow(1, 0, N).contiguous();
}

#ifndef SPECSTOP_NO_BINDINGS  // decoder_layer.cpp compiles this file in without its bindings
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "this CPU runs the kernel (AVX2 and FMA)");
  m.def("chain", &chain, "the chain packs run on in this process: avx2");
  m.def("pack", &pack, "W [N, K] -> [ceil(N/16), K/2, 16, 2] bfloat16");
  m.def("pack_int8", &pack_int8, "W [N, K] -> (int8 [ceil(N/16), K/2, 16, 2] in the AVX2 order, fp32 column scales)");
  m.def("gemm", &gemm,
        "x [M, K] bf16 @ packed W^T -> [M, N] bf16 (fp32_out: float32), fp32 accumulation, batch-invariant",
        pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("N"), pybind11::arg("scale") = pybind11::none(),
        pybind11::arg("fp32_out") = false);
}
#endif
