// Building blocks of the CPU kernels: element loads, row policies and the passes over one vocabulary row (softmax
// normaliser, residual or target mass, inverse CDF, argmax of the mixture). Torch-free; compiled once per instruction
// set inside diversed::cpu::DIVERSED_CPU_CAPABILITY (see cpu_kernels.h). Both builds perform the same operations in
// the same order (no FMA, fixed accumulator lanes), so their results are bitwise identical.
//
// A row policy exposes `float mass(int64_t v)`:
//   ProbRow<T>   a row of probabilities (mass = the sanitised value);
//   LogitRow<T>  a row of logits with its softmax normaliser (mass = softmax probability, computed on the fly).
// The loops read a row once per pass, never store a [V] temporary, and keep 8 independent accumulators so gcc
// vectorises them.
#pragma once

#include "kernel_prelude.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

constexpr int kLanes = 8;                 // independent accumulators per reduction
constexpr int64_t kScanBlock = 256;       // the inverse CDF skips whole blocks before scanning element-wise

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

template <typename T>
struct ProbRow {
  const T* values;
  float mass(int64_t v) const { return sanitize_mass(load_float(values, v)); }
};

template <typename T>
struct LogitRow {
  const T* values;
  float inverse_temperature;
  SoftmaxStats stats;
  float mass(int64_t v) const { return softmax_mass(load_float(values, v), inverse_temperature, stats); }
};

constexpr int kSoftmaxLanes = 16;         // float lanes of the sum-exp pass: two AVX2 registers
constexpr int64_t kSoftmaxBlock = 512;    // the online softmax works block by block: 2 KiB of float32, in L1

// kLanes floats (doubles) as one GCC vector. Element-wise arithmetic and `a > b ? a : b` on them are exact IEEE
// operations, so both builds still agree bit for bit; but gcc emits vector max/compare/convert instructions for them,
// which it will not do for the scalar forms of a max or a float-to-double sum without -ffast-math.
typedef float FloatLanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef double DoubleLanes __attribute__((vector_size(kLanes * sizeof(double))));

template <typename T>
inline FloatLanes load_lanes(const T* values, int64_t v) {
  FloatLanes lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = load_float(values, v + l);
  return lanes;
}

template <typename Row>
inline FloatLanes mass_lanes(const Row& row, int64_t v) {
  FloatLanes lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = row.mass(v + l);
  return lanes;
}

