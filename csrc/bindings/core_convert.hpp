#pragma once
// Conversions between Python objects and core structs for the codec / I/O bindings. Every
// function here runs with the GIL held; the bindings release it only after conversion.
#include <cstdint>
#include <string>

#include "bindings/bindings.hpp"
#include "core/codec.hpp"
#include "core/posix_storage.hpp"

namespace pyckpt::bindings {

/** @brief A buffer-protocol export held for the duration of a call (released with the GIL held). */
class BufferRef {
 public:
  /**
   * @param obj any object exporting a C-contiguous buffer (bytes, bytearray, memoryview, numpy).
   * @param writable request a writable buffer.
   * @throws py::error_already_set (BufferError/TypeError) when `obj` cannot export one.
   */
  BufferRef(py::handle obj, bool writable);
  ~BufferRef();
  BufferRef(const BufferRef&) = delete;
  BufferRef& operator=(const BufferRef&) = delete;
  /** @return the first byte. */
  void* data() const noexcept { return _view.buf; }
  /** @return the length in bytes. */
  std::size_t size() const noexcept { return static_cast<std::size_t>(_view.len); }

 private:
  Py_buffer _view{};
};

/**
 * @brief The CodecParams held by a `pyckpt._C.CodecParams` object (validated when it was made;
 *        the reference lives as long as `obj`). @throws TypeError naming `what` for anything else.
 */
const CodecParams& params_from_py(py::handle obj, const char* what);

/**
 * @brief Parses a Chunk record (file_offset, raw_len, xxh64, transform, (mode0, len0, ...)), or
 *        any sequence of that layout; stored_len is the sum of plane lengths.
 *        @throws FormatError(Header) on a malformed record.
 */
ChunkRecord record_from_py(py::handle obj);

/** @brief Inverse of record_from_py: a plain tuple of the Chunk layout (records are made in
 *         bulk; see Rec::Chunk in records.hpp). */
py::tuple record_to_py(const ChunkRecord& rec);

/** @brief Parses "auto" | "on" | "off". @throws ValueError. */
DirectMode direct_mode_from_py(const std::string& s);

/** @brief Converts a non-negative Python int. @throws TypeError / OverflowError / ValueError. */
std::uint64_t u64_from_py(py::handle obj, const char* what);

/** @brief os.fspath(obj) as a UTF-8 / filesystem-encoded std::string. */
std::string path_from_py(py::handle obj);

}  // namespace pyckpt::bindings
