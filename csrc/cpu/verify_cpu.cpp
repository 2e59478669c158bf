// Fused DIVERSED verification from probabilities on the CPU.
//
// The three phases live in cpu_kernels.h (shared with the logits path); this file supplies the probability rows:
//   1. per row (parallel over rows): accept tests on gathered values; greedy rows scan nu for its argmax;
//   2. per (row, vocabulary chunk) (parallel, so a single request still uses every core): residual or bonus mass;
//   3. per row: inverse-CDF sample inside the one chunk, and the one block, that holds the threshold.
// No [B, K, V] temporary; extra memory is O(B) plus a bounded number of chunk sums per row.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../poison.h"
#include "cpu_dispatch.h"

namespace diversed {
namespace cpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_probs_cpu(
    const at::Tensor& draft_tokens, const at::Tensor& draft_probs, const at::Tensor& target_probs,
    const at::Tensor& weight, const at::Tensor& num_draft, const at::Tensor& greedy,
    const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset, bool per_row_seed) {
  // Last line of defence: the Python layer has already produced these exact layouts.
  constexpr const char* op = "diversed::verify_probs";
  TORCH_CHECK(draft_probs.dim() == 3 && target_probs.dim() == 3, op, ": probabilities must be 3-D");
  const int64_t B = draft_probs.size(0), K = draft_probs.size(1), V = draft_probs.size(2);
  TORCH_CHECK(V > 0, op, ": vocabulary size must be positive");
  TORCH_CHECK(target_probs.size(0) == B && target_probs.size(1) == K + 1 && target_probs.size(2) == V, op,
              ": target_probs must be [B, K+1, V]");
  TORCH_CHECK(draft_probs.scalar_type() == target_probs.scalar_type(), op, ": dtype mismatch");
  TORCH_CHECK(draft_probs.is_contiguous() && target_probs.is_contiguous(), op, ": probabilities must be contiguous");
  TORCH_CHECK(draft_tokens.scalar_type() == at::kLong && draft_tokens.is_contiguous() && draft_tokens.numel() == B * K,
              op, ": draft_tokens must be contiguous int64 [B, K]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == B * K, op,
              ": weight must be contiguous float32 [B, K]");
  TORCH_CHECK(num_draft.scalar_type() == at::kLong && num_draft.is_contiguous() && num_draft.numel() == B, op,
              ": num_draft must be contiguous int64 [B]");
  TORCH_CHECK(greedy.scalar_type() == at::kBool && greedy.is_contiguous() && greedy.numel() == B, op,
              ": greedy must be contiguous bool [B]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.is_contiguous() && seeds.numel() == B, op,
              ": seeds must be contiguous int64 [B]");
  if (uniforms.has_value())
    TORCH_CHECK(uniforms->scalar_type() == at::kDouble && uniforms->is_contiguous() && uniforms->numel() == B * (K + 1),
                op, ": uniforms must be contiguous float64 [B, K+1]");

  auto tokens = at::empty({B, K + 1}, draft_tokens.options().dtype(at::kLong));
  auto num_accepted = at::empty({B}, draft_tokens.options().dtype(at::kInt));
  auto accept_prob = at::empty({B, K}, draft_tokens.options().dtype(at::kFloat));
  if (B == 0) return {tokens, num_accepted, accept_prob};
  poison_outputs(tokens, num_accepted, accept_prob);
  DIVERSED_CPU_CALL(verify_probs, draft_tokens, draft_probs, target_probs, weight, num_draft, greedy, uniforms,
                    seeds, offset, per_row_seed, tokens, num_accepted, accept_prob);
  return {tokens, num_accepted, accept_prob};
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(diversed, CPU, m) { m.impl("verify_probs", &cpu::verify_probs_cpu); }

}  // namespace diversed
