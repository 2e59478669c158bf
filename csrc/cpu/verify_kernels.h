// Fused DIVERSED verification on the CPU, from probabilities or from logits: torch-free kernels over a VerifyProblem
// (csrc/common/problems.h), compiled once per instruction set (see cpu_kernels.h).
//
// Three phases, whichever the input:
//   1. per row (parallel over rows): accept tests on gathered values; greedy rows scan nu for its argmax;
//   2. per (row, vocabulary chunk) (parallel, so a single request still uses every core): residual or bonus mass;
//   3. per row: inverse-CDF sample inside the one chunk, and the one block, that holds the threshold.
// No [B, K, V] temporary; extra memory is O(B) plus a bounded number of chunk sums per row. Logits are never turned
// into probabilities: each row the request reads gets its softmax normaliser (max and 1 / sum exp) in a first pass,
// and every later pass recomputes softmax(v) on the fly.
#pragma once

#include "kernel_prelude.h"
#include "row_ops.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

constexpr int64_t kChunkElements = 8192;  // vocabulary elements per parallel task of phase 2
constexpr int64_t kMaxChunks = 32;        // bounds per-row scratch whatever V is

// What the accept phase decides for one row.
struct RowPlan {
  int64_t num_accepted;   // m, also the position of the final token
  bool use_residual;      // sample max(0, p_m - q_m) rather than p_m
  bool needs_sample;      // sampled row (greedy rows are finished in the accept phase)
};

// Accept tests of one row; greedy rows also get their final token here. `Rows` provides draft(row, i) and
// target(row, i) returning Row policies.
template <typename Rows>
RowPlan accept_row(const VerifyProblem& problem, const Rows& rows, int64_t row) {
  const int64_t K = problem.num_positions;
  const int64_t drafted = problem.drafted(row);
  const bool is_greedy = problem.greedy_at(row);
  int64_t num_accepted = drafted;
  int64_t rejected_argmax = 0;
  for (int64_t i = 0; i < drafted; ++i) {
    const int64_t token = problem.draft_tokens[row * K + i];
    const bool valid = token >= 0 && token < problem.vocab;
    const float w = problem.weight_at(row, i);
    const auto target = rows.target(row, i);
    const auto draft = rows.draft(row, i);
    bool accepted = false;
    float probability = 0.0f;
    if (is_greedy) {
      const int64_t best = argmax_mixture(target, &draft, w, problem.vocab);
      accepted = valid && token == best;
      probability = accepted ? 1.0f : 0.0f;
      if (!accepted && num_accepted == drafted) rejected_argmax = best;
    } else if (valid) {
      const float q = draft.mass(token);
      const float nu = mix_mass(w, target.mass(token), q);
      probability = accept_probability(nu, q);
      accepted = accept_draft(problem.uniform(row, i), q, nu);
    }
    problem.out_accept_prob[row * K + i] = probability;
    if (!accepted && num_accepted == drafted) num_accepted = i;
  }
  for (int64_t i = drafted; i < K; ++i) problem.out_accept_prob[row * K + i] = 0.0f;

  int64_t* row_tokens = problem.out_tokens + row * (K + 1);
  for (int64_t i = 0; i < num_accepted; ++i) row_tokens[i] = problem.draft_tokens[row * K + i];
  for (int64_t i = num_accepted; i <= K; ++i) row_tokens[i] = -1;
  problem.out_num_accepted[row] = static_cast<int32_t>(num_accepted);

  const bool rejected = num_accepted < drafted;
  if (is_greedy) {
    const auto bonus_row = rows.target(row, drafted);
    row_tokens[num_accepted] =
        rejected ? rejected_argmax : argmax_mixture(bonus_row, static_cast<decltype(&bonus_row)>(nullptr), 1.0f,
                                                    problem.vocab);
  }
  return RowPlan{num_accepted, rejected && problem.weight_at(row, num_accepted) > 0.0f, !is_greedy};
}

// The draft row at the first rejection, built only when its residual is sampled (with K = 0 there is no draft row,
// and the logits policy would otherwise read a normaliser that does not exist).
template <typename Rows>
auto residual_draft_row(const Rows& rows, const RowPlan& plan, int64_t row)
    -> std::optional<decltype(rows.draft(row, 0))> {
  if (!plan.use_residual) return std::nullopt;
  return rows.draft(row, plan.num_accepted);
}

