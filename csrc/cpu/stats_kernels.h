// The CPU kernels of token_stats, mix and distribution_features: torch-free, over a PairProblem or a FeaturesProblem
// (csrc/common/problems.h), compiled once per instruction set (see cpu_kernels.h). One task per (row, position) pair of
// distributions, in parallel; from logits, each pair first gets its two softmax normalisers and then reads
// probabilities on the fly.
#pragma once

#include "kernel_prelude.h"
#include "row_ops.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

// Calls f(target_row, draft_row) with probability rows, or with logit rows and their normalisers, so one body serves
// both inputs.
template <typename T, typename F>
void with_rows(const PairProblem<T>& pair, int64_t index, F f) {
  const T* target = pair.target_values(index);
  const T* draft = pair.draft_values(index);
  if (pair.from_logits) {
    const float inverse_t = pair.inverse_temperature(index);
    const LogitRow<T> target_row{target, inverse_t, softmax_stats(target, pair.vocab, inverse_t)};
    const LogitRow<T> draft_row{draft, inverse_t, softmax_stats(draft, pair.vocab, inverse_t)};
    f(target_row, draft_row);
  } else {
    f(ProbRow<T>{target}, ProbRow<T>{draft});
  }
}

// Per position: p(y), q(y), TV(p, q) = 0.5 sum |p - q|.
template <typename Row>
void token_stats_row(const Row& target, const Row& draft, int64_t vocab, int64_t token, float* target_prob,
                     float* draft_prob, float* total_variation) {
  DoubleLanes sums = {};
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes)
    accumulate(sums, zip_lanes(target.mass_lanes(v), draft.mass_lanes(v), [](FloatVector p, FloatVector q) {
                 const FloatVector difference = p - q;
                 return difference > 0.0f ? difference : -difference;  // |p - q|
               }));
  double total = reduce_lanes(sums);
  for (; v < vocab; ++v) total += static_cast<double>(std::fabs(target.mass(v) - draft.mass(v)));
  *total_variation = static_cast<float>(0.5 * total);
  const bool valid = token >= 0 && token < vocab;
  *target_prob = valid ? target.mass(token) : 0.0f;
  *draft_prob = valid ? draft.mass(token) : 0.0f;
}

// log p(y) of a valid token. From logits, log softmax(y) = s_y - max - log(sum): exact for tiny probabilities whose
// mass underflows to 0; NaN gives -inf.
template <typename T>
float log_mass_at(const LogitRow<T>& row, int64_t token) {
  const float scaled = load_float(row.values, token) * row.inverse_temperature;
  const double value =
      static_cast<double>(scaled) - row.stats.max + std::log(static_cast<double>(row.stats.inverse_sum));
  return value == value ? static_cast<float>(value) : -INFINITY;
}
template <typename T>
float log_mass_at(const ProbRow<T>& row, int64_t token) {
  return std::log(row.mass(token));
}

// nu over a row, whole groups of kLanes in vectors (the products and the sum of mix_mass, lane by lane), the tail
// element by element.
template <typename Row>
void mix_row(const Row& target, const Row& draft, float weight, int64_t vocab, float* __restrict__ out) {
  const float draft_weight = 1.0f - weight;
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    const FloatLanes mixture = zip_lanes(target.mass_lanes(v), draft.mass_lanes(v),
                                         [&](FloatVector p, FloatVector q) { return weight * p + draft_weight * q; });
    __builtin_memcpy(out + v, &mixture, sizeof mixture);
  }
  for (; v < vocab; ++v) out[v] = mix_mass(weight, target.mass(v), draft.mass(v));
}

// One logit row's shifted logits s - m and masses at elements v .. v + kLanes - 1: features_math.h's shifted_mass,
// with exp_shifted (the same values, fewer instructions on AVX-512).
template <typename T>
void shifted_lanes(const LogitRow<T>& row, int64_t v, FloatLanes& shifted, FloatLanes& mass) {
  shifted = map_lanes(load_lanes(row.values, v),
                      [&](FloatVector x) { return x * row.inverse_temperature - row.stats.max; });
  mass = map_lanes(shifted, [&](FloatVector x) { return sanitize_mass(exp_shifted(x) * row.stats.inverse_sum); });
}

// One block of whole lane groups' sums of features_math.h, in float lanes: the sums a features pass adds.
struct FeatureLanes {
  FloatLanes draft_mass, draft_terms, target_mass, target_terms, difference;
};

template <typename TT, typename TD>
void add_feature_block(const LogitRow<TT>& target, const LogitRow<TD>& draft, int64_t begin, int64_t end,
                       FeatureLanes& lanes) {
  const auto add = [](FloatVector sum, FloatVector x) { return sum + x; };
  for (int64_t v = begin; v < end; v += kLanes) {
    FloatLanes p_shifted, p, q_shifted, q;
    shifted_lanes(target, v, p_shifted, p);
    shifted_lanes(draft, v, q_shifted, q);
    lanes.target_mass = zip_lanes(lanes.target_mass, p, add);
    lanes.draft_mass = zip_lanes(lanes.draft_mass, q, add);
    lanes.target_terms = zip_lanes(lanes.target_terms, zip_lanes(p, p_shifted, [](FloatVector m, FloatVector x) {
                                     return entropy_term(m, x);
                                   }), add);
    lanes.draft_terms = zip_lanes(lanes.draft_terms, zip_lanes(q, q_shifted, [](FloatVector m, FloatVector x) {
                                    return entropy_term(m, x);
                                  }), add);
    lanes.difference = zip_lanes(lanes.difference, zip_lanes(p, q, [](FloatVector a, FloatVector b) {
                                   const FloatVector d = a - b;
                                   return d > 0.0f ? d : -d;
                                 }), add);
  }
}

