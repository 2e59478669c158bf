// Everything the CPU kernels take from outside their own headers, and the torch-free types they share with their
// binding (ops_cpu.cpp).
//
// The kernels are compiled once per instruction set (kernels_baseline.cpp, kernels_avx2.cpp), and the AVX2 build must
// include every outside header BEFORE its target pragma: inline functions of the standard library must keep their
// default-target definitions, or the linker could hand AVX2 code to a CPU without it. So the kernel headers include
// this file and nothing else from outside; a header they need goes here.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>  // the explicit fused multiply-adds of float_gemm.h
#endif

#include "../common/problems.h"
#include "../common/verify_math.h"
#include "forward_problems.h"

namespace diversed {
namespace cpu {

// The 16-bit element types the kernels are written over: the bits of torch's Half and BFloat16, without torch.
struct HalfBits {
  uint16_t bits;
};
struct BFloat16Bits {
  uint16_t bits;
};

// How the kernels spread independent tasks over threads. The binding supplies at::parallel_for, which keeps torch out
// of the kernels; a function pointer rather than a template parameter, because the kernels are compiled apart from
// the binding, once per instruction set.
class ParallelFor {
 public:
  using Thunk = void (*)(const void* body, int64_t begin, int64_t end);
  using Runner = void (*)(int64_t begin, int64_t end, int64_t grain, Thunk thunk, const void* body);
  using ThreadCount = int (*)();

  constexpr ParallelFor(Runner runner, ThreadCount threads) : runner_(runner), threads_(threads) {}

  // Calls body(b, e) on disjoint sub-ranges that cover [begin, end), possibly on several threads at once, each of at
  // least `grain` indices (but the last): a range of at most `grain` indices runs on the calling thread, with no fork
  // and no wait, which is what small calls need on a loaded machine.
  template <typename Body>
  void operator()(int64_t begin, int64_t end, int64_t grain, const Body& body) const {
    runner_(begin, end, grain, [](const void* f, int64_t b, int64_t e) { (*static_cast<const Body*>(f))(b, e); },
            &body);
  }
  // One task per index: for tasks that are whole rows of a large vocabulary.
  template <typename Body>
  void operator()(int64_t begin, int64_t end, const Body& body) const {
    (*this)(begin, end, 1, body);
  }
  int threads() const { return threads_(); }

 private:
  Runner runner_;
  ThreadCount threads_;
};

// The flags value_flags (check_kernels.h) sets for a row; diversed_ext/ops/_values.py reads the same bits.
constexpr int32_t kValueFlagNan = 1;
constexpr int32_t kValueFlagNegative = 2;
constexpr int32_t kValueFlagPositiveInfinity = 4;
constexpr int32_t kValueFlagNoMass = 8;
// Set by verify_logits with flags (verify_kernels.h) on a drafted position whose token id lies outside [0, V).
constexpr int32_t kValueFlagBadToken = 16;

// Elements of work below which a task is not worth a fork (torch's own grain for element-wise loops).
constexpr int64_t kMinTaskElements = 32768;

// The grain, in tasks of `elements_per_task` elements each, that keeps every fork worth its cost.
inline int64_t grain_for(int64_t elements_per_task) {
  return std::max<int64_t>(1, kMinTaskElements / std::max<int64_t>(1, elements_per_task));
}

}  // namespace cpu
}  // namespace diversed
