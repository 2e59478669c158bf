// CPU bindings of the verify and stats ops: argument checks, output allocation, one kernel call per op. The kernels
// are torch-free (verify_kernels.h, stats_kernels.h, check_kernels.h), compiled per instruction set and picked at run
// time (cpu_dispatch.h); this file hands them raw pointers and at::parallel_for. The lean forward's ops (float and
// int8 products, Llama layers) are bound and registered in ../forward/ops_forward.cpp.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "../common/op_checks.h"
#include "../common/op_outputs.h"
#include "cpu_dispatch.h"
#include "parallel_binding.h"

namespace diversed {
namespace cpu {
namespace {

// The kernels are written over torch-free bit wrappers of the 16-bit types.
template <typename scalar_t>
using CpuElement = kernel_element_t<HalfBits, BFloat16Bits, scalar_t>;

using VerifyTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using OptionalTensor = c10::optional<at::Tensor>;

VerifyTuple verify_probs_cpu(const at::Tensor& draft_tokens, const OptionalTensor& draft_probs,
                             const at::Tensor& target_probs, const OptionalTensor& weight,
                             const OptionalTensor& num_draft, const OptionalTensor& greedy,
                             const OptionalTensor& uniforms, const OptionalTensor& seeds, int64_t offset,
                             bool per_row_seed, double weight_value, c10::optional<int64_t> seed,
                             const OptionalTensor& target_rows, const OptionalTensor& draft_rows,
                             const OptionalTensor& fly_window, const OptionalTensor& fly_threshold,
                             int64_t fly_window_value, double fly_threshold_value, int64_t fly_top_k) {
  const VerifyOptionals optional{weight, num_draft, greedy, uniforms, seeds, target_rows, draft_rows,
                                 kNoTargetTemperature};
  const FlyArgs fly{fly_window, fly_threshold, fly_window_value, fly_threshold_value, fly_top_k};
  const VerifyShape shape = check_verify_args(VerifyInput::kProbs, draft_tokens, draft_probs, target_probs, optional);
  check_fly_args(fly, shape.batch, kVerifyProbsOp);
  const VerifyCall call = start_verify(VerifyInput::kProbs, shape, draft_tokens, draft_probs, target_probs, optional,
                                       VerifyScalars{weight_value, 1.0, seed, offset, per_row_seed}, fly);
  if (call.empty()) return call.result();
  dispatch_verify_types(kVerifyProbsOp, draft_probs, target_probs, [&](auto draft_tag, auto target_tag) {
    using DraftScalar = typename decltype(draft_tag)::type;
    using TargetScalar = typename decltype(target_tag)::type;
    // The kernel's element types are deduced from the pointers (a tokens-only call's null draft has the target's).
    DIVERSED_CPU_CALL(verify_probs, call.problem, kernel_data<CpuElement<DraftScalar>, DraftScalar>(draft_probs),
                      kernel_data<CpuElement<TargetScalar>, TargetScalar>(target_probs), kClaimingParallelFor);
  });
  return call.result();
}

VerifyTuple verify_logits_cpu(const at::Tensor& draft_tokens, const OptionalTensor& draft_logits,
                              const at::Tensor& target_logits, const OptionalTensor& weight,
                              const OptionalTensor& num_draft, const OptionalTensor& temperature,
                              const OptionalTensor& uniforms, const OptionalTensor& seeds, int64_t offset,
                              bool per_row_seed, double weight_value, double temperature_value,
                              c10::optional<int64_t> seed, const OptionalTensor& target_rows,
                              const OptionalTensor& draft_rows, const OptionalTensor& target_temperature,
                              c10::optional<double> target_temperature_value, const OptionalTensor& fly_window,
                              const OptionalTensor& fly_threshold, int64_t fly_window_value,
                              double fly_threshold_value, int64_t fly_top_k) {
  const VerifyOptionals optional{weight, num_draft, temperature, uniforms, seeds, target_rows, draft_rows,
                                 target_temperature};
  const FlyArgs fly{fly_window, fly_threshold, fly_window_value, fly_threshold_value, fly_top_k};
  const VerifyShape shape =
      check_verify_args(VerifyInput::kLogits, draft_tokens, draft_logits, target_logits, optional);
  check_fly_args(fly, shape.batch, kVerifyLogitsOp);
  const VerifyCall call = start_verify(
      VerifyInput::kLogits, shape, draft_tokens, draft_logits, target_logits, optional,
      VerifyScalars{weight_value, temperature_value, seed, offset, per_row_seed, target_temperature_value}, fly);
  if (call.empty()) return call.result();
  dispatch_verify_types(kVerifyLogitsOp, draft_logits, target_logits, [&](auto draft_tag, auto target_tag) {
    using DraftScalar = typename decltype(draft_tag)::type;
    using TargetScalar = typename decltype(target_tag)::type;
    DIVERSED_CPU_CALL(verify_logits, call.problem, kernel_data<CpuElement<DraftScalar>, DraftScalar>(draft_logits),
                      kernel_data<CpuElement<TargetScalar>, TargetScalar>(target_logits), kClaimingParallelFor);
  });
  return call.result();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_cpu(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& temperature,
    bool from_logits) {
  check_token_stats_args(draft, target, tokens, temperature);
  const TokenStatsCall call = start_token_stats(draft, tokens);
  if (call.empty()) return call.result();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "token_stats_cpu", [&] {
    using T = CpuElement<scalar_t>;
    DIVERSED_CPU_CALL(token_stats<T>, pair_problem<T, scalar_t>(draft, target, temperature, from_logits), call.out,
                      kParallelFor);
  });
  return call.result();
}

// nu = w p + (1 - w) q materialised as float32 [B, K, V]; target may carry extra positions (K+1), which are ignored.
at::Tensor mix_cpu(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                   const at::Tensor& temperature, bool from_logits) {
  check_mix_args(draft, target, weight, temperature);
  at::Tensor mixture = allocate_mixture(draft);
  if (mixture.numel() == 0) return mixture;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "mix_cpu", [&] {
    using T = CpuElement<scalar_t>;
    DIVERSED_CPU_CALL(mix<T>, pair_problem<T, scalar_t>(draft, target, temperature, from_logits),
                      weight.data_ptr<float>(), mixture.data_ptr<float>(), kParallelFor);
  });
  return mixture;
}

// KL(nu_w || p) at grid_points weights w = 0 .. 1 per pair of logit rows [B, T, V] -> float32 [B, T, grid_points].
at::Tensor mixture_divergence_cpu(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& temperature,
                                  int64_t grid_points, double log_floor) {
  check_mixture_divergence_args(draft, target, temperature, grid_points, log_floor);
  at::Tensor table = allocate_divergence_table(draft, grid_points);
  if (table.numel() == 0) return table;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "mixture_divergence_cpu", [&] {
    using T = CpuElement<scalar_t>;
    DIVERSED_CPU_CALL(mixture_divergence<T>, pair_problem<T, scalar_t>(draft, target, temperature, true), grid_points,
                      static_cast<float>(log_floor), table.data_ptr<float>(), kParallelFor);
  });
  return table;
}

// Pairs of logit rows ([B, T, V], or [R, V] read through an index) -> float32 [B, T, 5]: entropies, largest
// probabilities and TV (features_math.h).
at::Tensor distribution_features_cpu(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& temperature,
                                     const OptionalTensor& target_rows, const OptionalTensor& draft_rows,
                                     const OptionalTensor& target_temperature) {
  const FeaturesShape shape =
      check_distribution_features_args(draft, target, temperature, target_rows, draft_rows, target_temperature);
  at::Tensor features = allocate_features(shape, target);
  if (features.numel() == 0) return features;
  const FeaturesProblem problem =
      features_problem(shape, draft, target, temperature, target_rows, draft_rows, target_temperature);
  dispatch_verify_types(kDistributionFeaturesOp, draft, target, [&](auto draft_tag, auto target_tag) {
    using DraftScalar = typename decltype(draft_tag)::type;
    using TargetScalar = typename decltype(target_tag)::type;
    DIVERSED_CPU_CALL(distribution_features, problem, kernel_data<CpuElement<DraftScalar>, DraftScalar>(draft),
                      kernel_data<CpuElement<TargetScalar>, TargetScalar>(target), features.data_ptr<float>(),
                      kParallelFor);
  });
  return features;
}

// Drafted tokens [B, T] and their target logit rows beside draft logits or probabilities (no draft: tokens only) ->
// (log p(x), E_r[log p]), float32 [B, T] each: what the log-probability gate compares (gate_math.h).
std::tuple<at::Tensor, at::Tensor> gate_statistics_cpu(const at::Tensor& draft_tokens, const OptionalTensor& draft,
                                                       const at::Tensor& target, const at::Tensor& temperature,
                                                       const OptionalTensor& target_rows,
                                                       const OptionalTensor& draft_rows,
                                                       const OptionalTensor& target_temperature, bool draft_probs) {
  const FeaturesShape shape = check_gate_statistics_args(draft_tokens, draft, target, temperature, target_rows,
                                                         draft_rows, target_temperature);
  auto [drafted, rejected] = allocate_gate_statistics(shape, target);
  if (drafted.numel() == 0) return {drafted, rejected};
  const FeaturesProblem problem = features_problem(shape, draft.has_value() ? *draft : target, target, temperature,
                                                   target_rows, draft_rows, target_temperature);
  dispatch_verify_types(kGateStatisticsOp, draft, target, [&](auto draft_tag, auto target_tag) {
    using DraftScalar = typename decltype(draft_tag)::type;
    using TargetScalar = typename decltype(target_tag)::type;
    DIVERSED_CPU_CALL(gate_statistics, problem, draft_tokens.data_ptr<int64_t>(),
                      kernel_data<CpuElement<DraftScalar>, DraftScalar>(draft), draft_probs,
                      kernel_data<CpuElement<TargetScalar>, TargetScalar>(target), drafted.data_ptr<float>(),
                      rejected.data_ptr<float>(), kParallelFor);
  });
  return {drafted, rejected};
}

// values [..., V] -> int32 [...]: each row's flags (check_kernels.h), for the value checks of check_inputs=True.
at::Tensor value_flags_cpu(const at::Tensor& values, bool from_logits) {
  constexpr const char* op = "diversed::value_flags";
  TORCH_CHECK(values.dim() >= 1, op, ": values must have at least one dimension (the vocabulary)");
  TORCH_CHECK(at::isFloatingType(values.scalar_type()), op, ": values must be floating point, got ",
              values.scalar_type());
  const at::Tensor contiguous = values.contiguous();
  const auto sizes = values.sizes();
  at::Tensor flags = at::empty(sizes.slice(0, sizes.size() - 1), values.options().dtype(at::kInt));
  const int64_t vocab = values.size(-1), rows = flags.numel();
  if (rows == 0) return flags;
  poison_outputs(flags);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, values.scalar_type(), "value_flags_cpu", [&] {
    using T = CpuElement<scalar_t>;
    DIVERSED_CPU_CALL(value_flags<T>, kernel_data<T, scalar_t>(contiguous), rows, vocab, from_logits,
                      flags.data_ptr<int32_t>(), kParallelFor);
  });
  return flags;
}

