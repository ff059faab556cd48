// A pool of threads that spin between the ops of a step, as llama.cpp's and vLLM's CPU backends
// do. OpenMP's own waiting could not be relied on: once a second thread of the process (the
// engine loads on one thread, schedules on another) has run a parallel region, libgomp counts
// more threads than cores and its workers go to sleep at every barrier, which made a batch-1
// decode step (~240 barriers) twice as slow. Workers spin for a bounded number of rounds when
// idle, then block until the next step, so an idle engine uses no CPU. How long anyone spins
// changes only speed: each output is computed by one thread in a fixed order.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace bsgl {

inline void cpu_relax() {
#if defined(__SSE2__)
  _mm_pause();
#endif
}

class SpinPool {
 public:
  // Rounds an idle worker spins before it blocks: a few milliseconds (a pause takes 40-140
  // cycles, by CPU), longer than the scheduler's work between two decode steps (~1 ms), so a
  // stream of steps never pays a wake-up.
  static constexpr int64_t kIdleSpins = 1 << 17;

  explicit SpinPool(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
  }

  ~SpinPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1);
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(tid, n) on n threads, the caller being tid 0, and returns when all are done.
  void run(int n, const std::function<void(int, int)>& fn) {
    n = std::max(1, std::min(n, size()));
    task_ = &fn;
    active_ = n;
    arrived_.store(0);
    pending_.store(n - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    fn(0, n);
    while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
  }

  // Every participant of the current run() calls it; none returns before all have arrived.
  void barrier() {
    const int64_t phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == active_) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    while (phase_.load(std::memory_order_acquire) == phase) cpu_relax();
  }

 private:
  void work(int tid) {
    int64_t seen = 0;
    while (true) {
      int64_t spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen && spins++ < kIdleSpins) cpu_relax();
      if (generation_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load() != seen; });
      }
      seen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
      if (tid < active_) {
        (*task_)(tid, active_);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::vector<std::thread> workers_;
  const std::function<void(int, int)>* task_ = nullptr;
  int active_ = 1;
  std::atomic<int64_t> generation_{0}, phase_{0};
  std::atomic<int> arrived_{0}, pending_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
};

}  // namespace bsgl
