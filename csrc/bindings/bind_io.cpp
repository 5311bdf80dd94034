#include "bindings/bindings.hpp"

namespace pyckpt::bindings {
void bind_io(py::module_&) {}
}  // namespace pyckpt::bindings
