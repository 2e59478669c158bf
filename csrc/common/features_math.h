// Per-element and per-row math of distribution_features, shared by the CPU and CUDA kernels: the entropies, largest
// probabilities and total variation of a pair of softmax rows, each in [0, 1], that a DIVERSED head reads beside the
// hidden states (diversed_ext/head.py).
//
// From a row's normaliser (max m, 1 / sum) every mass is p_v = exp(s_v - m) / sum, so log p_v = (s_v - m) + log(1 /
// sum) and the entropy needs no logarithm per element:
//     H = -sum_v p_v log p_v = -sum_v p_v (s_v - m) - log(1 / sum) * sum_v p_v,
// one pass beside the total variation's sum |p - q|. The largest probability is exp(0) / sum = 1 / sum.
#pragma once

#include <cmath>
#include <cstdint>

#include "verify_math.h"  // DX_HD, SoftmaxStats, exp_nonpositive, sanitize_mass

namespace diversed {

// The outputs per position, in diversed_ext.ops.DISTRIBUTION_FEATURES' order.
enum DistributionFeature : int {
  kDraftEntropy = 0,
  kTargetEntropy = 1,
  kDraftMaxProb = 2,
  kTargetMaxProb = 3,
  kTotalVariation = 4,
  kNumDistributionFeatures = 5,
};

// The normaliser a features pass shifts by: a row without a finite logit has no mass, and shifting it by 0 with
// 1 / sum = 0 keeps every mass 0 (s - (-inf) would be +inf or NaN).
DX_HD SoftmaxStats features_stats(SoftmaxStats stats) {
  return stats.max > -INFINITY ? stats : SoftmaxStats{0.0f, 0.0f};
}

// The mass of a shifted logit x = s - m, sanitised (a NaN logit has none). F a float or a GCC vector of floats.
template <typename F>
DX_HD F shifted_mass(F shifted, SoftmaxStats stats) {
  return sanitize_mass(exp_nonpositive(shifted) * stats.inverse_sum);
}

// p (s - m) of one element, the entropy's term: 0 where p is 0, so an excluded token (a -inf logit) adds nothing.
template <typename F>
DX_HD F entropy_term(F mass, F shifted) {
  return mass > 0.0f ? mass * shifted : F{};
}

// A value in [0, 1]; NaN (only from values check_inputs=False let through) counts as 0.
DX_HD float unit_interval(double value) {
  return value > 0.0 ? (value < 1.0 ? static_cast<float>(value) : 1.0f) : 0.0f;
}

// 1 / log V, the entropies' scale, so a head sees the same range for any vocabulary; 0 for V = 1 (no entropy).
DX_HD double inverse_log_vocab(int64_t vocab) { return vocab > 1 ? 1.0 / log(static_cast<double>(vocab)) : 0.0; }

// A row's entropy over log V from its pass sums: mass_sum = sum p, term_sum = sum p (s - m). 0 for a row without mass.
DX_HD float normalised_entropy(SoftmaxStats stats, double mass_sum, double term_sum, double entropy_scale) {
  if (!(stats.inverse_sum > 0.0f)) return 0.0f;
  const double entropy = -term_sum - log(static_cast<double>(stats.inverse_sum)) * mass_sum;
  return unit_interval(entropy * entropy_scale);
}

// What one pass over a pair of rows sums, in float64.
struct FeatureSums {
  double draft_mass, draft_terms, target_mass, target_terms, absolute_difference;
};

// Adds one element of each row (raw logits, scaled by their row's inverse temperature and shifted by its max) to the
// sums: the CUDA kernel's per-thread step (the CPU kernel sums its rows' exps as it takes them, csrc/cpu/
// features_kernels.h).
DX_HD void add_feature_element(FeatureSums& sums, float target_logit, float draft_logit, float target_inverse_t,
                               float draft_inverse_t, SoftmaxStats target, SoftmaxStats draft) {
  const float p_shifted = target_logit * target_inverse_t - target.max;
  const float q_shifted = draft_logit * draft_inverse_t - draft.max;
  const float p = shifted_mass(p_shifted, target), q = shifted_mass(q_shifted, draft);
  sums.target_mass += p;
  sums.draft_mass += q;
  sums.target_terms += entropy_term(p, p_shifted);
  sums.draft_terms += entropy_term(q, q_shifted);
  sums.absolute_difference += p > q ? p - q : q - p;
}

// The five features of a position into out[0, kNumDistributionFeatures).
DX_HD void write_features(const FeatureSums& sums, SoftmaxStats draft, SoftmaxStats target, double entropy_scale,
                          float* out) {
  out[kDraftEntropy] = normalised_entropy(draft, sums.draft_mass, sums.draft_terms, entropy_scale);
  out[kTargetEntropy] = normalised_entropy(target, sums.target_mass, sums.target_terms, entropy_scale);
  out[kDraftMaxProb] = unit_interval(draft.inverse_sum);
  out[kTargetMaxProb] = unit_interval(target.inverse_sum);
  out[kTotalVariation] = unit_interval(0.5 * sums.absolute_difference);
}

}  // namespace diversed
