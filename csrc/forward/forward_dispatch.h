// The entry points of the lean forward's kernel builds (forward_kernels.h compiled per instruction set), which
// DIVERSED_CPU_CALL (../cpu_base/capability.h) picks between at run time, and the choice of the int8 product tiles.
// Torch-free, like the kernels.
#pragma once

#include <cstdint>

#include "../cpu_base/capability.h"
#include "../cpu_base/kernel_base.h"
#include "forward_problems.h"
#include "int8_gemm.h"

namespace diversed {
namespace cpu {

#define DIVERSED_DECLARE_FORWARD_KERNELS(capability)                                                                  \
  namespace capability {                                                                                              \
  void llama_rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t width, float* out);       \
  void llama_rotate(float* qkv, const float* cos, const float* sin, int64_t tokens, int64_t row_stride, int64_t heads, \
                    int64_t head_dim);                                                                                \
  void llama_attention(const LlamaAttention& problem, const ParallelFor& parallel_for);                               \
  void llama_silu_mul(const float* gate_up, int64_t tokens, int64_t width, float* out);                               \
  void float_gemm(const FloatGemmProblem& problem, const ParallelFor& parallel_for);                                  \
  }

DIVERSED_DECLARE_FORWARD_KERNELS(baseline)
#ifdef DIVERSED_HAS_X86_BUILDS
DIVERSED_DECLARE_FORWARD_KERNELS(avx2)
DIVERSED_DECLARE_FORWARD_KERNELS(avx512)
#endif
#undef DIVERSED_DECLARE_FORWARD_KERNELS

// The int8 tiles this CPU runs under the DIVERSED_CPU_CAPABILITY cap: VNNI where the AVX-512 build may run and the CPU
// has it, else AVX2 where that build may run, else the portable loops. cpu_capability() has checked the CPU for the
// rest of AVX-512 (F, BW, VL) and for AVX2, so VNNI is the one feature left to ask about.
inline int8::Isa int8_isa() {
#ifdef DIVERSED_HAS_X86_BUILDS
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  switch (cpu_capability()) {
    case Capability::kAvx512: return vnni ? int8::Isa::kVnni : int8::Isa::kAvx2;
    case Capability::kAvx2: return int8::Isa::kAvx2;
    default: return int8::Isa::kPortable;
  }
#else
  return int8::Isa::kPortable;
#endif
}

}  // namespace cpu
}  // namespace diversed
