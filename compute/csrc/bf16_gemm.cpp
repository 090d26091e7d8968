// y = x W^T in bfloat16 with fp32 accumulation, each output row computed the same way whatever the number of rows:
// the GEMM of the packed-bf16 compute path (compute/bf16_gemm.py). Built on first use with
// torch.utils.cpp_extension.load; runs where the CPU has AVX512-BF16 (elsewhere available() is false and the caller
// keeps oneDNN), and bfloat16 packs on AMX-BF16 tiles where the CPU has those too (amx_rows, below).
//
// Layout (bf16_pack.h, shared with the AVX2 kernel): pack() stores W [N, K] as [ceil(N / 16)][K / 2][16][2] bf16
// ("VNNI" pairs: for 16 output columns, the weights of inputs 2p and 2p + 1 side by side), the operand order of
// vdpbf16ps. One 64-byte load feeds 16 columns; each row's input pair is broadcast to the 16 lanes, so a lane holds one
// output and no horizontal sum is needed. pack_int8() stores the same layout in int8 with one fp32 scale per output
// column (symmetric, max|w| / 127): half the bytes, for draft-side models whose steps are bound by reading their
// weights. The kernel widens each 32 integers to bf16 (exact) and multiplies the column's fp32 sum by its scale before
// rounding, so the chain below is unchanged.
//
// Batch invariance: every output element is the same chain of vdpbf16ps over p = 0 .. K/2 - 1 in order, into an fp32
// lane that starts at zero, then rounded to bf16 (round to nearest even; an LM head asks for the fp32 sums as they are,
// its logits). Row and column tiling, threads and the fp32 spills of long-K tiles change which instructions run
// together, never the chain, so a row has the same bits alone, in a verification forward of L rows or inside a prompt
// (tested against a one-row call).
//
// Speed: up to 16 rows the weights stream from memory once (see few_rows), where oneDNN's bf16 kernels read them again
// past ~6 rows. More rows run as 8-row tiles over L2-sized column chunks and 256-input blocks, a little slower than
// oneDNN. OpenMP must be on in the build (compute/native.py): at::parallel_for runs on one thread without it.
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16_pack.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>
#define SPECSTOP_BF16_KERNEL 1
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#else
#define SPECSTOP_BF16_KERNEL 0
#endif

