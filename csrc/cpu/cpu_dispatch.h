// The entry points of the CPU kernel builds (cpu_kernels.h compiled per instruction set) and the run-time choice
// between them.
//
// DIVERSED_CPU_CAPABILITY=baseline|avx2|avx512 caps the choice (the tests compare all three); otherwise the widest
// build the CPU runs is used. The builds give bitwise-identical results, so the choice only changes speed. Torch-free,
// like the kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kernel_prelude.h"

namespace diversed {
namespace cpu {

// T is float, double, HalfBits or BFloat16Bits (the instantiations in cpu_kernels.h).
#define DIVERSED_DECLARE_CPU_KERNELS(capability)                                                                      \
  namespace capability {                                                                                              \
  template <typename T>                                                                                               \
  void verify_probs(const VerifyProblem& problem, const T* draft_probs, const T* target_probs,                        \
                    const ParallelFor& parallel_for);                                                                 \
  template <typename T>                                                                                               \
  void verify_logits(const VerifyProblem& problem, const T* draft_logits, const T* target_logits,                     \
                     const ParallelFor& parallel_for, int32_t* row_flags);                                            \
  template <typename T>                                                                                               \
  void token_stats(const PairProblem<T>& pair, const TokenStatsOut& out, const ParallelFor& parallel_for);            \
  template <typename T>                                                                                               \
  void mix(const PairProblem<T>& pair, const float* weight, float* mixture, const ParallelFor& parallel_for);         \
  template <typename T>                                                                                               \
  void value_flags(const T* values, int64_t rows, int64_t vocab, bool from_logits, int32_t* flags,                    \
                   const ParallelFor& parallel_for);                                                                  \
  void llama_rms_norm(const float* x, const float* weight, float eps, int64_t rows, int64_t width, float* out);       \
  void llama_rotate(float* qkv, const float* cos, const float* sin, int64_t tokens, int64_t row_stride, int64_t heads, \
                    int64_t head_dim);                                                                                \
  void llama_attention(const LlamaAttention& problem, const ParallelFor& parallel_for);                               \
  void llama_silu_mul(const float* gate_up, int64_t tokens, int64_t width, float* out);                               \
  void float_gemm(const FloatGemmProblem& problem, const ParallelFor& parallel_for);                                  \
  }

DIVERSED_DECLARE_CPU_KERNELS(baseline)
#if defined(__x86_64__) && defined(__GNUC__)
#define DIVERSED_HAS_X86_BUILDS 1
DIVERSED_DECLARE_CPU_KERNELS(avx2)
DIVERSED_DECLARE_CPU_KERNELS(avx512)
#endif
#undef DIVERSED_DECLARE_CPU_KERNELS

enum class Capability { kBaseline, kAvx2, kAvx512 };

// The best build this CPU runs, capped by DIVERSED_CPU_CAPABILITY when it is set (read on every call, so tests can
// switch builds within one process; a getenv costs tens of nanoseconds). A forced build the CPU lacks is never used.
inline Capability cpu_capability() {
#ifdef DIVERSED_HAS_X86_BUILDS
  static const Capability supported =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
          ? Capability::kAvx512
          : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? Capability::kAvx2
                                                                             : Capability::kBaseline);
  const char* forced = std::getenv("DIVERSED_CPU_CAPABILITY");
  Capability cap = Capability::kAvx512;
  if (forced != nullptr && std::strcmp(forced, "baseline") == 0) cap = Capability::kBaseline;
  if (forced != nullptr && std::strcmp(forced, "avx2") == 0) cap = Capability::kAvx2;
  return std::min(cap, supported);
#else
  return Capability::kBaseline;
#endif
}

// DIVERSED_CPU_CALL(verify_probs<T>, args...) runs the build cpu_capability() picks.
#ifdef DIVERSED_HAS_X86_BUILDS
#define DIVERSED_CPU_CALL(kernel, ...)                                                                                \
  do {                                                                                                                \
    switch (::diversed::cpu::cpu_capability()) {                                                                      \
      case ::diversed::cpu::Capability::kAvx512: ::diversed::cpu::avx512::kernel(__VA_ARGS__); break;                 \
      case ::diversed::cpu::Capability::kAvx2: ::diversed::cpu::avx2::kernel(__VA_ARGS__); break;                     \
      default: ::diversed::cpu::baseline::kernel(__VA_ARGS__);                                                        \
    }                                                                                                                 \
  } while (false)
#else
#define DIVERSED_CPU_CALL(kernel, ...) ::diversed::cpu::baseline::kernel(__VA_ARGS__)
#endif

}  // namespace cpu
}  // namespace diversed
