// The ParallelFors the verify and stats kernels receive from their binding (ops_cpu.cpp): at::parallel_for
// (../cpu_base/torch_parallel_for.h), and the claiming loop of the verify ops. Included by the binding files only.
#pragma once

#include <ATen/Parallel.h>

#include "../cpu_base/torch_parallel_for.h"
#include "claiming_pool.h"

namespace diversed {
namespace cpu {

// The verify kernels' loops, short calls on the serving path: the calling thread claims tasks beside torch's number of
// threads and never waits for a helper that the scheduler has not run yet (claiming_pool.h).
inline void run_claiming(int64_t begin, int64_t end, int64_t grain, ParallelFor::Thunk thunk, const void* body) {
  run_claiming_parallel_for(begin, end, grain, at::get_num_threads(), thunk, body);
}
constexpr ParallelFor kClaimingParallelFor{&run_claiming, &thread_count};

}  // namespace cpu
}  // namespace diversed
