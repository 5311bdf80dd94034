#pragma once
// Conversions of the I/O call arguments (write items, read segments and requests), shared by
// the file bindings (bind_io.cpp) and the object-store bindings (bind_objstore.cpp).
#include <pybind11/pybind11.h>

#include <vector>

#include "core/chunk_reader.hpp"
#include "core/encode_pipeline.hpp"

namespace pyckpt::bindings {
namespace py = pybind11;

/** @brief Parses write items (name, data_ptr, nbytes, params). */
std::vector<WriteRequest> items_from_py(py::handle items);
/** @brief Parses segments (path, raw_begin, params, chunks). */
std::vector<ReadSegment> segments_from_py(py::handle segments);
/** @brief Parses read requests (name, segments, lo, hi, dst_ptr). */
std::vector<ReadRequest> requests_from_py(py::handle requests);

}  // namespace pyckpt::bindings
