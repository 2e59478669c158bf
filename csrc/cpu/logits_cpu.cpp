// CPU kernels of the logits path, token statistics and the materialised mixture.
//
// Logits are never turned into [B, K, V] probabilities: each needed row gets its softmax normaliser (max and
// 1 / sum exp) in a first pass, and every later pass recomputes softmax(v) on the fly (csrc/common/verify_math.h).
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../common/op_checks.h"
#include "../common/op_outputs.h"
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

  VerifyOutputs out = allocate_verify_outputs(draft_tokens, B, K);
  if (B == 0) return out.as_tuple();
  DIVERSED_CPU_CALL(verify_logits, draft_tokens, draft_logits, target_logits, weight, num_draft, temperature,
                    uniforms, seeds, offset, per_row_seed, out.tokens, out.num_accepted, out.accept_prob);
  return out.as_tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_cpu(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& temperature,
    bool from_logits) {
  constexpr const char* op = "diversed::token_stats";
  check_token_stats_args(op, draft, target, tokens, temperature);
  const int64_t B = draft.size(0), T = draft.size(1);
  TokenStatsOutputs out = allocate_token_stats_outputs(draft, B, T);
  if (B * T == 0) return out.as_tuple();
  DIVERSED_CPU_CALL(token_stats, draft, target, tokens, temperature, from_logits, out.target_prob, out.draft_prob,
                    out.total_variation, out.target_logprob, out.draft_logprob);
  return out.as_tuple();
}

// nu = w p + (1 - w) q materialised as float32 [B, K, V]; target may carry extra positions (K+1), which are ignored.
at::Tensor mix_cpu(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                   const at::Tensor& temperature, bool from_logits) {
  constexpr const char* op = "diversed::mix";
  check_mix_args(op, draft, target, weight, temperature);
  const int64_t B = draft.size(0), K = draft.size(1);
  at::Tensor mixture = allocate_mixture(draft);
  if (B * K == 0) return mixture;
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