// The three phases of fused verification.
template <typename Rows>
void run_verify(const VerifyProblem& problem, const Rows& rows, const ParallelFor& parallel_for) {
  const int64_t B = problem.batch, V = problem.vocab;
  std::vector<RowPlan> plans(B);
  parallel_for(0, B, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) plans[row] = accept_row(problem, rows, row);
  });

  const int64_t num_chunks = std::min(kMaxChunks, std::max<int64_t>(1, (V + kChunkElements - 1) / kChunkElements));
  const int64_t chunk_size = (V + num_chunks - 1) / num_chunks;
  std::vector<double> chunk_sums(B * num_chunks, 0.0);
  parallel_for(0, B * num_chunks, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const RowPlan& plan = plans[task / num_chunks];
      if (!plan.needs_sample) continue;
      const int64_t row = task / num_chunks;
      const int64_t chunk_begin = (task % num_chunks) * chunk_size;
      const int64_t chunk_end = std::min(V, chunk_begin + chunk_size);
      if (chunk_begin >= chunk_end) continue;
      const auto target = rows.target(row, plan.num_accepted);
      const auto draft = residual_draft_row(rows, plan, row);
      chunk_sums[task] = residual_or_target_mass(target, draft ? &*draft : nullptr, chunk_begin, chunk_end);
    }
  });

  parallel_for(0, B, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const RowPlan& plan = plans[row];
      if (!plan.needs_sample) continue;
      double* sums = chunk_sums.data() + row * num_chunks;
      const auto target = rows.target(row, plan.num_accepted);
      const auto draft_storage = residual_draft_row(rows, plan, row);
      const auto* draft = draft_storage ? &*draft_storage : nullptr;
      double total = 0.0;
      for (int64_t c = 0; c < num_chunks; ++c) total += sums[c];
      if (!(total > 0.0) && draft) {
        // Zero residual: the target puts no more mass anywhere than the draft does, so sample p itself.
        draft = nullptr;
        total = 0.0;
        for (int64_t c = 0; c < num_chunks; ++c) {
          const int64_t chunk_begin = c * chunk_size;
          sums[c] = chunk_begin < V ? residual_or_target_mass(target, draft, chunk_begin,
                                                              std::min(V, chunk_begin + chunk_size))
                                    : 0.0;
          total += sums[c];
        }
      }
      int64_t chosen = 0;  // a target row without mass has no valid sample; 0 keeps the id in range
      if (total > 0.0) {
        const double threshold = problem.uniform(row, problem.num_positions) * total;
        double prefix = 0.0;
        int64_t last_nonempty = -1;
        chosen = -1;
        for (int64_t c = 0; c < num_chunks && chosen < 0; ++c) {
          if (!(sums[c] > 0.0)) continue;
          last_nonempty = c;
          const int64_t chunk_begin = c * chunk_size;
          if (prefix + sums[c] > threshold)
            chosen = inverse_cdf_in_range(target, draft, chunk_begin, std::min(V, chunk_begin + chunk_size), prefix,
                                          threshold);
          prefix += sums[c];
        }
        if (chosen < 0) {  // rounding put the threshold past the last chunk: its last positive entry
          const int64_t chunk_begin = last_nonempty * chunk_size;
          chosen = inverse_cdf_in_range(target, draft, chunk_begin, std::min(V, chunk_begin + chunk_size), 0.0,
                                        INFINITY);
        }
      }
      problem.out_tokens[row * (problem.num_positions + 1) + plan.num_accepted] = chosen;
    }
  });
}

// ------------------------------------------------------------------------------------------ rows of the two paths
// Rows of draft probabilities [B, K, V] and target probabilities [B, K+1, V].
template <typename T>
struct ProbRows {
  const T* draft_probs;
  const T* target_probs;
  int64_t num_positions, vocab;

  ProbRow<T> draft(int64_t row, int64_t position) const {
    return {draft_probs + (row * num_positions + position) * vocab};
  }
  ProbRow<T> target(int64_t row, int64_t position) const {
    return {target_probs + (row * (num_positions + 1) + position) * vocab};
  }
};

// Rows of draft logits [B, K, V] and target logits [B, Kt, V] with their normalisers.
template <typename T>
struct LogitRows {
  const T* draft_logits;
  const T* target_logits;
  int64_t draft_positions, target_positions, vocab;
  const float* inverse_temperature;  // [B]
  const SoftmaxStats* draft_stats;   // [B * draft_positions]
  const SoftmaxStats* target_stats;  // [B * target_positions]

