// The CPU kernel of mixture_divergence: KL(nu_w || p) of nu_w = w p + (1 - w) q at G evenly spaced weights w = g / (G
// - 1), for every pair of logit rows, in one read of the two rows. Torch-free; compiled once per instruction set (see
// cpu_kernels.h).
//
//     KL(nu_w || p) = sum_v nu_w log nu_w - w sum_v p log p - (1 - w) sum_v q log p,
//
// so the two cross sums are taken once and only the first sum once per weight: G logarithms per element, which is
// what the op costs (the rows are read once, a block at a time, while the block's masses sit in L1). log p is floored
// at `log_floor`, so mass the draft puts on a token the target rules out costs a bounded amount.
#pragma once

#include <cfloat>

#include "kernel_prelude.h"
#include "row_ops.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

// ------------------------------------------------------------------------------------------ logarithm
// The float's bits and back, for a float or a GCC vector of floats (then a vector of int32).
template <typename F>
inline auto float_bits(F x) {
  if constexpr (std::is_arithmetic_v<F>) return __builtin_bit_cast(int32_t, x);
  else return __builtin_bit_cast(decltype(x < x), x);
}
template <typename F, typename I>
inline F float_of_bits(I bits) {
  return __builtin_bit_cast(F, bits);
}
template <typename F, typename I>
inline F int_to_float(I value) {
  if constexpr (std::is_arithmetic_v<F>) return static_cast<F>(value);
  else return __builtin_convertvector(value, F);
}

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr int32_t kMantissaBits = 0x007fffff;
constexpr int32_t kHalfExponentBits = 0x3f000000;  // the exponent field of 0.5
// log(1 + r) = r - r^2 / 2 + r^3 P(r) for r in [sqrt(1/2) - 1, sqrt(2) - 1): the minimax polynomial of the Cephes
// library's logf, coefficient of r^k (relative error about 1e-7 over the float range).
constexpr float kLogPoly8 = 7.0376836292e-2f;
constexpr float kLogPoly7 = -1.1514610310e-1f;
constexpr float kLogPoly6 = 1.1676998740e-1f;
constexpr float kLogPoly5 = -1.2420140846e-1f;
constexpr float kLogPoly4 = 1.4249322787e-1f;
constexpr float kLogPoly3 = -1.6668057665e-1f;
constexpr float kLogPoly2 = 2.0000714765e-1f;
constexpr float kLogPoly1 = -2.4999993993e-1f;
constexpr float kLogPoly0 = 3.3333331174e-1f;
constexpr float kLn2Head = 0.693359375f;  // ln 2 = kLn2Head + kLn2Tail, the head exact in a few bits
constexpr float kLn2Tail = -2.12194440e-4f;

// log(x) for a normal positive float x (callers keep zeros and subnormals away), a float or a GCC vector of floats:
// x = m 2^e with m in [sqrt(1/2), sqrt(2)), log x = log(1 + (m - 1)) + e ln 2. Branch-free and in fused multiply-adds,
// so every build evaluates the same expression.
template <typename F>
inline F log_of_normal(F x) {
  const auto bits = float_bits(x);
  F exponent = int_to_float<F>(((bits >> 23) & 0xff) - 126);
  F mantissa = float_of_bits<F>((bits & kMantissaBits) | kHalfExponentBits);  // in [0.5, 1)
  const auto below = mantissa < kSqrtHalf;
  exponent = below ? exponent - 1.0f : exponent;
  const F r = (below ? mantissa + mantissa : mantissa) - 1.0f;
  const F r2 = r * r;
  F poly = F{} + kLogPoly8;
  for (const float coefficient : {kLogPoly7, kLogPoly6, kLogPoly5, kLogPoly4, kLogPoly3, kLogPoly2, kLogPoly1,
                                  kLogPoly0})
    poly = fused_multiply_add(poly, r, F{} + coefficient);
  F tail = poly * r * r2;
  tail = fused_multiply_add(exponent, F{} + kLn2Tail, tail);
  tail = fused_multiply_add(r2, F{} - 0.5f, tail);
  return fused_multiply_add(exponent, F{} + kLn2Head, r + tail);
}

// nu log nu, 0 for nu below the normal range (|nu log nu| < 1e-36 there) and for nu = 0.
template <typename F>
inline F nu_log_nu(F nu) {
  const F safe = nu >= FLT_MIN ? nu : F{} + 1.0f;
  return nu >= FLT_MIN ? nu * log_of_normal(safe) : F{};
}

// ------------------------------------------------------------------------------------------ one pair of rows
// A block of kBlock elements of both rows: p, q and log p (floored), zero-padded to whole groups of kLanes (p = q = 0
// adds nothing to any sum).
struct DivergenceBlock {
  alignas(64) float target_mass[kBlock];
  alignas(64) float draft_mass[kBlock];
  alignas(64) float target_log[kBlock];
  int64_t padded;  // elements filled, a multiple of kLanes
};

