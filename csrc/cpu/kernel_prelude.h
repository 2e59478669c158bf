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
#include <vector>

#include "../common/problems.h"
#include "../common/verify_math.h"

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
  using Runner = void (*)(int64_t begin, int64_t end, Thunk thunk, const void* body);

  explicit constexpr ParallelFor(Runner runner) : runner_(runner) {}

  // Calls body(b, e) on disjoint sub-ranges that cover [begin, end), possibly on several threads at once; a task is
  // one index (grain 1): the kernels' tasks are whole rows or vocabulary chunks.
  template <typename Body>
  void operator()(int64_t begin, int64_t end, const Body& body) const {
    runner_(begin, end, [](const void* f, int64_t b, int64_t e) { (*static_cast<const Body*>(f))(b, e); }, &body);
  }

 private:
  Runner runner_;
};

}  // namespace cpu
}  // namespace diversed