  LogitRow<T> draft(int64_t row, int64_t position) const {
    const int64_t index = row * draft_positions + position;
    return {draft_logits + index * vocab, inverse_temperature[row], draft_stats[index]};
  }
  LogitRow<T> target(int64_t row, int64_t position) const {
    const int64_t index = row * target_positions + position;
    return {target_logits + index * vocab, inverse_temperature[row], target_stats[index]};
  }
};

// Normalisers of the rows the caller needs (row_needed(row, position, is_target)), in parallel over rows.
template <typename T, typename Needed>
void compute_softmax_stats(const T* draft_logits, const T* target_logits, int64_t batch,
                           int64_t draft_positions, int64_t target_positions, int64_t vocab,
                           const float* inverse_temperature, std::vector<SoftmaxStats>& draft_stats,
                           std::vector<SoftmaxStats>& target_stats, Needed row_needed,
                           const ParallelFor& parallel_for) {
  const int64_t rows_per_batch = draft_positions + target_positions;
  draft_stats.assign(batch * draft_positions, SoftmaxStats{0.0f, 0.0f});
  target_stats.assign(batch * target_positions, SoftmaxStats{0.0f, 0.0f});
  parallel_for(0, batch * rows_per_batch, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / rows_per_batch;
      const int64_t slot = task % rows_per_batch;
      const bool is_target = slot >= draft_positions;
      const int64_t position = is_target ? slot - draft_positions : slot;
      if (!row_needed(row, position, is_target)) continue;
      if (is_target) {
        const int64_t index = row * target_positions + position;
        target_stats[index] = softmax_stats(target_logits + index * vocab, vocab, inverse_temperature[row]);
      } else {
        const int64_t index = row * draft_positions + position;
        draft_stats[index] = softmax_stats(draft_logits + index * vocab, vocab, inverse_temperature[row]);
      }
    }
  });
}

// Temperatures as the kernels use them: 1 / T, and greedy where T = 0 (NaN and negatives count as greedy too).
struct TemperaturePlan {
  std::vector<float> inverse;
  std::unique_ptr<bool[]> greedy;
};

inline TemperaturePlan plan_temperatures(const VerifyProblem& problem) {
  const int64_t batch = problem.batch;
  TemperaturePlan plan;
  plan.inverse.resize(batch);
  plan.greedy.reset(new bool[batch]);
  for (int64_t row = 0; row < batch; ++row) {
    const float temperature = problem.temperature_at(row);
    plan.greedy[row] = is_greedy_temperature(temperature);
    plan.inverse[row] = inverse_temperature_of(temperature);
  }
  return plan;
}

// ------------------------------------------------------------------------------------------ entry points
// Called by the binding (ops_cpu.cpp, through cpu_dispatch.h) after the checks and the allocation of the outputs.

// verify_probs: draft probabilities [B, K, V], target probabilities [B, K+1, V]; problem.greedy is set.
template <typename T>
void verify_probs(const VerifyProblem& problem, const T* draft_probs, const T* target_probs,
                  const ParallelFor& parallel_for) {
  const ProbRows<T> rows{draft_probs, target_probs, problem.num_positions, problem.vocab};
  run_verify(problem, rows, parallel_for);
}

// verify_logits: draft logits [B, K, V], target logits [B, K+1, V], temperatures from the problem. Each row the request
// reads gets its softmax normaliser first; the greedy flags come from the temperatures.
template <typename T>
void verify_logits(const VerifyProblem& problem, const T* draft_logits, const T* target_logits,
                   const ParallelFor& parallel_for) {
  const int64_t B = problem.batch, K = problem.num_positions, V = problem.vocab;
  const TemperaturePlan temperatures = plan_temperatures(problem);
  std::vector<SoftmaxStats> draft_stats, target_stats;
  compute_softmax_stats(draft_logits, target_logits, B, K, K + 1, V, temperatures.inverse.data(), draft_stats,
                        target_stats,
                        [&](int64_t row, int64_t position, bool is_target) {
                          return is_target ? position <= problem.drafted(row) : position < problem.drafted(row);
                        },
                        parallel_for);
  const LogitRows<T> rows{draft_logits, target_logits, K, K + 1, V, temperatures.inverse.data(), draft_stats.data(),
                          target_stats.data()};
  VerifyProblem with_greedy = problem;
  with_greedy.greedy = temperatures.greedy.get();
  run_verify(with_greedy, rows, parallel_for);
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