// The sums of features_math.h over a pair of logit rows (their stats already through features_stats), in one pass:
// whole lane groups block by block in float lanes (every term is of one sign, so a block's float sums lose no
// digits to cancellation), each block's lanes flushed into float64 in order, as the softmax's normaliser sums; then
// the tail element by element. Converting to float64 once per block rather than per group keeps the pass bound by
// its exps.
template <typename TT, typename TD>
FeatureSums feature_sums(const LogitRow<TT>& target, const LogitRow<TD>& draft, int64_t vocab) {
  FeatureSums sums{};
  const int64_t whole = vocab - vocab % kLanes;
  for (int64_t block = 0; block < whole; block += kSoftmaxBlock) {
    const FloatLanes zero = splat_lanes(0.0f);
    FeatureLanes lanes{zero, zero, zero, zero, zero};
    add_feature_block(target, draft, block, std::min(whole, block + kSoftmaxBlock), lanes);
    sums.draft_mass = sum_float_lanes_in_order(lanes.draft_mass, sums.draft_mass);
    sums.draft_terms = sum_float_lanes_in_order(lanes.draft_terms, sums.draft_terms);
    sums.target_mass = sum_float_lanes_in_order(lanes.target_mass, sums.target_mass);
    sums.target_terms = sum_float_lanes_in_order(lanes.target_terms, sums.target_terms);
    sums.absolute_difference = sum_float_lanes_in_order(lanes.difference, sums.absolute_difference);
  }
  for (int64_t v = whole; v < vocab; ++v)
    add_feature_element(sums, load_float(target.values, v), load_float(draft.values, v), target.inverse_temperature,
                        draft.inverse_temperature, target.stats, draft.stats);
  return sums;
}

// A logit row taken at inverse temperature inverse_t, with the normaliser a features pass shifts by.
template <typename T>
LogitRow<T> features_row(const T* values, int64_t vocab, float inverse_t) {
  return LogitRow<T>{values, inverse_t, features_stats(softmax_stats(values, vocab, inverse_t))};
}

// ------------------------------------------------------------------------------------------ entry points
// Called by the binding (ops_cpu.cpp, through cpu_dispatch.h) after the checks and the allocation of the outputs.

// token_stats: draft and target [B, T, V], out.tokens [B, T]; the five outputs [B, T].
template <typename T>
void token_stats(const PairProblem<T>& pair, const TokenStatsOut& out, const ParallelFor& parallel_for) {
  parallel_for(0, pair.rows(), grain_for(2 * pair.vocab), [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t token = out.tokens[index];
      const bool valid = token >= 0 && token < pair.vocab;
      with_rows(pair, index, [&](const auto& target, const auto& draft) {
        token_stats_row(target, draft, pair.vocab, token, out.target_prob + index, out.draft_prob + index,
                        out.total_variation + index);
        out.target_logprob[index] = valid ? log_mass_at(target, token) : -INFINITY;
        out.draft_logprob[index] = valid ? log_mass_at(draft, token) : -INFINITY;
      });
    }
  });
}

// mix: nu = w p + (1 - w) q materialised as float32 [B, K, V]; the target's positions past K are ignored.
template <typename T>
void mix(const PairProblem<T>& pair, const float* weight, float* mixture, const ParallelFor& parallel_for) {
  parallel_for(0, pair.rows(), grain_for(2 * pair.vocab), [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const float w = sanitize_weight(weight[index]);
      with_rows(pair, index, [&](const auto& target, const auto& draft) {
        mix_row(target, draft, w, pair.vocab, mixture + index * pair.vocab);
      });
    }
  });
}

// distribution_features: the problem's pairs of logit rows (FeaturesProblem: [B, T, V] tensors or rows read in place);
// features float32 [B, T, kNumDistributionFeatures]. Each pair gets its two softmax normalisers (one pass per row)
// and then one pass over both rows.
template <typename TD, typename TT>
void distribution_features(const FeaturesProblem& problem, const TD* draft, const TT* target, float* features,
                           const ParallelFor& parallel_for) {
  const int64_t vocab = problem.vocab;
  const double entropy_scale = inverse_log_vocab(vocab);
  parallel_for(0, problem.slots(), grain_for(2 * vocab), [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot) {
      const LogitRow<TT> target_row =
          features_row(target + problem.target_row(slot) * vocab, vocab, problem.target_inverse_temperature(slot));
      const LogitRow<TD> draft_row =
          features_row(draft + problem.draft_row(slot) * vocab, vocab, problem.draft_inverse_temperature(slot));
      write_features(feature_sums(target_row, draft_row, vocab), draft_row.stats, target_row.stats, entropy_scale,
                     features + slot * kNumDistributionFeatures);
    }
  });
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
