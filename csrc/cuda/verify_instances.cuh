// Which instances of the four verify launchers exist, and where. Each family-and-input pair of launchers is compiled
// in a translation unit of its own (verify_{block,split}_{probs,logits}.cu), so that a build compiles the four sets
// of kernels in parallel rather than one after another in ops_cuda.cu; ops_cuda.cu declares them extern and only
// calls them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "split_kernels.cuh"
#include "verify_kernels.cuh"

// Every (draft, target) element-type pair the bindings dispatch (common/op_outputs.h, dispatch_verify_types): each
// type with itself, and each pair of distinct types among float and the two 16-bit types.
#define DX_VERIFY_TYPE_PAIRS(X)                                                                          \
  X(float, float) X(double, double) X(__half, __half) X(__nv_bfloat16, __nv_bfloat16) X(float, __half) \
  X(float, __nv_bfloat16) X(__half, float) X(__half, __nv_bfloat16) X(__nv_bfloat16, float)            \
  X(__nv_bfloat16, __half)

// One instance of a launcher: `prefix` is empty for the explicit instantiation, `extern` for the declaration.
#define DX_BLOCK_PROBS_INSTANCE(prefix, TD, TT) \
  prefix template void launch_verify_probs<TD, TT>(const VerifyProblem&, const TD*, const TT*, cudaStream_t);
#define DX_BLOCK_LOGITS_INSTANCE(prefix, TD, TT)                                                                 \
  prefix template void launch_verify_logits<TD, TT>(const VerifyProblem&, const TD*, const TT*, SoftmaxStats*, \
                                                    cudaStream_t);
#define DX_SPLIT_PROBS_INSTANCE(prefix, TD, TT)                                                             \
  prefix template void launch_split_verify_probs<TD, TT>(const VerifyProblem&, const TD*, const TT*,      \
                                                         const SplitPlan&, const SplitScratch&, cudaStream_t);
#define DX_SPLIT_LOGITS_INSTANCE(prefix, TD, TT)                                                            \
  prefix template void launch_split_verify_logits<TD, TT>(const VerifyProblem&, const TD*, const TT*,     \
                                                          const SplitPlan&, const SplitScratch&, cudaStream_t);
