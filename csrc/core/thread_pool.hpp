#pragma once
/**
 * @file thread_pool.hpp
 * @brief A fixed-size pool of worker threads returning std::future.
 *
 * Thread-safety: submit() may be called from any thread. Threads start lazily on the first
 * submit() and stop in shutdown() or the destructor; no thread is created at static init.
 */
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <queue>
#include <thread>
#include <type_traits>
#include <vector>

#include "core/cancel.hpp"

namespace pyckpt {

class ThreadPool {
 public:
  /**
   * @brief Creates a pool of `num_threads` workers (started lazily).
   * @param num_threads number of workers, >= 1.
   * @throws std::invalid_argument if num_threads is 0.
   */
  explicit ThreadPool(std::size_t num_threads);
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  /** @brief Drains the queue and joins every worker. */
  ~ThreadPool();

  /** @return the number of workers. */
  std::size_t size() const noexcept { return _num_threads; }

  /**
   * @brief Queues `fn` and returns a future for its result; exceptions travel in the future.
   * @throws std::runtime_error if the pool has been shut down.
   */
  template <typename F>
  auto submit(F&& fn) -> std::future<std::invoke_result_t<std::decay_t<F>>> {
    using R = std::invoke_result_t<std::decay_t<F>>;
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
    std::future<R> fut = task->get_future();
    enqueue([task]() { (*task)(); });
    return fut;
  }

  /** @brief Finishes queued work and joins the workers; later submit() calls throw. */
  void shutdown();

 private:
  void enqueue(std::function<void()> job);
  void start_locked();
  void worker_loop();

  std::size_t _num_threads;
  std::mutex _mu;
  std::condition_variable _cv;
  std::queue<std::function<void()>> _jobs;
  std::vector<std::thread> _threads;
  bool _stopping = false;
};

/**
 * @brief Runs fn(0) ... fn(n - 1) on `pool` and waits for every one of them, even after a
 *        failure (tasks may reference the caller's memory), then rethrows the first failure in
 *        index order (or the failure to submit).
 *
 * While it waits, the caller's interrupt check (cancel.hpp) is polled: once it fires, tasks that
 * have not started are skipped, the running ones are drained, and Cancelled is thrown.
 * @note `fn` is shared by all tasks and must be safe to call concurrently.
 */
template <typename Fn>
void run_all(ThreadPool& pool, std::size_t n, const Fn& fn) {
  std::vector<std::future<void>> futures;
  futures.reserve(n);
  std::exception_ptr first;
  // Shared with the tasks, which all finish before this frame is left.
  std::atomic<bool> cancelled{false};
  try {
    for (std::size_t i = 0; i < n; ++i) {
      futures.push_back(pool.submit([&fn, &cancelled, i] {
        if (cancelled.load(std::memory_order_relaxed)) throw Cancelled();
        fn(i);
      }));
    }
  } catch (...) {
    first = std::current_exception();  // e.g. a shut-down pool: still drain what was submitted
  }
  const bool polling = interrupt_check_installed();
  for (auto& f : futures) {
    if (polling && !cancelled.load(std::memory_order_relaxed)) {
      try {
        while (f.wait_for(kPollInterval) != std::future_status::ready) poll_interrupt();
      } catch (const Cancelled&) {
        cancelled.store(true, std::memory_order_relaxed);
      }
    }
    try {
      f.get();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (cancelled.load(std::memory_order_relaxed)) throw Cancelled();
  if (first) std::rethrow_exception(first);
}

/** @return the default worker count: PYCKPT_NUM_THREADS is read in Python; this is min(8, cores).
 */
std::size_t default_thread_count() noexcept;

}  // namespace pyckpt
