// Glue shared by the CUDA op bindings (verify_cuda.cu, stats_cuda.cu): the kernels' element types, device checks and
// typed data pointers. The kernels themselves (verify_kernels.cuh) never see torch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>

namespace diversed {
namespace gpu {

// torch's 16-bit types have the same bits as CUDA's; the kernels are written over the CUDA types.
template <typename scalar_t>
struct CudaType {
  using type = scalar_t;
};
template <>
struct CudaType<c10::Half> {
  using type = __half;
};
template <>
struct CudaType<c10::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename scalar_t>
const typename CudaType<scalar_t>::type* cuda_data(const at::Tensor& tensor) {
  return reinterpret_cast<const typename CudaType<scalar_t>::type*>(tensor.data_ptr<scalar_t>());
}

inline void check_same_device(const char* op, const at::Device& device, const at::Tensor& tensor) {
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
inline void check_grid_rows(const char* op, int64_t rows) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), op, ": too many rows for one launch (", rows, ")");
}

// The CPU wrappers' checks (csrc/cpu/verify_cpu.cpp, logits_cpu.cpp), the last line of defence behind the Python
// layer, which has already produced these exact layouts.
inline void check_float_vector(const at::Tensor& tensor, int64_t size, const char* op, const char* name) {
  TORCH_CHECK(tensor.scalar_type() == at::kFloat && tensor.is_contiguous() && tensor.numel() == size, op, ": ", name,
              " must be contiguous float32 with ", size, " elements");
}

inline void check_pair(const at::Tensor& draft, const at::Tensor& target, const char* op) {
  TORCH_CHECK(draft.dim() == 3 && target.dim() == 3, op, ": draft and target must be 3-D");
  TORCH_CHECK(draft.scalar_type() == target.scalar_type(), op, ": draft and target dtypes differ");
  TORCH_CHECK(draft.is_contiguous() && target.is_contiguous(), op, ": draft and target must be contiguous");
  TORCH_CHECK(draft.size(2) > 0 && draft.size(2) == target.size(2), op, ": vocabulary sizes differ or are zero");
  TORCH_CHECK(draft.size(0) == target.size(0), op, ": batch sizes differ");
}

// Everything of a verify call besides the distributions and the greedy flags / temperatures.
inline void check_verify_layouts(const char* op, const at::Tensor& draft_tokens, const at::Tensor& weight,
                                 const at::Tensor& num_draft, const c10::optional<at::Tensor>& uniforms,
                                 const at::Tensor& seeds, int64_t batch, int64_t num_positions) {
  const int64_t B = batch, K = num_positions;
  TORCH_CHECK(draft_tokens.scalar_type() == at::kLong && draft_tokens.is_contiguous() && draft_tokens.numel() == B * K,
              op, ": draft_tokens must be contiguous int64 [B, K]");
  check_float_vector(weight, B * K, op, "weight");
  TORCH_CHECK(num_draft.scalar_type() == at::kLong && num_draft.is_contiguous() && num_draft.numel() == B, op,
              ": num_draft must be contiguous int64 [B]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.is_contiguous() && seeds.numel() == B, op,
              ": seeds must be contiguous int64 [B]");
  if (uniforms.has_value()) {
    TORCH_CHECK(uniforms->scalar_type() == at::kDouble && uniforms->is_contiguous() && uniforms->numel() == B * (K + 1),
                op, ": uniforms must be contiguous float64 [B, K+1]");
    check_same_device(op, draft_tokens.device(), *uniforms);
  }
  check_cuda_device(op, draft_tokens, weight, num_draft, seeds);
  check_grid_rows(op, B);
}

}  // namespace gpu
}  // namespace diversed
