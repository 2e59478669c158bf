// The entry points of the verify and stats kernel builds (cpu_kernels.h compiled per instruction set), which
// DIVERSED_CPU_CALL (../cpu_base/capability.h) picks between at run time. Torch-free, like the kernels.
#pragma once

#include <cstdint>

#include "../cpu_base/capability.h"
#include "kernel_prelude.h"

namespace diversed {
namespace cpu {

// T is float, double, HalfBits or BFloat16Bits (the instantiations in cpu_kernels.h). The verify kernels take the
// draft's element type TD and the target's TT: equal, or two different ones of float, HalfBits and BFloat16Bits; so
// do distribution_features' and gate_statistics'.
#define DIVERSED_DECLARE_CPU_KERNELS(capability)                                                                      \
  namespace capability {                                                                                              \
  template <typename TD, typename TT>                                                                                 \
  void verify_probs(const VerifyProblem& problem, const TD* draft_probs, const TT* target_probs,                      \
                    const ParallelFor& parallel_for);                                                                 \
  template <typename TD, typename TT>                                                                                 \
  void verify_logits(const VerifyProblem& problem, const TD* draft_logits, const TT* target_logits,                   \
                     const ParallelFor& parallel_for);                                                                \
  template <typename T>                                                                                               \
  void token_stats(const PairProblem<T>& pair, const TokenStatsOut& out, const ParallelFor& parallel_for);            \
  template <typename T>                                                                                               \
  void mix(const PairProblem<T>& pair, const float* weight, float* mixture, const ParallelFor& parallel_for);         \
  template <typename T>                                                                                               \
  void mixture_divergence(const PairProblem<T>& pair, int64_t grid_points, float log_floor, float* table,             \
                          const ParallelFor& parallel_for);                                                           \
  template <typename TD, typename TT>                                                                                 \
  void distribution_features(const FeaturesProblem& problem, const TD* draft_logits, const TT* target_logits,        \
                             float* features, const ParallelFor& parallel_for);                                       \
  template <typename TD, typename TT>                                                                                 \
  void gate_statistics(const FeaturesProblem& problem, const int64_t* draft_tokens, const TD* draft, bool draft_probs, \
                       const TT* target_logits, float* drafted, float* rejected, const ParallelFor& parallel_for);    \
  template <typename T>                                                                                               \
  void value_flags(const T* values, int64_t rows, int64_t vocab, bool from_logits, int32_t* flags,                    \
                   const ParallelFor& parallel_for);                                                                  \
  }

DIVERSED_DECLARE_CPU_KERNELS(baseline)
#ifdef DIVERSED_HAS_X86_BUILDS
DIVERSED_DECLARE_CPU_KERNELS(avx2)
DIVERSED_DECLARE_CPU_KERNELS(avx512)
#endif
#undef DIVERSED_DECLARE_CPU_KERNELS

}  // namespace cpu
}  // namespace diversed
