// The ParallelFor the CPU kernels receive from their bindings: at::parallel_for behind a function pointer, so the
// kernels stay torch-free (kernel_prelude.h). Included by the binding files only.
#pragma once

#include <ATen/Parallel.h>

#include "kernel_prelude.h"

namespace diversed {
namespace cpu {

// The kernels pick their grain (kernel_prelude.h); a range within one grain runs inline.
inline void run_parallel_for(int64_t begin, int64_t end, int64_t grain, ParallelFor::Thunk thunk, const void* body) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { thunk(body, b, e); });
}
inline int thread_count() { return at::get_num_threads(); }
constexpr ParallelFor kParallelFor{&run_parallel_for, &thread_count};

}  // namespace cpu
}  // namespace diversed
