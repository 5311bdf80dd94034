#include "bindings/bindings.hpp"

namespace pyckpt::bindings {
void bind_pool(py::module_&) {}
}  // namespace pyckpt::bindings
