// Fixed-width lanes for the loops of both CPU floors (the verify kernels' vocabulary loops, the lean forward's
// products and layer math): kLanes consecutive elements as a few native vectors.
//
// Every sum the kernels form over a row is split over kLanes logical accumulators (lane l takes the elements whose
// index is l modulo kLanes) and the lanes are combined in one fixed tree. kLanes is the same in every build, so the
// baseline (4 floats per vector), AVX2 (8) and AVX-512 (16) builds add the same numbers in the same order and agree
// bit for bit; only how many native vectors hold the kLanes lanes differs. GCC vector extensions rather than
// intrinsics: element-wise arithmetic and selects on them are exact IEEE operations, and gcc emits the build's
// vector instructions for them (it will not vectorise a float-to-double sum or a max written on scalars without
// -ffast-math, which would also give up the fixed order).
#pragma once

#include "kernel_base.h"

#ifndef DIVERSED_CPU_VECTOR_FLOATS
#error "define DIVERSED_CPU_VECTOR_FLOATS (floats per native vector) with DIVERSED_CPU_CAPABILITY"
#endif

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

constexpr int kLanes = 16;                                 // logical accumulators of every reduction
constexpr int kVectorFloats = DIVERSED_CPU_VECTOR_FLOATS;  // floats per native vector of this build
constexpr int kParts = kLanes / kVectorFloats;
static_assert(kParts * kVectorFloats == kLanes, "kLanes must be a multiple of the native vector width");

typedef float FloatVector __attribute__((vector_size(kVectorFloats * sizeof(float))));
typedef float HalfFloatVector __attribute__((vector_size(kVectorFloats / 2 * sizeof(float))));
typedef double DoubleVector __attribute__((vector_size(kVectorFloats / 2 * sizeof(double))));
typedef uint16_t Bits16Vector __attribute__((vector_size(kVectorFloats * sizeof(uint16_t))));
typedef uint32_t Bits32Vector __attribute__((vector_size(kVectorFloats * sizeof(uint32_t))));

// kLanes floats: part i holds lanes [i * kVectorFloats, (i + 1) * kVectorFloats).
struct FloatLanes {
  FloatVector part[kParts];
};
// kLanes float64 accumulators, in lane order: part 2i holds the low half of float part i, part 2i + 1 its high half.
struct DoubleLanes {
  DoubleVector part[2 * kParts];
};

template <typename Op>
inline FloatLanes map_lanes(const FloatLanes& a, Op op) {
  FloatLanes result;
  for (int i = 0; i < kParts; ++i) result.part[i] = op(a.part[i]);
  return result;
}

template <typename Op>
inline FloatLanes zip_lanes(const FloatLanes& a, const FloatLanes& b, Op op) {
  FloatLanes result;
  for (int i = 0; i < kParts; ++i) result.part[i] = op(a.part[i], b.part[i]);
  return result;
}

// A native vector of `value` in every lane, as one broadcast: x - 0 is x exactly (-0 included), so the compiler drops
// the subtraction, where `FloatVector{} + value` keeps an add (-0 + 0 is +0).
inline FloatVector broadcast(float value) { return value - FloatVector{}; }

inline FloatLanes splat_lanes(float value) {
  FloatLanes result;
  for (int i = 0; i < kParts; ++i) result.part[i] = broadcast(value);
  return result;
}

// kLanes consecutive floats, one native load per part: a copy of the whole struct would go through the stack. The
// verify kernels' element loads (csrc/cpu/element_loads.h) add the 16-bit element types beside this overload.
inline FloatLanes load_lanes(const float* values, int64_t v) {
  FloatLanes lanes;
  for (int i = 0; i < kParts; ++i)
    __builtin_memcpy(&lanes.part[i], values + v + i * kVectorFloats, sizeof lanes.part[i]);
  return lanes;
}

// The low and high halves of a native vector, as shuffles (a copy through memory would stall store forwarding).
template <int... I>
inline HalfFloatVector low_half(FloatVector x, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(x, x, I...);
}
template <int... I>
inline HalfFloatVector high_half(FloatVector x, std::integer_sequence<int, I...>) {
  return __builtin_shufflevector(x, x, (I + kVectorFloats / 2)...);
}

// sums[l] += x[l] in float64, every lane. The AVX2 and AVX-512 builds widen each half with one conversion; gcc turns
// the generic shuffle-and-convert into four conversions and two inserts per 16 lanes, which made the conversion most
// of the residual loop's instructions.
inline void accumulate(DoubleLanes& sums, const FloatLanes& x) {
  for (int i = 0; i < kParts; ++i) {
#if DIVERSED_CPU_VECTOR_FLOATS == 16
    const __m512 part = reinterpret_cast<__m512>(x.part[i]);
    sums.part[2 * i] += reinterpret_cast<DoubleVector>(_mm512_cvtps_pd(_mm512_castps512_ps256(part)));
    sums.part[2 * i + 1] += reinterpret_cast<DoubleVector>(_mm512_cvtps_pd(_mm512_extractf32x8_ps(part, 1)));
#elif DIVERSED_CPU_VECTOR_FLOATS == 8
    const __m256 part = reinterpret_cast<__m256>(x.part[i]);
    sums.part[2 * i] += reinterpret_cast<DoubleVector>(_mm256_cvtps_pd(_mm256_castps256_ps128(part)));
    sums.part[2 * i + 1] += reinterpret_cast<DoubleVector>(_mm256_cvtps_pd(_mm256_extractf128_ps(part, 1)));
#else
    constexpr auto half = std::make_integer_sequence<int, kVectorFloats / 2>{};
    sums.part[2 * i] += __builtin_convertvector(low_half(x.part[i], half), DoubleVector);
    sums.part[2 * i + 1] += __builtin_convertvector(high_half(x.part[i], half), DoubleVector);
#endif
  }
}

// The lanes' total, combined pairwise in a fixed tree (lane l + lane l + 8, then + 4, + 2, + 1): a short dependency
// chain, the same in every build. Float64 accumulators, or float ones (the Llama layers' dot products).
template <typename Element, typename Lanes>
inline Element reduce_lane_tree(const Lanes& sums) {
  Element lane[kLanes];
  static_assert(sizeof lane == sizeof sums, "one element per lane");
  __builtin_memcpy(lane, &sums, sizeof lane);
#pragma GCC unroll 4
  for (int width = kLanes / 2; width >= 1; width /= 2)
#pragma GCC unroll 8
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  return lane[0];
}
inline double reduce_lanes(const DoubleLanes& sums) { return reduce_lane_tree<double>(sums); }
inline float reduce_lanes(const FloatLanes& sums) { return reduce_lane_tree<float>(sums); }

// Float lanes added one after the other from lane 0 (a block's float partial sums flushed into a float64 total).
inline double sum_float_lanes_in_order(const FloatLanes& x, double total) {
  float lane[kLanes];
  __builtin_memcpy(lane, &x, sizeof lane);
  for (int l = 0; l < kLanes; ++l) total += static_cast<double>(lane[l]);
  return total;
}

// The largest lane; NaN lanes never win (the comparison is false).
inline float max_lane(const FloatLanes& x) {
  float lane[kLanes];
  __builtin_memcpy(lane, &x, sizeof lane);
  float best = lane[0];
  for (int l = 1; l < kLanes; ++l) best = lane[l] > best ? lane[l] : best;
  return best;
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
