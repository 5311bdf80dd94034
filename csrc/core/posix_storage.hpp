#pragma once
/**
 * @file posix_storage.hpp
 * @brief The POSIX backend of the storage seam (storage.hpp): FileWriter, a ChunkSink writing a
 *        temp file with O_DIRECT (auto|on|off) that is fsynced and renamed on commit, and
 *        PosixFile, a ChunkSource over a regular file read with pread (or a mapping).
 *
 * Also the POSIX helpers every file-touching component of the core shares: open_regular_file()
 * (O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, then fstat: only regular files are accepted, so a FIFO
 * cannot hang a reader and a planted symlink is not followed), pread_full() and pwrite_full().
 *
 * Thread-safety: a FileWriter is used by one thread at a time (it runs its own I/O thread
 * internally). A PosixFile serves concurrent read_at()/view_at() calls; map() is not thread-safe.
 */
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/buffer_pool.hpp"
#include "core/storage.hpp"

namespace pyckpt {

/** @brief How open_regular_file() opens a file. */
enum class OpenFor : std::uint8_t {
  Read = 0,       ///< O_RDONLY
  ReadWrite = 1,  ///< O_RDWR (an existing file; never created or truncated)
};

/**
 * @brief Opens an existing regular file without following a symlink at its last component and
 *        without blocking on a FIFO, then checks with fstat that it is a regular file.
 * @param path the file.
 * @param mode read-only or read-write.
 * @param[out] size the file size from fstat.
 * @return the descriptor (the caller closes it).
 * @throws SysError naming the path when open() or fstat() fails (ENOENT -> FileNotFoundError,
 *         ELOOP for a symlink); FormatError(Other) naming the path and the file type when it is
 *         not a regular file (directory, FIFO, socket, device).
 */
int open_regular_file(const std::string& path, OpenFor mode, std::uint64_t& size);

/** @brief Default bytes per read call of preadv_full() (see there). */
inline constexpr std::uint64_t kDefaultReadPieceBytes = 128 << 10;

/**
 * @brief Sets the bytes per read call of preadv_full(), process-wide (a network file system's
 *        client may want larger requests than the local kernel's readahead).
 * @throws std::invalid_argument when `bytes` is below 4096.
 */
void set_read_piece_bytes(std::uint64_t bytes);

/** @return the bytes per read call of preadv_full(). */
std::uint64_t read_piece_bytes() noexcept;

/**
 * @brief Reads exactly `n` bytes at `off` in calls of at most read_piece_bytes(), looping on
 *        short reads and EINTR: preadv_full() with one buffer.
 * @throws SysError(op "pread") naming `path`; FormatError(Truncated) naming `path` and the byte
 *         range when the file ends first.
 */
void pread_full(int fd, void* dst, std::uint64_t n, std::uint64_t off, const std::string& path);

/**
 * @brief Reads the file bytes [off, off + total of iov lengths) into the `count` buffers of
 *        `iov` in order (the kernel scatters them: no user-space copy), looping on short reads
 *        and EINTR. `iov` is consumed (advanced in place).
 *
 * Each call reads at most read_piece_bytes() (default 128 KiB; whole buffers while they fit,
 * else part of one). Linux (6.18, ext4) serves a cold file's small sequential reads by
 * asynchronous readahead into large folios, and a read of several MiB synchronously into 4 KiB
 * pages: on a 2-core VM, 8 MiB of a cold checkpoint file read in 3.0 ms in 128 KiB calls against
 * 8.3 ms in 4 MiB calls, and the cached pages then read back at ~50 GB/s against ~27 GB/s.
 * Cached data costs one call per 128 KiB (about a microsecond each).
 * @throws as pread_full().
 */
void preadv_full(int fd, struct iovec* iov, int count, std::uint64_t off, const std::string& path);

/**
 * @brief Writes all of [p, p + n) at `off`, looping on short writes and EINTR.
 * @return 0, or the errno of the failure (EIO for a write that makes no progress).
 */
int pwrite_full(int fd, const void* p, std::uint64_t n, std::uint64_t off) noexcept;

/**
 * @brief An open regular file (see open_regular_file()) that is also a ChunkSource; optionally
 *        mapped, so view_at() lends pages of the mapping instead of copying.
 */
class PosixFile final : public ChunkSource {
 public:
  /**
   * @param path the file.
   * @param mode read-only, or read-write for outputs filled in place (stitcher).
   * @throws as open_regular_file().
   */
  PosixFile(std::string path, OpenFor mode);
  /** @brief Unmaps and closes. */
  ~PosixFile() override;
  PosixFile(const PosixFile&) = delete;
  PosixFile& operator=(const PosixFile&) = delete;

