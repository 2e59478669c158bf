// The verify, stats and check kernels, written once and compiled once per instruction set (kernels_baseline.cpp,
// kernels_avx2.cpp, kernels_avx512.cpp) inside the namespace diversed::cpu::DIVERSED_CPU_CAPABILITY; cpu_dispatch.h
// declares them and DIVERSED_CPU_CALL picks a build at run time.
// This header gathers the kernel headers and instantiates the entry points for every element type the binding
// dispatches to.
#ifndef DIVERSED_CPU_CAPABILITY
#error "define DIVERSED_CPU_CAPABILITY and DIVERSED_CPU_VECTOR_FLOATS before including cpu_kernels.h (kernels_*.cpp)"
#endif

#include "check_kernels.h"
#include "divergence_kernels.h"
#include "features_kernels.h"
#include "gate_kernels.h"
#include "kernel_prelude.h"
#include "stats_kernels.h"
#include "verify_kernels.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

#define DIVERSED_INSTANTIATE_PAIR_KERNELS(TD, TT)                                                                      \
  template void verify_probs<TD, TT>(const VerifyProblem&, const TD*, const TT*, const ParallelFor&);                 \
  template void verify_logits<TD, TT>(const VerifyProblem&, const TD*, const TT*, const ParallelFor&);                \
  template void distribution_features<TD, TT>(const FeaturesProblem&, const TD*, const TT*, float*,                   \
                                              const ParallelFor&);                                                     \
  template void gate_statistics<TD, TT>(const FeaturesProblem&, const int64_t*, const TD*, bool, const TT*, float*,   \
                                        float*, const ParallelFor&);
#define DIVERSED_INSTANTIATE_CPU_KERNELS(T)                                                                           \
  DIVERSED_INSTANTIATE_PAIR_KERNELS(T, T)                                                                              \
  template void token_stats<T>(const PairProblem<T>&, const TokenStatsOut&, const ParallelFor&);                      \
  template void mix<T>(const PairProblem<T>&, const float*, float*, const ParallelFor&);                             \
  template void mixture_divergence<T>(const PairProblem<T>&, int64_t, float, float*, const ParallelFor&);           \
  template void value_flags<T>(const T*, int64_t, int64_t, bool, int32_t*, const ParallelFor&);

DIVERSED_INSTANTIATE_CPU_KERNELS(float)
DIVERSED_INSTANTIATE_CPU_KERNELS(double)
DIVERSED_INSTANTIATE_CPU_KERNELS(HalfBits)
DIVERSED_INSTANTIATE_CPU_KERNELS(BFloat16Bits)
// Draft and target of different types (a server's bfloat16 or float16 draft beside its float32 target rows, read
// without a copy) for verify, distribution_features and gate_statistics, the pairs the binding's dispatch
// (ops_cpu.cpp) reaches.
DIVERSED_INSTANTIATE_PAIR_KERNELS(HalfBits, float)
DIVERSED_INSTANTIATE_PAIR_KERNELS(BFloat16Bits, float)
DIVERSED_INSTANTIATE_PAIR_KERNELS(float, HalfBits)
DIVERSED_INSTANTIATE_PAIR_KERNELS(float, BFloat16Bits)
DIVERSED_INSTANTIATE_PAIR_KERNELS(HalfBits, BFloat16Bits)
DIVERSED_INSTANTIATE_PAIR_KERNELS(BFloat16Bits, HalfBits)
#undef DIVERSED_INSTANTIATE_CPU_KERNELS
#undef DIVERSED_INSTANTIATE_PAIR_KERNELS

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
