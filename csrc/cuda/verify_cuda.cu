// CUDA bindings of diversed::verify_probs and diversed::verify_logits: checks, allocation, one launch per call.
// The kernels are in verify_kernels.cuh; nothing here reads device memory, so a call never syncs with the host.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../poison.h"
#include "cuda_binding.h"
#include "verify_kernels.cuh"

namespace diversed {
namespace gpu {
namespace {

using VerifyOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Allocates (and, under the test hook, poisons) the outputs and fills the kernel parameters.
struct VerifyCall {
  at::Tensor tokens, num_accepted, accept_prob;
  VerifyParams params;

  VerifyCall(const at::Tensor& draft_tokens, const at::Tensor& weight, const at::Tensor& num_draft,
             const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset, bool per_row_seed,
             int64_t B, int64_t K, int64_t V)
      : tokens(at::empty({B, K + 1}, draft_tokens.options().dtype(at::kLong))),
        num_accepted(at::empty({B}, draft_tokens.options().dtype(at::kInt))),
        accept_prob(at::empty({B, K}, draft_tokens.options().dtype(at::kFloat))) {
    if (B > 0) poison_outputs(tokens, num_accepted, accept_prob);
    params = VerifyParams{B, K, V, draft_tokens.data_ptr<int64_t>(), weight.data_ptr<float>(),
                          num_draft.data_ptr<int64_t>(), uniforms.has_value() ? uniforms->data_ptr<double>() : nullptr,
                          seeds.data_ptr<int64_t>(), offset, per_row_seed, tokens.data_ptr<int64_t>(),
                          num_accepted.data_ptr<int32_t>(), accept_prob.data_ptr<float>()};
  }
  VerifyOutputs outputs() const { return {tokens, num_accepted, accept_prob}; }
};

VerifyOutputs verify_probs_cuda(const at::Tensor& draft_tokens, const at::Tensor& draft_probs,
                                const at::Tensor& target_probs, const at::Tensor& weight, const at::Tensor& num_draft,
                                const at::Tensor& greedy, const c10::optional<at::Tensor>& uniforms,
                                const at::Tensor& seeds, int64_t offset, bool per_row_seed) {
  constexpr const char* op = "diversed::verify_probs";
  TORCH_CHECK(draft_probs.dim() == 3 && target_probs.dim() == 3, op, ": probabilities must be 3-D");
  const int64_t B = draft_probs.size(0), K = draft_probs.size(1), V = draft_probs.size(2);
  TORCH_CHECK(V > 0, op, ": vocabulary size must be positive");
  TORCH_CHECK(target_probs.size(0) == B && target_probs.size(1) == K + 1 && target_probs.size(2) == V, op,
              ": target_probs must be [B, K+1, V]");
  TORCH_CHECK(draft_probs.scalar_type() == target_probs.scalar_type(), op, ": dtype mismatch");
  TORCH_CHECK(draft_probs.is_contiguous() && target_probs.is_contiguous(), op, ": probabilities must be contiguous");
  TORCH_CHECK(greedy.scalar_type() == at::kBool && greedy.is_contiguous() && greedy.numel() == B, op,
              ": greedy must be contiguous bool [B]");
  check_verify_layouts(op, draft_tokens, weight, num_draft, uniforms, seeds, B, K);
  check_cuda_device(op, draft_probs, target_probs, draft_tokens, greedy);

  const c10::cuda::CUDAGuard guard(draft_probs.device());
  VerifyCall call(draft_tokens, weight, num_draft, uniforms, seeds, offset, per_row_seed, B, K, V);
  if (B == 0) return call.outputs();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_probs.scalar_type(), "verify_probs_cuda", [&] {
    launch_verify_probs(call.params, cuda_data<scalar_t>(draft_probs), cuda_data<scalar_t>(target_probs),
                        greedy.data_ptr<bool>(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return call.outputs();
}

VerifyOutputs verify_logits_cuda(const at::Tensor& draft_tokens, const at::Tensor& draft_logits,
                                 const at::Tensor& target_logits, const at::Tensor& weight,
                                 const at::Tensor& num_draft, const at::Tensor& temperature,
                                 const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset,
                                 bool per_row_seed) {
  constexpr const char* op = "diversed::verify_logits";
  check_pair(draft_logits, target_logits, op);
  const int64_t B = draft_logits.size(0), K = draft_logits.size(1), V = draft_logits.size(2);
  TORCH_CHECK(target_logits.size(1) == K + 1, op, ": target_logits must be [B, K+1, V]");
  check_float_vector(temperature, B, op, "temperature");
  check_verify_layouts(op, draft_tokens, weight, num_draft, uniforms, seeds, B, K);
  check_cuda_device(op, draft_logits, target_logits, draft_tokens, temperature);

  const c10::cuda::CUDAGuard guard(draft_logits.device());
  VerifyCall call(draft_tokens, weight, num_draft, uniforms, seeds, offset, per_row_seed, B, K, V);
  if (B == 0) return call.outputs();
  // Softmax normalisers of the rows each request reads, written and read back by its own block.
  static_assert(sizeof(SoftmaxStats) == 2 * sizeof(float), "SoftmaxStats is stored as two floats");
  const at::Tensor scratch = at::empty({2 * logits_scratch_size(B, K)}, draft_logits.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_logits.scalar_type(), "verify_logits_cuda", [&] {
    launch_verify_logits(call.params, cuda_data<scalar_t>(draft_logits), cuda_data<scalar_t>(target_logits),
                         temperature.data_ptr<float>(), reinterpret_cast<SoftmaxStats*>(scratch.data_ptr<float>()),
                         stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return call.outputs();
}

}  // namespace
}  // namespace gpu

TORCH_LIBRARY_IMPL(diversed, CUDA, m) {
  m.impl("verify_probs", &gpu::verify_probs_cuda);
  m.impl("verify_logits", &gpu::verify_logits_cuda);
}

}  // namespace diversed
