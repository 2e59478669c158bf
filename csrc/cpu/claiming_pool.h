// A parallel loop whose calling thread never waits for a helper thread that is not running.
//
// at::parallel_for (OpenMP here) hands each thread a fixed share of the range and joins at a barrier, so the call
// lasts until every thread has been scheduled and finished its share. On a machine whose cores are shared (a server's
// tokenisers, other workers, a CI machine's test processes) a helper thread that is not running when the call starts
// waits for a scheduler time slice, and a 50 us verify call took 8-16 ms with one other process multiplying matrices on
// two cores, while the same call on one thread took 85 us.
//
// Here the range is cut into tasks that every participant claims from one shared counter: the calling thread claims
// tasks like any helper and, once none is left, waits only for tasks that a running helper has claimed and not yet
// finished. A helper that wakes late finds nothing to claim. Quiet, the helpers spin for a while after each loop, so a
// loop of calls forks as fast as OpenMP does; loaded, the caller simply does more of the work itself.
//
// Torch-free: the binding (parallel_binding.h) wraps it in the kernels' ParallelFor.
#pragma once

#include <cstdint>

#include "kernel_prelude.h"

namespace diversed {
namespace cpu {

// Runs thunk(body, b, e) over disjoint sub-ranges covering [begin, end), each of at least `grain` indices (but the
// last), on the calling thread and on up to threads - 1 helper threads, and returns when all have run. A range of at
// most `grain` indices, a call with threads <= 1, and a call made while another thread's loop holds the helpers run
// on the calling thread alone.
void run_claiming_parallel_for(int64_t begin, int64_t end, int64_t grain, int threads, ParallelFor::Thunk thunk,
                               const void* body);

}  // namespace cpu
}  // namespace diversed
