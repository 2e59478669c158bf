// CUDA bindings of diversed::verify_probs and diversed::verify_logits: checks, allocation, one launch per call.
// The kernels are in verify_kernels.cuh; nothing here reads device memory, so a call never syncs with the host.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../common/op_checks.h"
#include "../common/op_outputs.h"
#include "cuda_binding.h"
#include "verify_kernels.cuh"

namespace diversed {
namespace gpu {
namespace {

using VerifyTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Every tensor argument on one CUDA device; one block per request must fit in the grid.
void check_verify_devices(const char* op, const at::Tensor& draft_tokens, const at::Tensor& draft,
                          const at::Tensor& target, const at::Tensor& weight, const at::Tensor& num_draft,
                          const at::Tensor& greedy_or_temperature, const c10::optional<at::Tensor>& uniforms,
                          const at::Tensor& seeds) {
  check_cuda_device(op, draft, target, draft_tokens, weight, num_draft, greedy_or_temperature, seeds);
  if (uniforms.has_value()) check_same_device(op, draft.device(), *uniforms);
  check_grid_rows(op, draft.size(0));
}

// The kernel parameters over freshly allocated (and, under the test hook, poisoned) outputs.
VerifyProblem verify_params(const at::Tensor& draft_tokens, const at::Tensor& weight, const at::Tensor& num_draft,
                            const c10::optional<at::Tensor>& uniforms, const at::Tensor& seeds, int64_t offset,
                            bool per_row_seed, int64_t B, int64_t K, int64_t V, VerifyOutputs& out) {
  return VerifyProblem{B, K, V, draft_tokens.data_ptr<int64_t>(), weight.data_ptr<float>(),
                       num_draft.data_ptr<int64_t>(), /*greedy=*/nullptr,
                       uniforms.has_value() ? uniforms->data_ptr<double>() : nullptr, seeds.data_ptr<int64_t>(),
                       offset, per_row_seed, out.tokens.data_ptr<int64_t>(), out.num_accepted.data_ptr<int32_t>(),
                       out.accept_prob.data_ptr<float>()};
}

VerifyTuple verify_probs_cuda(const at::Tensor& draft_tokens, const at::Tensor& draft_probs,
                              const at::Tensor& target_probs, const at::Tensor& weight, const at::Tensor& num_draft,
                              const at::Tensor& greedy, const c10::optional<at::Tensor>& uniforms,
                              const at::Tensor& seeds, int64_t offset, bool per_row_seed) {
  constexpr const char* op = "diversed::verify_probs";
  check_verify_args(op, draft_tokens, draft_probs, target_probs, weight, num_draft, uniforms, seeds);
  const int64_t B = draft_probs.size(0), K = draft_probs.size(1), V = draft_probs.size(2);
  check_greedy(op, greedy, B);
  check_verify_devices(op, draft_tokens, draft_probs, target_probs, weight, num_draft, greedy, uniforms, seeds);

  const c10::cuda::CUDAGuard guard(draft_probs.device());
  VerifyOutputs out = allocate_verify_outputs(draft_tokens, B, K);
  if (B == 0) return out.as_tuple();
  VerifyProblem params = verify_params(draft_tokens, weight, num_draft, uniforms, seeds, offset, per_row_seed, B, K, V,
                                       out);
  params.greedy = greedy.data_ptr<bool>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_probs.scalar_type(), "verify_probs_cuda", [&] {
    launch_verify_probs(params, cuda_data<scalar_t>(draft_probs), cuda_data<scalar_t>(target_probs), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out.as_tuple();
}

VerifyTuple verify_logits_cuda(const at::Tensor& draft_tokens, const at::Tensor& draft_logits,
                               const at::Tensor& target_logits, const at::Tensor& weight, const at::Tensor& num_draft,
                               const at::Tensor& temperature, const c10::optional<at::Tensor>& uniforms,
                               const at::Tensor& seeds, int64_t offset, bool per_row_seed) {
  constexpr const char* op = "diversed::verify_logits";
  check_verify_args(op, draft_tokens, draft_logits, target_logits, weight, num_draft, uniforms, seeds);
  const int64_t B = draft_logits.size(0), K = draft_logits.size(1), V = draft_logits.size(2);
  check_float_vector(temperature, B, op, "temperature");
  check_verify_devices(op, draft_tokens, draft_logits, target_logits, weight, num_draft, temperature, uniforms, seeds);

  const c10::cuda::CUDAGuard guard(draft_logits.device());
  VerifyOutputs out = allocate_verify_outputs(draft_tokens, B, K);
  if (B == 0) return out.as_tuple();
  const VerifyProblem params = verify_params(draft_tokens, weight, num_draft, uniforms, seeds, offset, per_row_seed, B,
                                             K, V, out);
  // Softmax normalisers of the rows each request reads, written and read back by its own block.
  static_assert(sizeof(SoftmaxStats) == 2 * sizeof(float), "SoftmaxStats is stored as two floats");
  const at::Tensor scratch = at::empty({2 * logits_scratch_size(B, K)}, draft_logits.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft_logits.scalar_type(), "verify_logits_cuda", [&] {
    launch_verify_logits(params, cuda_data<scalar_t>(draft_logits), cuda_data<scalar_t>(target_logits),
                         temperature.data_ptr<float>(), reinterpret_cast<SoftmaxStats*>(scratch.data_ptr<float>()),
                         stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out.as_tuple();
}

}  // namespace
}  // namespace gpu

TORCH_LIBRARY_IMPL(diversed, CUDA, m) {
  m.impl("verify_probs", &gpu::verify_probs_cuda);
  m.impl("verify_logits", &gpu::verify_logits_cuda);
}

}  // namespace diversed