namespace {

using bf16_pack::kCols;              // output columns per block (one zmm of fp32)
constexpr int64_t kTileRows = 16;    // calls of up to this many rows stream the weights once (few_rows)
constexpr int64_t kPairBlock = 128;  // input pairs per block of the many-row path (256 inputs)
constexpr int64_t kChunkBytes = 512 * 1024;  // weights per column chunk of the many-row path (half of L2)
// Software prefetch distance (input pairs = 64-byte lines per column block) for a call of R rows: their extra compute
// per byte leaves the hardware prefetcher behind from 3 rows on. The distances are the fastest of those timed on
// weights streamed from memory (none, 32, 64, 128, 256 pairs, to L1 or to L2 only): none for 1-2 rows, 32 pairs for
// 3-4, 128 for 5-16 (a pass over one column block, few_rows); int8 weights 64 pairs (2 KB ahead) at every row count.
template <typename WT>
constexpr int64_t prefetch_pairs(int rows) {
  if constexpr (std::is_same_v<WT, int8_t>) return 64;
  return rows <= 2 ? 0 : (rows <= 4 ? 32 : 128);
}

bool cpu_has_bf16() {
#if SPECSTOP_BF16_KERNEL
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX-BF16 (Intel Sapphire Rapids and later): the tile unit computes 16 rows x 16 columns x 32 inputs per instruction,
// so up to 16 rows cost what one row costs (reading the weights). Used for bfloat16 packs on every row count where the
// CPU has it, Linux grants the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once per process) and SPECSTOP_AMX is not
// 0; int8 packs stay on vdpbf16ps. Decided once per process, so a model's rows always run on one of the two chains.
bool cpu_has_amx() {
#if SPECSTOP_BF16_KERNEL
  static const bool ok = [] {
    const char* env = std::getenv("SPECSTOP_AMX");
    if (env && std::strcmp(env, "0") == 0) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
    if (!amx_bf16 || !amx_tile || !cpu_has_bf16()) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

#if SPECSTOP_BF16_KERNEL

// 32 weights of one input pair step for 16 columns as the __m512bh operand of vdpbf16ps: bf16 weights are loaded as
// they are; int8 weights are widened to fp32 and rounded to bf16, which holds every integer in [-127, 127] exactly, so
// an int8 pack computes the same chain as a bf16 pack of the integers (the column scale is applied to the fp32 sum).
BF16_TARGET inline __m512bh load_pairs(const uint16_t* w) { return (__m512bh)_mm512_loadu_si512(w); }
BF16_TARGET inline __m512bh load_pairs(const int8_t* w) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kCols))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// The column scales from column c on (an int8 pack's), or null for a bf16 pack, which has none (never an offset from a
// null pointer).
inline const float* cols_from(const float* scale, int64_t c) { return scale ? scale + c : nullptr; }

// fp32 sums of 16 columns -> the output (OT: uint16_t for bf16, rounded to nearest even; float for the fp32 sums as
// they are, the LM heads' logits), times the columns' scales first for an int8 pack.
template <typename WT, typename OT>
BF16_TARGET inline void store_out(OT* out, __m512 c, const float* scale) {
  if constexpr (std::is_same_v<WT, int8_t>) c = _mm512_mul_ps(c, _mm512_loadu_ps(scale));
  if constexpr (std::is_same_v<OT, float>) {
    _mm512_storeu_ps(out, c);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(c));
  }
}

// R rows x NB column blocks over input pairs [p0, p1). kSpill: the fp32 accumulators start from and go back to `acc`
// ([R][ldc] fp32, column offset of block 0); otherwise they start at zero and leave through store_out into `out`
// ([R][ldo]), scaled by `scale` (the blocks' column scales) for an int8 pack. Each row's input pair is broadcast from
// memory (a load, not a shuffle: the shuffle port would cap the kernel at one vdpbf16ps per cycle).
template <typename WT, typename OT, int R, int NB, bool kSpill>
BF16_TARGET inline void micro(const uint16_t* x, int64_t ldx, const WT* w, int64_t wstride, int64_t p0, int64_t p1,
                              float* acc, int64_t ldc, OT* out, int64_t ldo, const float* scale) {
  __m512 c[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b)
      c[r][b] = kSpill ? _mm512_loadu_ps(acc + r * ldc + b * kCols) : _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    __m512bh wv[NB];
    if constexpr (!kSpill && prefetch_pairs<WT>(R) > 0)
      for (int b = 0; b < NB; ++b)
        _mm_prefetch(reinterpret_cast<const char*>(w + b * wstride + (p + prefetch_pairs<WT>(R)) * 2 * kCols),
                     _MM_HINT_T0);
    for (int b = 0; b < NB; ++b) wv[b] = load_pairs(w + b * wstride + p * 2 * kCols);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv =
          (__m512bh)_mm512_castps_si512(_mm512_set1_ps(*reinterpret_cast<const float*>(x + r * ldx + 2 * p)));
      for (int b = 0; b < NB; ++b) c[r][b] = _mm512_dpbf16_ps(c[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) {
      if (kSpill) {
        _mm512_storeu_ps(acc + r * ldc + b * kCols, c[r][b]);
      } else {
        store_out<WT>(out + r * ldo + b * kCols, c[r][b], cols_from(scale, b * kCols));
      }
    }
}

constexpr int kRowChunk = 8;  // rows of a tile: the many-row path's, and few_rows' for an int8 pack
constexpr int kWideRows = 4;  // few_rows, bf16 pack: more rows than this run one column block per pass

template <typename WT, typename OT, int R, int NB, bool kSpill>
BF16_TARGET void chunk_fn(const uint16_t* x, int64_t ldx, const WT* w, int64_t wstride, int64_t p0, int64_t p1,
                          float* acc, int64_t ldc, OT* out, int64_t ldo, const float* scale) {
  micro<WT, OT, R, NB, kSpill>(x, ldx, w, wstride, p0, p1, acc, ldc, out, ldo, scale);
}

template <typename WT, typename OT>
using ChunkFn = void (*)(const uint16_t*, int64_t, const WT*, int64_t, int64_t, int64_t, float*, int64_t, OT*,
                         int64_t, const float*);

// The micro-kernels by row count, [R - 1]: one_block (1-16 rows, one column block a pass), four_blocks (1-4 rows),
// three_blocks (1-8 rows), and spilled3 / spilled1 (the many-row path's 8-row tiles: three blocks, a chunk's leftover).
template <typename WT, typename OT>
struct Tables {
  template <bool kSpill, int NB, int... Rs>
  static constexpr std::array<ChunkFn<WT, OT>, sizeof...(Rs)> row_table(std::integer_sequence<int, Rs...>) {
    return {&chunk_fn<WT, OT, Rs + 1, NB, kSpill>...};
  }
  static constexpr auto one_block = row_table<false, 1>(std::make_integer_sequence<int, static_cast<int>(kTileRows)>{});
  static constexpr auto four_blocks = row_table<false, 4>(std::make_integer_sequence<int, kWideRows>{});
  static constexpr auto three_blocks = row_table<false, 3>(std::make_integer_sequence<int, kRowChunk>{});
  static constexpr auto spilled3 = row_table<true, 3>(std::make_integer_sequence<int, kRowChunk>{});
  static constexpr auto spilled1 = row_table<true, 1>(std::make_integer_sequence<int, kRowChunk>{});
};

// Up to 16 rows, column blocks [b0, b1), over all of K; `scale`: the int8 pack's column scales (else unused).
// bf16 pack (bound by reading the weights): every weight read once, from memory, by all the rows. Up to 4 rows a pass
// covers four column blocks (4-16 chains of vdpbf16ps hide its latency); from 5 rows one block, one accumulator per
// row, so that memory never idles while rows 9-16 re-read a group of blocks from L2.
// int8 pack (half the bytes, its widening makes more rows compute-bound): groups of 3-4 column blocks that rows 1-8 and
// 9-16 read in turn, the second time from L2 (faster there than one block a pass).
template <typename WT, typename OT>
void few_rows(const uint16_t* x, int64_t M, int64_t ldx, const WT* wp, const float* scale, int64_t pairs, int64_t b0,
              int64_t b1, OT* out, int64_t ldo) {
  using T = Tables<WT, OT>;
  const int64_t wstride = pairs * 2 * kCols;
  auto call = [&](ChunkFn<WT, OT> fn, int64_t m0, int64_t b) {
    fn(x + m0 * ldx, ldx, wp + b * wstride, wstride, 0, pairs, nullptr, 0, out + m0 * ldo + b * kCols, ldo,
       cols_from(scale, b * kCols));
  };
  if constexpr (std::is_same_v<WT, int8_t>) {
    const int nb = M <= kWideRows ? 4 : 3;
    for (int64_t b = b0; b < b1; b += nb) {
      const bool whole = b + nb <= b1;
      for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
        const int r = static_cast<int>(std::min<int64_t>(kRowChunk, M - m0));
        if (whole) {
          call(nb == 4 ? T::four_blocks[r - 1] : T::three_blocks[r - 1], m0, b);
        } else {
          for (int64_t j = b; j < b1; ++j) call(T::one_block[r - 1], m0, j);
        }
      }
    }
  } else {
    const int r = static_cast<int>(M);
    int64_t b = b0;
    if (M <= kWideRows)
      for (; b + 4 <= b1; b += 4) call(T::four_blocks[r - 1], 0, b);
    for (; b < b1; ++b) call(T::one_block[r - 1], 0, b);
  }
}

template <typename WT, typename OT>
BF16_TARGET void to_out(const float* acc, int64_t n, const float* scale, OT* out) {
  for (int64_t j = 0; j < n; j += kCols) store_out<WT>(out + j, _mm512_loadu_ps(acc + j), cols_from(scale, j));
}

// More than 16 rows, column blocks [b0, b1): chunks of columns whose weights fit in L2, 8-row tiles, input blocks of
// kPairBlock pairs with the fp32 accumulators spilled between blocks (the same chain per element as few_rows).
template <typename WT, typename OT>
void many_rows(const uint16_t* x, int64_t M, int64_t ldx, const WT* wp, const float* scale, int64_t pairs, int64_t b0,
               int64_t b1, OT* out, int64_t ldo) {
  const auto& spilled3 = Tables<WT, OT>::spilled3;
  const auto& spilled1 = Tables<WT, OT>::spilled1;
  constexpr int nb = 3;  // column blocks per pass of an 8-row tile (24 accumulators)
  const int64_t wstride = pairs * 2 * kCols;
  const int64_t block_bytes = wstride * static_cast<int64_t>(sizeof(WT));
  const int64_t chunk = std::max<int64_t>(nb, kChunkBytes / block_bytes / nb * nb);
  std::vector<float> acc(kRowChunk * chunk * kCols);
  for (int64_t c0 = b0; c0 < b1; c0 += chunk) {
    const int64_t c1 = std::min(b1, c0 + chunk), ldc = (c1 - c0) * kCols;
    for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
      const int r = static_cast<int>(std::min<int64_t>(kRowChunk, M - m0));
      std::fill(acc.begin(), acc.begin() + r * ldc, 0.0f);
      for (int64_t p0 = 0; p0 < pairs; p0 += kPairBlock) {
        const int64_t p1 = std::min(pairs, p0 + kPairBlock);
        int64_t b = c0;
        for (; b + nb <= c1; b += nb)
          spilled3[r - 1](x + m0 * ldx, ldx, wp + b * wstride, wstride, p0, p1, acc.data() + (b - c0) * kCols, ldc,
                          static_cast<OT*>(nullptr), 0, nullptr);
        for (; b < c1; ++b)
          spilled1[r - 1](x + m0 * ldx, ldx, wp + b * wstride, wstride, p0, p1, acc.data() + (b - c0) * kCols, ldc,
                          static_cast<OT*>(nullptr), 0, nullptr);
      }
      for (int64_t q = 0; q < r; ++q)
        to_out<WT>(acc.data() + q * ldc, ldc, cols_from(scale, c0 * kCols), out + (m0 + q) * ldo + c0 * kCols);
    }
  }
}

