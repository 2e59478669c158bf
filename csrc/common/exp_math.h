// The exp of softmax and SiLU, shared by every native kernel: the verify kernels on the CPU and CUDA (verify_math.h
// includes it) and the lean forward's attention and MLP (csrc/forward/llama_math.h). Torch-free; every function is
// __host__ __device__, and on the CPU also written for GCC vectors of floats (the kernels' lanes), so each build
// evaluates the very same expression.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DX_HD __host__ __device__ __forceinline__
#else
// Always inlined on the host: the CPU kernels are compiled once per instruction set, and these helpers (defined outside
// those builds' target regions) must become part of each build's loops rather than be called out of line.
#define DX_HD inline __attribute__((always_inline))
#endif

namespace diversed {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693145751953125f;  // ln 2 split in two so n * ln2 is exact for |n| <= 126
constexpr float kLn2Low = 1.42860676533018704e-06f;
constexpr float kExpUnderflow = -87.33654f;     // exp of anything below is under FLT_MIN: flushed to 0
constexpr float kRoundingShift = 12582912.0f;   // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
// The polynomial of exp_nonpositive, coefficient of r^k (see there).
constexpr float kExpPoly6 = 0.001381461275741458f;
constexpr float kExpPoly5 = 0.008368710055947304f;
constexpr float kExpPoly4 = 0.04166838899254799f;
constexpr float kExpPoly3 = 0.1666652113199234f;
constexpr float kExpPoly2 = 0.4999999403953552f;
constexpr float kExpPoly1 = 1.0f;
constexpr float kExpPoly0 = 1.0f;

DX_HD float float_from_bits(int32_t bits) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(bits);
#else
  return __builtin_bit_cast(float, bits);
#endif
}

// 2^n for an integer-valued n in [-126, 0]: the float with exponent field n + 127.
DX_HD float exp2_of_integer(float n) { return float_from_bits((static_cast<int32_t>(n) + 127) << 23); }
#if !defined(__CUDACC__) && !defined(__HIPCC__)
// The same for a GCC vector of floats (the CPU kernels' lanes): comparing two such vectors gives the matching vector
// of int32, and the float-to-int conversion truncates like static_cast (exact here: n is an integer).
template <typename V>
inline std::enable_if_t<!std::is_arithmetic_v<V>, V> exp2_of_integer(V n) {
  using Int = decltype(n < n);
  const Int bits = (__builtin_convertvector(n, Int) + 127) << 23;
  return __builtin_bit_cast(V, bits);
}
#endif

// a * b + c with one rounding (exactly rounded on every device), for a float or, on the CPU, a GCC vector of floats.
// The kernel builds with FMA instructions (AVX2, AVX-512) turn the lane loop into one vector FMA; a build without
// them computes the same exactly rounded values lane by lane.
template <typename F>
DX_HD F fused_multiply_add(F a, F b, F c) {
#if defined(__CUDACC__) || defined(__HIPCC__)
  return fmaf(a, b, c);
#else
  if constexpr (std::is_arithmetic_v<F>) {
    return std::fma(a, b, c);
  } else {
    F result;
    for (int l = 0; l < static_cast<int>(sizeof(F) / sizeof(float)); ++l) result[l] = __builtin_fmaf(a[l], b[l], c[l]);
    return result;
  }
#endif
}

// exp(x) for x <= 0, the only range softmax needs (x = logit - row max). Cody-Waite reduction to r in [-ln2/2, ln2/2]
// and a degree-6 polynomial fitted to exp(r) by weighted least squares (truncation error 4e-9 relative, under a float32
// rounding step), all in fused multiply-adds: relative error below 1e-7 in 10 multiply-adds, where a Taylor polynomial
// in separate products and sums took 24 instructions (the logits kernels spend most of their time here). Branch-free
// (selects only), so the CUDA kernels and the CPU kernels evaluate the very same expression, the CPU kernels on whole
// vectors of lanes (F a float or a GCC vector of floats; F{} + c broadcasts the constant c exactly). exp(-inf) = 0;
// NaN stays NaN (callers sanitise the mass).
template <typename F>
DX_HD F exp_nonpositive(F x) {
  F clamped = x < kExpUnderflow ? F{} + kExpUnderflow : x;
  clamped = clamped > 0.0f ? F{} : clamped;
  const F shifted = fused_multiply_add(clamped, F{} + kLog2e, F{} + kRoundingShift);
  const F n = shifted - kRoundingShift;
  F r = fused_multiply_add(n, F{} - kLn2High, clamped);
  r = fused_multiply_add(n, F{} - kLn2Low, r);
  F poly = F{} + kExpPoly6;
  poly = fused_multiply_add(poly, r, F{} + kExpPoly5);
  poly = fused_multiply_add(poly, r, F{} + kExpPoly4);
  poly = fused_multiply_add(poly, r, F{} + kExpPoly3);
  poly = fused_multiply_add(poly, r, F{} + kExpPoly2);
  poly = fused_multiply_add(poly, r, F{} + kExpPoly1);
  poly = fused_multiply_add(poly, r, F{} + kExpPoly0);
  const F result = poly * exp2_of_integer(n);
  return x < kExpUnderflow ? F{} : result;  // NaN compares false and stays NaN
}

}  // namespace diversed
