// CUDA bindings of diversed::token_stats and diversed::mix: one thread block per (row, position) pair of
// distributions, one launch per call, no host sync. Kernels in verify_kernels.cuh.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../common/op_checks.h"
#include "../common/op_outputs.h"
#include "cuda_binding.h"
#include "verify_kernels.cuh"

namespace diversed {
namespace gpu {
namespace {

template <typename scalar_t>
PairParams<typename CudaType<scalar_t>::type> pair_params(const at::Tensor& draft, const at::Tensor& target,
                                                          const at::Tensor& temperature, bool from_logits) {
  return {cuda_data<scalar_t>(draft), cuda_data<scalar_t>(target), draft.size(0), draft.size(1), target.size(1),
          draft.size(2), temperature.data_ptr<float>(), from_logits};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_cuda(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& temperature,
    bool from_logits) {
  constexpr const char* op = "diversed::token_stats";
  check_token_stats_args(op, draft, target, tokens, temperature);
  const int64_t B = draft.size(0), T = draft.size(1);
  check_cuda_device(op, draft, target, tokens, temperature);
  check_grid_rows(op, B * T);

  const c10::cuda::CUDAGuard guard(draft.device());
  TokenStatsOutputs outputs = allocate_token_stats_outputs(draft, B, T);
  if (B * T == 0) return outputs.as_tuple();
  const TokenStatsOut out{tokens.data_ptr<int64_t>(), outputs.target_prob.data_ptr<float>(),
                          outputs.draft_prob.data_ptr<float>(), outputs.total_variation.data_ptr<float>(),
                          outputs.target_logprob.data_ptr<float>(), outputs.draft_logprob.data_ptr<float>()};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "token_stats_cuda", [&] {
    launch_token_stats(pair_params<scalar_t>(draft, target, temperature, from_logits), out, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return outputs.as_tuple();
}

// nu = w p + (1 - w) q materialised as float32 [B, K, V]; target may carry extra positions (K+1), which are ignored.
at::Tensor mix_cuda(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                    const at::Tensor& temperature, bool from_logits) {
  constexpr const char* op = "diversed::mix";
  check_mix_args(op, draft, target, weight, temperature);
  const int64_t B = draft.size(0), K = draft.size(1);
  check_cuda_device(op, draft, target, weight, temperature);
  check_grid_rows(op, B * K);

  const c10::cuda::CUDAGuard guard(draft.device());
  at::Tensor mixture = allocate_mixture(draft);
  if (B * K == 0) return mixture;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "mix_cuda", [&] {
    launch_mix(pair_params<scalar_t>(draft, target, temperature, from_logits), weight.data_ptr<float>(),
               mixture.data_ptr<float>(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return mixture;
}

}  // namespace
}  // namespace gpu

TORCH_LIBRARY_IMPL(diversed, CUDA, m) {
  m.impl("token_stats", &gpu::token_stats_cuda);
  m.impl("mix", &gpu::mix_cuda);
}

}  // namespace diversed
