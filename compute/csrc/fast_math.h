// Shared by the native kernels (compute/csrc/*.cpp): a vectorisable exp for non-positive arguments and the
// function-clone attribute that builds one binary for AVX-512, AVX2 and baseline x86-64 hosts.
#pragma once

#include <cstdint>

namespace specstop {

// exp(x) for x <= 0 (Cephes expf: Cody-Waite range reduction, degree-5 polynomial; ~1 ulp), written branch-free so
// that the compiler vectorises the loops calling it (rounding by the 1.5 * 2^23 trick, the power of two from its bits).
// exp(0) is exactly 1; below -87 it returns 0; NaN stays NaN.
__attribute__((always_inline)) inline float exp_nonpositive(float x) {
  const float xc = x < -87.0f ? -87.0f : x;
  const float zr = xc * 1.44269504088896341f + 12582912.0f;  // round(x / ln 2) in the low mantissa bits
  const float n = zr - 12582912.0f;
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (__builtin_bit_cast(int32_t, zr) - 0x4B400000 + 127) << 23;
  const float v = e * __builtin_bit_cast(float, bits);
  return x < -87.0f ? 0.0f : v;
}

}  // namespace specstop

// One binary for AVX2-only and AVX-512 hosts: the dynamic loader picks the clone this CPU runs.
#if defined(__x86_64__) && defined(__GNUC__)
#define SPECSTOP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SPECSTOP_CLONES
#endif
