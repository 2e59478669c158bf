// Building blocks of the CPU kernels: row policies and the passes over one vocabulary row (softmax normaliser,
// residual or target mass, inverse CDF, argmax of the mixture), over the element loads of element_loads.h. Torch-free;
// compiled once per instruction set inside diversed::cpu::DIVERSED_CPU_CAPABILITY (see cpu_kernels.h). Every build
// performs the same operations in the same order (no FMA, the fixed accumulator lanes of ../cpu_base/lanes.h), so
// their results are bitwise identical.
//
// A row policy exposes `float mass(int64_t v)` and `FloatLanes mass_lanes(int64_t v)` (elements v .. v + kLanes - 1):
//   ProbRow<T>   a row of probabilities (mass = the sanitised value);
//   LogitRow<T>  a row of logits with its softmax normaliser (mass = softmax probability, computed on the fly);
// both with a floor below which mass counts as zero (sanitize_mass): kMinTargetMass for the verify ops' target rows
// (the target's support, verify_math.h), 0 for every other row;
//   OneHotRow    the draft row of a drafter that gives tokens only: 1 at the drafted id, 0 elsewhere, reads nothing.
// The passes take the target row and an optional draft row of any policy (a null pointer: no draft row).
// The loops read a row once per pass and never store a [V] temporary; the sums of a sampled row are kept per block of
// kBlock elements (a few KiB per row), so the inverse CDF reads only the one block that holds its threshold.
#pragma once

#include "../cpu_base/lanes.h"
#include "element_loads.h"
#include "kernel_prelude.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

constexpr int64_t kBlock = 256;  // elements per stored block sum: the inverse CDF scans one block element-wise

template <typename T>
struct ProbRow {
  const T* values;
  float floor = 0.0f;
  float mass(int64_t v) const { return sanitize_mass(load_float(values, v), floor); }
  FloatLanes mass_lanes(int64_t v) const {
    return map_lanes(load_lanes(values, v), [this](FloatVector x) { return sanitize_mass(x, floor); });
  }
};

// One-hot at a drafted id (one_hot_draft_token: -1 for an id outside [0, V), whose row has no mass at all).
struct OneHotRow {
  int64_t token;
  float mass(int64_t v) const { return one_hot_mass(v, token); }
  FloatLanes mass_lanes(int64_t v) const {
    FloatLanes lanes = splat_lanes(0.0f);
    if (token >= v && token < v + kLanes) {  // one group of lanes in the row holds the 1
      float lane[kLanes] = {};
      lane[token - v] = 1.0f;
      __builtin_memcpy(&lanes, lane, sizeof lanes);
    }
    return lanes;
  }
};

// exp(x) of a shifted logit x = s - max <= 0 (or NaN), the same value as exp_nonpositive computes, bit for bit. The
// AVX-512 build spends four fewer instructions per vector, the softmax passes' main cost: it scales by 2^n with one
// vscalefps (exact, like the product with 2^n it replaces: the result is normal, or rounded the same way when it is
// not) instead of converting n to exponent bits, and zeroes the lanes under kExpUnderflow with the scaling's mask
// instead of clamping first (those lanes' intermediate values are discarded, and x <= 0 needs no clamp from above).
inline FloatVector exp_shifted(FloatVector x) {
#if DIVERSED_CPU_VECTOR_FLOATS == 16
  const __m512 shifted_logit = reinterpret_cast<__m512>(x);
  const __mmask16 above_underflow = _mm512_cmp_ps_mask(shifted_logit, _mm512_set1_ps(kExpUnderflow), _CMP_NLT_UQ);
  const __m512 rounded = _mm512_fmadd_ps(shifted_logit, _mm512_set1_ps(kLog2e), _mm512_set1_ps(kRoundingShift));
  const __m512 n = _mm512_sub_ps(rounded, _mm512_set1_ps(kRoundingShift));
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2High), shifted_logit);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Low), r);
  __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(kExpPoly6), r, _mm512_set1_ps(kExpPoly5));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpPoly4));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpPoly3));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpPoly2));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpPoly1));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kExpPoly0));
  return reinterpret_cast<FloatVector>(_mm512_maskz_scalef_ps(above_underflow, poly, n));
#else
  return exp_nonpositive(x);
#endif
}

template <typename T>
struct LogitRow {
  const T* values;
  float inverse_temperature;
  SoftmaxStats stats;
  bool vouched = false;  // its normaliser vouches for it (normaliser_vouches_for_row)
  float floor = 0.0f;
  float mass(int64_t v) const { return softmax_mass(load_float(values, v), inverse_temperature, stats, floor); }
  FloatLanes mass_lanes(int64_t v) const {
    return map_lanes(load_lanes(values, v), [this](FloatVector x) {
      return sanitize_mass(exp_shifted(x * inverse_temperature - stats.max) * stats.inverse_sum, floor);
    });
  }
  // Whether VouchedLogitRow gives this row's masses.
  bool plain_at_unit_temperature() const { return vouched && inverse_temperature == 1.0f; }
};

