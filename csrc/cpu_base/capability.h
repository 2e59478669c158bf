// The run-time choice between the per-instruction-set builds of the CPU kernels, shared by both native floors (each
// declares its own entry points: csrc/cpu/cpu_dispatch.h, csrc/forward/forward_dispatch.h).
//
// DIVERSED_CPU_CAPABILITY=baseline|avx2|avx512 caps the choice (the tests compare all three); otherwise the widest
// build the CPU runs is used. The builds give bitwise-identical results, so the choice only changes speed. Torch-free.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#define DIVERSED_HAS_X86_BUILDS 1  // the AVX2 and AVX-512 builds exist beside the baseline
#endif

namespace diversed {
namespace cpu {

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

// DIVERSED_CPU_CALL(verify_probs<T>, args...) runs the build cpu_capability() picks: the kernel's definitions in
// diversed::cpu::{avx512, avx2, baseline}, declared by the floor's dispatch header.
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
