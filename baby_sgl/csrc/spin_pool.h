// A pool of threads that spin between the ops of a step, as llama.cpp's and vLLM's CPU backends
// do. OpenMP's own waiting could not be relied on: once a second thread of the process (the
// engine loads on one thread, schedules on another) has run a parallel region, libgomp counts
// more threads than cores and its workers go to sleep at every barrier, which made a batch-1
// decode step (~240 barriers) twice as slow.
//
// A wait spins only briefly, then yields its core, then sleeps on a futex (Wait below). Spinning
// alone assumed every thread of the pool has a core of its own: beside a busy process, or a
// second engine on the same cores, a descheduled worker made every barrier wait out its time
// slice, and the spinning waiter kept its own core busy, so the kernel could not move the
// descheduled one there. How long anyone waits changes only speed: each output is computed by
// one thread in a fixed order.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

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

  void add(uint32_t delta) {
    word_.fetch_add(delta, std::memory_order_seq_cst);
    wake();
  }

  void subtract(uint32_t delta) {
    word_.fetch_sub(delta, std::memory_order_seq_cst);
    wake();
  }

  // Returns once the word differs from `seen`: spins for `spin`, yields the core until `yield`
  // has passed (to a thread of the pool or another process waiting for it), then sleeps.
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

class SpinPool {
 public:
  // How long a barrier (or run(), for the workers) spins, then yields, before it sleeps. Short:
  // on a 2-core EPYC (Zen 4) a batch-1 decode step beside a one-core busy loop took 1.0x its
  // solo time with 10 / 50 us, 1.2x with 20 / 100, 2.0x with 50 / 200 (spinning only: 1.2-2.0x),
  // and beside a second engine 1.4-1.6x, 1.6-2.2x, 2.6x (spinning only: 2.7-2.8x); 16 random
  // prompts ran as fast as with spinning only, within the runs' noise.
  static constexpr auto kSpin = std::chrono::microseconds(10);
  static constexpr auto kYield = std::chrono::microseconds(50);
  // How long an idle worker waits before sleeping: longer than the scheduler's work between two
  // decode steps (~1 ms), so a stream of steps never pays a wake-up; it yields for most of it.
  static constexpr auto kIdle = std::chrono::milliseconds(4);

  // At most as many threads as the process has cores: a second thread on a core only waits.
  explicit SpinPool(int threads) {
    threads = std::max(1, std::min(threads, usable_cores()));
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }

  ~SpinPool() {
    stop_.store(true);
    generation_.add(1);
    for (auto& t : workers_) t.join();
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(tid, n) on n threads, the caller being tid 0, and returns when all are done. Every
  // worker answers every run, those beyond n at once, so none can still be reading this run's
  // task when the next one is set.
  void run(int n, const std::function<void(int, int)>& fn) {
    n = std::max(1, std::min(n, size()));
    task_ = &fn;
    active_ = n;
    arrived_.store(0);
    pending_.store(static_cast<uint32_t>(workers_.size()));
    generation_.add(1);
    fn(0, n);
    for (uint32_t left = pending_.load(); left != 0; left = pending_.load()) pending_.wait_while(left, kSpin, kYield);
  }

  // Every participant of the current run() calls it; none returns before all have arrived.
  void barrier() {
    const uint32_t phase = phase_.load();
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == active_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1);
      return;
    }
    phase_.wait_while(phase, kSpin, kYield);
  }

 private:
  void work(int tid) {
    uint32_t seen = 0;
    while (true) {
      generation_.wait_while(seen, kSpin, kIdle);
      seen = generation_.load();
      if (stop_.load()) return;
      if (tid < active_) (*task_)(tid, active_);
      pending_.subtract(1);
    }
  }

  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* task_ = nullptr;
  int active_ = 1;
  Wait generation_, phase_, pending_;
  std::atomic<int> arrived_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace bsgl
