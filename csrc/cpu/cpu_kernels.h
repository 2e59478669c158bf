// The CPU kernels, written once and compiled once per instruction set (kernels_baseline.cpp, kernels_avx2.cpp) inside
// the namespace diversed::cpu::DIVERSED_CPU_CAPABILITY; cpu_dispatch.h picks one at run time. Both builds perform the
// same operations in the same order (no FMA, fixed accumulator lanes), so their results are bitwise identical.
//
// Building blocks are written over "row" policies:
//   ProbRow<scalar_t>   a row of probabilities (mass = the sanitised value);
//   LogitRow<scalar_t>  a row of logits with its softmax normaliser (mass = softmax probability, computed on the fly).
// Each policy exposes `float mass(int64_t v)`; the loops below read a row once per pass, never store a [V] temporary,
// and keep 8 independent accumulators so gcc vectorises them.
#ifndef DIVERSED_CPU_CAPABILITY
#error "define DIVERSED_CPU_CAPABILITY before including cpu_kernels.h (see kernels_baseline.cpp)"
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "../common/verify_math.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

constexpr int kLanes = 8;                 // independent accumulators per reduction
constexpr int64_t kChunkElements = 8192;  // vocabulary elements per parallel task
constexpr int64_t kMaxChunks = 32;        // bounds per-row scratch whatever V is
constexpr int64_t kScanBlock = 256;       // the inverse CDF skips whole blocks before scanning element-wise

// Element loads as float32. bfloat16 is the top half of a float32, so a shift converts it exactly; written on the raw
// bits because c10::BFloat16's conversion operator keeps gcc from vectorising the vocabulary loops.
template <typename scalar_t>
inline float load_float(const scalar_t* values, int64_t v) {
  return static_cast<float>(values[v]);
}
template <>
inline float load_float<c10::BFloat16>(const c10::BFloat16* values, int64_t v) {
  return float_from_bits(static_cast<int32_t>(static_cast<uint32_t>(values[v].x) << 16));
}

template <typename scalar_t>
struct ProbRow {
  const scalar_t* values;
  float mass(int64_t v) const { return sanitize_mass(load_float(values, v)); }
};

template <typename scalar_t>
struct LogitRow {
  const scalar_t* values;
  float inverse_temperature;
  SoftmaxStats stats;
  float mass(int64_t v) const { return softmax_mass(load_float(values, v), inverse_temperature, stats); }
};

constexpr int kSoftmaxLanes = 16;         // float lanes of the sum-exp pass: two AVX2 registers
constexpr int64_t kSoftmaxBlock = 512;    // the online softmax works block by block: 2 KiB of float32, in L1

// kLanes floats (doubles) as one GCC vector. Element-wise arithmetic and `a > b ? a : b` on them are exact IEEE
// operations, so both builds still agree bit for bit; but gcc emits vector max/compare/convert instructions for them,
// which it will not do for the scalar forms of a max or a float-to-double sum without -ffast-math.
typedef float FloatLanes __attribute__((vector_size(kLanes * sizeof(float))));
typedef double DoubleLanes __attribute__((vector_size(kLanes * sizeof(double))));

template <typename scalar_t>
inline FloatLanes load_lanes(const scalar_t* values, int64_t v) {
  FloatLanes lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = load_float(values, v + l);
  return lanes;
}

template <typename Row>
inline FloatLanes mass_lanes(const Row& row, int64_t v) {
  FloatLanes lanes;
  for (int l = 0; l < kLanes; ++l) lanes[l] = row.mass(v + l);
  return lanes;
}

inline double sum_lanes(DoubleLanes lanes) {
  double total = 0.0;
  for (int l = 0; l < kLanes; ++l) total += lanes[l];
  return total;
}

// Max of the scaled logits in [begin, end) (NaN compares false and is skipped).
template <typename scalar_t>
float scaled_max(const scalar_t* logits, int64_t begin, int64_t end, float inverse_temperature) {
  FloatLanes lane_max;
  for (int l = 0; l < kLanes; ++l) lane_max[l] = -INFINITY;
  int64_t v = begin;
  for (; v + kLanes <= end; v += kLanes) {
    const FloatLanes scaled = load_lanes(logits, v) * inverse_temperature;
    lane_max = scaled > lane_max ? scaled : lane_max;
  }
  float row_max = lane_max[0];
  for (int l = 1; l < kLanes; ++l) row_max = lane_max[l] > row_max ? lane_max[l] : row_max;
  for (; v < end; ++v) {
    const float scaled = load_float(logits, v) * inverse_temperature;
    row_max = scaled > row_max ? scaled : row_max;
  }
  return row_max;
}

