// The fused verify kernel of verify_probs and verify_logits: one thread block per request, so a whole batch is one
// launch and nothing syncs with the host. Torch-free: a VerifyProblem (csrc/common/problems.h) and raw rows in, a
// stream to launch on. The algorithm is the CPU kernels' (csrc/cpu/verify_kernels.h), with block collectives in place
// of the CPU's chunked passes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/problems.h"
#include "block_ops.cuh"
#include "fly_ops.cuh"

namespace diversed {
namespace gpu {

// The request-level inputs and outputs are a VerifyProblem, shared with the CPU kernels; its greedy flags are read by
// ProbRows, while LogitRows derives them from the temperatures.

// The draft's values (element type TD) and the target's (TT), [rows, V] each, and where a request position's row
// starts in them: the tensor rows the problem maps positions to ([B, K, V] / [B, K+1, V], or row tensors read through
// target_rows / draft_rows). Each is read as it lies: a bfloat16 draft beside a float32 target needs no copy.
template <typename TD, typename TT>
struct RowValues {
  const TD* draft;  // null: the drafter gave tokens only
  const TT* target;

  __device__ const TD* draft_values(const VerifyProblem& p, int64_t row, int64_t position) const {
    return draft + p.draft_row(row, position) * p.vocab;
  }
  __device__ const TT* target_values(const VerifyProblem& p, int64_t row, int64_t position) const {
    return target + p.target_row(row, position) * p.vocab;
  }
};

// Rows of draft probabilities and target probabilities; greedy rows flagged per request. Target rows count mass below
// kMinTargetMass as zero (the target's support, verify_math.h).
template <typename TD, typename TT>
struct ProbRows : RowValues<TD, TT> {
  using Row = ProbRow<TT>;
  using DraftRow = ProbRow<TD>;

  __device__ bool greedy(const VerifyProblem& p, int64_t row) const { return p.greedy_at(row); }
  __device__ void prepare(const VerifyProblem&, int64_t, int64_t, BlockStorage&) const {}
  __device__ DraftRow draft_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    return DraftRow{this->draft_values(p, row, position)};
  }
  __device__ Row target_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    return Row{this->target_values(p, row, position), kMinTargetMass};
  }
};

// Rows of logits with their softmax normalisers, which `prepare` computes into per-call scratch (see
// logits_scratch_size) for every row the request reads: draft positions < num_draft, target positions <= num_draft.
// Temperature <= 0 or NaN marks a greedy row, decided on the untempered softmax. Target rows have the support's
// floor, as in ProbRows.
template <typename TD, typename TT>
struct LogitRows : RowValues<TD, TT> {
  using Row = LogitRow<TT>;
  using DraftRow = LogitRow<TD>;
  SoftmaxStats* draft_stats;   // [B, K] scratch, one normaliser per request position (a row read twice gets two)
  SoftmaxStats* target_stats;  // [B, K+1] scratch

  __device__ bool greedy(const VerifyProblem& p, int64_t row) const {
    return is_greedy_temperature(p.temperature_at(row));
  }
  // The draft rows are divided by the temperature, the target rows by the target's own when the call gives one.
  __device__ float inverse_temperature(const VerifyProblem& p, int64_t row) const {
    return inverse_temperature_of(p.temperature_at(row));
  }
  __device__ float target_inverse_temperature(const VerifyProblem& p, int64_t row) const {
    return inverse_temperature_of(p.target_temperature_at(row));
  }

  __device__ void prepare(const VerifyProblem& p, int64_t row, int64_t drafted, BlockStorage& s) const {
    const float target_inverse_t = target_inverse_temperature(p, row);
    for (int64_t i = 0; i <= drafted; ++i) {
      const SoftmaxStats stats = block_softmax_stats(this->target_values(p, row, i), p.vocab, target_inverse_t, s);
      if (threadIdx.x == 0) target_stats[row * (p.num_positions + 1) + i] = stats;
    }
    const float inverse_t = inverse_temperature(p, row);
    for (int64_t i = 0; this->draft != nullptr && i < drafted; ++i) {  // no draft logits: tokens only
      const SoftmaxStats stats = block_softmax_stats(this->draft_values(p, row, i), p.vocab, inverse_t, s);
      if (threadIdx.x == 0) draft_stats[row * p.num_positions + i] = stats;
    }
    __syncthreads();  // the block reads the normalisers back from global memory
  }
  __device__ DraftRow draft_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    return DraftRow{this->draft_values(p, row, position), inverse_temperature(p, row),
                    draft_stats[row * p.num_positions + position]};
  }
  __device__ Row target_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    return Row{this->target_values(p, row, position), target_inverse_temperature(p, row),
               target_stats[row * (p.num_positions + 1) + position], kMinTargetMass};
  }
};

