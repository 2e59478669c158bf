// Fused DIVERSED verification from probabilities on the CPU.
//
// The three phases live in cpu_kernels.h (shared with the logits path); this file supplies the probability rows:
//   1. per row (parallel over rows): accept tests on gathered values; greedy rows scan nu for its argmax;
//   2. per (row, vocabulary chunk) (parallel, so a single request still uses every core): residual or bonus mass;
//   3. per row: inverse-CDF sample inside the one chunk, and the one block, that holds the threshold.
// No [B, K, V] temporary; extra memory is O(B) plus a bounded number of chunk sums per row.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../poison.h"
#include "cpu_kernels.h"

namespace diversed {
namespace cpu {
namespace {

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
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_probs.scalar_type(), "verify_probs_cpu", [&] {
    ProbRows<scalar_t> rows{draft_probs.data_ptr<scalar_t>(), target_probs.data_ptr<scalar_t>(), K, V};
    VerifyProblem problem{B, K, V, draft_tokens.data_ptr<int64_t>(), weight.data_ptr<float>(),
                          num_draft.data_ptr<int64_t>(), greedy.data_ptr<bool>(),
                          uniforms.has_value() ? uniforms->data_ptr<double>() : nullptr, seeds.data_ptr<int64_t>(),
                          offset, per_row_seed, tokens.data_ptr<int64_t>(), num_accepted.data_ptr<int32_t>(),
                          accept_prob.data_ptr<float>()};
    run_verify(problem, rows);
  });
  return {tokens, num_accepted, accept_prob};
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(diversed, CPU, m) { m.impl("verify_probs", &cpu::verify_probs_cpu); }

}  // namespace diversed
