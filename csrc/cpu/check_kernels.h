// The CPU kernel behind check_inputs=True: one pass over every row of a probability or logit tensor that records what
// is wrong with the row, so the Python checks read each value once, natively, and synchronise once.
//
// A row's flags (the bits of kValueFlag*): a NaN, a negative entry, a +inf entry, no usable entry at all (no
// positive probability; for logits, nothing above -inf), and, for probabilities, none in the verifier's target support
// (at or above kMinTargetMass). The flags state facts; which of them is an error (a negative
// logit is fine) is the caller's rule.
#pragma once

#include "kernel_prelude.h"
#include "row_ops.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

typedef int32_t FlagVector __attribute__((vector_size(kVectorFloats * sizeof(int32_t))));

// The flags of one row of `vocab` values. Comparisons give all-ones lanes where true; they are or-ed over the row, so
// the loop has no branch and the compiler keeps it in vectors. NaN compares false everywhere, so `largest` skips it.
template <typename T>
int32_t row_value_flags(const T* row, int64_t vocab, bool from_logits) {
  FlagVector nan = {}, negative = {}, positive_infinity = {};
  FloatVector largest = broadcast(-INFINITY);
  const FloatVector infinity = broadcast(INFINITY), zero = broadcast(0.f);
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    const FloatLanes lanes = load_lanes(row, v);
    for (int i = 0; i < kParts; ++i) {
      const FloatVector x = lanes.part[i];
      nan |= x != x;
      negative |= x < zero;
      positive_infinity |= x == infinity;
      largest = x > largest ? x : largest;
    }
  }
  bool has_nan = false, has_negative = false, has_infinity = false;
  float row_largest = -INFINITY;
  for (int l = 0; l < kVectorFloats; ++l) {
    has_nan |= nan[l] != 0;
    has_negative |= negative[l] != 0;
    has_infinity |= positive_infinity[l] != 0;
    row_largest = largest[l] > row_largest ? largest[l] : row_largest;
  }
  for (; v < vocab; ++v) {
    const float x = load_float(row, v);
    has_nan |= x != x;
    has_negative |= x < 0.f;
    has_infinity |= x == INFINITY;
    row_largest = x > row_largest ? x : row_largest;
  }
  const bool no_mass = from_logits ? !(row_largest > -INFINITY) : !(row_largest > 0.f);
  // As a target row, nothing in the verifier's support (verify_math.h): no token it may emit.
  const bool no_target_mass = !from_logits && !(row_largest >= kMinTargetMass);
  return (has_nan ? kValueFlagNan : 0) | (has_negative ? kValueFlagNegative : 0) |
         (has_infinity ? kValueFlagPositiveInfinity : 0) | (no_mass ? kValueFlagNoMass : 0) |
         (no_target_mass ? kValueFlagNoTargetMass : 0);
}

// flags [rows] of values [rows, vocab], rows spread over threads (a task reads at least kMinTaskElements values).
template <typename T>
void value_flags(const T* values, int64_t rows, int64_t vocab, bool from_logits, int32_t* flags,
                 const ParallelFor& parallel_for) {
  parallel_for(0, rows, grain_for(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) flags[row] = row_value_flags(values + row * vocab, vocab, from_logits);
  });
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
