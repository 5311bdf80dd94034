#pragma once
/**
 * @file storage.hpp
 * @brief The storage seam: where chunks are written to (ChunkSink) and read from (ChunkSource).
 *
 * Everything above this seam (the encode pipeline, the chunk reader, the stitcher) moves bytes
 * only through these two interfaces; everything below it (posix_storage.hpp today, an object
 * store client later) knows nothing about chunks, codecs or tensors.
 *
 * Buffers always belong to the caller: a sink copies (or DMAs) `append()`ed bytes before it
 * returns, and a source fills a caller buffer in `read_at()`. A backend that already holds the
 * bytes in memory (a mapping, a downloaded object, a buffer handed over from Python) can lend
 * them through `view_at()` instead, so the chunk path verifies and decodes them in place with no
 * extra payload copy. A backend written in Python would implement read_at() by filling `dst`
 * (e.g. a memoryview over it, `readinto`) with the GIL taken only inside the backend.
 *
 * Thread-safety: a ChunkSource must allow concurrent read_at()/view_at() calls from many threads
 * (positional reads, no shared file position). A ChunkSink is used by one thread at a time.
 */
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace pyckpt {

/** @brief A place chunks are read from: a sized, immutable byte range with positional reads. */
class ChunkSource {
 public:
  virtual ~ChunkSource() = default;

  /** @return the name used in error messages (a path, an object key). */
  virtual const std::string& name() const noexcept = 0;

  /**
   * @return the number of bytes the source holds, known when it was opened. Every record is
   *         checked against it before any buffer is allocated for it.
   */
  virtual std::uint64_t size() const noexcept = 0;

  /**
   * @brief Copies bytes [offset, offset + len) into `dst` (len writable bytes).
   * @note Thread-safe; `dst` belongs to the caller and is not retained.
   * @throws SysError when the backend fails; FormatError(Truncated) when the source ends before
   *         offset + len.
   */
  virtual void read_at(std::uint64_t offset, std::size_t len, void* dst) = 0;

  /**
   * @brief Zero-copy access: a pointer to bytes [offset, offset + len) that stays valid while the
   *        source lives, or nullptr when the backend cannot lend them (callers then use read_at()).
   * @note The default lends nothing. Thread-safe.
   */
  virtual const std::uint8_t* view_at(std::uint64_t offset, std::size_t len) {
    (void)offset;
    (void)len;
    return nullptr;
  }
};

/**
 * @brief A place chunks are written to: an append-only byte stream that becomes visible under its
 *        final name only on commit().
 */
class ChunkSink {
 public:
  virtual ~ChunkSink() = default;

  /** @return the final name (for error messages and for the metadata). */
  virtual const std::string& name() const noexcept = 0;

  /**
   * @brief Appends `n` bytes; returns the offset where they start.
   * @note The bytes are copied before append() returns; `data` may be reused at once.
   * @throws SysError when the backend failed (now or in an earlier background write).
   */
  virtual std::uint64_t append(const void* data, std::size_t n) = 0;

  /** @return bytes appended so far. */
  virtual std::uint64_t size() const noexcept = 0;

  /**
   * @brief Makes everything appended durable and visible under the final name, atomically.
   * @throws SysError; the sink is then aborted.
   */
  virtual void commit() = 0;

  /** @brief Discards everything appended (idempotent; a no-op after commit()). Never throws. */
  virtual void abort() noexcept = 0;
};

/**
 * @brief Opens a source by name. The readers take one so that a backend other than POSIX files
 *        can serve the same segments; open_posix_source() (posix_storage.hpp) is the default.
 * @throws what the backend throws for a missing or unusable source (SysError, FormatError).
 */
using SourceOpener = std::function<std::unique_ptr<ChunkSource>(const std::string& name)>;

}  // namespace pyckpt
