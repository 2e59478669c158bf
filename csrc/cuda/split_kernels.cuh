// The "split" verify kernels: each request's vocabulary spread over many blocks, so that a small batch still fills
// the GPU (the "block" kernels of verify_kernels.cuh give each request one block). Chosen at run time by
// diversed_ext.set_cuda_kernels("split") (common/kernel_family.h); same results as the block kernels up to the order
// of float64 sums.
//
// verify_probs is one launch over (request, chunk) blocks (vocab_split.h cuts the rows):
//   1. every block of a request runs its accept tests (a few gathered values, the same in every block) and reduces its
//      chunk of the row the final token is drawn from: the residual and target masses of a sampled row, or, for a
//      greedy row, the argmax of nu at every drafted position and of p at the bonus position;
//   2. the last block of the request to finish (an atomic counter per request, no host sync) combines the chunks in
//      chunk order: the total, the chunk that holds u * total (choose_chunk), and the sample inside that chunk alone
//      (or the greedy decisions). A sampled row's other outputs are written by its first block, a greedy row's all
//      by its last.
// verify_logits first launches softmax_partials_kernel over (request, row, chunk) blocks, whose last block per row
// merges the chunks' online-softmax partials into the row's normaliser; the verify launch then reads those.
// Torch-free, like the block kernels; the binding provides the scratch (lay_out_split_scratch), counters zeroed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/vocab_split.h"
#include "verify_kernels.cuh"

namespace diversed {
namespace gpu {

// Per-call scratch of the split kernels, carved from one allocation (see lay_out_split_scratch). The counters come
// first, so one memset zeroes them all.
struct SplitScratch {
  unsigned* request_done;        // [B] blocks of a request that have finished
  unsigned* row_done;            // [B, 2K + 1] blocks of a logits row whose partial is written (logits only)
  double* sampled_mass;          // [B, chunks] residual (or p) mass per chunk of a sampled row
  double* target_mass;           // [B, chunks] p mass per chunk: the fallback of a zero residual
  ArgMax* argmax;                // [B, K + 1, chunks] greedy rows: argmax per position and chunk
  SoftmaxPartial* partials;      // [B, 2K + 1, row chunks] logits only
  SoftmaxStats* draft_stats;     // [B, K] logits only
  SoftmaxStats* target_stats;    // [B, K + 1] logits only
};

// The two cuts of one call: the verify launch's (one row per request) and, for logits, the normalisers' (2K + 1 rows
// per request).
struct SplitPlan {
  VocabSplit verify, rows;
  int64_t batch, num_positions;
  bool logits;

  int64_t counters() const { return batch + (logits ? batch * (2 * num_positions + 1) : 0); }
};

inline SplitPlan split_plan(int64_t batch, int64_t num_positions, int64_t vocab, bool logits, int64_t target_blocks) {
  return SplitPlan{split_vocab(batch, vocab, target_blocks),
                   split_vocab(batch * (2 * num_positions + 1), vocab, target_blocks), batch, num_positions, logits};
}

inline int64_t aligned_bytes(int64_t bytes) { return (bytes + 15) / 16 * 16; }

// The scratch of a call: its size, how many of its first bytes hold the counters (zeroed before the launch), and the
// regions carved from `memory`, each 16-byte aligned. With memory == nullptr it only measures (the pointers stay null),
// so the sizes are stated once, here.
struct SplitScratchLayout {
  int64_t bytes, counter_bytes;
  SplitScratch scratch;
};

inline SplitScratchLayout lay_out_split_scratch(const SplitPlan& plan, void* memory) {
  const int64_t B = plan.batch, K = plan.num_positions, chunks = plan.verify.num_chunks;
  int64_t used = 0;
  const auto take = [&](int64_t count, int64_t element_bytes) -> void* {
    const int64_t start = used;
    used += aligned_bytes(count * element_bytes);
    return memory != nullptr ? static_cast<char*>(memory) + start : nullptr;
  };
  SplitScratch scratch{};
  scratch.request_done = static_cast<unsigned*>(take(plan.counters(), sizeof(unsigned)));
  scratch.row_done = plan.logits && memory != nullptr ? scratch.request_done + B : nullptr;
  const int64_t counter_bytes = used;
  scratch.sampled_mass = static_cast<double*>(take(B * chunks, sizeof(double)));
  scratch.target_mass = static_cast<double*>(take(B * chunks, sizeof(double)));
  scratch.argmax = static_cast<ArgMax*>(take(B * (K + 1) * chunks, sizeof(ArgMax)));
  if (plan.logits) {
    const int64_t rows = B * (2 * K + 1);
    scratch.partials = static_cast<SoftmaxPartial*>(take(rows * plan.rows.num_chunks, sizeof(SoftmaxPartial)));
    scratch.draft_stats = static_cast<SoftmaxStats*>(take(rows, sizeof(SoftmaxStats)));
    scratch.target_stats = memory != nullptr ? scratch.draft_stats + B * K : nullptr;
  }
  return SplitScratchLayout{used, counter_bytes, scratch};
}

// ------------------------------------------------------------------------------------------------ block handoff
// Whether this block is the last of `blocks` blocks counted on `counter`. Thread 0, the only thread that writes a
// block's partials, fences them before it counts the block, so the last block sees every other block's partials (which
// it reads with __ldcg, past L1). Reached by every thread of the block; the answer is the same in all of them.
__device__ __forceinline__ bool arrive_last(unsigned* counter, int64_t blocks) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1u) == static_cast<unsigned>(blocks - 1);
  }
  __syncthreads();
  const bool is_last = last;
  if (is_last) __threadfence();
  return is_last;
}

