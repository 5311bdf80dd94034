#pragma once
/**
 * @file file_io.hpp
 * @brief Data-file writer (O_DIRECT auto|on|off, temp + fsync + rename), the parallel
 *        encode-and-write pipeline, and the parallel pread + verify + decode reader.
 *
 * Thread-safety: a FileWriter is used by one thread at a time (it runs its own I/O thread
 * internally). encode_and_write() and read_requests() may run concurrently on different files.
 */
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/buffer_pool.hpp"
#include "core/codec.hpp"
#include "core/thread_pool.hpp"

namespace pyckpt {

/** @brief Direct I/O policy: Auto falls back to buffered I/O where O_DIRECT is refused. */
enum class DirectMode : std::uint8_t { Auto = 0, On = 1, Off = 2 };

/**
 * @brief Test hook: makes the writer behave as if the file system refused O_DIRECT, so the
 *        fallback paths can be tested on file systems that accept it (tmpfs and ext4 here).
 *
 * OpenEinval: the O_DIRECT open() fails with EINVAL. FirstWriteEinval: the first aligned pwrite
 * through the O_DIRECT descriptor fails with EINVAL. Never used outside tests.
 */
enum class DirectFault : std::uint8_t { None = 0, OpenEinval = 1, FirstWriteEinval = 2 };

/**
 * @brief Appends bytes to `<final>.tmp-<pid>-<counter>` and renames it to `final` on commit().
 *
 * Data is copied into 4 KiB-aligned staging blocks; each full block is written with pwrite at an
 * aligned offset by a background I/O thread (O_DIRECT when in effect), so copying the next block
 * overlaps writing the previous one. The unaligned tail is written through a second, buffered
 * descriptor. commit() fsyncs the file (if enabled), renames it and fsyncs the directory.
 * Destroying an uncommitted writer unlinks the temp file, so no file ever appears under its final
 * name half-written, and an existing file of that name is untouched until the rename.
 *
 * Thread-safety: one thread at a time may call append()/commit()/abort(); the accessors may be
 * called from any thread.
 */
class FileWriter {
 public:
  /**
   * @param final_path the file's final name (its directory must exist).
   * @param mode direct I/O policy. On: failure to open with O_DIRECT throws SysError.
   * @param fsync fsync the file and the directory on commit.
   * @param staging_block_bytes size of each staging block (rounded up to 4 KiB; default 8 MiB).
   * @param staging_blocks number of staging blocks (>= 2, for overlap).
   * @param fault test hook (see DirectFault); DirectFault::None in production.
   * @param staging optional pool to take staging blocks from instead of a private one (so a
   *        long-lived writer component can reuse hot, possibly pinned, memory across files);
   *        when given, `staging_block_bytes`/`staging_blocks` are ignored. It must not be the
   *        pool passed to encode_and_write() as `blocks` (both sides block on it).
   * @throws SysError when the temp file cannot be created (e.g. EACCES, ENOENT, ENOTDIR), or
   *         with mode On when O_DIRECT is refused; std::invalid_argument on bad sizes.
   */
  FileWriter(std::string final_path, DirectMode mode, bool fsync,
             std::size_t staging_block_bytes = 8u << 20, std::size_t staging_blocks = 3,
             DirectFault fault = DirectFault::None,
             std::shared_ptr<BufferPool> staging = nullptr);
  /** @brief Aborts (unlinks the temp file) unless committed. Never throws. */
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  /**
   * @brief Appends `n` bytes; returns the file offset where they start.
   * @note The bytes are copied before append() returns; `data` may be reused at once.
   * @throws SysError when an earlier background write failed (ENOSPC, EFBIG, EIO ...);
   *         std::logic_error after commit() or abort().
   */
  std::uint64_t append(const void* data, std::size_t n);
  /** @return bytes appended so far. */
  std::uint64_t size() const noexcept { return _size; }
  /**
   * @return true when O_DIRECT is in effect (it may turn false after the first write in Auto
   *         mode, when the file system accepted the open but refused the write).
   */
  bool direct() const noexcept;
  /** @return true once commit() has succeeded. */
  bool committed() const noexcept;
  /** @return the final path. */
  const std::string& path() const noexcept { return _final; }
  /** @return the temp file's path (where the bytes live until commit). */
  const std::string& temp_path() const noexcept;
  /**
   * @brief Flushes, fsyncs (if enabled) and renames into place, then fsyncs the directory.
   * @throws SysError (the writer is then aborted: the temp file is gone, `final` untouched);
   *         std::logic_error after abort().
   */
  void commit();
  /** @brief Discards the temp file (idempotent, never throws; a no-op after commit()). */
  void abort() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> _impl;
  std::string _final;
  std::uint64_t _size = 0;
};

/** @brief One item to encode and append. */
struct WriteRequest {
  std::string name;        ///< for error messages (e.g. the tensor's FQN)
  const void* data = nullptr;  ///< host bytes; must stay valid until the call returns
  std::uint64_t nbytes = 0;
  CodecParams params;
};

/** @brief Where an item landed and how it was encoded. */
struct WrittenItem {
  std::uint64_t offset = 0;        ///< file offset of its first stored byte
  std::uint64_t stored_bytes = 0;  ///< total stored bytes
  std::vector<ChunkRecord> chunks; ///< in raw order; chunk i holds raw [i*chunk_bytes, ...)
};

/**
 * @brief Encodes `items` in chunks of `chunk_bytes` on `pool` and appends them in order.
 *
 * At most 2 x pool.size() + 2 chunks are in flight; zstd chunks are encoded into blocks of
 * `blocks` (whose block size must be >= max_encoded_size(chunk_bytes)). Codec::None chunks are
 * only checksummed by the workers and appended straight from the source. Zero-byte items get
 * zero chunks (their offset is the file size at their turn). Chunk records carry file offsets.
 * @note SAFETY: every items[i].data must stay valid and unmodified until the call returns.
 * @throws the first error of any task (after all tasks are drained), with the item name in the
 *         message (same exception type; for SysError the name goes in detail()); the writer is
 *         then left uncommitted. std::invalid_argument for chunk_bytes == 0, bad params or a too
 *         small `blocks`.
 */
std::vector<WrittenItem> encode_and_write(FileWriter& out, const std::vector<WriteRequest>& items,
                                          std::size_t chunk_bytes, ThreadPool& pool,
                                          BufferPool& blocks);

/** @brief A run of consecutive chunks of an item stored in one file. */
struct ReadSegment {
  std::string path;               ///< data file
  std::uint64_t raw_begin = 0;    ///< offset of the segment's first raw byte within the item
  CodecParams params;             ///< codec parameters (elem_size needed to ungroup)
  std::vector<ChunkRecord> chunks;
};

/** @brief Fill dst with raw bytes [lo, hi) of an item made of `segments`. */
struct ReadRequest {
  std::string name;
  std::vector<ReadSegment> segments;
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  void* dst = nullptr;  ///< hi - lo writable bytes; must stay valid until the call returns
};

/** @brief What a read_requests() call did. */
struct ReadStats {
  std::uint64_t bytes_read = 0;      ///< stored bytes read from files
  std::uint64_t chunks_decoded = 0;  ///< chunks read, verified and decoded
};

/**
 * @brief Reads, verifies and decodes, in parallel, only the chunks overlapping each [lo, hi).
 * @throws FileNotFoundError-style SysError for a missing file, FormatError(Truncated) when a file
 *         is shorter than a recorded chunk, FormatError(Checksum) on corruption, FormatError when
 *         the segments do not cover [lo, hi); messages name the file and the item.
 */
ReadStats read_requests(const std::vector<ReadRequest>& requests, ThreadPool& pool);

}  // namespace pyckpt
