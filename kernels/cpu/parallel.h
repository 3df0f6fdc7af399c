// A parallel-for over XLA's intra-op thread pool for the jmegatron CPU kernels.
//
// The calling thread takes tasks too, and it only ever waits for tasks another thread
// has already started: when every pool thread is itself inside a kernel, the queued
// helpers find no work left and return, so nothing deadlocks.
//
// Nothing thrown inside a task escapes to the pool (where it would terminate the
// process): the first exception is kept, the tasks not yet started are skipped, and
// ParallelFor returns it as an ffi::Error. The kernels allocate their scratch before
// dispatching (one slice per worker, `fn(i, worker)`), so a task normally throws nothing.
#ifndef JMEGATRON_KERNELS_CPU_PARALLEL_H_
#define JMEGATRON_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <type_traits>

#include "checks.h"
#include "xla/ffi/api/ffi.h"

namespace jmegatron {

struct TaskCounter {
  explicit TaskCounter(int64_t n) : count(n) {}
  const int64_t count;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> workers{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first exception (under mu)
  int64_t finished = 0;
  std::mutex mu;
  std::condition_variable cv;
};

// How many workers ParallelFor(pool, n, fn, max_threads) runs: the `worker` argument of
// fn(i, worker) is in [0, Workers(...)), one worker at a time per id.
inline int64_t Workers(xla::ffi::ThreadPool& pool, int64_t n, int64_t max_threads = 0) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (max_threads > 0) threads = std::min(threads, max_threads);
  return std::max<int64_t>(1, std::min(threads, n));
}

template <typename Fn>
inline void RunTask(Fn& fn, int64_t i, int64_t worker) {
  if constexpr (std::is_invocable_v<Fn&, int64_t, int64_t>) {
    fn(i, worker);
  } else {
    fn(i);
  }
}

// Runs fn(i) or fn(i, worker) for i in [0, n) on at most max_threads threads (the pool's
// size by default); an error (naming `op`) for the first exception a task threw.
template <typename Fn>
[[nodiscard]] xla::ffi::Error ParallelFor(const char* op, xla::ffi::ThreadPool& pool, int64_t n, Fn fn,
                                          int64_t max_threads = 0) {
  if (n <= 0) return xla::ffi::Error::Success();
  const int64_t threads = Workers(pool, n, max_threads);
  if (threads == 1) {
    try {
      for (int64_t i = 0; i < n; ++i) RunTask(fn, i, 0);
    } catch (...) {
      return FromException(op, std::current_exception());
    }
    return xla::ffi::Error::Success();
  }
  std::shared_ptr<TaskCounter> state;
  try {
    state = std::make_shared<TaskCounter>(n);
  } catch (...) {
    return FromException(op, std::current_exception());
  }
  // Runs on the pool: catches everything (an exception escaping a pool task terminates).
  auto work = [state, fn]() mutable noexcept {
    const int64_t worker = state->workers.fetch_add(1);
    int64_t i;
    while ((i = state->next.fetch_add(1)) < state->count) {
      if (!state->failed.load(std::memory_order_relaxed)) {
        try {
          RunTask(fn, i, worker);
        } catch (...) {
          std::lock_guard<std::mutex> lock(state->mu);
          if (!state->error) state->error = std::current_exception();
          state->failed = true;
        }
      }
      std::lock_guard<std::mutex> lock(state->mu);
      if (++state->finished == state->count) state->cv.notify_all();
    }
  };
  for (int64_t t = 1; t < threads; ++t) {
    try {
      pool.Schedule([work]() mutable { work(); });
    } catch (...) {  // could not queue a helper (memory): the threads already queued and this one do the work
      break;
    }
  }
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->finished == state->count; });
  if (state->error) return FromException(op, state->error);
  return xla::ffi::Error::Success();
}

}  // namespace jmegatron

#endif  // JMEGATRON_KERNELS_CPU_PARALLEL_H_
