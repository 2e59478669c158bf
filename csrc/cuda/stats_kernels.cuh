// The kernels of token_stats, mix, distribution_features and gate_statistics: one thread block per (row, position)
// pair of distributions, one launch per call. Torch-free: a PairProblem or FeaturesProblem (csrc/common/problems.h)
// and raw outputs in, a stream to launch on.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "../common/features_math.h"
#include "../common/gate_math.h"
#include "../common/problems.h"
#include "block_ops.cuh"

namespace diversed {
namespace gpu {

// Calls f(target_row, draft_row) with probability rows, or with logit rows and their normalisers (computed here by
// the whole block), so one body serves both inputs.
template <typename T, typename F>
__device__ __forceinline__ void with_rows(const PairProblem<T>& p, int64_t index, BlockStorage& s, F f) {
  const T* target = p.target_values(index);
  const T* draft = p.draft_values(index);
  if (p.from_logits) {
    const float inverse_t = p.inverse_temperature(index);
    const LogitRow<T> target_row{target, inverse_t, block_softmax_stats(target, p.vocab, inverse_t, s)};
    const LogitRow<T> draft_row{draft, inverse_t, block_softmax_stats(draft, p.vocab, inverse_t, s)};
    f(target_row, draft_row);
  } else {
    f(ProbRow<T>{target}, ProbRow<T>{draft});
  }
}

// Calls f(first, p, q) with this thread's masses of two rows read in lockstep, tile by tile (0 outside the row).
template <typename Row, typename F>
__device__ __forceinline__ void for_each_pair_tile(const Row& target, const Row& draft, int64_t vocab, F f) {
  const TileLayout layout = tile_layout(target.values, draft.values);
  for (int64_t tile = 0; tile < vocab; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float p[kItemsPerThread], q[kItemsPerThread];
    load_masses(target, first, Span{0, vocab}, layout.vectorised, p);
    load_masses(draft, first, Span{0, vocab}, layout.second_vectorised, q);
    f(first, p, q);
  }
}

// log p(y) from logits: s_y - max + log(1 / sum) in float64, exact where the mass underflows; NaN gives -inf.
template <typename T>
__device__ __forceinline__ float log_mass_at(const LogitRow<T>& row, int64_t token) {
  const float scaled = load_element(row.values, token) * row.inverse_temperature;
  const double value =
      static_cast<double>(scaled) - row.stats.max + log(static_cast<double>(row.stats.inverse_sum));
  return value == value ? static_cast<float>(value) : -INFINITY;
}
template <typename T>
__device__ __forceinline__ float log_mass_at(const ProbRow<T>& row, int64_t token) {
  return static_cast<float>(log(static_cast<double>(mass_at(row, token))));
}

template <typename T>
__global__ void __launch_bounds__(kThreads) token_stats_kernel(const PairProblem<T> params, const TokenStatsOut out) {
  __shared__ BlockStorage storage;
  const int64_t index = blockIdx.x;
  const int64_t vocab = params.vocab;
  with_rows(params, index, storage, [&](const auto& target, const auto& draft) {
    double thread_sum = 0.0;
    for_each_pair_tile(target, draft, vocab, [&](int64_t, const float(&p)[kItemsPerThread],
                                                 const float(&q)[kItemsPerThread]) {
#pragma unroll
      for (int k = 0; k < kItemsPerThread; ++k) thread_sum += static_cast<double>(fabsf(p[k] - q[k]));
    });
    const double sum = block_sum(thread_sum, storage);
    if (threadIdx.x == 0) {
      const int64_t token = out.tokens[index];
      const bool valid = in_row(token, vocab);
      out.total_variation[index] = static_cast<float>(0.5 * sum);
      out.target_prob[index] = valid ? mass_at(target, token) : 0.0f;
      out.draft_prob[index] = valid ? mass_at(draft, token) : 0.0f;
      out.target_logprob[index] = valid ? log_mass_at(target, token) : -INFINITY;
      out.draft_logprob[index] = valid ? log_mass_at(draft, token) : -INFINITY;
    }
  });
}

// nu = w p + (1 - w) q as float32 [B, K, V]; float4 stores where the output row is aligned.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    mix_kernel(const PairProblem<T> params, const float* weight, float* mixture) {
  __shared__ BlockStorage storage;
  const int64_t index = blockIdx.x;
  const int64_t vocab = params.vocab;
  const float w = sanitize_weight(weight[index]);
  float* out = mixture + index * vocab;
  with_rows(params, index, storage, [&](const auto& target, const auto& draft) {
    for_each_pair_tile(target, draft, vocab, [&](int64_t first, const float(&p)[kItemsPerThread],
                                                 const float(&q)[kItemsPerThread]) {
      float nu[kItemsPerThread];
#pragma unroll
      for (int k = 0; k < kItemsPerThread; ++k) nu[k] = mix_mass(w, p[k], q[k]);
#pragma unroll
      for (int j = 0; j < kItemsPerThread; j += 4) {
        const int64_t start = first + j;
        if (start >= 0 && start + 4 <= vocab && reinterpret_cast<uintptr_t>(out + start) % 16 == 0) {
          *reinterpret_cast<float4*>(out + start) = make_float4(nu[j], nu[j + 1], nu[j + 2], nu[j + 3]);
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k)
            if (in_row(start + k, vocab)) out[start + k] = nu[j + k];
        }
      }
    });
  });
}

