#include "core/cancel.hpp"

namespace pyckpt {

namespace {

struct ThreadCheck {
  InterruptCheck check = nullptr;
  void* ctx = nullptr;
  bool fired = false;
  std::chrono::steady_clock::time_point next{};
};

// One per thread: the check belongs to the call running on this thread (the bindings install it
// around one native call), so worker threads of the pools never see it.
thread_local ThreadCheck t_check;
thread_local std::atomic<std::uint64_t>* t_progress = nullptr;

}  // namespace

ScopedInterruptCheck::ScopedInterruptCheck(InterruptCheck check, void* ctx) noexcept
    : _prev_check(t_check.check), _prev_ctx(t_check.ctx), _installed(check != nullptr) {
  if (!_installed) return;
  t_check.check = check;
  t_check.ctx = ctx;
  t_check.fired = false;
  t_check.next = std::chrono::steady_clock::now() + kPollInterval;
}

ScopedInterruptCheck::~ScopedInterruptCheck() {
  if (!_installed) return;
  t_check.check = _prev_check;
  t_check.ctx = _prev_ctx;
  t_check.fired = false;
}

bool interrupt_check_installed() noexcept { return t_check.check != nullptr; }

void poll_interrupt() {
  ThreadCheck& t = t_check;
  if (t.check == nullptr) return;
  if (t.fired) throw Cancelled();
  const auto now = std::chrono::steady_clock::now();
  if (now < t.next) return;
  t.next = now + kPollInterval;
  if (t.check(t.ctx)) {
    t.fired = true;
    throw Cancelled();
  }
}

ScopedProgressCounter::ScopedProgressCounter(std::atomic<std::uint64_t>* counter) noexcept
    : _prev(t_progress), _installed(counter != nullptr) {
  if (_installed) t_progress = counter;
}

ScopedProgressCounter::~ScopedProgressCounter() {
  if (_installed) t_progress = _prev;
}

std::atomic<std::uint64_t>* progress_counter() noexcept { return t_progress; }

}  // namespace pyckpt
