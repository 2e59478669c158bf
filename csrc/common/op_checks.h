// Argument checks of the `diversed` ops, shared by every backend's bindings (csrc/cpu, csrc/cuda). They are the last
// line of defence: the Python layer (diversed_ext/_inputs.py) has already produced these exact layouts. Structural
// checks only, so they never read tensor values (no device sync). Device placement is the CUDA binding's own check.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "tensor_checks.h"  // check_layout, check_float_vector

namespace diversed {

// Operator names as error messages give them.
constexpr const char* kVerifyProbsOp = "diversed::verify_probs";
constexpr const char* kVerifyLogitsOp = "diversed::verify_logits";
constexpr const char* kTokenStatsOp = "diversed::token_stats";
constexpr const char* kMixOp = "diversed::mix";

inline void check_int64_vector(const at::Tensor& tensor, int64_t size, const char* op, const char* what) {
  check_layout(tensor, at::kLong, {size}, op, what);
}

// A draft/target pair of 3-D distributions [B, *, V] (probabilities or logits).
inline void check_pair(const at::Tensor& draft, const at::Tensor& target, const char* op) {
  TORCH_CHECK(draft.dim() == 3 && target.dim() == 3, op, ": draft and target must be 3-D");
  TORCH_CHECK(draft.scalar_type() == target.scalar_type(), op, ": draft and target dtypes differ");
  TORCH_CHECK(draft.is_contiguous() && target.is_contiguous(), op, ": draft and target must be contiguous");
  TORCH_CHECK(draft.size(2) > 0 && draft.size(2) == target.size(2), op, ": vocabulary sizes differ or are zero");
  TORCH_CHECK(draft.size(0) == target.size(0), op, ": batch sizes differ");
}

// verify_probs / verify_logits: draft [B, K, V], target [B, K+1, V], draft_tokens (int64 [B, K]), and when given:
// weight (float32 [B, K]), num_draft and seeds (int64 [B]), uniforms (float64 [B, K+1]), and the per-row flags: greedy
// (bool [B]) from probabilities, temperature (float32 [B]) from logits. An absent one takes its scalar default.
enum class VerifyInput { kProbs, kLogits };

inline const char* verify_op(VerifyInput input) {
  return input == VerifyInput::kProbs ? kVerifyProbsOp : kVerifyLogitsOp;
}

// The optional tensor arguments of the verify ops, in schema order.
struct VerifyOptionals {
  const c10::optional<at::Tensor>& weight;
  const c10::optional<at::Tensor>& num_draft;
  const c10::optional<at::Tensor>& greedy_or_temperature;
  const c10::optional<at::Tensor>& uniforms;
  const c10::optional<at::Tensor>& seeds;
};

// The target alone, for a call whose drafter gave tokens only (no draft tensor): [B, K+1, V] with K + 1 >= 1.
inline void check_target_only(const at::Tensor& target, const char* op) {
  TORCH_CHECK(target.dim() == 3, op, ": target must be 3-D");
  TORCH_CHECK(target.is_contiguous(), op, ": target must be contiguous");
  TORCH_CHECK(target.size(2) > 0, op, ": the vocabulary size is zero");
  TORCH_CHECK(target.size(1) >= 1, op, ": target must be [B, K+1, V] with K >= 0");
}

// verify's draft tensor is optional (absent: the drafter gave tokens only); B, K and V come from the target.
inline void check_verify_args(VerifyInput input, const at::Tensor& draft_tokens,
                              const c10::optional<at::Tensor>& draft, const at::Tensor& target,
                              const VerifyOptionals& optional) {
  const char* op = verify_op(input);
  check_target_only(target, op);
  const int64_t B = target.size(0), K = target.size(1) - 1;
  if (draft.has_value()) {
    check_pair(*draft, target, op);
    TORCH_CHECK(draft->size(1) == K, op, ": target must be [B, K+1, V]");
  }
  check_layout(draft_tokens, at::kLong, {B, K}, op, "draft_tokens");
  if (optional.weight.has_value()) check_layout(*optional.weight, at::kFloat, {B, K}, op, "weight");
  if (optional.num_draft.has_value()) check_int64_vector(*optional.num_draft, B, op, "num_draft");
  if (optional.seeds.has_value()) check_int64_vector(*optional.seeds, B, op, "seeds");
  const auto& uniforms = optional.uniforms;
  if (uniforms.has_value()) check_layout(*uniforms, at::kDouble, {B, K + 1}, op, "uniforms");
  if (!optional.greedy_or_temperature.has_value()) return;
  const at::Tensor& flags = *optional.greedy_or_temperature;
  if (input == VerifyInput::kLogits) {
    check_float_vector(flags, B, op, "temperature");
  } else {
    check_layout(flags, at::kBool, {B}, op, "greedy");
  }
}

// token_stats: draft and target [B, T, V], tokens int64 [B, T], temperature float32 [B].
inline void check_token_stats_args(const at::Tensor& draft, const at::Tensor& target,
                                   const at::Tensor& tokens, const at::Tensor& temperature) {
  constexpr const char* op = kTokenStatsOp;
  check_pair(draft, target, op);
  const int64_t B = draft.size(0), T = draft.size(1);
  TORCH_CHECK(target.size(1) == T, op, ": draft and target must both be [B, T, V]");
  check_layout(tokens, at::kLong, {B, T}, op, "tokens");
  check_float_vector(temperature, B, op, "temperature");
}

// mix: draft [B, K, V], target [B, K or more, V], weight float32 [B, K], temperature float32 [B].
inline void check_mix_args(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                           const at::Tensor& temperature) {
  constexpr const char* op = kMixOp;
  check_pair(draft, target, op);
  const int64_t B = draft.size(0), K = draft.size(1);
  TORCH_CHECK(target.size(1) >= K, op, ": target must have at least K positions");
  check_layout(weight, at::kFloat, {B, K}, op, "weight");
  check_float_vector(temperature, B, op, "temperature");
}

}  // namespace diversed
