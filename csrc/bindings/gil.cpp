#include "bindings/gil.hpp"

#include <chrono>
#include <thread>

#include "bindings/interrupt.hpp"

namespace pyckpt::bindings {

bool finalizing_elsewhere() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing() != 0;
#else
  const bool finalizing = _Py_IsFinalizing() != 0;
#endif
  // Py_FinalizeEx runs on the main thread (the one that imported pyckpt._C); that thread must
  // go on with the finalization.
  return finalizing && !on_main_thread();
}

void park_thread() noexcept {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace pyckpt::bindings