__device__ __forceinline__ ArgMax load_partial(const ArgMax* slot) {
  return ArgMax{__ldcg(&slot->value), static_cast<int64_t>(__ldcg(reinterpret_cast<const long long*>(&slot->index)))};
}

// ------------------------------------------------------------------------------------------------ normalisers
// One block per (request, row, chunk): the row's online-softmax partial over the chunk; the last block of a row
// merges its chunks (max, then the sums rescaled to it) into the row's normaliser. Rows the request never reads
// (draft positions >= num_draft, target positions > num_draft, draft rows without draft logits) are skipped.
template <typename TD, typename TT>
__global__ void __launch_bounds__(kThreads)
    softmax_partials_kernel(const VerifyProblem params, const LogitRows<TD, TT> rows, const VocabSplit split,
                            const SplitScratch scratch) {
  __shared__ BlockStorage storage;
  const int64_t K = params.num_positions, per_request = 2 * K + 1, chunks = split.num_chunks;
  const int64_t chunk = blockIdx.x % chunks, row_index = blockIdx.x / chunks;
  const int64_t b = row_index / per_request, slot = row_index % per_request;  // slots: K draft rows, K + 1 target
  const bool is_draft = slot < K;
  const int64_t position = is_draft ? slot : slot - K;
  const int64_t drafted = params.drafted(b);
  if (is_draft ? (rows.draft == nullptr || position >= drafted) : position > drafted) return;
  const float inverse_t = is_draft ? rows.inverse_temperature(params, b) : rows.target_inverse_temperature(params, b);
  const Span span{split.begin(chunk), split.end(chunk)};
  // The draft's and the target's rows may have different element types; the block takes one branch (is_draft).
  const SoftmaxPartial partial =
      is_draft ? block_softmax_partial(rows.draft_values(params, b, position), span, inverse_t, storage)
               : block_softmax_partial(rows.target_values(params, b, position), span, inverse_t, storage);
  SoftmaxPartial* row_partials = scratch.partials + row_index * chunks;
  if (threadIdx.x == 0) row_partials[chunk] = partial;
  if (!arrive_last(scratch.row_done + row_index, chunks)) return;

  // chunks <= kSplitMaxChunks <= kThreads: one partial per thread.
  SoftmaxPartial mine{-INFINITY, 0.0};
  if (threadIdx.x < chunks)
    mine = SoftmaxPartial{__ldcg(&row_partials[threadIdx.x].max), __ldcg(&row_partials[threadIdx.x].sum)};
  const float row_max = block_all_reduce(mine.max, MaxOp{}, storage.temp.max, storage.result.max);
  const double total = block_sum(rescaled_partial_sum(mine, row_max), storage);
  if (threadIdx.x == 0) {
    SoftmaxStats* stats = is_draft ? rows.draft_stats + b * K + position : rows.target_stats + b * (K + 1) + position;
    *stats = finish_softmax(row_max, total);
  }
}

