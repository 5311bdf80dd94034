#pragma once
// Conversions of the I/O call arguments (write items, read segments and requests, in-memory
// sources), shared by the file bindings (bind_io.cpp) and the object-store bindings
// (bind_objstore.cpp).
#include <pybind11/pybind11.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bindings/core_convert.hpp"
#include "core/chunk_reader.hpp"
#include "core/encode_pipeline.hpp"
#include "core/memory_storage.hpp"

namespace pyckpt::bindings {
namespace py = pybind11;

/** @brief Parses WriteItems (name, data_ptr, nbytes, params), or tuples of that layout. */
std::vector<WriteRequest> items_from_py(py::handle items);
/** @brief Parses Segments (path, raw_begin, params, chunks), or tuples of that layout. */
std::vector<ReadSegment> segments_from_py(py::handle segments);
/** @brief Parses ReadRequests (name, segments, lo, hi, dst), or tuples of that layout. */
std::vector<ReadRequest> requests_from_py(py::handle requests);
/** @brief The result of write_items: [WrittenItem(offset, stored_bytes, [record, ...]), ...]. */
py::list written_to_py(const std::vector<WrittenItem>& written);

/**
 * @brief Byte ranges already in memory (downloaded from an object store, received from a peer
 *        rank), opened as MemorySources so the chunk path verifies and decodes them in place.
 *
 * Made from `{name: MemorySource(size, [MemoryRange(offset, data), ...])}` (or tuples of that
 * layout; data any buffer-protocol objects, kept referenced until destruction); a name not
 * listed opens as a POSIX file. Construct and destroy with the GIL held; opener() may be used
 * without it.
 */
class MemorySources {
 public:
  explicit MemorySources(py::handle sources);
  ~MemorySources() { _buffers.clear(); }
  MemorySources(const MemorySources&) = delete;
  MemorySources& operator=(const MemorySources&) = delete;
  /** @return an opener serving listed names from memory and others from files. */
  SourceOpener opener() const;

 private:
  struct Entry {
    std::uint64_t size = 0;
    std::vector<MemoryRange> ranges;
  };
  std::vector<std::unique_ptr<BufferRef>> _buffers;
  std::map<std::string, Entry> _entries;
};

}  // namespace pyckpt::bindings
