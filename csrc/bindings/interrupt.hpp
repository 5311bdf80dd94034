#pragma once
// Ctrl-C and progress during long native calls. A binding that releases the GIL for long work
// (save, load, verify, stitch) creates an InterruptWatch first, with the GIL held:
//
//   InterruptWatch watch;
//   GilRelease nogil;  // bindings/gil.hpp
//   ... core call ...
//
// On the main thread it installs an interrupt check (core/cancel.hpp) that the core polls between
// chunks: it re-takes the GIL briefly and runs Python's pending signal handlers
// (PyErr_CheckSignals). When a handler raises (KeyboardInterrupt for SIGINT), the exception is
// kept, the core cancels the rest of its work and throws pyckpt::Cancelled, and the translator
// in module.cpp raises the kept exception. Off the main thread Python runs no signal handlers,
// so nothing is installed there.
//
// The watch also installs the thread's progress counter (set from Python with
// _C.set_progress_counter), which the core advances as chunks finish (core/cancel.hpp).
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <memory>

#include "core/cancel.hpp"

namespace pyckpt::bindings {
namespace py = pybind11;

class InterruptWatch {
 public:
  InterruptWatch();
  InterruptWatch(const InterruptWatch&) = delete;
  InterruptWatch& operator=(const InterruptWatch&) = delete;

 private:
  static bool check(void* ctx);
  std::shared_ptr<std::atomic<std::uint64_t>> _counter;  // kept alive for the call
  ScopedInterruptCheck _scope;
  ScopedProgressCounter _progress;
};

/** @brief Registers ProgressCounter and set_progress_counter. */
void bind_interrupt(py::module_& m);

/** @brief Remembers the main thread (called once at import, with the GIL held). */
void init_interrupts();

/** @return true on the main thread (as remembered by init_interrupts; any thread, no GIL). */
bool on_main_thread() noexcept;

/**
 * @brief Sets the Python error for a pyckpt::Cancelled that reached the translator: the
 *        exception a signal handler raised during the call, else KeyboardInterrupt.
 */
void raise_cancelled();

}  // namespace pyckpt::bindings