// ------------------------------------------------------------------------------------------------ verification
// The last block's part for a greedy row: each position's argmax over all chunks, the accept decisions, the outputs.
// The chunks' argmaxes are taken over the target's support, so a forbidden draft never equals one; a target without
// support (no chunk found a candidate) accepts nothing.
__device__ inline void finish_greedy_row(const VerifyProblem& params, int64_t b, int64_t drafted, int64_t chunks,
                                  const ArgMax* row_argmax, BlockStorage& storage) {
  const int64_t K = params.num_positions;
  int64_t m = drafted, choice = 0;
  for (int64_t i = 0; i <= drafted; ++i) {
    ArgMax mine{-1.0f, INT64_MAX};
    if (threadIdx.x < chunks) mine = load_partial(row_argmax + i * chunks + threadIdx.x);
    const int64_t best = block_all_reduce(mine, ArgMaxOp{}, storage.temp.argmax, storage.result.argmax).index;
    const int64_t index = best < params.vocab ? best : 0;
    if (i == drafted) {  // the bonus position: its argmax of p is the final token when every draft was kept
      if (m == drafted) choice = index;
      break;
    }
    // ids outside [0, V) are rejected
    const bool accepted = best < params.vocab && params.draft_tokens[b * K + i] == index;
    if (threadIdx.x == 0) params.out_accept_prob[b * K + i] = accepted ? 1.0f : 0.0f;
    if (!accepted && m == drafted) {
      m = i;
      choice = index;
    }
  }
  write_row_outputs(params, b, drafted, m);
  if (threadIdx.x == 0) params.out_tokens[b * (K + 1) + m] = choice;
}

// The last block's part for a sampled row: the final token, from the chunk that holds u * total. (Block 0 of the
// request wrote the other outputs.)
template <typename Rows>
__device__ void finish_sampled_row(const VerifyProblem& params, const Rows& rows, int64_t b, int64_t m,
                                   bool use_residual, const VocabSplit& split, const SplitScratch& scratch,
                                   BlockStorage& storage) {
  using DraftRow = typename Rows::DraftRow;
  __shared__ double sampled_mass[kSplitMaxChunks], target_mass[kSplitMaxChunks];
  __shared__ ChunkChoice choice;
  __shared__ bool residual;
  const int64_t K = params.num_positions, chunks = split.num_chunks;
  for (int64_t c = threadIdx.x; c < chunks; c += kThreads) {  // every chunk's partials at once, past L1
    sampled_mass[c] = __ldcg(scratch.sampled_mass + b * chunks + c);
    target_mass[c] = __ldcg(scratch.target_mass + b * chunks + c);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // at most kSplitMaxChunks values, added in chunk order by one thread
    bool residual_row = use_residual;
    const double* masses = residual_row ? sampled_mass : target_mass;
    double total = total_mass(masses, chunks);
    if (!(total > 0.0) && residual_row) {  // zero residual: sample p itself
      residual_row = false;
      masses = target_mass;
      total = total_mass(masses, chunks);
    }
    const double threshold = params.uniform(b, K) * total;
    const ChunkChoice found = total > 0.0 ? choose_chunk(masses, chunks, threshold) : ChunkChoice{-1, 0.0};
    choice = ChunkChoice{found.chunk, threshold - found.mass_before};  // the threshold inside the chunk
    residual = residual_row;
  }
  __syncthreads();
  int64_t token = -1;
  if (choice.chunk >= 0) {
    const auto target = rows.target_row(params, b, m);
    DraftRow draft_storage{};
    if (residual) draft_storage = rows.draft_row(params, b, m);
    const Span span{split.begin(choice.chunk), split.end(choice.chunk)};
    token = block_inverse_cdf(target, residual ? &draft_storage : nullptr, span, choice.mass_before, storage);
  }
  // A target row without mass has no valid sample; 0 keeps the id in range.
  if (threadIdx.x == 0) params.out_tokens[b * (K + 1) + m] = token >= 0 ? token : 0;
}

static_assert(kSplitMaxChunks <= kThreads, "the combining block reads one chunk's partial per thread");

