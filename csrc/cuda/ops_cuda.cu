// CUDA bindings of the four `diversed` ops: argument and device checks, output allocation, one kernel launch per call.
// Nothing here reads device memory, so a call never syncs with the host (CUDA graphs can capture it). The kernels are
// torch-free headers: verify_kernels.cuh (verify_probs, verify_logits) and stats_kernels.cuh (token_stats, mix).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <tuple>

#include "../common/op_checks.h"
#include "../common/op_outputs.h"
#include "stats_kernels.cuh"
#include "verify_kernels.cuh"

namespace diversed {
namespace gpu {
namespace {

// The kernels are written over CUDA's 16-bit types.
template <typename scalar_t>
using CudaElement = kernel_element_t<__half, __nv_bfloat16, scalar_t>;

void check_same_device(const char* op, const at::Device& device, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.device() == device, op, ": every tensor must be on the same device (", device, "), got one on ",
              tensor.device());
}

// The first tensor decides the device, which must be a CUDA device; the rest must share it.
template <typename... Tensors>
void check_cuda_device(const char* op, const at::Tensor& first, const Tensors&... rest) {
  TORCH_CHECK(first.is_cuda(), op, ": CUDA kernel called with tensors on ", first.device());
  (check_same_device(op, first.device(), rest), ...);
}

// One thread block per row: the grid's x dimension bounds the number of rows of one launch.
void check_grid_rows(const char* op, int64_t rows) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), op, ": too many rows for one launch (", rows, ")");
}

using VerifyTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using OptionalTensor = c10::optional<at::Tensor>;

// Every tensor argument on one CUDA device (the draft's may be absent); one block per request must fit in the grid.
void check_verify_devices(const char* op, const at::Tensor& draft_tokens, const OptionalTensor& draft,
                          const at::Tensor& target, const VerifyOptionals& optional) {
  check_cuda_device(op, target, draft_tokens);
  for (const auto* tensor : {&draft, &optional.weight, &optional.num_draft, &optional.greedy_or_temperature,
                             &optional.uniforms, &optional.seeds})
    if (tensor->has_value()) check_same_device(op, target.device(), **tensor);
  check_grid_rows(op, target.size(0));
}

VerifyTuple verify_probs_cuda(const at::Tensor& draft_tokens, const OptionalTensor& draft_probs,
                              const at::Tensor& target_probs, const OptionalTensor& weight,
                              const OptionalTensor& num_draft, const OptionalTensor& greedy,
                              const OptionalTensor& uniforms, const OptionalTensor& seeds, int64_t offset,
                              bool per_row_seed, double weight_value, c10::optional<int64_t> seed) {
  const VerifyOptionals optional{weight, num_draft, greedy, uniforms, seeds};
  check_verify_args(VerifyInput::kProbs, draft_tokens, draft_probs, target_probs, optional);
  check_verify_devices(kVerifyProbsOp, draft_tokens, draft_probs, target_probs, optional);
  const c10::cuda::CUDAGuard guard(target_probs.device());
  const VerifyCall call = start_verify(VerifyInput::kProbs, draft_tokens, target_probs, optional,
                                       VerifyScalars{weight_value, 1.0, seed, offset, per_row_seed});
  if (call.empty()) return call.result();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, target_probs.scalar_type(), "verify_probs_cuda", [&] {
    using T = CudaElement<scalar_t>;
    launch_verify_probs(call.problem, kernel_data<T, scalar_t>(draft_probs), kernel_data<T, scalar_t>(target_probs),
                        stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return call.result();
}

VerifyTuple verify_logits_cuda(const at::Tensor& draft_tokens, const OptionalTensor& draft_logits,
                               const at::Tensor& target_logits, const OptionalTensor& weight,
                               const OptionalTensor& num_draft, const OptionalTensor& temperature,
                               const OptionalTensor& uniforms, const OptionalTensor& seeds, int64_t offset,
                               bool per_row_seed, double weight_value, double temperature_value,
                               c10::optional<int64_t> seed) {
  const VerifyOptionals optional{weight, num_draft, temperature, uniforms, seeds};
  check_verify_args(VerifyInput::kLogits, draft_tokens, draft_logits, target_logits, optional);
  check_verify_devices(kVerifyLogitsOp, draft_tokens, draft_logits, target_logits, optional);
  const c10::cuda::CUDAGuard guard(target_logits.device());
  const VerifyCall call = start_verify(VerifyInput::kLogits, draft_tokens, target_logits, optional,
                                       VerifyScalars{weight_value, temperature_value, seed, offset, per_row_seed});
  if (call.empty()) return call.result();
  // Softmax normalisers of the rows each request reads, written and read back by its own block.
  static_assert(sizeof(SoftmaxStats) == 2 * sizeof(float), "SoftmaxStats is stored as two floats");
  const int64_t scratch_entries = logits_scratch_size(call.problem.batch, call.problem.num_positions);
  const at::Tensor scratch = at::empty({2 * scratch_entries}, target_logits.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, target_logits.scalar_type(), "verify_logits_cuda", [&] {
    using T = CudaElement<scalar_t>;
    launch_verify_logits(call.problem, kernel_data<T, scalar_t>(draft_logits), kernel_data<T, scalar_t>(target_logits),
                         reinterpret_cast<SoftmaxStats*>(scratch.data_ptr<float>()), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return call.result();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> token_stats_cuda(
    const at::Tensor& draft, const at::Tensor& target, const at::Tensor& tokens, const at::Tensor& temperature,
    bool from_logits) {
  check_token_stats_args(draft, target, tokens, temperature);
  check_cuda_device(kTokenStatsOp, draft, target, tokens, temperature);
  check_grid_rows(kTokenStatsOp, draft.size(0) * draft.size(1));
  const c10::cuda::CUDAGuard guard(draft.device());
  const TokenStatsCall call = start_token_stats(draft, tokens);
  if (call.empty()) return call.result();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "token_stats_cuda", [&] {
    launch_token_stats(pair_problem<CudaElement<scalar_t>, scalar_t>(draft, target, temperature, from_logits),
                       call.out, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return call.result();
}

// nu = w p + (1 - w) q materialised as float32 [B, K, V]; target may carry extra positions (K+1), which are ignored.
at::Tensor mix_cuda(const at::Tensor& draft, const at::Tensor& target, const at::Tensor& weight,
                    const at::Tensor& temperature, bool from_logits) {
  check_mix_args(draft, target, weight, temperature);
  check_cuda_device(kMixOp, draft, target, weight, temperature);
  check_grid_rows(kMixOp, draft.size(0) * draft.size(1));
  const c10::cuda::CUDAGuard guard(draft.device());
  at::Tensor mixture = allocate_mixture(draft);
  if (mixture.numel() == 0) return mixture;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, draft.scalar_type(), "mix_cuda", [&] {
    launch_mix(pair_problem<CudaElement<scalar_t>, scalar_t>(draft, target, temperature, from_logits),
               weight.data_ptr<float>(), mixture.data_ptr<float>(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return mixture;
}

}  // namespace
}  // namespace gpu

TORCH_LIBRARY_IMPL(diversed, CUDA, m) {
  m.impl("verify_probs", &gpu::verify_probs_cuda);
  m.impl("verify_logits", &gpu::verify_logits_cuda);
  m.impl("token_stats", &gpu::token_stats_cuda);
  m.impl("mix", &gpu::mix_cuda);
}

}  // namespace diversed