// A LogitRow at temperature 1 whose normaliser vouches for it, with the same masses in fewer instructions: the
// product by 1 changes no value, and every mass is exp(s - max) <= 1 times a finite 1 / sum <= 1, which sanitising
// leaves as it is but for the floor (one select). The residual and bonus passes use it where they can.
template <typename T>
struct VouchedLogitRow {
  const T* values;
  SoftmaxStats stats;
  float floor;
  explicit VouchedLogitRow(const LogitRow<T>& row) : values(row.values), stats(row.stats), floor(row.floor) {}
  float mass(int64_t v) const { return softmax_mass(load_float(values, v), 1.0f, stats, floor); }
  FloatLanes mass_lanes(int64_t v) const {
    return map_lanes(load_lanes(values, v), [this](FloatVector x) {
      const FloatVector mass = exp_shifted(x - stats.max) * stats.inverse_sum;
      return mass >= floor ? mass : FloatVector{};
    });
  }
};

// Calls fn(target, draft) (draft a pointer, or nullptr) with the row policies the mass passes should use: for logit
// rows that VouchedLogitRow serves (both of them, when there are two), that policy; otherwise the rows as they are.
template <typename Row, typename Draft, typename F>
void with_mass_rows(const Row& target, const Draft* draft, F&& fn) {
  fn(target, draft);
}
template <typename T, typename F>
void with_mass_rows(const LogitRow<T>& target, const OneHotRow* draft, F&& fn) {
  if (!target.plain_at_unit_temperature()) {
    fn(target, draft);
    return;
  }
  fn(VouchedLogitRow<T>(target), draft);
}
template <typename TT, typename TD, typename F>
void with_mass_rows(const LogitRow<TT>& target, const LogitRow<TD>* draft, F&& fn) {
  if (!target.plain_at_unit_temperature() || (draft && !draft->plain_at_unit_temperature())) {
    fn(target, draft);
    return;
  }
  const VouchedLogitRow<TT> vouched_target(target);
  if (!draft) {
    fn(vouched_target, static_cast<const VouchedLogitRow<TD>*>(nullptr));
    return;
  }
  const VouchedLogitRow<TD> vouched_draft(*draft);
  fn(vouched_target, &vouched_draft);
}

constexpr int64_t kSoftmaxBlock = 2048;  // the online softmax works block by block: 8 KiB of float32, in L1

// logit * inverse_temperature; at temperature 1 (kUnitTemperature) the product is left out, which changes no value
// (x * 1 is x for every float) and saves one of the few instructions per element of the softmax passes.
template <bool kUnitTemperature, typename F>
inline F scale_logit(F logit, float inverse_temperature) {
  if constexpr (kUnitTemperature) return logit;
  else return logit * inverse_temperature;
}

// Max of the scaled logits in [begin, end) (NaN compares false and is skipped).
template <bool kUnitTemperature, typename T>
float scaled_max(const T* logits, int64_t begin, int64_t end, float inverse_temperature) {
  FloatLanes lane_max = splat_lanes(-INFINITY);
  int64_t v = begin;
  for (; v + kLanes <= end; v += kLanes) {
    const FloatLanes scaled = map_lanes(
        load_lanes(logits, v), [&](FloatVector x) { return scale_logit<kUnitTemperature>(x, inverse_temperature); });
    lane_max = zip_lanes(scaled, lane_max, [](FloatVector x, FloatVector m) { return x > m ? x : m; });
  }
  float row_max = max_lane(lane_max);
  for (; v < end; ++v) {
    const float scaled = scale_logit<kUnitTemperature>(load_float(logits, v), inverse_temperature);
    row_max = scaled > row_max ? scaled : row_max;
  }
  return row_max;
}

// One block's exp(s - shift) summed in float lanes (whole groups of kLanes) and a float tail, and with kTrackMax the
// block's max of s taken in the same pass.
struct BlockExpSum {
  FloatLanes sums;
  float tail;
  float max;
};