// One block per (request, chunk); see the top of this file.
template <typename Rows>
__global__ void __launch_bounds__(kThreads)
    split_verify_kernel(const VerifyProblem params, const Rows rows, const VocabSplit split,
                        const SplitScratch scratch) {
  __shared__ BlockStorage storage;
  using Row = typename Rows::Row;
  using DraftRow = typename Rows::DraftRow;
  const int64_t chunks = split.num_chunks, K = params.num_positions;
  const int64_t b = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const Span span{split.begin(chunk), split.end(chunk)};
  const int64_t drafted = params.drafted(b);
  const bool greedy = rows.greedy(params, b);
  ArgMax* row_argmax = scratch.argmax + b * (K + 1) * chunks;

  int64_t m = drafted;
  bool use_residual = false;
  if (greedy) {
    for (int64_t i = 0; i <= drafted; ++i) {
      const Row target = rows.target_row(params, b, i);
      ArgMax best;
      if (i < drafted) {
        const DraftRow draft = rows.draft_row(params, b, i);
        best = block_argmax_span(target, &draft, params.weight_at(b, i), span, storage);
      } else {
        best = block_argmax_span(target, static_cast<const Row*>(nullptr), 1.0f, span, storage);
      }
      if (threadIdx.x == 0) row_argmax[i * chunks + chunk] = best;
    }
  } else {
    // Every block of the request finds the same m; its first block writes the outputs that do not need the sample.
    m = sampled_first_rejection(params, rows, b, drafted, chunk == 0, storage);
    if (chunk == 0) write_row_outputs(params, b, drafted, m);
    // Residual max(0, p_m - q_m) only when rejected with w_m > 0 (1 at a forbidden draft); otherwise (or when it has
    // no mass) p_m itself.
    use_residual = m < drafted && rejection_weight(params, rows, b, m) > 0.0f;
    const Row target = rows.target_row(params, b, m);
    DraftRow draft_storage{};
    if (use_residual) draft_storage = rows.draft_row(params, b, m);
    const SampleTotals totals = block_sample_totals(target, use_residual ? &draft_storage : nullptr, span, storage);
    if (threadIdx.x == 0) {
      scratch.sampled_mass[b * chunks + chunk] = totals.sampled;
      scratch.target_mass[b * chunks + chunk] = totals.target;
    }
  }
  if (!arrive_last(scratch.request_done + b, chunks)) return;
  if (greedy) {
    finish_greedy_row(params, b, drafted, chunks, row_argmax, storage);
  } else {
    finish_sampled_row(params, rows, b, m, use_residual, split, scratch, storage);
  }
}

// ------------------------------------------------------------------------------------------------ launchers
// `scratch` was laid out by lay_out_split_scratch, its counters zeroed. A null draft pointer: the drafter gave tokens
// only (then TD = TT, with_launch_rows).
template <typename TD, typename TT, typename Rows>
void launch_split_verify(const VerifyProblem& params, const Rows& rows, bool has_draft, const SplitPlan& plan,
                         const SplitScratch& scratch, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(params.batch * plan.verify.num_chunks);
  with_launch_rows<TD, TT>(rows, has_draft, [&](const auto& launched) {
    split_verify_kernel<<<blocks, kThreads, 0, stream>>>(params, launched, plan.verify, scratch);
  });
}

template <typename TD, typename TT>
void launch_split_verify_probs(const VerifyProblem& params, const TD* draft, const TT* target, const SplitPlan& plan,
                               const SplitScratch& scratch, cudaStream_t stream) {
  if (params.batch == 0) return;
  launch_split_verify<TD, TT>(params, ProbRows<TD, TT>{{draft, target}}, draft != nullptr, plan, scratch, stream);
}

template <typename TD, typename TT>
void launch_split_verify_logits(const VerifyProblem& params, const TD* draft, const TT* target, const SplitPlan& plan,
                                const SplitScratch& scratch, cudaStream_t stream) {
  if (params.batch == 0) return;
  const LogitRows<TD, TT> rows{{draft, target}, scratch.draft_stats, scratch.target_stats};
  const unsigned row_blocks =
      static_cast<unsigned>(params.batch * (2 * params.num_positions + 1) * plan.rows.num_chunks);
  softmax_partials_kernel<<<row_blocks, kThreads, 0, stream>>>(params, rows, plan.rows, scratch);
  launch_split_verify<TD, TT>(params, rows, draft != nullptr, plan, scratch, stream);
}

}  // namespace gpu
}  // namespace diversed