// Softmax normaliser of logits[0, vocab) scaled by inverse_temperature, in ONE pass over memory (online softmax): each
// block's max is taken while the block sits in L1, the sum so far is rescaled when the running max grows, and the
// block's exp(s - max) are added. Partial sums are float (as torch's softmax), flushed to float64 every block.
template <typename scalar_t>
SoftmaxStats softmax_stats(const scalar_t* logits, int64_t vocab, float inverse_temperature) {
  float running_max = -INFINITY;
  double total = 0.0;
  for (int64_t block = 0; block < vocab; block += kSoftmaxBlock) {
    const int64_t block_end = std::min(vocab, block + kSoftmaxBlock);
    const float block_max = scaled_max(logits, block, block_end, inverse_temperature);
    if (block_max > running_max) {
      total = rescale_exp_sum(total, running_max, block_max);
      running_max = block_max;
    }
    if (!(running_max > -INFINITY)) continue;  // no finite logit so far: nothing to add
    float lanes[kSoftmaxLanes] = {0.0f};
    int64_t v = block;
    for (; v + kSoftmaxLanes <= block_end; v += kSoftmaxLanes)
      for (int l = 0; l < kSoftmaxLanes; ++l)
        lanes[l] += exp_nonpositive(load_float(logits, v + l) * inverse_temperature - running_max);
    for (; v < block_end; ++v) lanes[0] += exp_nonpositive(load_float(logits, v) * inverse_temperature - running_max);
    for (int l = 0; l < kSoftmaxLanes; ++l) total += static_cast<double>(lanes[l]);
  }
  // No finite logit (all -inf or NaN): every mass is 0.
  if (!(running_max > -INFINITY)) return SoftmaxStats{-INFINITY, 0.0f};
  return SoftmaxStats{running_max, static_cast<float>(1.0 / total)};
}

