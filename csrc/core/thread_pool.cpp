#include "core/thread_pool.hpp"

#include <algorithm>
#include <stdexcept>

namespace pyckpt {

ThreadPool::ThreadPool(std::size_t num_threads) : _num_threads(num_threads) {
  if (num_threads == 0) throw std::invalid_argument("ThreadPool needs at least one thread");
}

ThreadPool::~ThreadPool() { shutdown(); }

void ThreadPool::start_locked() {
  _threads.reserve(_num_threads);
  for (std::size_t i = 0; i < _num_threads; ++i) _threads.emplace_back([this] { worker_loop(); });
}

void ThreadPool::enqueue(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(_mu);
    if (_stopping) throw std::runtime_error("ThreadPool: submit() after shutdown()");
    if (_threads.empty()) start_locked();
    _jobs.push(std::move(job));
  }
  _cv.notify_one();
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(_mu);
      _cv.wait(lock, [this] { return _stopping || !_jobs.empty(); });
      if (_jobs.empty()) return;  // stopping and drained
      job = std::move(_jobs.front());
      _jobs.pop();
    }
    job();  // packaged_task stores any exception in its future
  }
}

void ThreadPool::shutdown() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(_mu);
    _stopping = true;
    threads.swap(_threads);
  }
  _cv.notify_all();
  for (auto& t : threads) t.join();
}

std::size_t default_thread_count() noexcept {
  unsigned n = std::thread::hardware_concurrency();
  return std::max<std::size_t>(1, std::min<std::size_t>(8, n == 0 ? 1 : n));
}

}  // namespace pyckpt
