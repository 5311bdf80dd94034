#include "bindings/bindings.hpp"

namespace pyckpt::bindings {
// Filled in by the safetensors component.
void bind_safetensors(py::module_&) {}
}  // namespace pyckpt::bindings