// Sum over [begin, end) of max(0, p - q) (residual) or of p alone (draft == nullptr).
template <typename Row>
double residual_or_target_mass(const Row& target, const Row* draft, int64_t begin, int64_t end) {
  DoubleLanes lanes = {};
  const FloatLanes zero = {};
  int64_t v = begin;
  if (draft) {
    for (; v + kLanes <= end; v += kLanes) {
      const FloatLanes difference = mass_lanes(target, v) - mass_lanes(*draft, v);
      lanes += __builtin_convertvector(difference > zero ? difference : zero, DoubleLanes);  // residual_mass
    }
    for (; v < end; ++v) lanes[0] += static_cast<double>(residual_mass(target.mass(v), draft->mass(v)));
  } else {
    for (; v + kLanes <= end; v += kLanes) lanes += __builtin_convertvector(mass_lanes(target, v), DoubleLanes);
    for (; v < end; ++v) lanes[0] += static_cast<double>(target.mass(v));
  }
  return sum_lanes(lanes);
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

// VerifyProblem (csrc/common/verify_math.h): everything a verify kernel needs besides the rows themselves.


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

// ------------------------------------------------------------------------------------------ op launchers
// Called by the op wrappers (verify_cpu.cpp, logits_cpu.cpp) after validation and allocation; see cpu_dispatch.h.

// Rows of draft probabilities [B, K, V] and target probabilities [B, K+1, V].
template <typename scalar_t>
struct ProbRows {
  const scalar_t* draft_probs;
  const scalar_t* target_probs;
  int64_t num_positions, vocab;

  ProbRow<scalar_t> draft(int64_t row, int64_t position) const {
    return {draft_probs + (row * num_positions + position) * vocab};
  }
  ProbRow<scalar_t> target(int64_t row, int64_t position) const {
    return {target_probs + (row * (num_positions + 1) + position) * vocab};
  }
};

// Rows of draft logits [B, K, V] and target logits [B, Kt, V] with their normalisers.
template <typename scalar_t>
struct LogitRows {
  const scalar_t* draft_logits;
  const scalar_t* target_logits;
  int64_t draft_positions, target_positions, vocab;
  const float* inverse_temperature;  // [B]
  const SoftmaxStats* draft_stats;   // [B * draft_positions]
  const SoftmaxStats* target_stats;  // [B * target_positions]

  LogitRow<scalar_t> draft(int64_t row, int64_t position) const {
    const int64_t index = row * draft_positions + position;
    return {draft_logits + index * vocab, inverse_temperature[row], draft_stats[index]};
  }
  LogitRow<scalar_t> target(int64_t row, int64_t position) const {
    const int64_t index = row * target_positions + position;
    return {target_logits + index * vocab, inverse_temperature[row], target_stats[index]};
  }
};

// Normalisers of the rows the caller needs (row_needed(row, position, is_target)), in parallel over rows.
template <typename scalar_t, typename Needed>
void compute_softmax_stats(const scalar_t* draft_logits, const scalar_t* target_logits, int64_t batch,
                           int64_t draft_positions, int64_t target_positions, int64_t vocab,
                           const float* inverse_temperature, std::vector<SoftmaxStats>& draft_stats,
                           std::vector<SoftmaxStats>& target_stats, Needed row_needed) {
  const int64_t rows_per_batch = draft_positions + target_positions;
  draft_stats.assign(batch * draft_positions, SoftmaxStats{0.0f, 0.0f});
  target_stats.assign(batch * target_positions, SoftmaxStats{0.0f, 0.0f});
  at::parallel_for(0, batch * rows_per_batch, 1, [&](int64_t begin, int64_t end) {
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

TemperaturePlan plan_temperatures(const at::Tensor& temperature, int64_t batch) {
  TemperaturePlan plan;
  plan.inverse.resize(batch);
  plan.greedy.reset(new bool[batch]);
  const float* values = temperature.data_ptr<float>();
  for (int64_t row = 0; row < batch; ++row) {
    plan.greedy[row] = !(values[row] > 0.0f);
    plan.inverse[row] = inverse_temperature_of(values[row]);
  }
  return plan;
}

// Per position: p(y), q(y), TV(p, q) = 0.5 sum |p - q|, log p(y), log q(y).
template <typename Row>
void token_stats_row(const Row& target, const Row& draft, int64_t vocab, int64_t token, float* target_prob,
                     float* draft_prob, float* total_variation) {
  DoubleLanes lanes = {};
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes) {
    const FloatLanes difference = mass_lanes(target, v) - mass_lanes(draft, v);
    lanes += __builtin_convertvector(difference > 0.0f ? difference : -difference, DoubleLanes);  // |p - q|
  }
  for (; v < vocab; ++v) lanes[0] += static_cast<double>(std::fabs(target.mass(v) - draft.mass(v)));
  *total_variation = static_cast<float>(0.5 * sum_lanes(lanes));
  const bool valid = token >= 0 && token < vocab;
  *target_prob = valid ? target.mass(token) : 0.0f;
  *draft_prob = valid ? draft.mass(token) : 0.0f;
}

// log softmax(y) = s_y - max - log(sum); exact for tiny probabilities whose mass underflows to 0.
template <typename scalar_t>
float log_softmax_at(const LogitRow<scalar_t>& row, int64_t token) {
  const float scaled = load_float(row.values, token) * row.inverse_temperature;
  const double value = static_cast<double>(scaled) - row.stats.max + std::log(static_cast<double>(row.stats.inverse_sum));
  return value == value ? static_cast<float>(value) : -INFINITY;
}

template <typename Row>
void mix_row(const Row& target, const Row& draft, float weight, int64_t vocab, float* __restrict__ out) {
  for (int64_t v = 0; v < vocab; ++v) out[v] = mix_mass(weight, target.mass(v), draft.mass(v));
}

void verify_probs(const at::Tensor& draft_tokens, const at::Tensor& draft_probs, const at::Tensor& target_probs,
                  const at::Tensor& weight, const at::Tensor& num_draft, const at::Tensor& greedy,
                  const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset,
                  bool per_row_seed, at::Tensor& tokens, at::Tensor& num_accepted, at::Tensor& accept_prob) {
  const int64_t B = draft_probs.size(0), K = draft_probs.size(1), V = draft_probs.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_probs.scalar_type(), "verify_probs_cpu", [&] {
    ProbRows<scalar_t> rows{draft_probs.data_ptr<scalar_t>(), target_probs.data_ptr<scalar_t>(), K, V};
    VerifyProblem problem{B, K, V, draft_tokens.data_ptr<int64_t>(), weight.data_ptr<float>(),
                          num_draft.data_ptr<int64_t>(), greedy.data_ptr<bool>(),
                          uniforms.has_value() ? uniforms->data_ptr<double>() : nullptr, seeds.data_ptr<int64_t>(),
                          offset, per_row_seed, tokens.data_ptr<int64_t>(), num_accepted.data_ptr<int32_t>(),
                          accept_prob.data_ptr<float>()};
    run_verify(problem, rows);
  });
}

void verify_logits(const at::Tensor& draft_tokens, const at::Tensor& draft_logits, const at::Tensor& target_logits,
                   const at::Tensor& weight, const at::Tensor& num_draft, const at::Tensor& temperature,
                   const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset,
                   bool per_row_seed, at::Tensor& tokens, at::Tensor& num_accepted, at::Tensor& accept_prob) {
  const int64_t B = draft_logits.size(0), K = draft_logits.size(1), V = draft_logits.size(2);
  TemperaturePlan temperatures = plan_temperatures(temperature, B);
  const int64_t* num_draft_ptr = num_draft.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_logits.scalar_type(), "verify_logits_cpu", [&] {
    std::vector<SoftmaxStats> draft_stats, target_stats;
    auto drafted = [&](int64_t row) { return std::min(std::max<int64_t>(num_draft_ptr[row], 0), K); };
    compute_softmax_stats(draft_logits.data_ptr<scalar_t>(), target_logits.data_ptr<scalar_t>(), B, K, K + 1, V,
                          temperatures.inverse.data(), draft_stats, target_stats,
                          [&](int64_t row, int64_t position, bool is_target) {
                            return is_target ? position <= drafted(row) : position < drafted(row);
                          });
    LogitRows<scalar_t> rows{draft_logits.data_ptr<scalar_t>(), target_logits.data_ptr<scalar_t>(), K, K + 1, V,
                             temperatures.inverse.data(), draft_stats.data(), target_stats.data()};
    VerifyProblem problem{B, K, V, draft_tokens.data_ptr<int64_t>(), weight.data_ptr<float>(), num_draft_ptr,
                          temperatures.greedy.get(), uniforms.has_value() ? uniforms->data_ptr<double>() : nullptr,
                          seeds.data_ptr<int64_t>(), offset, per_row_seed, tokens.data_ptr<int64_t>(),
                          num_accepted.data_ptr<int32_t>(), accept_prob.data_ptr<float>()};
    run_verify(problem, rows);
  });
}

void token_stats(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens,
                 const at::Tensor& temperature, bool from_logits, at::Tensor& target_prob, at::Tensor& draft_prob,
                 at::Tensor& total_variation, at::Tensor& target_logprob, at::Tensor& draft_logprob) {
  const int64_t B = draft.size(0), T = draft.size(1), V = draft.size(2);
  TemperaturePlan temperatures = plan_temperatures(temperature, B);
  const int64_t* token_ptr = tokens.data_ptr<int64_t>();
  float *p_out = target_prob.data_ptr<float>(), *q_out = draft_prob.data_ptr<float>();
  float *tv_out = total_variation.data_ptr<float>();
  float *logp_out = target_logprob.data_ptr<float>(), *logq_out = draft_logprob.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "token_stats_cpu", [&] {
    const scalar_t* draft_ptr = draft.data_ptr<scalar_t>();
    const scalar_t* target_ptr = target.data_ptr<scalar_t>();
    at::parallel_for(0, B * T, 1, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        const int64_t row = index / T, token = token_ptr[index];
        const bool valid = token >= 0 && token < V;
        if (from_logits) {
          const float inverse_t = temperatures.inverse[row];
          LogitRow<scalar_t> p_row{target_ptr + index * V, inverse_t, softmax_stats(target_ptr + index * V, V, inverse_t)};
          LogitRow<scalar_t> q_row{draft_ptr + index * V, inverse_t, softmax_stats(draft_ptr + index * V, V, inverse_t)};
          token_stats_row(p_row, q_row, V, token, p_out + index, q_out + index, tv_out + index);
          logp_out[index] = valid ? log_softmax_at(p_row, token) : -INFINITY;
          logq_out[index] = valid ? log_softmax_at(q_row, token) : -INFINITY;
        } else {
          ProbRow<scalar_t> p_row{target_ptr + index * V}, q_row{draft_ptr + index * V};
          token_stats_row(p_row, q_row, V, token, p_out + index, q_out + index, tv_out + index);
          logp_out[index] = std::log(p_out[index]);
          logq_out[index] = std::log(q_out[index]);
        }
      }
    });
  });
}