inline double sum_lanes(DoubleLanes lanes) {
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// Max of the scaled logits in [begin, end) (NaN compares false and is skipped).
template <typename T>
float scaled_max(const T* logits, int64_t begin, int64_t end, float inverse_temperature) {
  FloatLanes lane_max;
  for (int l = 0; l < kLanes; ++l) lane_max[l] = -INFINITY;
  int64_t v = begin;
  for (; v + kLanes <= end; v += kLanes) {
    const FloatLanes scaled = load_lanes(logits, v) * inverse_temperature;
    lane_max = scaled > lane_max ? scaled : lane_max;
  }
  float row_max = lane_max[0];
  for (int l = 1; l < kLanes; ++l) row_max = lane_max[l] > row_max ? lane_max[l] : row_max;
  for (; v < end; ++v) {
    const float scaled = load_float(logits, v) * inverse_temperature;
    row_max = scaled > row_max ? scaled : row_max;
  }
  return row_max;
}

// Softmax normaliser of logits[0, vocab) scaled by inverse_temperature, in ONE pass over memory (online softmax): each
// block's max is taken while the block sits in L1, the sum so far is rescaled when the running max grows, and the
// block's exp(s - max) are added. Partial sums are float (as torch's softmax), flushed to float64 every block.
template <typename T>
SoftmaxStats softmax_stats(const T* logits, int64_t vocab, float inverse_temperature) {
  float running_max = -INFINITY;
  double total = 0.0;
  for (int64_t block = 0; block < vocab; block += kSoftmaxBlock) {
    const int64_t block_end = std::min(vocab, block + kSoftmaxBlock);
    const float block_max = scaled_max(logits, block, block_end, inverse_temperature);
    if (block_max > running_max) {
      total = rescale_exp_sum(total, running_max, block_max);
      running_max = block_max;
    }
    if (!(running_max > -INFINITY)) continue;  // no finite logit so far: nothing to add
    float lanes[kSoftmaxLanes] = {0.0f};
    int64_t v = block;
    for (; v + kSoftmaxLanes <= block_end; v += kSoftmaxLanes)
      for (int l = 0; l < kSoftmaxLanes; ++l)
        lanes[l] += exp_nonpositive(load_float(logits, v + l) * inverse_temperature - running_max);
    for (; v < block_end; ++v) lanes[0] += exp_nonpositive(load_float(logits, v) * inverse_temperature - running_max);
    for (int l = 0; l < kSoftmaxLanes; ++l) total += static_cast<double>(lanes[l]);
  }
  // No finite logit (all -inf or NaN): every mass is 0.
  if (!(running_max > -INFINITY)) return SoftmaxStats{-INFINITY, 0.0f};
  return SoftmaxStats{running_max, static_cast<float>(1.0 / total)};
}

// Sum over [begin, end) of max(0, p - q) (residual) or of p alone (draft == nullptr).
template <typename Row>
double residual_or_target_mass(const Row& target, const Row* draft, int64_t begin, int64_t end) {
  DoubleLanes lanes = {};
  const FloatLanes zero = {};
  int64_t v = begin;
  if (draft) {
    for (; v + kLanes <= end; v += kLanes) {
      const FloatLanes difference = mass_lanes(target, v) - mass_lanes(*draft, v);
      lanes += __builtin_convertvector(difference > zero ? difference : zero, DoubleLanes);  // residual_mass
    }
    for (; v < end; ++v) lanes[0] += static_cast<double>(residual_mass(target.mass(v), draft->mass(v)));
  } else {
    for (; v + kLanes <= end; v += kLanes) lanes += __builtin_convertvector(mass_lanes(target, v), DoubleLanes);
    for (; v < end; ++v) lanes[0] += static_cast<double>(target.mass(v));
  }
  return sum_lanes(lanes);
}

template <typename Row>
float sample_mass(const Row& target, const Row* draft, int64_t v) {
  const float p = target.mass(v);
  return draft ? residual_mass(p, draft->mass(v)) : p;
}

// Inverse CDF inside [begin, end) from `prefix`: the first index whose running sum exceeds `threshold`. Whole blocks
// are skipped with a vectorised sum; only the block holding the threshold is scanned element by element. Falls back to
// the last index with positive mass (block sums and the running sum may round differently), so the result has
// positive mass whenever the range has any; -1 when it has none.
template <typename Row>
int64_t inverse_cdf_in_range(const Row& target, const Row* draft, int64_t begin, int64_t end, double prefix,
                             double threshold) {
  double running = prefix;
  int64_t last_positive = -1;
  int64_t last_nonempty_block = -1;
  for (int64_t block = begin; block < end; block += kScanBlock) {
    const int64_t block_end = std::min(end, block + kScanBlock);
    const double block_total = residual_or_target_mass(target, draft, block, block_end);
    if (!(block_total > 0.0)) continue;
    last_nonempty_block = block;
    if (running + block_total <= threshold) {
      running += block_total;
      continue;
    }
    for (int64_t v = block; v < block_end; ++v) {
      const float mass = sample_mass(target, draft, v);
      if (mass > 0.0f) {
        running += static_cast<double>(mass);
        last_positive = v;
        if (running > threshold) return v;
      }
    }
  }
  if (last_positive < 0 && last_nonempty_block >= 0) {
    const int64_t block_end = std::min(end, last_nonempty_block + kScanBlock);
    for (int64_t v = last_nonempty_block; v < block_end; ++v)
      if (sample_mass(target, draft, v) > 0.0f) last_positive = v;
  }
  return last_positive;
}

// argmax of nu = w p + (1 - w) q (or of p when draft == nullptr); ties to the lowest id.
template <typename Row>
int64_t argmax_mixture(const Row& target, const Row* draft, float weight, int64_t vocab) {
  float best_value = -1.0f;
  int64_t best_index = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float p = target.mass(v);
    const float nu = draft ? mix_mass(weight, p, draft->mass(v)) : p;
    if (better_candidate(nu, v, best_value, best_index)) {
      best_value = nu;
      best_index = v;
    }
  }
  return best_index;
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