  const std::string& name() const noexcept override { return _path; }
  std::uint64_t size() const noexcept override { return _size; }
  /** @throws SysError / FormatError(Truncated) as pread_full(). */
  void read_at(std::uint64_t offset, std::size_t len, void* dst) override;
  /** @return a pointer into the mapping when map() was called and the range is inside the file. */
  const std::uint8_t* view_at(std::uint64_t offset, std::size_t len) override;

  /**
   * @brief Maps the whole file (MAP_SHARED; writable when opened ReadWrite). A no-op for an empty
   *        or already mapped file. Not thread-safe: call before sharing the object.
   * @param sequential advise sequential access.
   * @throws SysError(op "mmap").
   */
  void map(bool sequential);
  /** @brief msync (when mapped writable), then fsync. @throws SysError. */
  void sync();
  /** @return the descriptor. */
  int fd() const noexcept { return _fd; }
  /** @return the mapping, or nullptr. */
  std::uint8_t* data() const noexcept { return _map; }
  /** @return the path. */
  const std::string& path() const noexcept { return _path; }

 private:
  std::string _path;
  int _fd = -1;
  std::uint64_t _size = 0;
  bool _writable = false;
  std::uint8_t* _map = nullptr;
};

/**
 * @brief The default SourceOpener: a read-only PosixFile.
 * @throws as open_regular_file().
 */
std::unique_ptr<ChunkSource> open_posix_source(const std::string& path);

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
class FileWriter final : public ChunkSink {
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
             DirectFault fault = DirectFault::None, std::shared_ptr<BufferPool> staging = nullptr);
  /** @brief Aborts (unlinks the temp file) unless committed. Never throws. */
  ~FileWriter() override;
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  /**
   * @brief Appends `n` bytes; returns the file offset where they start.
   * @note The bytes are copied before append() returns; `data` may be reused at once.
   * @throws SysError when an earlier background write failed (ENOSPC, EFBIG, EIO ...);
   *         std::logic_error after commit() or abort().
   */
  std::uint64_t append(const void* data, std::size_t n) override;
  /** @return bytes appended so far. */
  std::uint64_t size() const noexcept override { return _size; }
  /**
   * @return true when O_DIRECT is in effect (it may turn false after the first write in Auto
   *         mode, when the file system accepted the open but refused the write).
   */
  bool direct() const noexcept;
  /** @return true once commit() has succeeded. */
  bool committed() const noexcept;
  /** @return the final path. */
  const std::string& path() const noexcept { return _final; }
  /** @return the final path (ChunkSink). */
  const std::string& name() const noexcept override { return _final; }
  /** @return the temp file's path (where the bytes live until commit). */
  const std::string& temp_path() const noexcept;
  /**
   * @brief Flushes, fsyncs (if enabled) and renames into place, then fsyncs the directory.
   * @throws SysError (the writer is then aborted: the temp file is gone, `final` untouched);
   *         std::logic_error after abort().
   */
  void commit() override;
  /** @brief Discards the temp file (idempotent, never throws; a no-op after commit()). */
  void abort() noexcept override;

 private:
  struct Impl;
  std::unique_ptr<Impl> _impl;
  std::string _final;
  std::uint64_t _size = 0;
};

}  // namespace pyckpt
