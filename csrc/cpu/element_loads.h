// Element loads of the CPU kernels: float32, bfloat16 and float16 elements read as float32, one at a time or kLanes
// at once. Exact for every element type; torch-free, compiled once per instruction set like the kernels that include
// it (see cpu_kernels.h).
#pragma once

#include "../cpu_base/lanes.h"
#include "kernel_prelude.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

// float16 bits to float32, exactly, in selects and float arithmetic that vectorise. `twice` holds exponent and
// mantissa at the top, the sign shifted out. Normal numbers, infinities and NaN: exponent and mantissa are moved into
// float32 position with the exponent raised by 224, then scaled by 2^-112; the net 112 is the difference of the two
// biases, and an all-ones exponent (Inf, NaN) stays all ones (NaN comes out quiet, as from a hardware conversion).
// Subnormals: the mantissa m under the exponent of 0.5 reads 0.5 + m * 2^-24; subtracting 0.5 leaves m * 2^-24.
inline float half_to_float(uint16_t half) {
  const uint32_t word = static_cast<uint32_t>(half) << 16;
  const uint32_t sign = word & 0x80000000u;
  const uint32_t twice = word + word;
  const float normal = float_from_bits(static_cast<int32_t>((twice >> 4) + (0xE0u << 23))) * 0x1p-112f;
  const float subnormal = float_from_bits(static_cast<int32_t>((twice >> 17) | (126u << 23))) - 0.5f;
  const uint32_t magnitude = twice < (1u << 27) ? __builtin_bit_cast(uint32_t, subnormal)
                                                : __builtin_bit_cast(uint32_t, normal);
  return __builtin_bit_cast(float, sign | magnitude);
}

// Element loads as float32 (exact for every element type). bfloat16 is the top half of a float32, so a shift converts
// it; both 16-bit types are converted on their raw bits, which keeps the vocabulary loops vectorisable.
template <typename T>
inline float load_float(const T* values, int64_t v) {
  return static_cast<float>(values[v]);
}
template <>
inline float load_float<BFloat16Bits>(const BFloat16Bits* values, int64_t v) {
  return float_from_bits(static_cast<int32_t>(static_cast<uint32_t>(values[v].bits) << 16));
}
template <>
inline float load_float<HalfBits>(const HalfBits* values, int64_t v) {
  return half_to_float(values[v].bits);
}

// kLanes consecutive elements as float32: float32 by lanes.h's overload, which overload resolution prefers to this
// template; bfloat16 widened by a shift on whole vectors; the other types lane by lane.
template <typename T>
inline FloatLanes load_lanes(const T* values, int64_t v) {
  float lane[kLanes];
  for (int l = 0; l < kLanes; ++l) lane[l] = load_float(values, v + l);
  FloatLanes lanes;
  __builtin_memcpy(&lanes, lane, sizeof lanes);
  return lanes;
}
// The AVX2 and AVX-512 builds widen with one zero-extending load and a shift; gcc splits the generic conversion of a
// whole 16-lane vector into four steps (two half conversions and an insert), which cost the bfloat16 softmax passes a
// sixth of their time.
template <>
inline FloatLanes load_lanes<BFloat16Bits>(const BFloat16Bits* values, int64_t v) {
  FloatLanes lanes;
  for (int i = 0; i < kParts; ++i) {
    const BFloat16Bits* part = values + v + i * kVectorFloats;
#if DIVERSED_CPU_VECTOR_FLOATS == 16
    const __m512i widened = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(part)));
    lanes.part[i] = reinterpret_cast<FloatVector>(_mm512_slli_epi32(widened, 16));
#elif DIVERSED_CPU_VECTOR_FLOATS == 8
    const __m256i widened = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(part)));
    lanes.part[i] = reinterpret_cast<FloatVector>(_mm256_slli_epi32(widened, 16));
#else
    Bits16Vector bits;
    __builtin_memcpy(&bits, part, sizeof bits);
    lanes.part[i] = __builtin_bit_cast(FloatVector, __builtin_convertvector(bits, Bits32Vector) << 16);
#endif
  }
  return lanes;
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
