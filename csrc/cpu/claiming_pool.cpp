// The claiming parallel loop of claiming_pool.h: one process-wide pool of helper threads and one loop at a time.
//
// Protocol. A loop is published under a new generation in `state_` (generation in the high 32 bits, the next task to
// claim in the low 32). Claiming is a compare-and-swap of that word, so a task is claimed exactly once, and only
// within the generation whose description the claimer read: the caller first stores (generation, kPublishing), which
// no claim can pass, then writes the description, then stores (generation, 0). Whoever runs a task counts it in
// `done_`; the caller returns once every task is done, so nothing refers to the loop's body after that.
#include "claiming_pool.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <mutex>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace diversed {
namespace cpu {
namespace {

constexpr uint32_t kPublishing = UINT32_MAX;  // next-task value while a loop's description is being written
constexpr int kTasksPerThread = 8;            // tasks per participant, so a late helper still finds some to take
constexpr auto kHelperSpin = std::chrono::microseconds(1000);  // how long an idle helper watches for the next loop
constexpr int kCallerSpinsBeforeYield = 1 << 12;

// Sleeping on an atomic's value is C++20 (std::atomic::wait), and torch builds extensions as C++17 up to 2.11, so the
// helpers sleep on the Linux futex that libstdc++'s wait uses: a wake between the load of `expected` and the sleep
// makes the sleep return at once, so no wake is lost.
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a futex word is 32 bits");

void sleep_while_equal(std::atomic<uint32_t>& word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

inline uint64_t pack(uint32_t generation, uint32_t next) { return (static_cast<uint64_t>(generation) << 32) | next; }
inline uint32_t generation_of(uint64_t state) { return static_cast<uint32_t>(state >> 32); }
inline uint32_t next_of(uint64_t state) { return static_cast<uint32_t>(state); }

// Set on a thread while it runs a loop's tasks (as caller or helper): a loop started from inside one runs inline.
thread_local bool in_loop = false;
struct LoopScope {
  LoopScope() { in_loop = true; }
  ~LoopScope() { in_loop = false; }
};

class ClaimingPool {
 public:
  void run(int64_t begin, int64_t end, int64_t grain, int threads, ParallelFor::Thunk thunk, const void* body) {
    threads = std::max(1, threads);
    const int64_t range = end - begin;
    const int64_t task_size = std::max<int64_t>(grain, (range + threads * kTasksPerThread - 1) /
                                                            (static_cast<int64_t>(threads) * kTasksPerThread));
    const int64_t num_tasks = (range + task_size - 1) / task_size;
    if (threads <= 1 || num_tasks <= 1 || num_tasks >= kPublishing || in_loop) {
      thunk(body, begin, end);
      return;
    }
    std::unique_lock<std::mutex> loop(loop_mutex_, std::try_to_lock);
    if (!loop.owns_lock()) {
      thunk(body, begin, end);
      return;
    }
    const LoopScope scope;
    start_helpers(threads - 1);
    const uint32_t generation = ++generation_;
    state_.store(pack(generation, kPublishing), std::memory_order_seq_cst);
    begin_.store(begin, std::memory_order_relaxed);
    end_.store(end, std::memory_order_relaxed);
    task_size_.store(task_size, std::memory_order_relaxed);
    num_tasks_.store(static_cast<uint32_t>(num_tasks), std::memory_order_relaxed);
    helpers_wanted_.store(threads - 1, std::memory_order_relaxed);
    thunk_.store(thunk, std::memory_order_relaxed);
    body_.store(body, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    state_.store(pack(generation, 0), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      wake_.fetch_add(1, std::memory_order_seq_cst);
      wake_all(wake_);
    }
    run_claimed_tasks(generation);
    for (int spins = 0; done_.load(std::memory_order_acquire) < num_tasks; ++spins) {
      // Only tasks a running helper claimed are left: they end soon, unless that helper lost its core meanwhile.
      if (spins < kCallerSpinsBeforeYield) cpu_relax();
      else std::this_thread::yield();
    }
  }

 private:
  // Claims and runs tasks of `generation` until none is left, or until another loop has been published.
  void run_claimed_tasks(uint32_t generation) {
    uint64_t state = state_.load(std::memory_order_acquire);
    for (;;) {
      if (generation_of(state) != generation) return;
      if (next_of(state) == kPublishing) {  // its description is being written
        cpu_relax();
        state = state_.load(std::memory_order_acquire);
        continue;
      }
      const uint32_t num_tasks = num_tasks_.load(std::memory_order_relaxed);
      const int64_t begin = begin_.load(std::memory_order_relaxed), end = end_.load(std::memory_order_relaxed);
      const int64_t task_size = task_size_.load(std::memory_order_relaxed);
      const ParallelFor::Thunk thunk = thunk_.load(std::memory_order_relaxed);
      const void* body = body_.load(std::memory_order_relaxed);
      if (next_of(state) >= num_tasks) return;
      // Succeeds only while the word still holds this generation and task, so the description read above is its own.
      if (!state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      const int64_t task_begin = begin + static_cast<int64_t>(next_of(state)) * task_size;
      thunk(body, task_begin, std::min(end, task_begin + task_size));
      done_.fetch_add(1, std::memory_order_release);
      state = state_.load(std::memory_order_acquire);
    }
  }

  // Helpers 0 .. count - 1 exist in this process (a forked child has none of its parent's threads).
  void start_helpers(int count) {
    const pid_t pid = getpid();
    if (pid != owner_pid_) {
      owner_pid_ = pid;
      helpers_started_ = 0;
    }
    for (; helpers_started_ < count; ++helpers_started_) {
      std::thread([this, index = helpers_started_] { helper_loop(index); }).detach();
    }
  }

  void helper_loop(int index) {
    in_loop = true;
    uint32_t seen = generation_of(state_.load(std::memory_order_acquire));
    for (;;) {
      const uint32_t generation = wait_for_loop(seen);
      seen = generation;
      if (index < helpers_wanted_.load(std::memory_order_relaxed)) run_claimed_tasks(generation);
    }
  }

  // The generation of the next loop after `seen`: watched for kHelperSpin, then slept for.
  uint32_t wait_for_loop(uint32_t seen) {
    const auto spin_end = std::chrono::steady_clock::now() + kHelperSpin;
    for (int spins = 0;; ++spins) {
      const uint32_t generation = generation_of(state_.load(std::memory_order_acquire));
      if (generation != seen) return generation;
      // Yielding rather than pausing: on a quiet core it returns at once, and on a loaded one the waiting helper
      // spends little of its fair share, so the scheduler does not take its core away in the middle of a task.
      std::this_thread::yield();
      if (spins % 16 == 0 && std::chrono::steady_clock::now() > spin_end) break;
    }
    for (;;) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t wake = wake_.load(std::memory_order_seq_cst);
      const uint32_t generation = generation_of(state_.load(std::memory_order_seq_cst));
      if (generation == seen) sleep_while_equal(wake_, wake);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      if (generation != seen) return generation;
    }
  }

  std::mutex loop_mutex_;  // one loop at a time; another thread's concurrent call runs alone
  uint32_t generation_ = 0;
  int helpers_started_ = 0;
  pid_t owner_pid_ = 0;
  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> begin_{0}, end_{0}, task_size_{1};
  std::atomic<uint32_t> num_tasks_{0};
  std::atomic<int> helpers_wanted_{0};
  std::atomic<ParallelFor::Thunk> thunk_{nullptr};
  std::atomic<const void*> body_{nullptr};
  std::atomic<uint32_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<uint32_t> wake_{0};
};

}  // namespace

void run_claiming_parallel_for(int64_t begin, int64_t end, int64_t grain, int threads, ParallelFor::Thunk thunk,
                               const void* body) {
  if (begin >= end) return;
  // Never destroyed: detached helpers may still be waiting on it while the process exits.
  static ClaimingPool* const pool = new ClaimingPool;
  pool->run(begin, end, grain, threads, thunk, body);
}

}  // namespace cpu
}  // namespace diversed