// seeds, offsets int64 [B] -> float64 [B, num_positions]: the draws of philox_uniform (verify_math.h), which the
// verify kernels make for the same (seed, offset, row key, position), so they are theirs bit for bit.
at::Tensor philox_uniforms_cpu(const at::Tensor& seeds, const at::Tensor& offsets, int64_t num_positions,
                               bool per_row_seed) {
  constexpr const char* op = "diversed::philox_uniforms";
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 1, op, ": seeds must be a 1-D int64 tensor");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.sizes() == seeds.sizes(), op,
              ": offsets must be an int64 tensor with the shape of seeds, got ", offsets.sizes());
  TORCH_CHECK(num_positions >= 0, op, ": num_positions must be >= 0, got ", num_positions);
  const at::Tensor seed_values = seeds.contiguous(), offset_values = offsets.contiguous();
  const int64_t batch = seeds.size(0);
  at::Tensor out = at::empty({batch, num_positions}, seeds.options().dtype(at::kDouble));
  const int64_t* seed = seed_values.data_ptr<int64_t>();
  const int64_t* offset = offset_values.data_ptr<int64_t>();
  double* uniforms = out.data_ptr<double>();
  for (int64_t row = 0; row < batch; ++row) {
    for (int64_t position = 0; position < num_positions; ++position) {
      uniforms[row * num_positions + position] =
          philox_uniform(seed[row], offset[row], per_row_seed ? 0 : row, position);
    }
  }
  return out;
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(diversed, CPU, m) {
  m.impl("verify_probs", &cpu::verify_probs_cpu);
  m.impl("verify_logits", &cpu::verify_logits_cpu);
  m.impl("token_stats", &cpu::token_stats_cpu);
  m.impl("mix", &cpu::mix_cpu);
  m.impl("mixture_divergence", &cpu::mixture_divergence_cpu);
  m.impl("distribution_features", &cpu::distribution_features_cpu);
  m.impl("gate_statistics", &cpu::gate_statistics_cpu);
  m.impl("philox_uniforms", &cpu::philox_uniforms_cpu);
  m.impl("value_flags", &cpu::value_flags_cpu);
}

}  // namespace diversed
