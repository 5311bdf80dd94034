#pragma once
// Releasing the GIL around core calls, safely at interpreter exit.
//
// Use GilRelease (or py::call_guard<GilRelease>) instead of py::gil_scoped_release. A daemon
// thread still inside a core call when the interpreter finalizes would, on the way out, be
// ended by CPython (before 3.14) with pthread_exit as it re-takes the GIL. That forced unwind
// starts in the guard's destructor; py::gil_scoped_release's is noexcept, so the C++ runtime
// calls std::terminate and the whole process dies of SIGABRT ("terminate called without an
// active exception") after its work is done. GilRelease instead parks such a thread for good
// before re-taking the GIL, as CPython 3.14 does itself: the process exits from under it. Its
// destructor is also noexcept(false), so that a thread the check misses (finalization starting
// between the check and the re-take) unwinds instead of terminating the process.
#include <pybind11/pybind11.h>

namespace pyckpt::bindings {

/** @return true when the interpreter is finalizing on another thread than the calling one. */
bool finalizing_elsewhere() noexcept;

/** @brief Blocks the calling thread forever (it ends with the process). */
[[noreturn]] void park_thread() noexcept;

class GilRelease {
 public:
  GilRelease() : _state(PyEval_SaveThread()) {}
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;
  ~GilRelease() noexcept(false) {
    if (finalizing_elsewhere()) park_thread();
    PyEval_RestoreThread(_state);
  }

 private:
  PyThreadState* _state;
};

}  // namespace pyckpt::bindings
