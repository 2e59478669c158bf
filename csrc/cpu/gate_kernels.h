// The CPU kernel of gate_statistics: torch-free, over a FeaturesProblem (csrc/common/problems.h) and the drafted
// tokens, compiled once per instruction set (see cpu_kernels.h). One task per drafted position, in parallel.
//
// As distribution_features' kernel (features_kernels.h) does, each element's exp is taken once: a row's max, one pass
// storing its exps in a task's scratch row with their sum, then the residual pass of gate_math.h over the scratch
// rows (in cache) and the target's logits, which give the shifted logits the expected log-probability weighs. A
// draft given as probabilities is read as it lies in that last pass.
#pragma once

#include <vector>

#include "../common/gate_math.h"
#include "features_kernels.h"
#include "kernel_prelude.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

// Where the residual pass reads q: nowhere (a one-hot draft, whose element the caller zeroed in p's scratch row), a
// draft's exps in scratch with its normaliser (features_kernels.h's ExpMasses), or a draft's probabilities as they
// lie. Each sanitises its masses.
struct NoDraft {
  FloatLanes lanes(int64_t) const { return splat_lanes(0.0f); }
  float at(int64_t) const { return 0.0f; }
};
template <typename T>
struct DraftProbs {
  const T* values;
  FloatLanes lanes(int64_t v) const {
    return map_lanes(load_lanes(values, v), [](FloatVector q) { return sanitize_mass(q); });
  }
  float at(int64_t v) const { return sanitize_mass(load_float(values, v)); }
};

// sum (p - q)+ and sum (p - q)+ (s - m) over a row: p from the target's exps and normaliser, q from `draft` (above),
// s - m from the target's logits at `inverse_t`. Float lanes block by block, flushed to float64 once a block (every
// term has one sign).
template <typename T, typename Draft>
ResidualSums residual_sums(const T* target, float inverse_t, SoftmaxStats p_stats, const float* p_exps,
                           const Draft& draft, int64_t vocab) {
  const float shift = p_stats.max;  // exponentiate_row's: 0 for a row without a finite logit (and without mass)
  const ExpMasses p_masses{p_exps, p_stats.inverse_sum};
  const int64_t whole = vocab - vocab % kLanes;
  ResidualSums sums{0.0, 0.0};
  for (int64_t block = 0; block < whole; block += kSoftmaxBlock) {
    FloatLanes block_mass = splat_lanes(0.0f), block_weighted = splat_lanes(0.0f);
    for (int64_t v = block; v < std::min(whole, block + kSoftmaxBlock); v += kLanes) {
      const FloatLanes residual = zip_lanes(p_masses.lanes(v), draft.lanes(v), [](FloatVector a, FloatVector b) {
        return residual_mass(a, b);
      });
      const FloatLanes shifted = map_lanes(load_lanes(target, v), [&](FloatVector x) { return x * inverse_t - shift; });
      block_mass = zip_lanes(block_mass, residual, [](FloatVector total, FloatVector x) { return total + x; });
      block_weighted = zip_lanes(block_weighted, zip_lanes(residual, shifted, [](FloatVector r, FloatVector x) {
                                   return entropy_term(r, x);
                                 }), [](FloatVector total, FloatVector x) { return total + x; });
    }
    sums.mass = sum_float_lanes_in_order(block_mass, sums.mass);
    sums.weighted = sum_float_lanes_in_order(block_weighted, sums.weighted);
  }
  for (int64_t v = whole; v < vocab; ++v) {
    const float residual = residual_mass(p_masses.at(v), draft.at(v));
    sums.mass += static_cast<double>(residual);
    sums.weighted += static_cast<double>(entropy_term(residual, load_float(target, v) * inverse_t - shift));
  }
  return sums;
}

// ------------------------------------------------------------------------------------------ entry point
// Called by the binding (ops_cpu.cpp, through cpu_dispatch.h) after the checks and the allocation of the outputs.

// gate_statistics: the problem's target rows and draft rows (draft null: tokens only, q one-hot at each drafted
// token; draft_probs: the draft rows are probabilities, else logits), draft_tokens int64 [B, T]; drafted and rejected
// float32 [B, T] (gate_math.h). A task's scratch rows are allocated once and reused for each of its positions.
template <typename TD, typename TT>
void gate_statistics(const FeaturesProblem& problem, const int64_t* draft_tokens, const TD* draft, bool draft_probs,
                     const TT* target, float* drafted, float* rejected, const ParallelFor& parallel_for) {
  const int64_t vocab = problem.vocab;
  const bool draft_exps_needed = draft != nullptr && !draft_probs;
  const int64_t rows_read = draft != nullptr ? 2 : 1;
  parallel_for(0, problem.slots(), grain_for(rows_read * vocab), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(static_cast<size_t>((draft_exps_needed ? 2 : 1) * vocab));
    float* const target_exps = scratch.data();
    float* const draft_exps = target_exps + vocab;
    for (int64_t slot = begin; slot < end; ++slot) {
      const TT* target_row = target + problem.target_row(slot) * vocab;
      const float inverse_t = problem.target_inverse_temperature(slot);
      const SoftmaxStats p = exponentiate_row(target_row, vocab, inverse_t, target_exps).stats;
      const int64_t token = draft_tokens[slot];
      const bool valid = token >= 0 && token < vocab;
      const TD* draft_row = draft != nullptr ? draft + problem.draft_row(slot) * vocab : nullptr;
      ResidualSums sums;
      if (draft_row == nullptr) {
        if (valid) target_exps[token] = 0.0f;  // q one-hot at x: the residual is p off x
        sums = residual_sums(target_row, inverse_t, p, target_exps, NoDraft{}, vocab);
      } else if (draft_probs) {
        sums = residual_sums(target_row, inverse_t, p, target_exps, DraftProbs<TD>{draft_row}, vocab);
      } else {
        const float q_inverse_sum = exponentiate_row(draft_row, vocab, problem.draft_inverse_temperature(slot),
                                                     draft_exps).stats.inverse_sum;
        sums = residual_sums(target_row, inverse_t, p, target_exps, ExpMasses{draft_exps, q_inverse_sum}, vocab);
      }
      drafted[slot] = drafted_logprob(valid, valid ? load_float(target_row, token) * inverse_t : 0.0f, p);
      rejected[slot] = rejected_logprob(sums, p);
    }
  });
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
