// Glue shared by the CUDA op bindings (verify_cuda.cu, stats_cuda.cu): the kernels' element types, device checks and
// typed data pointers. Argument layouts are checked by csrc/common/op_checks.h, as on the CPU; the kernels themselves
// (verify_kernels.cuh) never see torch.
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

}  // namespace gpu
}  // namespace diversed