// One pair of logit rows' features (FeaturesProblem: the slot's own rows or rows read in place): both normalisers,
// then one pass over both rows adding features_math.h's sums, per thread in float64 and across the block in float64.
template <typename TD, typename TT>
__global__ void __launch_bounds__(kThreads) distribution_features_kernel(const FeaturesProblem problem,
                                                                         const TD* draft_logits,
                                                                         const TT* target_logits, float* features) {
  __shared__ BlockStorage storage;
  const int64_t slot = blockIdx.x;
  const int64_t vocab = problem.vocab;
  const float target_inverse_t = problem.target_inverse_temperature(slot);
  const float draft_inverse_t = problem.draft_inverse_temperature(slot);
  const TT* target = target_logits + problem.target_row(slot) * vocab;
  const TD* draft = draft_logits + problem.draft_row(slot) * vocab;
  const SoftmaxStats target_stats = features_stats(block_softmax_stats(target, vocab, target_inverse_t, storage));
  const SoftmaxStats draft_stats = features_stats(block_softmax_stats(draft, vocab, draft_inverse_t, storage));
  const TileLayout layout = tile_layout(target, draft);
  FeatureSums thread_sums{};
  for (int64_t tile = 0; tile < vocab; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float p_logit[kItemsPerThread], q_logit[kItemsPerThread];
    load_items(target, first, Span{0, vocab}, layout.vectorised, p_logit);
    load_items(draft, first, Span{0, vocab}, layout.second_vectorised, q_logit);
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k)
      if (in_row(first + k, vocab))
        add_feature_element(thread_sums, p_logit[k], q_logit[k], target_inverse_t, draft_inverse_t, target_stats,
                            draft_stats);
  }
  // Each block_sum ends in a barrier, so the storage is free again for the next.
  const FeatureSums sums{block_sum(thread_sums.draft_mass, storage), block_sum(thread_sums.draft_terms, storage),
                         block_sum(thread_sums.target_mass, storage), block_sum(thread_sums.target_terms, storage),
                         block_sum(thread_sums.absolute_difference, storage)};
  if (threadIdx.x == 0)
    write_features(sums, draft_stats, target_stats, inverse_log_vocab(vocab),
                   features + slot * kNumDistributionFeatures);
}

