// Block-wide collectives (CUB) and the row operations built on them: softmax normaliser, argmax of the mixture,
// sampled-mass total and inverse CDF. Each row operation is called by every thread of a block and returns the same
// value in every thread; mass is accumulated in float64.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cmath>
#include <cstdint>

#include "../common/vocab_split.h"
#include "row_loads.cuh"

namespace diversed {
namespace gpu {

// ------------------------------------------------------------------------------------------------ block collectives
struct ArgMax {
  float value;
  int64_t index;
};
struct ArgMaxOp {  // larger value, ties to the lower id (better_candidate): a total order, so associative
  __device__ __forceinline__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    return better_candidate(b.value, b.index, a.value, a.index) ? b : a;
  }
};
struct SumOp {
  template <typename V>
  __device__ __forceinline__ V operator()(const V& a, const V& b) const { return a + b; }
};
struct MaxOp {  // operands are never NaN: threads skip NaN before reducing
  template <typename V>
  __device__ __forceinline__ V operator()(const V& a, const V& b) const { return a > b ? a : b; }
};
struct MinOp {
  template <typename V>
  __device__ __forceinline__ V operator()(const V& a, const V& b) const { return a < b ? a : b; }
};

template <typename V>
using BlockReduce = cub::BlockReduce<V, kThreads>;
using BlockScan = cub::BlockScan<double, kThreads>;

// Shared memory of one block: CUB scratch and the slot that broadcasts a reduction's result to every thread.
struct BlockStorage {
  union {
    typename BlockReduce<double>::TempStorage sum;
    typename BlockReduce<float>::TempStorage max;
    typename BlockReduce<int64_t>::TempStorage index;
    typename BlockReduce<ArgMax>::TempStorage argmax;
    typename BlockScan::TempStorage scan;
  } temp;
  union {
    double sum;
    float max;
    int64_t index;
    ArgMax argmax;
  } result;
};

// Reduction whose result every thread receives. Must be reached by all threads of the block.
template <typename V, typename Op>
__device__ __forceinline__ V block_all_reduce(V value, Op op, typename BlockReduce<V>::TempStorage& temp, V& slot) {
  const V reduced = BlockReduce<V>(temp).Reduce(value, op);
  if (threadIdx.x == 0) slot = reduced;
  __syncthreads();
  const V result = slot;
  __syncthreads();  // temp and slot may be reused
  return result;
}

__device__ __forceinline__ double block_sum(double value, BlockStorage& s) {
  return block_all_reduce(value, SumOp{}, s.temp.sum, s.result.sum);
}
__device__ __forceinline__ int64_t block_min(int64_t value, BlockStorage& s) {
  return block_all_reduce(value, MinOp{}, s.temp.index, s.result.index);
}
__device__ __forceinline__ int64_t block_max(int64_t value, BlockStorage& s) {
  return block_all_reduce(value, MaxOp{}, s.temp.index, s.result.index);
}

// ------------------------------------------------------------------------------------------------ row operations
// Each is called by every thread of the block and returns the same value in every thread. Each reads one span of a
// row (Span{0, V}: the whole row; the split kernels give each block one chunk), in tiles from the span's start.

// Softmax partial of logits scaled by inverse_temperature over a span, reading it once (online softmax): each thread
// keeps its running max and its sum of exp(s - running max), rescaled when a tile raises the max; the block then
// rescales every thread's sum to the span's max and adds them. Float partials per tile, float64 across tiles. NaN is
// skipped by the max; a span without a finite logit has max -inf and sum 0.
template <typename T>
__device__ SoftmaxPartial block_softmax_partial(const T* row, Span span, float inverse_temperature, BlockStorage& s) {
  const TileLayout layout = tile_layout<T>(row, static_cast<const T*>(nullptr));
  float thread_max = -INFINITY;
  double thread_sum = 0.0;
  for (int64_t tile = span.begin; tile < span.end; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float scaled[kItemsPerThread];
    load_items(row, first, span, layout.vectorised, scaled);
    float tile_max = thread_max;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      scaled[k] *= inverse_temperature;
      if (span.contains(first + k) && scaled[k] > tile_max) tile_max = scaled[k];
    }
    if (!(tile_max > -INFINITY)) continue;  // nothing finite seen by this thread yet
    if (tile_max > thread_max) thread_sum = rescale_exp_sum(thread_sum, thread_max, tile_max);
    thread_max = tile_max;
    float partial = 0.0f;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k)
      if (span.contains(first + k)) partial += exp_nonpositive(scaled[k] - thread_max);
    thread_sum += static_cast<double>(partial);
  }
  const float span_max = block_all_reduce(thread_max, MaxOp{}, s.temp.max, s.result.max);
  if (!(span_max > -INFINITY)) return SoftmaxPartial{-INFINITY, 0.0};
  return SoftmaxPartial{span_max, block_sum(rescale_exp_sum(thread_sum, thread_max, span_max), s)};
}

// The softmax normaliser of a whole row: its max and 1 / sum exp(s - max).
template <typename T>
__device__ SoftmaxStats block_softmax_stats(const T* row, int64_t vocab, float inverse_temperature, BlockStorage& s) {
  const SoftmaxPartial partial = block_softmax_partial(row, Span{0, vocab}, inverse_temperature, s);
  return finish_softmax(partial.max, partial.sum);
}

