// The entry points of the CPU kernel builds (cpu_kernels.h compiled per instruction set) and the run-time choice
// between them.
//
// DIVERSED_CPU_CAPABILITY=baseline|avx2 forces one (the tests compare both); otherwise AVX2 is used where the CPU has
// it. The builds give bitwise-identical results, so the choice only changes speed. Torch-free, like the kernels.
#pragma once

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
                     const ParallelFor& parallel_for);                                                                \
  template <typename T>                                                                                               \
  void token_stats(const PairProblem<T>& pair, const TokenStatsOut& out, const ParallelFor& parallel_for);            \
  template <typename T>                                                                                               \
  void mix(const PairProblem<T>& pair, const float* weight, float* mixture, const ParallelFor& parallel_for);         \
  }

DIVERSED_DECLARE_CPU_KERNELS(baseline)
#if defined(__x86_64__) && defined(__GNUC__)
#define DIVERSED_HAS_AVX2_BUILD 1
DIVERSED_DECLARE_CPU_KERNELS(avx2)
#endif
#undef DIVERSED_DECLARE_CPU_KERNELS

inline bool use_avx2() {
#ifdef DIVERSED_HAS_AVX2_BUILD
  const char* forced = std::getenv("DIVERSED_CPU_CAPABILITY");
  if (forced != nullptr && std::strcmp(forced, "baseline") == 0) return false;
  static const bool supported = __builtin_cpu_supports("avx2");
  return supported;
#else
  return false;
#endif
}

// DIVERSED_CPU_CALL(verify_probs<T>, args...) runs the build use_avx2() picks.
#ifdef DIVERSED_HAS_AVX2_BUILD
#define DIVERSED_CPU_CALL(kernel, ...)                                                                                \
  (::diversed::cpu::use_avx2() ? ::diversed::cpu::avx2::kernel(__VA_ARGS__)                                           \
                               : ::diversed::cpu::baseline::kernel(__VA_ARGS__))
#else
#define DIVERSED_CPU_CALL(kernel, ...) ::diversed::cpu::baseline::kernel(__VA_ARGS__)
#endif

}  // namespace cpu
}  // namespace diversed
