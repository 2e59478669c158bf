// The CPU kernels of token_stats and mix (distribution_features': features_kernels.h): torch-free, over a PairProblem
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

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
