#include "bindings/bindings.hpp"

namespace pyckpt::bindings {
// Filled in by the cuda component.
void bind_cuda(py::module_&) {}
}  // namespace pyckpt::bindings
