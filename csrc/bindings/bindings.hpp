#pragma once
// Registration functions of the pyckpt._C submodules; one bind_<area>.cpp each.
#include <pybind11/pybind11.h>

#include "bindings/gil.hpp"
#include "core/buffer_pool.hpp"

namespace pyckpt::bindings {
namespace py = pybind11;

void bind_pool(py::module_& m);
void bind_codec(py::module_& m);
void bind_io(py::module_& m);
void bind_objstore(py::module_& m);
void bind_safetensors(py::module_& m);
void bind_index(py::module_& m);
void bind_cuda(py::module_& m);

/** @return a BufferPool's counters as a dict keyed by the PoolStats field names. */
py::dict pool_stats(const BufferPool& pool);

}  // namespace pyckpt::bindings
