// The rows the CPU verify kernels read (verify_kernels.h), as row policies of row_ops.h: probabilities or logits
// with their softmax normalisers, and the one-hot draft rows of a tokens-only drafter. A request's position maps to a
// tensor row through the VerifyProblem (target_row / draft_row), which reads the row indices of a call that passes
// target_rows / draft_rows and clamps them into the tensor. Torch-free, compiled once per instruction set.
#pragma once

#include "check_kernels.h"
#include "kernel_prelude.h"
#include "row_ops.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

// Rows of draft probabilities (element type TD) and target probabilities (TT), at the tensor rows the problem maps
// positions to. Each tensor is read as it lies, so a draft in the model's bfloat16 and a float32 target need no copy.
// Target rows count mass below kMinTargetMass as zero (the target's support, verify_math.h).
template <typename TD, typename TT>
struct ProbRows {
  const TD* draft_probs;
  const TT* target_probs;
  const VerifyProblem* problem;

  ProbRow<TD> draft(int64_t row, int64_t position) const {
    return {draft_probs + problem->draft_row(row, position) * problem->vocab};
  }
  ProbRow<TT> target(int64_t row, int64_t position) const {
    return {target_probs + problem->target_row(row, position) * problem->vocab, kMinTargetMass};
  }
};

// Rows of a drafter that gives tokens only: the base rows' target rows, and one-hot draft rows at the drafted ids. The
// base rows' draft rows are never built (their draft tensor is absent).
template <typename Rows>
struct TokenDraftRows {
  Rows base;
  const int64_t* draft_tokens;  // [B, K]
  int64_t num_positions, vocab;

  OneHotRow draft(int64_t row, int64_t position) const {
    return {one_hot_draft_token(draft_tokens[row * num_positions + position], vocab)};
  }
  auto target(int64_t row, int64_t position) const { return base.target(row, position); }
};

// Rows of draft (TD) and target (TT) logits with their normalisers. The normalisers are kept per request position
// ([B, K] and [B, K+1] slots), not per tensor row: a row that several positions read gets one normaliser per position.
// Target rows have the support's floor, as in ProbRows.
template <typename TD, typename TT>
struct LogitRows {
  const TD* draft_logits;
  const TT* target_logits;
  const VerifyProblem* problem;
  const float* inverse_temperature;         // [B], the draft rows'
  const float* target_inverse_temperature;  // [B]
  const SoftmaxStats* draft_stats;          // [B * K]
  const SoftmaxStats* target_stats;         // [B * (K + 1)]
  const uint8_t* draft_vouched;             // [B * K]: normaliser_vouches_for_row
  const uint8_t* target_vouched;            // [B * (K + 1)]

  LogitRow<TD> draft(int64_t row, int64_t position) const {
    const int64_t index = row * problem->num_positions + position;
    return {draft_logits + problem->draft_row(row, position) * problem->vocab, inverse_temperature[row],
            draft_stats[index], draft_vouched[index] != 0};
  }
  LogitRow<TT> target(int64_t row, int64_t position) const {
    const int64_t index = row * (problem->num_positions + 1) + position;
    return {target_logits + problem->target_row(row, position) * problem->vocab, target_inverse_temperature[row],
            target_stats[index], target_vouched[index] != 0, kMinTargetMass};
  }
};

// Softmax normalisers of the rows a request reads: draft positions < num_draft and target positions <= num_draft.
// Slots [0, K) of a request are its draft positions, slots [K, 2K + 1) its target positions. Without draft logits
// (tokens only) a request has no draft normalisers to compute.
template <typename TD, typename TT>
struct SoftmaxStatsPlan {
  const VerifyProblem& problem;
  const TD* draft_logits;
  const TT* target_logits;
  const float* inverse_temperature;         // [B], the draft rows'
  const float* target_inverse_temperature;  // [B]
  std::vector<SoftmaxStats> draft_stats, target_stats;
  std::vector<uint8_t> draft_vouched, target_vouched;  // whether each normaliser vouches for its row

  SoftmaxStatsPlan(const VerifyProblem& p, const TD* draft, const TT* target, const float* inverse,
                   const float* target_inverse)
      : problem(p), draft_logits(draft), target_logits(target), inverse_temperature(inverse),
        target_inverse_temperature(target_inverse),
        draft_stats(p.batch * p.num_positions, SoftmaxStats{0.0f, 0.0f}),
        target_stats(p.batch * (p.num_positions + 1), SoftmaxStats{0.0f, 0.0f}),
        draft_vouched(draft_stats.size(), 0), target_vouched(target_stats.size(), 0) {}

