// Generic CPU building blocks of the fused ops, written once over "row" policies:
//   ProbRow<scalar_t>   a row of probabilities (mass = the sanitised value);
//   LogitRow<scalar_t>  a row of logits with its softmax normaliser (mass = softmax probability, computed on the fly).
// Each policy exposes `float mass(int64_t v)`; the loops below read a row once per pass, never store a [V] temporary,
// and keep 8 independent accumulators so gcc vectorises them.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "../verify_math.h"

namespace diversed {
namespace cpu {

constexpr int kLanes = 8;                 // independent accumulators per reduction
constexpr int64_t kChunkElements = 8192;  // vocabulary elements per parallel task
constexpr int64_t kMaxChunks = 32;        // bounds per-row scratch whatever V is
constexpr int64_t kScanBlock = 256;       // the inverse CDF skips whole blocks before scanning element-wise

template <typename scalar_t>
struct ProbRow {
  const scalar_t* values;
  float mass(int64_t v) const { return sanitize_mass(static_cast<float>(values[v])); }
};

template <typename scalar_t>
struct LogitRow {
  const scalar_t* values;
  float inverse_temperature;
  SoftmaxStats stats;
  float mass(int64_t v) const { return softmax_mass(static_cast<float>(values[v]), inverse_temperature, stats); }
};

// Softmax normaliser of logits[0, vocab) scaled by inverse_temperature: a max pass, then a sum-exp pass (the row is
// in cache by then).
template <typename scalar_t>
SoftmaxStats softmax_stats(const scalar_t* logits, int64_t vocab, float inverse_temperature) {
  float lane_max[kLanes];
  for (int l = 0; l < kLanes; ++l) lane_max[l] = -INFINITY;
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float s = static_cast<float>(logits[v + l]) * inverse_temperature;
      lane_max[l] = s > lane_max[l] ? s : lane_max[l];
    }
  for (; v < vocab; ++v) {
    const float s = static_cast<float>(logits[v]) * inverse_temperature;
    lane_max[0] = s > lane_max[0] ? s : lane_max[0];
  }
  float row_max = lane_max[0];
  for (int l = 1; l < kLanes; ++l) row_max = lane_max[l] > row_max ? lane_max[l] : row_max;

