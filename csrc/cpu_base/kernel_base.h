// What every CPU kernel build takes from outside its own headers, shared by both native floors: the verify kernels
// (csrc/cpu) and the lean forward (csrc/forward). Torch-free: the standard headers, the vector intrinsics, the exp of
// exp_math.h, and the ParallelFor through which a binding lends the kernels its threads.
//
// The kernels are compiled once per instruction set (csrc/cpu/kernels_*.cpp, csrc/forward/forward_kernels_*.cpp), and
// an AVX2 or AVX-512 build must include every outside header BEFORE its target pragma (begin_avx2.h): inline functions
// of the standard library must keep their default-target definitions, or the linker could hand AVX2 code to a CPU
// without it. So the kernel headers include their floor's prelude and these shared headers only; a header they need
// goes here.
#pragma once

#if defined(__GNUC__)
// exp_nonpositive and the other vector templates are instantiated for the AVX2 and AVX-512 builds' vectors from the
// kernels' functions and lambdas, where gcc warns that an out-of-line copy returning such a vector would have another
// ABI. They are always inlined into the kernels (no copy exists), so no call crosses that ABI. Set here, before the
// headers that define them: gcc reads the setting at the place it reports, the template's definition.
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>  // the explicit vector instructions of the AVX2 and AVX-512 builds
#endif

#include "../common/exp_math.h"

namespace diversed {
namespace cpu {

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

// Elements of work below which a task is not worth a fork (torch's own grain for element-wise loops).
constexpr int64_t kMinTaskElements = 32768;

// The grain, in tasks of `elements_per_task` elements each, that keeps every fork worth its cost.
inline int64_t grain_for(int64_t elements_per_task) {
  return std::max<int64_t>(1, kMinTaskElements / std::max<int64_t>(1, elements_per_task));
}

}  // namespace cpu
}  // namespace diversed
