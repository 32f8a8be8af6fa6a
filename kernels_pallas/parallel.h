// A parallel-for over XLA's intra-op thread pool, shared by the native kernels' FFI handlers.
//
// XLA's `ffi::ThreadPool` offers `Schedule` but no parallel-for. Work is claimed in chunks from
// an atomic counter by the calling thread and by pool tasks, so a thread that starts late (or
// runs slower on a shared machine) takes fewer chunks instead of holding the others up.
//
// The caller waits for the chunks other threads hold by yielding for up to kYieldUs, then by
// blocking, never by spinning: on a machine with fewer cores than busy threads (two cores under
// eight virtual devices) a spinning waiter takes the time of the very threads it waits for,
// while a yielding one gives them its core. Blocking at once costs a wake-up when the last chunk
// ends, which on a virtual machine's idle core is tens of microseconds: yielding for 60 us
// before blocking took 1.6-2.8% off a batch-1 and a batch-8 decode step of the MoE bench model
// (four paired runs of 16 rounds, two cores), where 16 yields had been the limit.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace flipjax {

// How long a caller yields, waiting for other threads' chunks, before it blocks.
constexpr int64_t kYieldUs = 60;

// The threads a call of `work` units runs on: one per `per_thread` units (what pays for waking
// a thread), at least one and at most the pool's.
inline int64_t Threads(xla::ffi::ThreadPool& pool, int64_t work, int64_t per_thread) {
  return std::max<int64_t>(1, std::min<int64_t>(work / per_thread, pool.num_threads()));
}

// Runs body(first, last) over [0, items) in chunks of about items / (chunks_per_thread *
// threads), on at most `max_threads` threads (the caller's included); returns when every item
// is done.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t items, int64_t chunks_per_thread,
                 int64_t max_threads, Body body) {
  struct State {
    Body body;
    int64_t items, chunk;
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mutex;
    std::condition_variable finished;
    State(Body b, int64_t n, int64_t c) : body(std::move(b)), items(n), chunk(c) {}
    void Drain() {
      for (;;) {
        const int64_t first = next.fetch_add(chunk);
        if (first >= items) return;
        const int64_t last = std::min(first + chunk, items);
        body(first, last);
        if (done.fetch_add(last - first) + (last - first) == items) {
          // Taking the lock orders this notify after a waiter's check of `done`.
          std::lock_guard<std::mutex> lock(mutex);
          finished.notify_all();
        }
      }
    }
    void Wait() {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kYieldUs);
      for (int yields = 1;; ++yields) {
        if (done.load() >= items) return;
        std::this_thread::yield();
        if (yields % 16 == 0 && std::chrono::steady_clock::now() > until) break;
      }
      std::unique_lock<std::mutex> lock(mutex);
      finished.wait(lock, [this] { return done.load() >= items; });
    }
  };
  if (items <= 0) return;
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(max_threads, pool.num_threads()));
  const int64_t chunk = std::max<int64_t>(1, items / (chunks_per_thread * threads));
  auto state = std::make_shared<State>(std::move(body), items, chunk);
  const int64_t helpers = std::min(threads, (items + chunk - 1) / chunk) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->Drain(); });
  state->Drain();
  // A task scheduled behind busy threads may start after the work is gone; it then returns at
  // once, holding its own reference to the state, so only claimed chunks are waited for here.
  state->Wait();
}

}  // namespace flipjax
