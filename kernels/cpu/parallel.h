// A parallel-for over XLA's intra-op thread pool for the jmegatron CPU kernels.
//
// The calling thread takes tasks too, and it only ever waits for tasks another thread
// has already started: when every pool thread is itself inside a kernel, the queued
// helpers find no work left and return, so nothing deadlocks.
#ifndef JMEGATRON_KERNELS_CPU_PARALLEL_H_
#define JMEGATRON_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jmegatron {

struct TaskCounter {
  explicit TaskCounter(int64_t n) : count(n) {}
  const int64_t count;
  std::atomic<int64_t> next{0};
  int64_t finished = 0;
  std::mutex mu;
  std::condition_variable cv;
};

// Runs fn(i) for i in [0, n), on at most max_threads threads (the pool's size by default).
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, Fn fn, int64_t max_threads = 0) {
  if (n <= 0) return;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (max_threads > 0) threads = std::min(threads, max_threads);
  threads = std::min(threads, n);
  if (threads == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  auto state = std::make_shared<TaskCounter>(n);
  auto work = [state, fn]() {
    int64_t i;
    while ((i = state->next.fetch_add(1)) < state->count) {
      fn(i);
      std::lock_guard<std::mutex> lock(state->mu);
      if (++state->finished == state->count) state->cv.notify_all();
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->finished == state->count; });
}

}  // namespace jmegatron

#endif  // JMEGATRON_KERNELS_CPU_PARALLEL_H_
