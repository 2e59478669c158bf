// Which CUDA verify kernels a call on CUDA tensors runs: one process-wide setting, chosen from Python with
// diversed_ext.set_cuda_kernels (csrc/ops.cpp holds it, csrc/cuda/ops_cuda.cu reads it at each call).
//   kBlock: one thread block per request (the default);
//   kSplit: each request's vocabulary spread over many blocks (csrc/cuda/split_kernels.cuh), without FLy.
#pragma once

#include <atomic>

namespace diversed {

enum CudaKernelFamily : int { kBlockKernels = 0, kSplitKernels = 1 };

extern std::atomic<int> cuda_kernel_family;

}  // namespace diversed