template <bool kUnitTemperature, bool kTrackMax, typename T>
BlockExpSum block_exp_sum(const T* logits, int64_t begin, int64_t end, float inverse_temperature, float shift) {
  FloatLanes sums = splat_lanes(0.0f), lane_max = splat_lanes(-INFINITY);
  int64_t v = begin;
  for (; v + kLanes <= end; v += kLanes) {
    const FloatLanes scaled = map_lanes(
        load_lanes(logits, v), [&](FloatVector x) { return scale_logit<kUnitTemperature>(x, inverse_temperature); });
    if constexpr (kTrackMax)
      lane_max = zip_lanes(scaled, lane_max, [](FloatVector x, FloatVector m) { return x > m ? x : m; });
    sums = zip_lanes(sums, scaled, [&](FloatVector sum, FloatVector x) { return sum + exp_shifted(x - shift); });
  }
  BlockExpSum result{sums, 0.0f, kTrackMax ? max_lane(lane_max) : -INFINITY};
  for (; v < end; ++v) {
    const float scaled = scale_logit<kUnitTemperature>(load_float(logits, v), inverse_temperature);
    if constexpr (kTrackMax) result.max = scaled > result.max ? scaled : result.max;
    result.tail += exp_nonpositive(scaled - shift);
  }
  return result;
}

// Softmax normaliser of logits[0, vocab) scaled by inverse_temperature, in ONE pass over memory (online softmax), block
// by block while the block sits in L1: the sum so far is rescaled when the running max grows, and the block's
// exp(s - max) are added in float lanes (as torch's softmax sums in float), flushed to float64 every block. Once a
// finite max is known, a block's exps are taken against it in the same pass that finds the block's max, and taken
// again only in the rare block whose max exceeds it; so every block adds exactly the exps of a max-first pass.
// `summed_every_block` (optional) tells whether every block's exps were added: a block before the first finite logit
// is skipped, so a NaN there would leave no trace in the sum.
template <bool kUnitTemperature, typename T>
SoftmaxStats scaled_softmax_stats(const T* logits, int64_t vocab, float inverse_temperature,
                                  bool* summed_every_block) {
  float running_max = -INFINITY;
  double total = 0.0;
  bool skipped_a_block = false;
  for (int64_t block = 0; block < vocab; block += kSoftmaxBlock) {
    const int64_t block_end = std::min(vocab, block + kSoftmaxBlock);
    BlockExpSum block_sum;
    if (running_max > -INFINITY) {
      block_sum = block_exp_sum<kUnitTemperature, true>(logits, block, block_end, inverse_temperature, running_max);
      if (block_sum.max > running_max) {
        total = rescale_exp_sum(total, running_max, block_sum.max);
        running_max = block_sum.max;
        block_sum = block_exp_sum<kUnitTemperature, false>(logits, block, block_end, inverse_temperature, running_max);
      }
    } else {
      running_max = scaled_max<kUnitTemperature>(logits, block, block_end, inverse_temperature);
      if (!(running_max > -INFINITY)) {  // no finite logit so far (scaled_max skips NaN): nothing to add
        skipped_a_block = true;
        continue;
      }
      block_sum = block_exp_sum<kUnitTemperature, false>(logits, block, block_end, inverse_temperature, running_max);
    }
    total = sum_float_lanes_in_order(block_sum.sums, total) + static_cast<double>(block_sum.tail);
  }
  if (summed_every_block) *summed_every_block = !skipped_a_block;
  // No finite logit (all -inf or NaN): every mass is 0.
  if (!(running_max > -INFINITY)) return SoftmaxStats{-INFINITY, 0.0f};
  return SoftmaxStats{running_max, static_cast<float>(1.0 / total)};
}

template <typename T>
SoftmaxStats softmax_stats(const T* logits, int64_t vocab, float inverse_temperature,
                           bool* summed_every_block = nullptr) {
  return inverse_temperature == 1.0f
             ? scaled_softmax_stats<true>(logits, vocab, inverse_temperature, summed_every_block)
             : scaled_softmax_stats<false>(logits, vocab, inverse_temperature, summed_every_block);
}

// Whether a row's normaliser proves its logits clean (no NaN, no +inf, some entry above -inf): a NaN or a +inf
// logit turns the sum of exps into NaN (exp(NaN) is NaN, and +inf - +inf is NaN), and a row without a finite entry
// has no finite max. What it cannot vouch for (a skipped block, a finite logit that overflowed when scaled by a small
// temperature) the caller checks element by element.
inline bool normaliser_vouches_for_row(SoftmaxStats stats, bool summed_every_block) {
  return summed_every_block && stats.max > -INFINITY && stats.max < INFINITY && stats.inverse_sum > 0.0f &&
         stats.inverse_sum < INFINITY;
}

template <typename Row, typename Draft>
float sample_mass(const Row& target, const Draft* draft, int64_t v) {
  const float p = target.mass(v);
  return draft ? residual_mass(p, draft->mass(v)) : p;
}

