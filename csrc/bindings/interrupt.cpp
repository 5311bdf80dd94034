#include "bindings/interrupt.hpp"

#include <pythread.h>

namespace pyckpt::bindings {

namespace {

unsigned long g_main_thread = 0;  // threading.main_thread().ident, set at import

// The exception a signal handler raised on this thread, kept (with the GIL) from the check to the
// translator. Owned references; the translator hands them back to Python.
struct PendingError {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
};
thread_local PendingError t_pending;

/** Raw bytes finished by the native calls of the thread(s) it is set on; read from any thread.
 * The one native progress counter type (saves, loads, verifies, stitches). */
struct ProgressCounter {
  std::shared_ptr<std::atomic<std::uint64_t>> bytes =
      std::make_shared<std::atomic<std::uint64_t>>(0);
};

// The counter Python set on this thread (set_progress_counter), installed by each watch.
thread_local std::shared_ptr<std::atomic<std::uint64_t>> t_counter;

}  // namespace

void init_interrupts() {
  py::object main = py::module_::import("threading").attr("main_thread")();
  g_main_thread = main.attr("ident").cast<unsigned long>();
}

bool on_main_thread() noexcept {
  return g_main_thread != 0 && PyThread_get_thread_ident() == g_main_thread;
}

bool InterruptWatch::check(void*) {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  PendingError& p = t_pending;
  Py_XDECREF(p.type);
  Py_XDECREF(p.value);
  Py_XDECREF(p.traceback);
  PyErr_Fetch(&p.type, &p.value, &p.traceback);
  return true;
}

InterruptWatch::InterruptWatch()
    : _counter(t_counter),
      _scope(g_main_thread != 0 && PyThread_get_thread_ident() == g_main_thread
                 ? &InterruptWatch::check
                 : nullptr,
             nullptr),
      _progress(_counter.get()) {}

void raise_cancelled() {
  PendingError& p = t_pending;
  if (p.type == nullptr) {
    PyErr_SetNone(PyExc_KeyboardInterrupt);
    return;
  }
  PyErr_Restore(p.type, p.value, p.traceback);  // steals the references
  p = PendingError{};
}

void bind_interrupt(py::module_& m) {
  py::class_<ProgressCounter>(
      m, "ProgressCounter",
      R"pbdoc(Raw bytes finished by the native saves, loads, verifies and stitches of the threads it is set on (set_progress_counter); readable from any thread.)pbdoc")
      .def(py::init<>())
      .def_property_readonly("bytes", [](const ProgressCounter& c) {
        return c.bytes->load(std::memory_order_relaxed);
      });
  m.def(
      "set_progress_counter",
      [](const ProgressCounter* counter) { t_counter = counter ? counter->bytes : nullptr; },
      py::arg("counter").none(true),
      R"pbdoc(Set (or clear, with None) the calling thread's progress counter.)pbdoc");
}

}  // namespace pyckpt::bindings