// Rows of a drafter that gives tokens only: the base rows' target rows and greedy flags, and one-hot draft rows at
// the drafted ids (the base rows' draft pointer is null and never read).
template <typename Rows>
struct TokenDraftRows {
  using Row = typename Rows::Row;
  using DraftRow = OneHotRow;
  Rows base;

  __device__ bool greedy(const VerifyProblem& p, int64_t row) const { return base.greedy(p, row); }
  __device__ void prepare(const VerifyProblem& p, int64_t row, int64_t drafted, BlockStorage& s) const {
    base.prepare(p, row, drafted, s);
  }
  __device__ DraftRow draft_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    return DraftRow{one_hot_draft_token(p.draft_tokens[row * p.num_positions + position], p.vocab)};
  }
  __device__ Row target_row(const VerifyProblem& p, int64_t row, int64_t position) const {
    return base.target_row(p, row, position);
  }
};

// SoftmaxStats entries the logits path needs as scratch: [B, K] draft and [B, K+1] target normalisers.
inline int64_t logits_scratch_size(int64_t batch, int64_t num_positions) {
  return batch * (2 * num_positions + 1);
}

// The weight a request's rejection at m verifies with (verify_weight): 1 where the target forbids the draft x_m (or
// x_m lies outside [0, V)), so its correction is drawn from the residual whatever w_m is.
template <typename Rows>
__device__ float rejection_weight(const VerifyProblem& params, const Rows& rows, int64_t b, int64_t m) {
  const int64_t token = params.draft_tokens[b * params.num_positions + m];
  const float p = in_row(token, params.vocab) ? mass_at(rows.target_row(params, b, m), token) : 0.0f;
  return params.verify_weight_at(b, m, p);
}

// Accept tests of a sampled (not greedy) row at its drafted positions, one position per thread: returns m, the first
// rejection (drafted when every test passes), in every thread. With write_outputs, also each drafted position's
// accept_prob. A draft the target forbids verifies with w = 1 (verify_weight): never accepted.
template <typename Rows>
__device__ int64_t sampled_first_rejection(const VerifyProblem& params, const Rows& rows, int64_t b, int64_t drafted,
                                           bool write_outputs, BlockStorage& storage) {
  using Row = typename Rows::Row;
  using DraftRow = typename Rows::DraftRow;
  const int64_t K = params.num_positions;
  int64_t first_rejection = drafted;
  for (int64_t i = threadIdx.x; i < drafted; i += kThreads) {
    const int64_t token = params.draft_tokens[b * K + i];
    float probability = 0.0f;
    bool accepted = false;
    if (in_row(token, params.vocab)) {
      const Row target = rows.target_row(params, b, i);
      const DraftRow draft = rows.draft_row(params, b, i);
      const float p = mass_at(target, token);
      const float q = mass_at(draft, token);
      const float nu = mix_mass(verify_weight(params.weight_at(b, i), p), p, q);
      probability = accept_probability(nu, q);
      accepted = accept_draft(params.uniform(b, i), q, nu);
    }
    if (write_outputs) params.out_accept_prob[b * K + i] = probability;
    if (!accepted && i < first_rejection) first_rejection = i;
  }
  return block_min(first_rejection, storage);
}

// Every output of row b but its final token: accept_prob past num_draft, the accepted drafts, -1 padding, and m.
__device__ __forceinline__ void write_row_outputs(const VerifyProblem& params, int64_t b, int64_t drafted, int64_t m) {
  const int64_t K = params.num_positions;
  for (int64_t i = drafted + threadIdx.x; i < K; i += kThreads) params.out_accept_prob[b * K + i] = 0.0f;
  int64_t* row_tokens = params.out_tokens + b * (K + 1);
  for (int64_t i = threadIdx.x; i <= K; i += kThreads)
    if (i != m) row_tokens[i] = i < m ? params.draft_tokens[b * K + i] : -1;
  if (threadIdx.x == 0) params.out_num_accepted[b] = static_cast<int32_t>(m);
}

