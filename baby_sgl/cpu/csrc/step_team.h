// The threads that run a decode step: the calling thread's OpenMP team, torch's own, with a
// barrier of ours between the step's ops (~240 of them a step). A pool of threads of the step's
// own beside torch's made two sets of threads take turns on the cores: libgomp's workers spin for
// milliseconds after every torch op (sampling runs a few per step), and a batch-1 step of the
// default model took 11.7 ms instead of 4.1 on a 2-core EPYC (Zen 4). libgomp's own barrier
// sleeps at once where the process has more threads than cores (threads.py keeps it from that).
//
// A wait spins only briefly, then yields its core, then sleeps on a futex (Wait below). Spinning
// alone assumed every thread has a core of its own: beside a busy process, or a second engine on
// the same cores, a descheduled thread made every barrier wait out its time slice, and the
// spinning waiter kept its own core busy, so the kernel could not move the descheduled one
// there. How long anyone waits changes only speed: each output is computed by one thread in a
// fixed order.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <thread>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace bsgl {

inline void cpu_relax() {
#if defined(__SSE2__)
  _mm_pause();
#endif
}

// The cores this process may run on (its affinity mask), at least 1.
inline int usable_cores() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// A 32-bit word that threads wait on until it changes: they spin, then yield, then sleep in the
// kernel; whoever changes it wakes the sleepers (a system call only when there are any).
class Wait {
 public:
  using Clock = std::chrono::steady_clock;

  uint32_t load() const { return word_.load(std::memory_order_acquire); }

  void store(uint32_t value) {
    word_.store(value, std::memory_order_seq_cst);
    wake();
  }

  // Returns once the word differs from `seen`: spins for `spin`, yields the core until `yield`
  // has passed (to a thread of the team or another process waiting for it), then sleeps.
  void wait_while(uint32_t seen, Clock::duration spin, Clock::duration yield) {
    const auto start = Clock::now();
    for (uint32_t i = 1;; ++i) {
      if (load() != seen) return;
      cpu_relax();
      if (i % 64 == 0 && Clock::now() - start > spin) break;  // a clock read costs ~20 pauses
    }
    while (Clock::now() - start < yield) {
      if (load() != seen) return;
      std::this_thread::yield();
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    while (load() == seen) sleep(seen);
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  // Both sides are sequentially consistent: a waiter that counted itself before its last look at
  // the word is seen by the writer's load of sleepers_, or it sees the new word (the kernel
  // compares it again before sleeping).
  void wake() {
    if (sleepers_.load(std::memory_order_seq_cst) == 0) return;
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
#endif
  }

  void sleep(uint32_t seen) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word_), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
#else
    std::this_thread::yield();
#endif
  }

  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) && std::atomic<uint32_t>::is_always_lock_free,
                "the futex is the atomic's own word");
  std::atomic<uint32_t> word_{0};
  std::atomic<int> sleepers_{0};
};

class StepTeam {
 public:
  // How long a barrier spins, then yields, before it sleeps. Short: on a 2-core EPYC (Zen 4) a
  // batch-1 decode step beside a one-core busy loop took 1.0x its solo time with 10 / 50 us, 1.2x
  // with 20 / 100, 2.0x with 50 / 200 (spinning only: 1.2-2.0x), and beside a second engine
  // 1.4-1.6x, 1.6-2.2x, 2.6x (spinning only: 2.7-2.8x).
  static constexpr auto kSpin = std::chrono::microseconds(10);
  static constexpr auto kYield = std::chrono::microseconds(50);

  // At most as many threads as the process has cores: a second thread on a core only waits.
  explicit StepTeam(int threads) : threads_(std::max(1, std::min(threads, usable_cores()))) {}

  int size() const { return threads_; }

  // Runs fn(tid, n) on n threads of the calling thread's OpenMP team, the caller being tid 0, and
  // returns when all are done.
  void run(int n, const std::function<void(int, int)>& fn) {
    n = std::max(1, std::min(n, threads_));
#if defined(_OPENMP)
    if (n > 1) {
      claims_.store(0, std::memory_order_relaxed);  // the threads' start orders it before their claims
#pragma omp parallel num_threads(n)
      {
        lists_seen() = 0;
        fn(omp_get_thread_num(), omp_get_num_threads());
      }
      return;
    }
#endif
    fn(0, 1);
  }

  // Calls f(c0, c1) for the chunks of items [0, n) this thread claims, every chunk a multiple of
  // `unit` items but the last: the threads of run() take chunks from one counter as they finish
  // the last, about a 2 * threads-th of what is left (at least min_chunk), so a thread slowed by a
  // cold cache or another process does less of the list instead of making the others wait for it
  // at the next barrier (a batch-1 step of the default model on a 2-core EPYC, Zen 3: each thread
  // waited 1.9-2.8 ms of a 15-17 ms step at barriers when each took a fixed half of every
  // product; claimed, the products took 9.8 ms of the step instead of 10.7). Every thread of the
  // run must call it for the same lists in the same order; an item is computed by whichever
  // thread claims it, in the same way, so the results do not depend on who did what.
  template <typename F>
  void share(int64_t n, int64_t unit, int64_t min_chunk, F&& f) const {
#if defined(_OPENMP)
    const int nt = omp_get_num_threads();
#else
    const int nt = 1;
#endif
    if (nt == 1) {
      if (n > 0) f(int64_t{0}, n);
      return;
    }
    // The counter holds the number of the newest list anyone claimed from (high half) and its
    // next item: a list is numbered when a thread first claims from it, and a thread moves to the
    // next list only once its own is used up, so a newer number means this list is done.
    const uint64_t list = ++lists_seen();
    uint64_t word = claims_.load(std::memory_order_relaxed);
    for (;;) {
      if ((word >> 32) > list) return;
      const int64_t next = (word >> 32) == list ? static_cast<int64_t>(word & 0xffffffffu) : 0;
      if (next >= n) return;
      int64_t size = std::max(min_chunk, (n - next) / (2 * nt));
      size = std::min(n - next, (size + unit - 1) / unit * unit);
      if (claims_.compare_exchange_weak(word, (list << 32) | static_cast<uint64_t>(next + size),
                                        std::memory_order_relaxed)) {
        f(next, next + size);
        word = claims_.load(std::memory_order_relaxed);
      }
    }
  }

  // Every thread of the current run() calls it; none returns before all have arrived.
  void barrier() {
#if defined(_OPENMP)
    const int n = omp_get_num_threads();
#else
    const int n = 1;
#endif
    if (n == 1) return;
    const uint32_t phase = phase_.load();
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1);
      return;
    }
    phase_.wait_while(phase, kSpin, kYield);
  }

 private:
  // How many lists this thread has called share() for in the current run().
  static uint32_t& lists_seen() {
    static thread_local uint32_t lists = 0;
    return lists;
  }

  const int threads_;
  mutable std::atomic<uint64_t> claims_{0};
  Wait phase_;
  std::atomic<int> arrived_{0};
};

}  // namespace bsgl