// One drafted position's gate statistics (gate_math.h): the target's normaliser (and a draft's from logits), then one
// pass over the rows adding the residual's sums, per thread in float64 and across the block in float64. A draft of
// probabilities is read as it lies; without a draft q is one-hot at the drafted token.
template <typename TD, typename TT>
__global__ void __launch_bounds__(kThreads) gate_statistics_kernel(const FeaturesProblem problem,
                                                                   const int64_t* draft_tokens, const TD* draft_values,
                                                                   bool draft_probs, const TT* target_logits,
                                                                   float* drafted, float* rejected) {
  __shared__ BlockStorage storage;
  const int64_t slot = blockIdx.x;
  const int64_t vocab = problem.vocab;
  const float target_inverse_t = problem.target_inverse_temperature(slot);
  const TT* target = target_logits + problem.target_row(slot) * vocab;
  const SoftmaxStats target_stats = features_stats(block_softmax_stats(target, vocab, target_inverse_t, storage));
  const int64_t token = draft_tokens[slot];
  const TD* draft = draft_values != nullptr ? draft_values + problem.draft_row(slot) * vocab : nullptr;
  const float draft_inverse_t = problem.draft_inverse_temperature(slot);
  const SoftmaxStats draft_stats = draft != nullptr && !draft_probs
                                       ? features_stats(block_softmax_stats(draft, vocab, draft_inverse_t, storage))
                                       : SoftmaxStats{};
  const TileLayout layout = tile_layout(target, draft);
  ResidualSums thread_sums{0.0, 0.0};
  for (int64_t tile = 0; tile < vocab; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float p_logit[kItemsPerThread], q_value[kItemsPerThread];  // q_value: the draft's logit or probability
    load_items(target, first, Span{0, vocab}, layout.vectorised, p_logit);
    if (draft != nullptr) load_items(draft, first, Span{0, vocab}, layout.second_vectorised, q_value);
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      if (!in_row(first + k, vocab)) continue;
      const float q = draft == nullptr ? (first + k == token ? 1.0f : 0.0f)  // one-hot at x
                      : draft_probs    ? sanitize_mass(q_value[k])
                                       : shifted_mass(q_value[k] * draft_inverse_t - draft_stats.max, draft_stats);
      add_residual_element(thread_sums, p_logit[k] * target_inverse_t - target_stats.max, target_stats, q);
    }
  }
  // Each block_sum ends in a barrier, so the storage is free again for the next.
  const ResidualSums sums{block_sum(thread_sums.mass, storage), block_sum(thread_sums.weighted, storage)};
  if (threadIdx.x == 0) {
    const bool valid = in_row(token, vocab);
    drafted[slot] =
        drafted_logprob(valid, valid ? load_element(target, token) * target_inverse_t : 0.0f, target_stats);
    rejected[slot] = rejected_logprob(sums, target_stats);
  }
}

template <typename T>
void launch_token_stats(const PairProblem<T>& params, const TokenStatsOut& out, cudaStream_t stream) {
  const int64_t rows = params.rows();
  if (rows == 0) return;
  token_stats_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(params, out);
}

template <typename T>
void launch_mix(const PairProblem<T>& params, const float* weight, float* mixture, cudaStream_t stream) {
  const int64_t rows = params.rows();
  if (rows == 0) return;
  mix_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(params, weight, mixture);
}

template <typename TD, typename TT>
void launch_distribution_features(const FeaturesProblem& problem, const TD* draft_logits, const TT* target_logits,
                                  float* features, cudaStream_t stream) {
  const int64_t slots = problem.slots();
  if (slots == 0) return;
  distribution_features_kernel<<<static_cast<unsigned>(slots), kThreads, 0, stream>>>(problem, draft_logits,
                                                                                      target_logits, features);
}

template <typename TD, typename TT>
void launch_gate_statistics(const FeaturesProblem& problem, const int64_t* draft_tokens, const TD* draft,
                            bool draft_probs, const TT* target_logits, float* drafted, float* rejected,
                            cudaStream_t stream) {
  const int64_t slots = problem.slots();
  if (slots == 0) return;
  gate_statistics_kernel<<<static_cast<unsigned>(slots), kThreads, 0, stream>>>(
      problem, draft_tokens, draft, draft_probs, target_logits, drafted, rejected);
}

}  // namespace gpu
}  // namespace diversed