  int64_t slots() const { return 2 * problem.num_positions + 1; }
  bool is_draft(int64_t slot) const { return slot < problem.num_positions; }
  // The index of a slot among its tensor's [B, K] (draft) or [B, K+1] (target) positions, and whether the request
  // reads its row.
  int64_t position_index(int64_t row, int64_t slot) const {
    const int64_t K = problem.num_positions;
    return is_draft(slot) ? row * K + slot : row * (K + 1) + slot - K;
  }
  bool reads(int64_t row, int64_t slot) const {
    const int64_t K = problem.num_positions, drafted = problem.drafted(row);
    return is_draft(slot) ? slot < drafted : slot - K <= drafted;
  }
  // The normaliser of a slot's row, from the draft's or the target's tensor (each of its own element type).
  SoftmaxStats slot_stats(int64_t row, int64_t slot, bool* summed_every_block) const {
    const int64_t K = problem.num_positions;
    const float inverse = inverse_temperature_of_slot(row, slot);
    if (is_draft(slot))
      return softmax_stats(draft_logits + problem.draft_row(row, slot) * problem.vocab, problem.vocab, inverse,
                           summed_every_block);
    return softmax_stats(target_logits + problem.target_row(row, slot - K) * problem.vocab, problem.vocab, inverse,
                         summed_every_block);
  }
  float inverse_temperature_of_slot(int64_t row, int64_t slot) const {
    return (is_draft(slot) ? inverse_temperature : target_inverse_temperature)[row];
  }
  void compute(int64_t row, int64_t slot) {
    if ((is_draft(slot) && draft_logits == nullptr) || !reads(row, slot)) return;
    normalise(row, slot);
  }
  // The normalisers of the rows the accept tests read; the bonus row's too when `with_bonus` (a greedy row's argmax
  // of it is taken in the accept phase). A sampled row's bonus normaliser is computed only when the bonus is drawn:
  // after a rejection, which is the common case, its row is never read.
  void compute_row(int64_t row, bool with_bonus) {
    const int64_t bonus_slot = problem.num_positions + problem.drafted(row);
    for (int64_t slot = 0; slot < slots(); ++slot)
      if (slot != bonus_slot || with_bonus) compute(row, slot);
  }
  void compute_bonus(int64_t row) { normalise(row, problem.num_positions + problem.drafted(row)); }
  // The normaliser of a slot's row, stored with whether it vouches for the row (returned).
  bool normalise(int64_t row, int64_t slot) {
    bool summed_every_block = false;
    const SoftmaxStats stats = slot_stats(row, slot, &summed_every_block);
    const bool vouched = normaliser_vouches_for_row(stats, summed_every_block);
    const int64_t index = position_index(row, slot);
    (is_draft(slot) ? draft_stats : target_stats)[index] = stats;
    (is_draft(slot) ? draft_vouched : target_vouched)[index] = vouched;
    return vouched;
  }
  // Every request's normalisers, in parallel over (request, slot).
  void compute_all(const ParallelFor& parallel_for) {
    parallel_for(0, problem.batch * slots(), grain_for(problem.vocab), [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) compute(task / slots(), task % slots());
    });
  }
};

// Temperatures as the kernels use them: 1 / T of the draft rows and of the target rows (the target's own temperature
// when the call gives one), and greedy where T = 0 (NaN and negatives count as greedy too).
struct TemperaturePlan {
  std::vector<float> inverse, target_inverse;
  std::unique_ptr<bool[]> greedy;
};

inline TemperaturePlan plan_temperatures(const VerifyProblem& problem) {
  const int64_t batch = problem.batch;
  TemperaturePlan plan;
  plan.inverse.resize(batch);
  plan.target_inverse.resize(batch);
  plan.greedy.reset(new bool[batch]);
  for (int64_t row = 0; row < batch; ++row) {
    const float temperature = problem.temperature_at(row);
    plan.greedy[row] = is_greedy_temperature(temperature);
    plan.inverse[row] = inverse_temperature_of(temperature);
    plan.target_inverse[row] = inverse_temperature_of(problem.target_temperature_at(row));
  }
  return plan;
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