  double lane_sum[kLanes] = {0.0};
  v = 0;
  for (; v + kLanes <= vocab; v += kLanes)
    for (int l = 0; l < kLanes; ++l)
      lane_sum[l] += static_cast<double>(exp_nonpositive(static_cast<float>(logits[v + l]) * inverse_temperature - row_max));
  for (; v < vocab; ++v)
    lane_sum[0] += static_cast<double>(exp_nonpositive(static_cast<float>(logits[v]) * inverse_temperature - row_max));
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lane_sum[l];
  return SoftmaxStats{row_max, static_cast<float>(1.0 / total)};
}

// Sum over [begin, end) of max(0, p - q) (residual) or of p alone (draft == nullptr).
template <typename Row>
double residual_or_target_mass(const Row& target, const Row* draft, int64_t begin, int64_t end) {
  double lanes[kLanes] = {0.0};
  int64_t v = begin;
  if (draft) {
    for (; v + kLanes <= end; v += kLanes)
      for (int l = 0; l < kLanes; ++l)
        lanes[l] += static_cast<double>(residual_mass(target.mass(v + l), draft->mass(v + l)));
    for (; v < end; ++v) lanes[0] += static_cast<double>(residual_mass(target.mass(v), draft->mass(v)));
  } else {
    for (; v + kLanes <= end; v += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(target.mass(v + l));
    for (; v < end; ++v) lanes[0] += static_cast<double>(target.mass(v));
  }
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

template <typename Row>
float sample_mass(const Row& target, const Row* draft, int64_t v) {
  const float p = target.mass(v);
  return draft ? residual_mass(p, draft->mass(v)) : p;
}

// Inverse CDF inside [begin, end) from `prefix`: the first index whose running sum exceeds `threshold`. Whole blocks
// are skipped with a vectorised sum; only the block holding the threshold is scanned element by element. Falls back to
// the last index with positive mass (block sums and the running sum may round differently), so the result has
// positive mass whenever the range has any; -1 when it has none.
template <typename Row>
int64_t inverse_cdf_in_range(const Row& target, const Row* draft, int64_t begin, int64_t end, double prefix,
                             double threshold) {
  double running = prefix;
  int64_t last_positive = -1;
  int64_t last_nonempty_block = -1;
  for (int64_t block = begin; block < end; block += kScanBlock) {
    const int64_t block_end = std::min(end, block + kScanBlock);
    const double block_total = residual_or_target_mass(target, draft, block, block_end);
    if (!(block_total > 0.0)) continue;
    last_nonempty_block = block;
    if (running + block_total <= threshold) {
      running += block_total;
      continue;
    }
    for (int64_t v = block; v < block_end; ++v) {
      const float mass = sample_mass(target, draft, v);
      if (mass > 0.0f) {
        running += static_cast<double>(mass);
        last_positive = v;
        if (running > threshold) return v;
      }
    }
  }
  if (last_positive < 0 && last_nonempty_block >= 0) {
    const int64_t block_end = std::min(end, last_nonempty_block + kScanBlock);
    for (int64_t v = last_nonempty_block; v < block_end; ++v)
      if (sample_mass(target, draft, v) > 0.0f) last_positive = v;
  }
  return last_positive;
}

// argmax of nu = w p + (1 - w) q (or of p when draft == nullptr); ties to the lowest id.
template <typename Row>
int64_t argmax_mixture(const Row& target, const Row* draft, float weight, int64_t vocab) {
  float best_value = -1.0f;
  int64_t best_index = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    const float p = target.mass(v);
    const float nu = draft ? mix_mass(weight, p, draft->mass(v)) : p;
    if (better_candidate(nu, v, best_value, best_index)) {
      best_value = nu;
      best_index = v;
    }
  }
  return best_index;
}

// What the accept phase decides for one row.
struct RowPlan {
  int64_t num_accepted;   // m, also the position of the final token
  bool use_residual;      // sample max(0, p_m - q_m) rather than p_m
  bool needs_sample;      // sampled row (greedy rows are finished in the accept phase)
};

// Everything a verify kernel needs besides the rows themselves.
struct VerifyProblem {
  int64_t batch, num_positions, vocab;
  const int64_t* draft_tokens;  // [B, K]
  const float* weight;          // [B, K]
  const int64_t* num_draft;     // [B]
  const bool* greedy;           // [B]
  const double* uniforms;       // [B, K+1] or nullptr (then Philox)
  const int64_t* seeds;         // [B]
  int64_t offset;
  bool per_row_seed;
  int64_t* out_tokens;          // [B, K+1]
  int32_t* out_num_accepted;    // [B]
  float* out_accept_prob;       // [B, K]

  double uniform(int64_t row, int64_t position) const {
    if (uniforms) return sanitize_uniform(uniforms[row * (num_positions + 1) + position]);
    return philox_uniform(seeds[row], offset, per_row_seed ? 0 : row, position);
  }
  int64_t drafted(int64_t row) const { return std::min(std::max<int64_t>(num_draft[row], 0), num_positions); }
  float weight_at(int64_t row, int64_t position) const {
    return sanitize_weight(weight[row * num_positions + position]);
  }
};

// Accept tests of one row; greedy rows also get their final token here. `Rows` provides draft(row, i) and
// target(row, i) returning Row policies.
template <typename Rows>
RowPlan accept_row(const VerifyProblem& problem, const Rows& rows, int64_t row) {
  const int64_t K = problem.num_positions;
  const int64_t drafted = problem.drafted(row);
  const bool is_greedy = problem.greedy[row];
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

// The three phases of fused verification (see csrc/cpu/verify_cpu.cpp for the probability entry point).
template <typename Rows>
void run_verify(const VerifyProblem& problem, const Rows& rows) {
  const int64_t B = problem.batch, V = problem.vocab;
  std::vector<RowPlan> plans(B);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) plans[row] = accept_row(problem, rows, row);
  });

  const int64_t num_chunks = std::min(kMaxChunks, std::max<int64_t>(1, (V + kChunkElements - 1) / kChunkElements));
  const int64_t chunk_size = (V + num_chunks - 1) / num_chunks;
  std::vector<double> chunk_sums(B * num_chunks, 0.0);
  at::parallel_for(0, B * num_chunks, 1, [&](int64_t begin, int64_t end) {
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

  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
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

}  // namespace cpu
}  // namespace diversed