template <typename T>
void load_divergence_block(const LogitRow<T>& target, const LogitRow<T>& draft, int64_t begin, int64_t end,
                           float log_shift, float log_floor, DivergenceBlock& block) {
  const auto floored_log = [&](auto logit) {
    const auto log_mass = logit * target.inverse_temperature - log_shift;
    return log_mass > log_floor ? log_mass : decltype(log_mass){} + log_floor;  // NaN and -inf take the floor
  };
  int64_t v = begin;
  for (; v + kLanes <= end; v += kLanes) {
    const int64_t at = v - begin;
    const FloatLanes p = target.mass_lanes(v), q = draft.mass_lanes(v);
    const FloatLanes log_p = map_lanes(load_lanes(target.values, v), floored_log);
    __builtin_memcpy(block.target_mass + at, &p, sizeof p);
    __builtin_memcpy(block.draft_mass + at, &q, sizeof q);
    __builtin_memcpy(block.target_log + at, &log_p, sizeof log_p);
  }
  int64_t at = v - begin;
  for (; v < end; ++v, ++at) {
    block.target_mass[at] = target.mass(v);
    block.draft_mass[at] = draft.mass(v);
    block.target_log[at] = floored_log(load_float(target.values, v));
  }
  block.padded = (at + kLanes - 1) / kLanes * kLanes;
  for (; at < block.padded; ++at) block.target_mass[at] = block.draft_mass[at] = block.target_log[at] = 0.0f;
}

// Adds the block's sum of nu log nu at weight w to *negentropy (float lanes within the block, float64 across blocks).
inline void add_block_negentropy(const DivergenceBlock& block, float weight, double* negentropy) {
  const FloatVector target_weight = broadcast(weight), draft_weight = broadcast(1.0f - weight);
  FloatLanes sums = splat_lanes(0.0f);
  for (int64_t at = 0; at < block.padded; at += kLanes) {
    const FloatLanes p = load_lanes(block.target_mass, at), q = load_lanes(block.draft_mass, at);
    for (int i = 0; i < kParts; ++i)
      sums.part[i] += nu_log_nu(target_weight * p.part[i] + draft_weight * q.part[i]);
  }
  *negentropy = sum_float_lanes_in_order(sums, *negentropy);
}

// Adds the block's sums of p log p and q log p to *on_target and *on_draft.
inline void add_block_cross_sums(const DivergenceBlock& block, double* on_target, double* on_draft) {
  FloatLanes target_sums = splat_lanes(0.0f), draft_sums = splat_lanes(0.0f);
  for (int64_t at = 0; at < block.padded; at += kLanes) {
    const FloatLanes p = load_lanes(block.target_mass, at), q = load_lanes(block.draft_mass, at);
    const FloatLanes log_p = load_lanes(block.target_log, at);
    for (int i = 0; i < kParts; ++i) {
      target_sums.part[i] += p.part[i] * log_p.part[i];
      draft_sums.part[i] += q.part[i] * log_p.part[i];
    }
  }
  *on_target = sum_float_lanes_in_order(target_sums, *on_target);
  *on_draft = sum_float_lanes_in_order(draft_sums, *on_draft);
}

// The weight of grid point g of G: g / (G - 1), exactly 0 and 1 at the ends.
inline float grid_weight(int64_t point, int64_t grid_points) {
  return static_cast<float>(static_cast<double>(point) / static_cast<double>(grid_points - 1));
}

template <typename T>
void mixture_divergence_row(const LogitRow<T>& target, const LogitRow<T>& draft, int64_t vocab, int64_t grid_points,
                            float log_floor, float* table) {
  // log p_v = s_v / T - (max + log sum): the target's normaliser as one shift.
  const float log_shift = static_cast<float>(static_cast<double>(target.stats.max) -
                                             std::log(static_cast<double>(target.stats.inverse_sum)));
  double negentropy[kMaxGridPoints] = {};
  double on_target = 0.0, on_draft = 0.0;
  DivergenceBlock block;
  for (int64_t begin = 0; begin < vocab; begin += kBlock) {
    load_divergence_block(target, draft, begin, std::min(vocab, begin + kBlock), log_shift, log_floor, block);
    add_block_cross_sums(block, &on_target, &on_draft);
    for (int64_t point = 0; point < grid_points; ++point)
      add_block_negentropy(block, grid_weight(point, grid_points), negentropy + point);
  }
  for (int64_t point = 0; point < grid_points; ++point) {
    const double weight = grid_weight(point, grid_points);
    const double divergence = negentropy[point] - weight * on_target - (1.0 - weight) * on_draft;
    table[point] = static_cast<float>(divergence > 0.0 ? divergence : 0.0);  // rounding below 0 (NaN stays NaN)
  }
}

// ------------------------------------------------------------------------------------------ entry point
// mixture_divergence: logit pairs draft and target [B, T, V] (pair.from_logits), table float32 [B, T, G].
template <typename T>
void mixture_divergence(const PairProblem<T>& pair, int64_t grid_points, float log_floor, float* table,
                        const ParallelFor& parallel_for) {
  parallel_for(0, pair.rows(), grain_for(grid_points * pair.vocab), [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const float inverse_t = pair.inverse_temperature(index);
      const T* target_values = pair.target_values(index);
      const T* draft_values = pair.draft_values(index);
      const LogitRow<T> target{target_values, inverse_t, softmax_stats(target_values, pair.vocab, inverse_t)};
      const LogitRow<T> draft{draft_values, inverse_t, softmax_stats(draft_values, pair.vocab, inverse_t)};
      mixture_divergence_row(target, draft, pair.vocab, grid_points, log_floor, table + index * grid_points);
    }
  });
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
