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
// finished. A helper that wakes late finds nothing to claim. After a loop the helpers watch for the next one for 1 ms,
// yielding their core between looks (a helper spinning on pause instructions used up its fair share on a loaded
// machine and was then preempted in the middle of a task, which the caller had to wait for: 7x slowdowns), then sleep.
//
// The price, measured on 2 cores: a loop of calls runs as fast as with OpenMP, but a call that follows a torch op
// finds the other core held by torch's OpenMP worker, which spins for a few ms after every region, and a call after
// the helpers went to sleep wakes them on its own core; either way the caller does most of the work itself
// (verify_logits B = 8, K = 4, V = 49152 float32: 931-951 us against OpenMP's 472-487 us after a softmax).
//
// Torch-free: the binding (parallel_binding.h) wraps it in the kernels' ParallelFor.
#pragma once

#include <cstdint>

#include "../cpu_base/kernel_base.h"  // ParallelFor

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
