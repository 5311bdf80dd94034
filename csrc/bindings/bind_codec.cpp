#include "bindings/bindings.hpp"

namespace pyckpt::bindings {
void bind_codec(py::module_&) {}
}  // namespace pyckpt::bindings