// Each thread's items of every tile of a span, as masses: p, and q with a draft row (left unset without), handed to
// visit(first id, p, q).
template <typename Row, typename Draft, typename Visit>
__device__ __forceinline__ void for_each_mass_tile(const Row& target, const Draft* draft, Span span, Visit&& visit) {
  const TileLayout layout = tile_layout(target.values, row_memory(draft));
  for (int64_t tile = span.begin; tile < span.end; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float p[kItemsPerThread], q[kItemsPerThread];
    load_masses(target, first, span, layout.vectorised, p);
    if (draft != nullptr) load_masses(*draft, first, span, layout.second_vectorised, q);
    visit(first, p, q);
  }
}

// argmax over a span of nu = w p + (1 - w) q (or of p without a draft row) over the target's support
// (greedy_value), ties to the lowest id; an index of INT64_MAX (which loses to every element of the support) for a
// span without support.
template <typename Row, typename Draft>
__device__ ArgMax block_argmax_span(const Row& target, const Draft* draft, float weight, Span span, BlockStorage& s) {
  ArgMax best{-1.0f, INT64_MAX};  // loses to every element of the support (masses are >= 0), beats the rest (-inf)
  for_each_mass_tile(target, draft, span, [&](int64_t first, const float* p, const float* q) {
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      const int64_t v = first + k;
      const float nu = draft != nullptr ? greedy_value(weight, p[k], q[k]) : greedy_value(1.0f, p[k], 0.0f);
      if (span.contains(v) && better_candidate(nu, v, best.value, best.index)) best = ArgMax{nu, v};
    }
  });
  return block_all_reduce(best, ArgMaxOp{}, s.temp.argmax, s.result.argmax);
}

// The argmax over a whole row, always in [0, vocab): 0 when the target has no support at all.
template <typename Row, typename Draft>
__device__ int64_t block_argmax_mixture(const Row& target, const Draft* draft, float weight, int64_t vocab,
                                        BlockStorage& s) {
  const int64_t index = block_argmax_span(target, draft, weight, Span{0, vocab}, s).index;
  return index < vocab ? index : 0;  // unreachable guard: vocab >= 1, so some element always wins
}

// What a sampled row's final step may draw from, summed over a span in float64: the sampled mass (the residual
// max(0, p - q) with a draft row, p without) and p alone, which the sample falls back to when the residual has none.
struct SampleTotals {
  double sampled, target;
};

template <typename Row, typename Draft>
__device__ SampleTotals block_sample_totals(const Row& target, const Draft* draft, Span span, BlockStorage& s) {
  double thread_sampled = 0.0, thread_target = 0.0;
  for_each_mass_tile(target, draft, span, [&](int64_t, const float* p, const float* q) {
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      thread_target += static_cast<double>(p[k]);
      if (draft != nullptr) thread_sampled += static_cast<double>(residual_mass(p[k], q[k]));
    }
  });
  const double target_total = block_sum(thread_target, s);
  return SampleTotals{draft != nullptr ? block_sum(thread_sampled, s) : target_total, target_total};
}

// Inverse CDF over a span: the first id whose running sum of sampled mass exceeds `threshold` (relative to the span's
// start), tile by tile with a block-wide exclusive scan in float64. Only ids with positive mass can be chosen, and
// when rounding puts the threshold past the scanned sum (the scan and the totals add in different orders), the last
// id with positive mass is returned: a parallel prefix sum is not monotone in floating point, yet the sample must have
// positive mass. -1 when the span has no mass. sample_in_chunk (vocab_split.h) states the same rule sequentially.
template <typename Row, typename Draft>
__device__ int64_t block_inverse_cdf(const Row& target, const Draft* draft, Span span, double threshold,
                                     BlockStorage& s) {
  const TileLayout layout = tile_layout(target.values, row_memory(draft));
  constexpr int64_t kNone = INT64_MAX;
  double carry = 0.0;              // mass of all earlier tiles
  int64_t last_positive = -1;      // this thread's last element with positive mass
  for (int64_t tile = span.begin; tile < span.end; tile += kTileElements) {
    const int64_t first = thread_first(tile);
    float mass[kItemsPerThread];
    load_sample_masses(target, draft, first, span, layout, mass);
    double local = 0.0;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) local += static_cast<double>(mass[k]);
    double before, tile_total;
    BlockScan(s.temp.scan).ExclusiveSum(local, before, tile_total);
    __syncthreads();  // the scan's storage is reused below
    double running = carry + before;
    int64_t found = kNone;
#pragma unroll
    for (int k = 0; k < kItemsPerThread; ++k) {
      if (mass[k] > 0.0f) {  // 0 outside the span
        running += static_cast<double>(mass[k]);
        last_positive = first + k;
        if (found == kNone && running > threshold) found = first + k;
      }
    }
    found = block_min(found, s);
    if (found != kNone) return found;
    carry += tile_total;
  }
  return block_max(last_positive, s);
}

}  // namespace gpu
}  // namespace diversed