// The AMX chain. Tiles: 0, 1 the fp32 sums of two column blocks (R rows x 16), 2 the rows' next 32 inputs (R x 32
// bf16), 3, 4 the two blocks' weights for them (16 input pairs x 16 columns x 2: 1 KB of the pack as it lies, whose
// [K / 2][16][2] layout is the tile operand's), 5-7 the same for the last K mod 32 inputs. Every output element is the
// tdpbf16ps chain over the input chunks in order from zero, whatever the rows, the blocks or the threads: a row has the
// same bits alone, in a verification forward or in a prompt.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

AMX_TARGET inline void amx_configure(int rows, int tail_pairs) {
  TileConfig cfg;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  for (int t = 3; t < 5; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  if (tail_pairs) {
    cfg.rows[5] = static_cast<uint8_t>(rows), cfg.colsb[5] = static_cast<uint16_t>(4 * tail_pairs);
    for (int t = 6; t < 8; ++t) cfg.rows[t] = static_cast<uint8_t>(tail_pairs), cfg.colsb[t] = 64;
  }
  // The whole 64 bytes as the operand: GCC's _tile_loadconfig declares a read of 8, which lets the optimiser drop the
  // stores of the rows and widths above (it does in ggml's AMX kernel, which then dies with SIGILL: docs/llamacpp.md).
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

// One pass: rows [m0, m0 + R) (R <= 16, tiles configured for R) times column block b (and b + 1 when kTwo).
template <bool kTwo, typename OT>
AMX_TARGET inline void amx_pass(const uint16_t* x, int64_t ldx, const uint16_t* w0, int64_t wstride, int64_t chunks,
                                int64_t tail, int rows, float* buf, OT* out, int64_t ldo) {
  const uint16_t* w1 = w0 + wstride;
  constexpr int64_t kChunk = 16 * 2 * kCols;  // pack elements of 16 input pairs of one block
  _tile_zero(0);
  if constexpr (kTwo) _tile_zero(1);
  for (int64_t j = 0; j < chunks; ++j) {
    _tile_loadd(2, x + j * 32, ldx * 2);
    _tile_loadd(3, w0 + j * kChunk, 64);
    if constexpr (kTwo) _tile_loadd(4, w1 + j * kChunk, 64);
    _tile_dpbf16ps(0, 2, 3);
    if constexpr (kTwo) _tile_dpbf16ps(1, 2, 4);
  }
  if (tail) {
    _tile_loadd(5, x + chunks * 32, ldx * 2);
    _tile_loadd(6, w0 + chunks * kChunk, 64);
    if constexpr (kTwo) _tile_loadd(7, w1 + chunks * kChunk, 64);
    _tile_dpbf16ps(0, 5, 6);
    if constexpr (kTwo) _tile_dpbf16ps(1, 5, 7);
  }
  _tile_stored(0, buf, 64);
  if constexpr (kTwo) _tile_stored(1, buf + 16 * kCols, 64);
  for (int r = 0; r < rows; ++r) {
    store_out<uint16_t>(out + r * ldo, _mm512_load_ps(buf + r * kCols), nullptr);
    if constexpr (kTwo) store_out<uint16_t>(out + r * ldo + kCols, _mm512_load_ps(buf + (16 + r) * kCols), nullptr);
  }
}

// Any number of rows, column blocks [b0, b1) of a bfloat16 pack: pairs of blocks, 16-row tiles under each (a pair's
// weights, at most 2 x 16 x K bf16 = 573 KB for K = 8960, come from memory once and from L2 for the next row tiles).
template <typename OT>
AMX_TARGET void amx_rows(const uint16_t* x, int64_t M, int64_t ldx, const uint16_t* wp, int64_t pairs, int64_t b0,
                         int64_t b1, OT* out, int64_t ldo) {
  const int64_t wstride = pairs * 2 * kCols, chunks = pairs / 16, tail = pairs % 16;
  alignas(64) float buf[2 * 16 * kCols];
  int configured = -1;
  for (int64_t b = b0; b < b1; b += 2) {
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      if (rows != configured) amx_configure(rows, static_cast<int>(tail)), configured = rows;
      const uint16_t* xr = x + m0 * ldx;
      OT* o = out + m0 * ldo + b * kCols;
      if (b + 1 < b1) {
        amx_pass<true>(xr, ldx, wp + b * wstride, wstride, chunks, tail, rows, buf, o, ldo);
      } else {
        amx_pass<false>(xr, ldx, wp + b * wstride, wstride, chunks, tail, rows, buf, o, ldo);
      }
    }
  }
  _tile_release();
}

#endif  // SPECSTOP_BF16_KERNEL

}  // namespace

