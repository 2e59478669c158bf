// FLy in the block verify kernels (verify_kernels.cuh): the target's top-k entropy of one row, block-wide, and the
// walk of a sampled row past its first rejection. The rule itself (which draft may be deferred, the walk, the
// entropy's terms and their order) is csrc/common/fly_math.h, which the CPU kernels run too.
#pragma once

#include <cstdint>

#include "../common/problems.h"
#include "block_ops.cuh"

namespace diversed {
namespace gpu {

// -sum p log p over the row's top_k largest masses, in one pass: each thread keeps the top k of its own elements,
// then top_k rounds take the block's largest remaining head (ties to the lower thread, which then drops it), so the
// terms are added in decreasing order of p, as on the CPU. Called by every thread; returns the same value in each.
template <typename Row>
__device__ double block_fly_entropy(const Row& target, int64_t vocab, int top_k, BlockStorage& s) {
  const Span span{0, vocab};
  const TileLayout layout = tile_layout(target.values, static_cast<decltype(target.values)>(nullptr));
  FlyTopK top(top_k);
  for (int64_t tile = span.begin; tile < span.end; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float p[kItemsPerThread];
    load_masses(target, first, span, layout.vectorised, p);
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k)
      if (span.contains(first + k)) top.offer(p[k]);
  }
  int head = 0;
  double sum = 0.0;
  for (int round = 0; round < top_k; ++round) {
    const float mine = head < top.count ? top.values[head] : -1.0f;  // masses are >= 0: -1 offers nothing
    const ArgMax best = block_all_reduce(ArgMax{mine, static_cast<int64_t>(threadIdx.x)}, ArgMaxOp{},
                                         s.temp.argmax, s.result.argmax);
    if (best.value < 0.0f) break;  // a row of fewer than top_k elements
    if (best.index == static_cast<int64_t>(threadIdx.x)) ++head;
    sum += fly_entropy_term(best.value);
  }
  return -sum;
}

// Whether FLy defers the rejection at `position` whose window has passed: its entropy against the row's threshold.
template <typename Rows>
__device__ bool fly_entropy_defers(const VerifyProblem& params, const Rows& rows, int64_t b, int64_t position,
                                   BlockStorage& s) {
  const double entropy = block_fly_entropy(rows.target_row(params, b, position), params.vocab, params.fly.top_k, s);
  return fly_entropy_passes(entropy, params.fly.threshold_at(b));
}

// A sampled row's accepted length with FLy, from its first rejection m: the exact tests again from m on (a few
// gathered values each, the same in every thread), fed to the walk, which asks an entropy only where a window passed.
template <typename Rows>
__device__ int64_t fly_sampled_length(const VerifyProblem& params, const Rows& rows, int64_t b, int64_t drafted,
                                      int64_t m, int64_t window, BlockStorage& s) {
  const int64_t K = params.num_positions;
  FlyWalk walk(drafted, window);
  for (int64_t i = m; i < drafted && !walk.decided(); ++i) {
    const int64_t token = params.draft_tokens[b * K + i];
    const bool valid = in_row(token, params.vocab);
    float p = 0.0f, q = 0.0f;
    bool passed = false;
    if (valid) {
      p = mass_at(rows.target_row(params, b, i), token);
      q = mass_at(rows.draft_row(params, b, i), token);
      passed = accept_draft(params.uniform(b, i), q, mix_mass(verify_weight(params.weight_at(b, i), p), p, q));
    }
    const int64_t asked = walk.feed(i, passed, fly_deferrable(false, valid, p, q));
    if (asked >= 0) walk.settle(fly_entropy_defers(params, rows, b, asked, s));
  }
  return walk.accepted_length();
}

}  // namespace gpu
}  // namespace diversed
