// CPU kernels of the logits path, token statistics and the materialised mixture.
//
// Logits are never turned into [B, K, V] probabilities: each needed row gets its softmax normaliser (max and
// 1 / sum exp) in a first pass, and every later pass recomputes softmax(v) on the fly (csrc/verify_math.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../poison.h"
#include "cpu_dispatch.h"

namespace diversed {
namespace cpu {
namespace {

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
  DIVERSED_CPU_CALL(verify_logits, draft_tokens, draft_logits, target_logits, weight, num_draft, temperature,
                    uniforms, seeds, offset, per_row_seed, tokens, num_accepted, accept_prob);
  return {tokens, num_accepted, accept_prob};
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
  DIVERSED_CPU_CALL(token_stats, draft, target, tokens, temperature, from_logits, target_prob, draft_prob,
                    total_variation, target_logprob, draft_logprob);
  return {target_prob, draft_prob, total_variation, target_logprob, draft_logprob};
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