bool available() { return cpu_has_bf16(); }

// The chain bfloat16 packs run on in this process: "amx" or "avx512-bf16" (int8 packs: always the latter).
std::string chain() { return cpu_has_amx() ? "amx" : "avx512-bf16"; }

// W [N, K] (float32 or bfloat16) -> [ceil(N / 16), K / 2, 16, 2] bfloat16, zero columns past N; K must be even.
torch::Tensor pack(torch::Tensor w) { return bf16_pack::pack_bf16(w); }

// W [N, K] -> (int8 [ceil(N / 16), K / 2, 16, 2], fp32 scales [ceil(N / 16) * 16]): each output row of W rounded to
// integers in [-127, 127] times its own scale max|w| / 127 (symmetric, per output channel; scale 1 for a zero row or
// past N).
std::tuple<torch::Tensor, torch::Tensor> pack_int8(torch::Tensor w) { return bf16_pack::pack_int8(w); }

// x [M, K] bfloat16 contiguous, a weight of pack() (bfloat16) or pack_int8() (int8, with its scales), N -> [M, N]
// bfloat16 (fp32_out: float32, the fp32 sums unrounded; the same chain, so the bf16 output is this one rounded).
torch::Tensor gemm(torch::Tensor x, torch::Tensor wp, int64_t N, std::optional<torch::Tensor> scale, bool fp32_out) {
  TORCH_CHECK(cpu_has_bf16(), "bf16_gemm.gemm: this CPU has no AVX512-BF16");
  const bool int8 = bf16_pack::check_gemm(x, wp, N, scale);
  const int64_t M = x.size(0), pairs = wp.size(1), nb = wp.size(0), npad = nb * kCols;
  auto out = torch::empty({M, npad}, x.options().dtype(fp32_out ? torch::kFloat32 : torch::kBFloat16));
#if SPECSTOP_BF16_KERNEL
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int64_t K = x.size(1);
  const bool amx = cpu_has_amx();
  auto run = [&](auto* wptr, const float* sc, auto* op) {
    at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) {
      constexpr bool bf16_pack = std::is_same_v<std::decay_t<decltype(*wptr)>, uint16_t>;
      if constexpr (bf16_pack) {
        if (amx) {
          amx_rows(xp, M, K, wptr, pairs, b0, b1, op, npad);
          return;
        }
      }
      if (M <= kTileRows) {
        few_rows(xp, M, K, wptr, sc, pairs, b0, b1, op, npad);
      } else {
        many_rows(xp, M, K, wptr, sc, pairs, b0, b1, op, npad);
      }
    });
  };
  auto run_out = [&](auto* wptr, const float* sc) {
    if (fp32_out) {
      run(wptr, sc, out.data_ptr<float>());
    } else {
      run(wptr, sc, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
    }
  };
  if (M > 0) {
    if (int8) {
      run_out(wp.data_ptr<int8_t>(), scale->data_ptr<float>());
    } else {
      run_out(reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>()), nullptr);
    }
  }
#endif
  return npad == N ? out : out.narrow(1, 0, N).contiguous();
}

#ifndef SPECSTOP_NO_BINDINGS  // decoder_layer.cpp compiles this file in without its bindings
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "this CPU runs the kernel (AVX512-BF16)");
  m.def("chain", &chain, "the chain bfloat16 packs run on in this process: amx or avx512-bf16");
  m.def("pack", &pack, "W [N, K] -> [ceil(N/16), K/2, 16, 2] bfloat16");
  m.def("pack_int8", &pack_int8, "W [N, K] -> (int8 [ceil(N/16), K/2, 16, 2], fp32 column scales)");
  m.def("gemm", &gemm,
        "x [M, K] bf16 @ packed W^T -> [M, N] bf16 (fp32_out: float32), fp32 accumulation, batch-invariant",
        pybind11::arg("x"), pybind11::arg("wp"), pybind11::arg("N"), pybind11::arg("scale") = pybind11::none(),
        pybind11::arg("fp32_out") = false);
}
#endif