void mix(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight, const at::Tensor& temperature,
         bool from_logits, at::Tensor& mixture) {
  const int64_t B = draft.size(0), K = draft.size(1), V = draft.size(2), Kt = target.size(1);
  TemperaturePlan temperatures = plan_temperatures(temperature, B);
  const float* weight_ptr = weight.data_ptr<float>();
  float* out = mixture.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "mix_cpu", [&] {
    const scalar_t* draft_ptr = draft.data_ptr<scalar_t>();
    const scalar_t* target_ptr = target.data_ptr<scalar_t>();
    at::parallel_for(0, B * K, 1, [&](int64_t begin, int64_t end) {
      for (int64_t index = begin; index < end; ++index) {
        const int64_t row = index / K, position = index % K;
        const scalar_t* draft_row = draft_ptr + index * V;
        const scalar_t* target_row = target_ptr + (row * Kt + position) * V;
        const float w = sanitize_weight(weight_ptr[index]);
        if (from_logits) {
          const float inverse_t = temperatures.inverse[row];
          LogitRow<scalar_t> p_row{target_row, inverse_t, softmax_stats(target_row, V, inverse_t)};
          LogitRow<scalar_t> q_row{draft_row, inverse_t, softmax_stats(draft_row, V, inverse_t)};
          mix_row(p_row, q_row, w, V, out + index * V);
        } else {
          mix_row(ProbRow<scalar_t>{target_row}, ProbRow<scalar_t>{draft_row}, w, V, out + index * V);
        }
      }
    });
  });
}

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
