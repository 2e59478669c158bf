// The verify, stats and check kernels, written once and compiled once per instruction set (kernels_baseline.cpp,
// kernels_avx2.cpp, kernels_avx512.cpp) inside the namespace diversed::cpu::DIVERSED_CPU_CAPABILITY; cpu_dispatch.h
// declares them and DIVERSED_CPU_CALL picks a build at run time.
// This header gathers the kernel headers and instantiates the entry points for every element type the binding
// dispatches to.
#ifndef DIVERSED_CPU_CAPABILITY
#error "define DIVERSED_CPU_CAPABILITY and DIVERSED_CPU_VECTOR_FLOATS before including cpu_kernels.h (kernels_*.cpp)"
#endif

#include "check_kernels.h"
#include "kernel_prelude.h"
#include "stats_kernels.h"
#include "verify_kernels.h"

namespace diversed {
namespace cpu {
namespace DIVERSED_CPU_CAPABILITY {

#define DIVERSED_INSTANTIATE_CPU_KERNELS(T)                                                                           \
  template void verify_probs<T>(const VerifyProblem&, const T*, const T*, const ParallelFor&);                        \
  template void verify_logits<T>(const VerifyProblem&, const T*, const T*, const ParallelFor&);              \
  template void token_stats<T>(const PairProblem<T>&, const TokenStatsOut&, const ParallelFor&);                      \
  template void mix<T>(const PairProblem<T>&, const float*, float*, const ParallelFor&);                             \
  template void value_flags<T>(const T*, int64_t, int64_t, bool, int32_t*, const ParallelFor&);

DIVERSED_INSTANTIATE_CPU_KERNELS(float)
DIVERSED_INSTANTIATE_CPU_KERNELS(double)
DIVERSED_INSTANTIATE_CPU_KERNELS(HalfBits)
DIVERSED_INSTANTIATE_CPU_KERNELS(BFloat16Bits)
#undef DIVERSED_INSTANTIATE_CPU_KERNELS

}  // namespace DIVERSED_CPU_CAPABILITY
}  // namespace cpu
}  // namespace diversed
