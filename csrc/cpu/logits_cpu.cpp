// CPU kernels of the logits path, token statistics and the materialised mixture.
//
// Logits are never turned into [B, K, V] probabilities: each needed row gets its softmax normaliser (max and
// 1 / sum exp) in a first pass, and every later pass recomputes softmax(v) on the fly (csrc/verify_math.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <memory>

#include "../poison.h"
#include "cpu_kernels.h"

namespace diversed {
namespace cpu {
namespace {

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

void check_float_vector(const at::Tensor& tensor, int64_t size, const char* op, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == at::kFloat && tensor.is_contiguous() && tensor.numel() == size, op, ": ", name,
              " must be contiguous float32 with ", size, " elements");
}

void check_pair(const at::Tensor& draft, const at::Tensor& target, const char* op) {
  TORCH_CHECK(draft.dim() == 3 && target.dim() == 3, op, ": draft and target must be 3-D");
  TORCH_CHECK(draft.scalar_type() == target.scalar_type(), op, ": draft and target dtypes differ");
  TORCH_CHECK(draft.is_contiguous() && target.is_contiguous(), op, ": draft and target must be contiguous");
  TORCH_CHECK(draft.size(2) > 0 && draft.size(2) == target.size(2), op, ": vocabulary sizes differ or are zero");
  TORCH_CHECK(draft.size(0) == target.size(0), op, ": batch sizes differ");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_logits_cpu(
    const at::Tensor& draft_tokens, const at::Tensor& draft_logits, const at::Tensor& target_logits,
    const at::Tensor& weight, const at::Tensor& num_draft, const at::Tensor& temperature,
    const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset, bool per_row_seed) {
  constexpr const char* op = "diversed::verify_logits";
  check_pair(draft_logits, target_logits, op);
  const int64_t B = draft_logits.size(0), K = draft_logits.size(1), V = draft_logits.size(2);
  TORCH_CHECK(target_logits.size(1) == K + 1, op, ": target_logits must be [B, K+1, V]");
  TORCH_CHECK(draft_tokens.scalar_type() == at::kLong && draft_tokens.is_contiguous() && draft_tokens.numel() == B * K,
              op, ": draft_tokens must be contiguous int64 [B, K]");
  check_float_vector(weight, B * K, op, "weight");
  check_float_vector(temperature, B, op, "temperature");
  TORCH_CHECK(num_draft.scalar_type() == at::kLong && num_draft.is_contiguous() && num_draft.numel() == B, op,
              ": num_draft must be contiguous int64 [B]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.is_contiguous() && seeds.numel() == B, op,
              ": seeds must be contiguous int64 [B]");
  if (uniforms.has_value())
    TORCH_CHECK(uniforms->scalar_type() == at::kDouble && uniforms->is_contiguous() && uniforms->numel() == B * (K + 1),
                op, ": uniforms must be contiguous float64 [B, K+1]");

  auto tokens = at::empty({B, K + 1}, draft_tokens.options());
  auto num_accepted = at::empty({B}, draft_tokens.options().dtype(at::kInt));
  auto accept_prob = at::empty({B, K}, draft_tokens.options().dtype(at::kFloat));
  if (B == 0) return {tokens, num_accepted, accept_prob};
  poison_outputs(tokens, num_accepted, accept_prob);
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
  return {tokens, num_accepted, accept_prob};
}

// Per position: p(y), q(y), TV(p, q) = 0.5 sum |p - q|, log p(y), log q(y).
template <typename Row>
void token_stats_row(const Row& target, const Row& draft, int64_t vocab, int64_t token, float* target_prob,
                     float* draft_prob, float* total_variation) {
  double lanes[kLanes] = {0.0};
  int64_t v = 0;
  for (; v + kLanes <= vocab; v += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += static_cast<double>(std::fabs(target.mass(v + l) - draft.mass(v + l)));
  for (; v < vocab; ++v) lanes[0] += static_cast<double>(std::fabs(target.mass(v) - draft.mass(v)));
  double sum = 0.0;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  *total_variation = static_cast<float>(0.5 * sum);
  const bool valid = token >= 0 && token < vocab;
  *target_prob = valid ? target.mass(token) : 0.0f;
  *draft_prob = valid ? draft.mass(token) : 0.0f;
}

// log softmax(y) = s_y - max - log(sum); exact for tiny probabilities whose mass underflows to 0.
template <typename scalar_t>
float log_softmax_at(const LogitRow<scalar_t>& row, int64_t token) {
  const float scaled = static_cast<float>(row.values[token]) * row.inverse_temperature;
  const double value = static_cast<double>(scaled) - row.stats.max + std::log(static_cast<double>(row.stats.inverse_sum));
  return value == value ? static_cast<float>(value) : -INFINITY;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_cpu(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& temperature,
    bool from_logits) {
  constexpr const char* op = "diversed::token_stats";
  check_pair(draft, target, op);
  const int64_t B = draft.size(0), T = draft.size(1), V = draft.size(2);
  TORCH_CHECK(target.size(1) == T, op, ": draft and target must both be [B, T, V]");
  TORCH_CHECK(tokens.scalar_type() == at::kLong && tokens.is_contiguous() && tokens.numel() == B * T, op,
              ": tokens must be contiguous int64 [B, T]");
  check_float_vector(temperature, B, op, "temperature");
  auto options = draft.options().dtype(at::kFloat);
  at::Tensor target_prob = at::empty({B, T}, options), draft_prob = at::empty({B, T}, options);
  at::Tensor total_variation = at::empty({B, T}, options);
  at::Tensor target_logprob = at::empty({B, T}, options), draft_logprob = at::empty({B, T}, options);
  if (B * T == 0) return {target_prob, draft_prob, total_variation, target_logprob, draft_logprob};
  poison_outputs(target_prob, draft_prob, total_variation, target_logprob, draft_logprob);
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
  return {target_prob, draft_prob, total_variation, target_logprob, draft_logprob};
}

template <typename Row>
void mix_row(const Row& target, const Row& draft, float weight, int64_t vocab, float* out) {
  for (int64_t v = 0; v < vocab; ++v) out[v] = mix_mass(weight, target.mass(v), draft.mass(v));
}

// nu = w p + (1 - w) q materialised as float32 [B, K, V]; target may carry extra positions (K+1), which are ignored.
at::Tensor mix_cpu(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                   const at::Tensor& temperature, bool from_logits) {
  constexpr const char* op = "diversed::mix";
  check_pair(draft, target, op);
  const int64_t B = draft.size(0), K = draft.size(1), V = draft.size(2), Kt = target.size(1);
  TORCH_CHECK(Kt >= K, op, ": target must have at least K positions");
  check_float_vector(weight, B * K, op, "weight");
  check_float_vector(temperature, B, op, "temperature");
  at::Tensor mixture = at::empty({B, K, V}, draft.options().dtype(at::kFloat));
  if (B * K == 0) return mixture;
  poison_outputs(mixture);
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
  return mixture;
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(diversed, CPU, m) {
  m.impl("verify_logits", &cpu::verify_logits_cpu);
  m.impl("token_stats", &cpu::token_stats_cpu);
  m.impl("mix", &cpu::mix_cpu);
}

}  // namespace diversed
