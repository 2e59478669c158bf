// CPU kernels of the logits path, token statistics and the materialised mixture.
//
// Logits are never turned into [B, K, V] probabilities: each needed row gets its softmax normaliser (max and
// 1 / sum exp) in a first pass, and every later pass recomputes softmax(v) on the fly (csrc/verify_math.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../op_checks.h"
#include "../poison.h"
#include "cpu_dispatch.h"

namespace diversed {
namespace cpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_logits_cpu(
    const at::Tensor& draft_tokens, const at::Tensor& draft_logits, const at::Tensor& target_logits,
    const at::Tensor& weight, const at::Tensor& num_draft, const at::Tensor& temperature,
    const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset, bool per_row_seed) {
  constexpr const char* op = "diversed::verify_logits";
  check_verify_args(op, draft_tokens, draft_logits, target_logits, weight, num_draft, uniforms, seeds);
  const int64_t B = draft_logits.size(0), K = draft_logits.size(1);
  check_float_vector(temperature, B, op, "temperature");

  auto tokens = at::empty({B, K + 1}, draft_tokens.options());
  auto num_accepted = at::empty({B}, draft_tokens.options().dtype(at::kInt));
  auto accept_prob = at::empty({B, K}, draft_tokens.options().dtype(at::kFloat));
  if (B == 0) return {tokens, num_accepted, accept_prob};
  poison_outputs(tokens, num_accepted, accept_prob);
  DIVERSED_CPU_CALL(verify_logits, draft_tokens, draft_logits, target_logits, weight, num_draft, temperature,
                    uniforms, seeds, offset, per_row_seed, tokens, num_accepted, accept_prob);
  return {tokens, num_accepted, accept_prob};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_cpu(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& temperature,
    bool from_logits) {
  constexpr const char* op = "diversed::token_stats";
  check_token_stats_args(op, draft, target, tokens, temperature);
  const int64_t B = draft.size(0), T = draft.size(1);
  auto options = draft.options().dtype(at::kFloat);
  at::Tensor target_prob = at::empty({B, T}, options), draft_prob = at::empty({B, T}, options);
  at::Tensor total_variation = at::empty({B, T}, options);
  at::Tensor target_logprob = at::empty({B, T}, options), draft_logprob = at::empty({B, T}, options);
  if (B * T == 0) return {target_prob, draft_prob, total_variation, target_logprob, draft_logprob};
  poison_outputs(target_prob, draft_prob, total_variation, target_logprob, draft_logprob);
  DIVERSED_CPU_CALL(token_stats, draft, target, tokens, temperature, from_logits, target_prob, draft_prob,
                    total_variation, target_logprob, draft_logprob);
  return {target_prob, draft_prob, total_variation, target_logprob, draft_logprob};
}

// nu = w p + (1 - w) q materialised as float32 [B, K, V]; target may carry extra positions (K+1), which are ignored.
at::Tensor mix_cpu(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                   const at::Tensor& temperature, bool from_logits) {
  constexpr const char* op = "diversed::mix";
  check_mix_args(op, draft, target, weight, temperature);
  const int64_t B = draft.size(0), K = draft.size(1), V = draft.size(2);
  at::Tensor mixture = at::empty({B, K, V}, draft.options().dtype(at::kFloat));
  if (B * K == 0) return mixture;
  poison_outputs(mixture);
  DIVERSED_CPU_CALL(mix, draft, target, weight, temperature, from_logits, mixture);
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
