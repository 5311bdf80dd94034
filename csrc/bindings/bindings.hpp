#pragma once
// Registration functions of the pyckpt._C submodules; one bind_<area>.cpp each.
#include <pybind11/pybind11.h>

namespace pyckpt::bindings {
namespace py = pybind11;

void bind_pool(py::module_& m);
void bind_codec(py::module_& m);
void bind_io(py::module_& m);
void bind_safetensors(py::module_& m);
void bind_cuda(py::module_& m);

}  // namespace pyckpt::bindings
