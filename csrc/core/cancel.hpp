#pragma once
/**
 * @file cancel.hpp
 * @brief Cooperative cancellation and progress of long operations (save, load, verify, stitch).
 *
 * The core knows nothing of signals or Python. A caller that wants its long operation to stop
 * early (the bindings, on Ctrl-C) installs an interrupt check on the calling thread for the
 * duration of the call (ScopedInterruptCheck). The operation's loops call poll_interrupt()
 * between chunks on that thread; when the check reports an interrupt, poll_interrupt() throws
 * Cancelled. run_all() (thread_pool.hpp) polls while it waits for its tasks, skips the tasks that
 * have not started yet, drains the running ones and rethrows Cancelled; callers clean up through
 * their usual failure paths (temp files removed, nothing committed).
 *
 * Thread-safety: the check is per thread; worker threads never see one, so poll_interrupt() is a
 * no-op there. The check is called at most once per kPollInterval on its thread.
 */
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>

namespace pyckpt {

/**
 * @brief Thrown when an operation stops because its caller asked it to (e.g. Ctrl-C).
 * @note Deliberately not a std::runtime_error: context wrappers (rethrow_with_context) pass it
 *       through unchanged, so the bindings can turn it back into the caller's own exception.
 */
class Cancelled : public std::exception {
 public:
  const char* what() const noexcept override { return "operation cancelled"; }
};

/**
 * @brief An interrupt check: returns true when the running operation should stop.
 * @note Called only on the thread that installed it, never while a core lock is held.
 */
using InterruptCheck = bool (*)(void* ctx);

/** @brief How often (at most) poll_interrupt() calls the installed check. */
inline constexpr std::chrono::milliseconds kPollInterval{50};

/**
 * @brief Installs `check` on the calling thread for this object's lifetime (restoring the
 *        previous one, if any, on destruction). A null `check` installs nothing.
 */
class ScopedInterruptCheck {
 public:
  ScopedInterruptCheck(InterruptCheck check, void* ctx) noexcept;
  ~ScopedInterruptCheck();
  ScopedInterruptCheck(const ScopedInterruptCheck&) = delete;
  ScopedInterruptCheck& operator=(const ScopedInterruptCheck&) = delete;

 private:
  InterruptCheck _prev_check;
  void* _prev_ctx;
  bool _installed;
};

/** @return true when a check is installed on the calling thread. */
bool interrupt_check_installed() noexcept;

/**
 * @brief Calls the calling thread's check (at most every kPollInterval) and throws Cancelled
 *        when it reports an interrupt. No-op without a check. Once a check has fired, every later
 *        poll on the thread throws too, until the scope ends.
 * @throws Cancelled
 */
void poll_interrupt();

/**
 * @brief Installs a progress counter on the calling thread for this object's lifetime: long
 *        operations started on this thread add the raw bytes they have finished to it (a save:
 *        bytes encoded and appended; a load or verify: bytes delivered or checked; a stitch:
 *        output bytes written). A null counter installs nothing.
 * @note The counter must outlive the scope; it is updated from worker threads (relaxed adds).
 */
class ScopedProgressCounter {
 public:
  explicit ScopedProgressCounter(std::atomic<std::uint64_t>* counter) noexcept;
  ~ScopedProgressCounter();
  ScopedProgressCounter(const ScopedProgressCounter&) = delete;
  ScopedProgressCounter& operator=(const ScopedProgressCounter&) = delete;

 private:
  std::atomic<std::uint64_t>* _prev;
  bool _installed;
};

/** @return the calling thread's progress counter, or nullptr. */
std::atomic<std::uint64_t>* progress_counter() noexcept;

}  // namespace pyckpt
