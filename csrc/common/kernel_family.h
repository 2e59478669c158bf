// Which CUDA verify kernels a call on CUDA tensors runs: one process-wide setting, chosen from Python with
// diversed_ext.set_cuda_kernels (csrc/ops.cpp holds it, csrc/cuda/ops_cuda.cu reads it at each call).
//   kBlock: one thread block per request;
//   kSplit: each request's vocabulary spread over many blocks (csrc/cuda/split_kernels.cuh), without FLy;
//   kAuto (the default): split, and block for a call that asks for FLy.
#pragma once

#include <atomic>

namespace diversed {

enum CudaKernelFamily : int { kBlockKernels = 0, kSplitKernels = 1, kAutoKernels = 2 };

extern std::atomic<int> cuda_kernel_family;

}  // namespace diversed