// Sum over [begin, end) of max(0, p - q) (residual) or of p alone (draft == nullptr): float64 lanes over whole groups
// of kLanes elements, combined by reduce_lanes, then the short tail in order.
template <typename Row, typename Draft>
double range_mass(const Row& target, const Draft* draft, int64_t begin, int64_t end) {
  DoubleLanes sums = {};
  int64_t v = begin;
  if (draft) {
    for (; v + kLanes <= end; v += kLanes)
      accumulate(sums, zip_lanes(target.mass_lanes(v), draft->mass_lanes(v),
                                 [](FloatVector p, FloatVector q) { return residual_mass(p, q); }));
  } else {
    for (; v + kLanes <= end; v += kLanes) accumulate(sums, target.mass_lanes(v));
  }
  double total = reduce_lanes(sums);
  for (; v < end; ++v) total += static_cast<double>(sample_mass(target, draft, v));
  return total;
}

// The number of kBlock blocks of a row of `vocab` elements (the last may be short).
inline int64_t blocks_of(int64_t vocab) { return (vocab + kBlock - 1) / kBlock; }

// The mass of every block of [begin, end) into block_sums[(block - begin) / kBlock]; begin is a multiple of kBlock
// (whole blocks, so every layout forms the same block sums).
template <typename Row, typename Draft>
void block_masses(const Row& target, const Draft* draft, int64_t begin, int64_t end, double* block_sums) {
  for (int64_t block = begin; block < end; block += kBlock)
    block_sums[(block - begin) / kBlock] = range_mass(target, draft, block, std::min(end, block + kBlock));
}

// The masses of [begin, end) (at most kBlock elements) into masses[0, end - begin): whole groups of kLanes as
// vectors, the tail element by element (the same values either way).
template <typename Row, typename Draft>
void block_sample_masses(const Row& target, const Draft* draft, int64_t begin, int64_t end, float* masses) {
  int64_t v = begin;
  for (; v + kLanes <= end; v += kLanes) {
    const FloatLanes lanes = draft ? zip_lanes(target.mass_lanes(v), draft->mass_lanes(v),
                                               [](FloatVector p, FloatVector q) { return residual_mass(p, q); })
                                   : target.mass_lanes(v);
    __builtin_memcpy(masses + (v - begin), &lanes, sizeof lanes);
  }
  for (; v < end; ++v) masses[v - begin] = sample_mass(target, draft, v);
}

// Inverse CDF over a row of `vocab` elements from its block sums: the first index whose running sum exceeds
// `threshold`. Whole blocks are skipped on their stored sums; only the block holding the threshold is read again (its
// masses in vectors, then added one by one in order). Falls back to the last index with positive mass (block sums and
// the running sum may round differently), so the result has positive mass whenever the row has any; -1 when it has
// none.
template <typename Row, typename Draft>
int64_t inverse_cdf(const Row& target, const Draft* draft, const double* block_sums, int64_t vocab,
                    double threshold) {
  double running = 0.0;
  int64_t last_positive = -1;
  int64_t last_nonempty_block = -1;
  float masses[kBlock];
  for (int64_t block = 0; block < vocab; block += kBlock) {
    const int64_t block_end = std::min(vocab, block + kBlock);
    const double block_total = block_sums[block / kBlock];
    if (!(block_total > 0.0)) continue;
    last_nonempty_block = block;
    if (running + block_total <= threshold) {
      running += block_total;
      continue;
    }
    block_sample_masses(target, draft, block, block_end, masses);
    for (int64_t v = block; v < block_end; ++v) {
      const float mass = masses[v - block];
      if (mass > 0.0f) {
        running += static_cast<double>(mass);
        last_positive = v;
        if (running > threshold) return v;
      }
    }
  }
  if (last_positive < 0 && last_nonempty_block >= 0) {
    const int64_t block_end = std::min(vocab, last_nonempty_block + kBlock);
    block_sample_masses(target, draft, last_nonempty_block, block_end, masses);
    for (int64_t v = last_nonempty_block; v < block_end; ++v)
      if (masses[v - last_nonempty_block] > 0.0f) last_positive = v;
  }
  return last_positive;
}

// argmax of nu = w p + (1 - w) q (or of p when draft == nullptr) over the target's support (greedy_value); ties to
// the lowest id; 0 when the target has no support at all (a row without mass, only reachable unchecked).
template <typename Row, typename Draft>
int64_t argmax_mixture(const Row& target, const Draft* draft, float weight, int64_t vocab) {
  float best_value = -1.0f;
  int64_t best_index = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float p = target.mass(v);
    const float nu = draft ? greedy_value(weight, p, draft->mass(v)) : greedy_value(1.0f, p, 0.0f);
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