// One block per request: accept tests, outputs, then the greedy argmax or the residual/bonus sample.
template <typename Rows>
__global__ void __launch_bounds__(kThreads) verify_kernel(const VerifyProblem params, const Rows rows) {
  __shared__ BlockStorage storage;
  using Row = typename Rows::Row;
  using DraftRow = typename Rows::DraftRow;
  const int64_t b = blockIdx.x;
  const int64_t K = params.num_positions, V = params.vocab;
  const int64_t drafted = params.drafted(b);
  const bool greedy = rows.greedy(params, b);
  rows.prepare(params, b, drafted, storage);

  // 1. Accept tests at drafted positions; m = the first rejection (drafted when all pass), or with FLy the first
  // position neither accepted nor deferred (fly_math.h).
  int64_t m = drafted;
  int64_t greedy_choice = 0;  // argmax nu_m of a greedy row rejected at m
  const int64_t window = params.fly.window_at(b, K);
  if (greedy) {
    FlyWalk walk(drafted, window);
    for (int64_t i = 0; i < drafted; ++i) {
      const Row target = rows.target_row(params, b, i);
      const DraftRow draft = rows.draft_row(params, b, i);
      const int64_t best = block_argmax_mixture(target, &draft, params.weight_at(b, i), V, storage);
      const int64_t token = params.draft_tokens[b * K + i];
      const bool valid = in_row(token, V);
      const float p = valid ? mass_at(target, token) : 0.0f;
      // best lies in [0, V) (ids outside are rejected) and in the support, unless the target has none.
      const bool accepted = token == best && !target_forbids(p);
      if (threadIdx.x == 0) params.out_accept_prob[b * K + i] = accepted ? 1.0f : 0.0f;
      // A failure while no rejection is pending is this position's; one inside a window ends at the pending one.
      if (!accepted && !walk.decided() && walk.pending < 0) greedy_choice = best;
      const bool deferrable = window > 0 && fly_deferrable(true, valid, p, 0.0f);
      const int64_t asked = walk.feed(i, accepted, deferrable);
      if (asked >= 0) walk.settle(fly_entropy_defers(params, rows, b, asked, storage));
    }
    m = walk.accepted_length();
  } else {
    m = sampled_first_rejection(params, rows, b, drafted, true, storage);
    if (window > 0 && m < drafted) m = fly_sampled_length(params, rows, b, drafted, m, window, storage);
  }

  // 2. Every output but the final token.
  write_row_outputs(params, b, drafted, m);
  int64_t* row_tokens = params.out_tokens + b * (K + 1);

  // 3. The final token at position m.
  const bool rejected = m < drafted;
  int64_t choice;
  if (greedy) {
    if (rejected) {
      choice = greedy_choice;
    } else {
      const Row bonus = rows.target_row(params, b, drafted);
      choice = block_argmax_mixture(bonus, static_cast<const Row*>(nullptr), 1.0f, V, storage);
    }
  } else {
    // Residual max(0, p_m - q_m) only when rejected with w_m > 0 (1 at a forbidden draft); otherwise (or when it has
    // no mass) p_m itself.
    const bool use_residual = rejected && rejection_weight(params, rows, b, m) > 0.0f;
    const Row target = rows.target_row(params, b, m);
    DraftRow draft_storage{};
    if (use_residual) draft_storage = rows.draft_row(params, b, m);
    const DraftRow* draft = use_residual ? &draft_storage : nullptr;
    const SampleTotals totals = block_sample_totals(target, draft, Span{0, V}, storage);
    double total = totals.sampled;
    if (!(total > 0.0) && draft != nullptr) {  // zero residual: sample p itself
      draft = nullptr;
      total = totals.target;
    }
    choice = -1;
    if (total > 0.0) choice = block_inverse_cdf(target, draft, Span{0, V}, params.uniform(b, K) * total, storage);
    if (choice < 0) choice = 0;  // a target row without mass has no valid sample; 0 keeps the id in range
  }
  if (threadIdx.x == 0) row_tokens[m] = choice;
}

// The rows a launch reads: as they are, or with one-hot draft rows when the draft tensor is absent (a null draft).
// Only a draft of the target's element type may be absent (the binding dispatches a tokens-only call on the target's
// type alone), so the mixed-type instantiations compile no tokens-only kernels.
template <typename TD, typename TT, typename Rows, typename Launch>
void with_launch_rows(const Rows& rows, bool has_draft, const Launch& launch) {
  if constexpr (std::is_same_v<TD, TT>) {
    if (!has_draft) {
      launch(TokenDraftRows<Rows>{rows});
      return;
    }
  }
  launch(rows);
}

// One launch over the batch.
template <typename TD, typename TT, typename Rows>
void launch_verify(const VerifyProblem& params, const Rows& rows, bool has_draft, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(params.batch);
  with_launch_rows<TD, TT>(rows, has_draft, [&](const auto& launched) {
    verify_kernel<<<blocks, kThreads, 0, stream>>>(params, launched);
  });
}

// Launchers; params.greedy must be set for probabilities. `scratch` holds logits_scratch_size(B, K) entries. A null
// draft pointer: the drafter gave tokens only (then TD = TT).
template <typename TD, typename TT>
void launch_verify_probs(const VerifyProblem& params, const TD* draft, const TT* target, cudaStream_t stream) {
  if (params.batch == 0) return;
  launch_verify<TD, TT>(params, ProbRows<TD, TT>{{draft, target}}, draft != nullptr, stream);
}

template <typename TD, typename TT>
void launch_verify_logits(const VerifyProblem& params, const TD* draft, const TT* target, SoftmaxStats* scratch,
                          cudaStream_t stream) {
  if (params.batch == 0) return;
  const LogitRows<TD, TT> rows{{draft, target}, scratch, scratch + params.batch * params.num_positions};
  launch_verify<TD, TT>(params, rows, draft != nullptr, stream);
}

}  // namespace gpu
}  // namespace diversed
