// Fused DIVERSED verification from probabilities on the CPU.
//
// The three phases live in cpu_kernels.h (shared with the logits path); this file supplies the probability rows:
//   1. per row (parallel over rows): accept tests on gathered values; greedy rows scan nu for its argmax;
//   2. per (row, vocabulary chunk) (parallel, so a single request still uses every core): residual or bonus mass;
//   3. per row: inverse-CDF sample inside the one chunk, and the one block, that holds the threshold.
// No [B, K, V] temporary; extra memory is O(B) plus a bounded number of chunk sums per row.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../common/op_checks.h"
#include "../common/op_outputs.h"
#include "cpu_dispatch.h"

namespace diversed {
namespace cpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_probs_cpu(
    const at::Tensor& draft_tokens, const at::Tensor& draft_probs, const at::Tensor& target_probs,
    const at::Tensor& weight, const at::Tensor& num_draft, const at::Tensor& greedy,
    const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset, bool per_row_seed) {
  constexpr const char* op = "diversed::verify_probs";
  check_verify_args(op, draft_tokens, draft_probs, target_probs, weight, num_draft, uniforms, seeds);
  const int64_t B = draft_probs.size(0), K = draft_probs.size(1);
  check_greedy(op, greedy, B);

  VerifyOutputs out = allocate_verify_outputs(draft_tokens, B, K);
  if (B == 0) return out.as_tuple();
  DIVERSED_CPU_CALL(verify_probs, draft_tokens, draft_probs, target_probs, weight, num_draft, greedy, uniforms,
                    seeds, offset, per_row_seed, out.tokens, out.num_accepted, out.accept_prob);
  return out.as_tuple();
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(diversed, CPU, m) { m.impl("verify_probs", &cpu::verify_probs_cpu); }

}  // namespace diversed
