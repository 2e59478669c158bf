// The CPU kernel of distribution_features: torch-free, over a FeaturesProblem (csrc/common/problems.h), compiled once
// per instruction set (see cpu_kernels.h). One task per pair of rows, in parallel.
//
// Each element's exp is taken once. A row gets its max (one pass of comparisons), then one pass takes
// e_v = exp(s_v / T - max) into a scratch row, summing e_v and e_v (s_v / T - max): the normaliser 1 / sum and the
// entropy's terms (features_math.h) come out of that pass, and TV(p, q) = 0.5 sum |e_p / sum_p - e_q / sum_q| is one
// last pass over the two scratch rows, which a task keeps in cache. The CUDA kernel takes the exps twice instead (two
// passes over the logits, no scratch), which a GPU's memory bandwidth makes the cheaper way there.
#pragma once

#include <vector>

#include "kernel_prelude.h"
#include "row_ops.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

// What the exp pass gives of one row: its normaliser (features_stats: none for a row without a finite logit), the sum
// of its masses and the sum of its masses times their shifted logits.
struct FeatureRow {
  SoftmaxStats stats;
  double mass_sum, term_sum;
};

// The exp pass: e_v = exp(s_v * inverse_t - max) into exps[0, vocab), whole lane groups block by block in float lanes
// flushed to float64 once a block (every term has one sign, so nothing cancels), then the tail element by element.
// NaN logits give NaN exps, and so a NaN sum: the row then has no mass (sanitize_mass), as from softmax_stats.
template <typename T>
FeatureRow exponentiate_row(const T* values, int64_t vocab, float inverse_t, float* exps) {
  const float max = scaled_max<false>(values, 0, vocab, inverse_t);
  const float shift = max > -INFINITY ? max : 0.0f;  // no finite logit: every e is 0 or NaN, and the row has no mass
  const int64_t whole = vocab - vocab % kLanes;
  double sum = 0.0, terms = 0.0;
  for (int64_t block = 0; block < whole; block += kSoftmaxBlock) {
    FloatLanes block_sum = splat_lanes(0.0f), block_terms = splat_lanes(0.0f);
    for (int64_t v = block; v < std::min(whole, block + kSoftmaxBlock); v += kLanes) {
      const FloatLanes shifted =
          map_lanes(load_lanes(values, v), [&](FloatVector x) { return x * inverse_t - shift; });
      const FloatLanes e = map_lanes(shifted, [](FloatVector x) { return exp_shifted(x); });
      __builtin_memcpy(exps + v, &e, sizeof e);
      block_sum = zip_lanes(block_sum, e, [](FloatVector total, FloatVector x) { return total + x; });
      block_terms = zip_lanes(block_terms, zip_lanes(e, shifted, [](FloatVector m, FloatVector x) {
                                return entropy_term(m, x);
                              }), [](FloatVector total, FloatVector x) { return total + x; });
    }
    sum = sum_float_lanes_in_order(block_sum, sum);
    terms = sum_float_lanes_in_order(block_terms, terms);
  }
  for (int64_t v = whole; v < vocab; ++v) {
    const float shifted = load_float(values, v) * inverse_t - shift;
    exps[v] = exp_nonpositive(shifted);
    sum += static_cast<double>(exps[v]);
    terms += static_cast<double>(entropy_term(exps[v], shifted));
  }
  if (!(max > -INFINITY)) return FeatureRow{SoftmaxStats{0.0f, 0.0f}, 0.0, 0.0};
  const float inverse_sum = static_cast<float>(1.0 / sum);
  return FeatureRow{SoftmaxStats{max, inverse_sum}, sum * inverse_sum, terms * inverse_sum};
}

// The masses of a row whose exps sit in scratch: e_v * (1 / sum), each sanitised as shifted_mass does; lane groups
// or single elements (the distribution features' TV pass and the gate's residual pass read them alike).
struct ExpMasses {
  const float* exps;
  float inverse_sum;
  FloatLanes lanes(int64_t v) const {
    return map_lanes(load_lanes(exps, v), [&](FloatVector e) { return sanitize_mass(e * inverse_sum); });
  }
  float at(int64_t v) const { return sanitize_mass(exps[v] * inverse_sum); }
};

// sum_v |p_v - q_v| over two rows' masses.
inline double absolute_difference(const ExpMasses& p, const ExpMasses& q, int64_t vocab) {
  const int64_t whole = vocab - vocab % kLanes;
  double total = 0.0;
  for (int64_t block = 0; block < whole; block += kSoftmaxBlock) {
    FloatLanes block_total = splat_lanes(0.0f);
    for (int64_t v = block; v < std::min(whole, block + kSoftmaxBlock); v += kLanes) {
      block_total = zip_lanes(block_total, zip_lanes(p.lanes(v), q.lanes(v), [](FloatVector a, FloatVector b) {
                                const FloatVector d = a - b;
                                return d > 0.0f ? d : -d;
                              }), [](FloatVector total, FloatVector x) { return total + x; });
    }
    total = sum_float_lanes_in_order(block_total, total);
  }
  for (int64_t v = whole; v < vocab; ++v) total += static_cast<double>(std::fabs(p.at(v) - q.at(v)));
  return total;
}

// ------------------------------------------------------------------------------------------ entry point
// Called by the binding (ops_cpu.cpp, through cpu_dispatch.h) after the checks and the allocation of the outputs.

// distribution_features: the problem's pairs of logit rows ([B, T, V] tensors or rows read in place); features float32
// [B, T, kNumDistributionFeatures]. A task's two scratch rows are allocated once and reused for each of its pairs.
template <typename TD, typename TT>
void distribution_features(const FeaturesProblem& problem, const TD* draft, const TT* target, float* features,
                           const ParallelFor& parallel_for) {
  const int64_t vocab = problem.vocab;
  const double entropy_scale = inverse_log_vocab(vocab);
  parallel_for(0, problem.slots(), grain_for(2 * vocab), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>(2 * vocab));
    float* const target_exps = scratch.data();
    float* const draft_exps = target_exps + vocab;
    for (int64_t slot = begin; slot < end; ++slot) {
      const FeatureRow p = exponentiate_row(target + problem.target_row(slot) * vocab, vocab,
                                            problem.target_inverse_temperature(slot), target_exps);
      const FeatureRow q = exponentiate_row(draft + problem.draft_row(slot) * vocab, vocab,
                                            problem.draft_inverse_temperature(slot), draft_exps);
      const FeatureSums sums{q.mass_sum, q.term_sum, p.mass_sum, p.term_sum,
                             absolute_difference(ExpMasses{target_exps, p.stats.inverse_sum},
                                                 ExpMasses{draft_exps, q.stats.inverse_sum}, vocab)};
      write_features(sums, q.stats, p.stats, entropy_scale, features + slot * kNumDistributionFeatures);
    }
  });
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
