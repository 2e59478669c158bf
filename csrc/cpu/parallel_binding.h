// The ParallelFors the CPU kernels receive from their bindings, behind function pointers so the kernels stay torch-free
// (kernel_prelude.h): at::parallel_for, and the claiming loop of the verify ops. Included by the binding files only.
#pragma once

#include <ATen/Parallel.h>

#include "claiming_pool.h"
#include "kernel_prelude.h"

namespace diversed {
namespace cpu {

// The kernels pick their grain (kernel_prelude.h); a range within one grain runs inline.
inline void run_parallel_for(int64_t begin, int64_t end, int64_t grain, ParallelFor::Thunk thunk, const void* body) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { thunk(body, b, e); });
}
inline int thread_count() { return at::get_num_threads(); }
constexpr ParallelFor kParallelFor{&run_parallel_for, &thread_count};

// The verify kernels' loops, short calls on the serving path: the calling thread claims tasks beside torch's number of
// threads and never waits for a helper that the scheduler has not run yet (claiming_pool.h).
inline void run_claiming(int64_t begin, int64_t end, int64_t grain, ParallelFor::Thunk thunk, const void* body) {
  run_claiming_parallel_for(begin, end, grain, at::get_num_threads(), thunk, body);
}
constexpr ParallelFor kClaimingParallelFor{&run_claiming, &thread_count};

}  // namespace cpu
}  // namespace diversed
