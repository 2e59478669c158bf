// at::parallel_for as the ParallelFor the CPU kernels of both floors receive from their bindings, behind function
// pointers so the kernels stay torch-free (kernel_base.h). Included by binding files only.
#pragma once

#include <ATen/Parallel.h>

#include "kernel_base.h"

namespace diversed {
namespace cpu {

// The kernels pick their grain (kernel_base.h); a range within one grain runs inline.
inline void run_parallel_for(int64_t begin, int64_t end, int64_t grain, ParallelFor::Thunk thunk, const void* body) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { thunk(body, b, e); });
}
inline int thread_count() { return at::get_num_threads(); }
constexpr ParallelFor kParallelFor{&run_parallel_for, &thread_count};

}  // namespace cpu
}  // namespace diversed
