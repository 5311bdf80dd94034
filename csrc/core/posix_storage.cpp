// POSIX backend of the storage seam. See posix_storage.hpp for the contracts; comments here
// explain the mechanics.
#include "core/posix_storage.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <utility>

#include "core/error.hpp"

namespace pyckpt {

namespace {

// Linux caps one read()/write() at ~2 GiB; ask for at most 1 GiB per call.
constexpr std::uint64_t kMaxIoPerCall = std::uint64_t{1} << 30;

const char* file_type(mode_t m) noexcept {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  return "not a regular file";
}

}  // namespace

int open_regular_file(const std::string& path, OpenFor mode, std::uint64_t& size) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever. It has no
  // effect on regular files, which are all we accept. O_NOFOLLOW: a symlink planted at a data
  // file's name must not redirect the read (or, for outputs, the write) to another file.
  const int acc = mode == OpenFor::ReadWrite ? O_RDWR : O_RDONLY;
  const int fd = ::open(path.c_str(), acc | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw SysError(errno, "open", path);
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw SysError(err, "fstat", path);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw FormatError(FormatKind::Other, detail::concat("'", path, "' is ", file_type(st.st_mode),
                                                        ", not a regular file"));
  }
  size = static_cast<std::uint64_t>(st.st_size);
  return fd;
}

// At most this many buffers per preadv call (the kernel's UIO_MAXIOV on Linux).
constexpr int kMaxIovPerCall = 1024;
// Bytes per read call: small sequential reads keep the kernel's readahead ahead of the reader
// and fill the page cache with large folios (see preadv_full() in the header).
namespace {
std::atomic<std::uint64_t> g_read_piece_bytes{kDefaultReadPieceBytes};
}  // namespace

void set_read_piece_bytes(std::uint64_t bytes) {
  if (bytes < 4096) {
    throw std::invalid_argument(detail::concat("read piece of ", bytes, " bytes: at least 4096"));
  }
  g_read_piece_bytes.store(bytes, std::memory_order_relaxed);
}

std::uint64_t read_piece_bytes() noexcept {
  return g_read_piece_bytes.load(std::memory_order_relaxed);
}

void preadv_full(int fd, struct iovec* iov, int count, std::uint64_t off, const std::string& path) {
  const std::uint64_t max_piece = read_piece_bytes();
  std::uint64_t want = 0;
  for (int i = 0; i < count; ++i) want += iov[i].iov_len;
  const std::uint64_t start = off;
  while (count > 0) {
    if (iov->iov_len == 0) {
      ++iov;
      --count;
      continue;
    }
    // At most max_piece bytes per call: whole buffers while they fit, else a first part.
    int n = 0;
    std::uint64_t piece = 0;
    while (n < std::min(count, kMaxIovPerCall) && piece + iov[n].iov_len <= max_piece) {
      piece += iov[n].iov_len;
      ++n;
    }
    struct iovec first{};
    const struct iovec* call = iov;
    if (n == 0) {
      first = {iov->iov_base, static_cast<std::size_t>(max_piece)};
      call = &first;
      n = 1;
    }
    const ssize_t r = ::preadv(fd, call, n, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw SysError(errno, "pread", path);
    }
    if (r == 0) {
      throw FormatError(FormatKind::Truncated,
                        detail::concat("file '", path, "' is truncated: bytes [", start, ", ",
                                       start + want, ") are needed but the file ends at ", off));
    }
    off += static_cast<std::uint64_t>(r);
    auto left = static_cast<std::size_t>(r);
    while (left > 0 && left >= iov->iov_len) {  // whole buffers filled
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (left > 0) {  // one buffer filled in part
      iov->iov_base = static_cast<std::uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
}

void pread_full(int fd, void* dst, std::uint64_t n, std::uint64_t off, const std::string& path) {
  struct iovec one{dst, static_cast<std::size_t>(n)};
  preadv_full(fd, &one, 1, off, path);
}

int pwrite_full(int fd, const void* p, std::uint64_t n, std::uint64_t off) noexcept {
  const auto* s = static_cast<const std::uint8_t*>(p);
  while (n > 0) {
    const auto want = static_cast<std::size_t>(std::min(n, kMaxIoPerCall));
    const ssize_t r = ::pwrite(fd, s, want, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return EIO;  // a regular file never accepts 0 of n > 0 bytes; do not spin
    s += r;
    n -= static_cast<std::uint64_t>(r);
    off += static_cast<std::uint64_t>(r);
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// PosixFile
// ---------------------------------------------------------------------------------------------

PosixFile::PosixFile(std::string path, OpenFor mode)
    : _path(std::move(path)), _writable(mode == OpenFor::ReadWrite) {
  _fd = open_regular_file(_path, mode, _size);
}

PosixFile::~PosixFile() {
  if (_map) ::munmap(_map, static_cast<std::size_t>(_size));
  if (_fd >= 0) ::close(_fd);
}

void PosixFile::read_at(std::uint64_t offset, std::size_t len, void* dst) {
  pread_full(_fd, dst, len, offset, _path);
}

const std::uint8_t* PosixFile::view_at(std::uint64_t offset, std::size_t len) {
  if (_map == nullptr || offset > _size || len > _size - offset) return nullptr;
  const std::uint8_t* p = _map + offset;
  // Ask for the pages up front: copying out of a cold mapping otherwise runs at page-fault speed
  // (readahead driven one fault at a time).
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto lo = reinterpret_cast<std::uintptr_t>(p) & ~(page - 1);
  (void)::madvise(reinterpret_cast<void*>(lo), reinterpret_cast<std::uintptr_t>(p + len) - lo,
                  MADV_WILLNEED);
  return p;
}

void PosixFile::map(bool sequential) {
  if (_map || _size == 0) return;
  const int prot = _writable ? (PROT_READ | PROT_WRITE) : PROT_READ;
  void* p = ::mmap(nullptr, static_cast<std::size_t>(_size), prot, MAP_SHARED, _fd, 0);
  if (p == MAP_FAILED) throw SysError(errno, "mmap", _path);
  _map = static_cast<std::uint8_t*>(p);
  if (sequential) (void)::madvise(_map, static_cast<std::size_t>(_size), MADV_SEQUENTIAL);
}

void PosixFile::sync() {
  // Pages dirtied through the mapping are written back by fsync on Linux; msync first keeps
  // that true on systems without dirty tracking of shared mappings.
  if (_map && _writable) {
    PYCKPT_SYSCALL_CHECK(::msync(_map, static_cast<std::size_t>(_size), MS_SYNC), "msync", _path);
  }
  PYCKPT_SYSCALL_CHECK(::fsync(_fd), "fsync", _path);
}

std::unique_ptr<ChunkSource> open_posix_source(const std::string& path) {
  return std::make_unique<PosixFile>(path, OpenFor::Read);
}

// ---------------------------------------------------------------------------------------------
// FileWriter
// ---------------------------------------------------------------------------------------------

namespace {

// O_DIRECT needs the buffer address, the file offset and the length aligned to the logical
// block size of the device; one page covers every device we know of.
constexpr std::size_t kDirectAlign = kBlockAlign;

std::atomic<std::uint64_t> g_temp_counter{0};

std::string dir_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void close_quietly(int& fd) noexcept {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

struct FileWriter::Impl {
  enum class State { Open, Committed, Aborted };

  struct Job {
    Lease block;
    std::size_t len = 0;
    std::uint64_t offset = 0;
  };

  std::string temp;
  bool do_fsync = true;
  DirectMode mode = DirectMode::Auto;
  DirectFault fault = DirectFault::None;
  State state = State::Open;

  int fd = -1;       // data descriptor: O_DIRECT when `direct`; touched by the I/O thread
  int tail_fd = -1;  // buffered descriptor for the unaligned tail (only when direct)
  std::atomic<bool> direct{false};
  bool first_write = true;  // I/O thread only

  std::shared_ptr<BufferPool> staging;
  Lease cur;                     // block being filled by append()
  std::size_t cur_fill = 0;      // bytes used in `cur`
  std::uint64_t cur_offset = 0;  // file offset of cur's first byte

  std::thread io;
  std::mutex mu;
  std::condition_variable cv_work;
  std::condition_variable cv_idle;
  std::deque<Job> queue;
  bool busy = false;
  bool stop = false;
  int io_errno = 0;  // first background write failure; sticky

  void open_files();
  void io_loop();
  int write_job(const Job& job);
  void submit(Job job);
  void wait_idle();
  void stop_io(bool discard) noexcept;
  void rethrow_io_error();
};

void FileWriter::Impl::open_files() {
  const int flags = O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC;
  if (mode != DirectMode::Off) {
    int err = 0;
    if (fault == DirectFault::OpenEinval) {
      err = EINVAL;
    } else {
      fd = ::open(temp.c_str(), flags | O_DIRECT, 0644);
      if (fd < 0) err = errno;
    }
    if (fd >= 0) {
      direct = true;
    } else if (mode == DirectMode::On || err != EINVAL) {
      // Only EINVAL means "this file system refuses O_DIRECT"; anything else (EACCES, ENOENT,
      // ENOTDIR, EEXIST) would fail the buffered open just the same.
      throw SysError(err, mode == DirectMode::On ? "open(O_DIRECT)" : "open", temp);
    }
  }
  if (fd < 0) {
    // Some kernels create the file before refusing O_DIRECT with EINVAL. EINVAL (not EEXIST)
    // proves the name was free before that call, so the file there now is ours: drop O_EXCL.
    const int f = (mode == DirectMode::Off) ? flags : (O_WRONLY | O_CREAT | O_CLOEXEC);
    fd = ::open(temp.c_str(), f, 0644);
    if (fd < 0) throw SysError(errno, "open", temp);
  } else {
    tail_fd = ::open(temp.c_str(), O_WRONLY | O_CLOEXEC);
    if (tail_fd < 0) {
      const int err = errno;
      close_quietly(fd);
      ::unlink(temp.c_str());
      throw SysError(err, "open", temp);
    }
  }
}

int FileWriter::Impl::write_job(const Job& job) {
  const std::uint8_t* p = reinterpret_cast<const std::uint8_t*>(job.block.data());
  if (!direct) return pwrite_full(fd, p, job.len, job.offset);

  int err;
  if (first_write && fault == DirectFault::FirstWriteEinval) {
    err = EINVAL;
  } else {
    // One aligned pwrite; a short count (e.g. RLIMIT_FSIZE cutting it) may leave an unaligned
    // remainder that O_DIRECT would refuse, so the rest goes through the buffered descriptor.
    ssize_t r;
    do {
      r = ::pwrite(fd, p, job.len, static_cast<off_t>(job.offset));
    } while (r < 0 && errno == EINTR);
    if (r >= 0) {
      first_write = false;
      const auto done = static_cast<std::size_t>(r);
      if (done == job.len) return 0;
      if (done == 0) return EIO;
      return pwrite_full(tail_fd, p + done, job.len - done, job.offset + done);
    }
    err = errno;
  }
  if (err == EINVAL && first_write && mode == DirectMode::Auto) {
    // The open succeeded but the file system refuses direct writes (seen on some FUSE and
    // network file systems): switch to buffered I/O for the whole file and carry on.
    first_write = false;
    const int bfd = ::open(temp.c_str(), O_WRONLY | O_CLOEXEC);
    if (bfd < 0) return errno;
    close_quietly(fd);
    fd = bfd;
    close_quietly(tail_fd);
    direct = false;
    return pwrite_full(fd, p, job.len, job.offset);
  }
  first_write = false;
  return err;
}

void FileWriter::Impl::io_loop() {
  for (;;) {
    Job job;
    bool skip;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv_work.wait(lock, [this] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stop requested and drained
      job = std::move(queue.front());
      queue.pop_front();
      busy = true;
      skip = io_errno != 0;  // after a failure the file is lost: just recycle the blocks
    }
    const int err = skip ? 0 : write_job(job);
    job.block.reset();  // back to the staging pool: unblocks an append() waiting for a block
    {
      std::lock_guard<std::mutex> lock(mu);
      if (err != 0 && io_errno == 0) io_errno = err;
      busy = false;
    }
    cv_idle.notify_all();
  }
}

void FileWriter::Impl::submit(Job job) {
  {
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(std::move(job));
  }
  cv_work.notify_one();
}

void FileWriter::Impl::wait_idle() {
  std::unique_lock<std::mutex> lock(mu);
  cv_idle.wait(lock, [this] { return queue.empty() && !busy; });
}

void FileWriter::Impl::stop_io(bool discard) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
    if (discard) queue.clear();  // releases the leases
  }
  cv_work.notify_all();
  if (io.joinable()) io.join();
}

void FileWriter::Impl::rethrow_io_error() {
  int err;
  {
    std::lock_guard<std::mutex> lock(mu);
    err = io_errno;
  }
  if (err != 0) throw SysError(err, "pwrite", temp);
}

FileWriter::FileWriter(std::string final_path, DirectMode mode, bool fsync,
                       std::size_t staging_block_bytes, std::size_t staging_blocks,
                       DirectFault fault, std::shared_ptr<BufferPool> staging)
    : _impl(std::make_unique<Impl>()), _final(std::move(final_path)) {
  PYCKPT_EXPECT(!_final.empty(), std::invalid_argument, "FileWriter: empty path");
  if (!staging) {
    PYCKPT_EXPECT(staging_block_bytes > 0, std::invalid_argument,
                  "FileWriter: staging_block_bytes must be > 0");
    PYCKPT_EXPECT(staging_blocks >= 2, std::invalid_argument,
                  "FileWriter: staging_blocks must be >= 2, got ", staging_blocks);
    staging = BufferPool::create(staging_block_bytes, staging_blocks);
  }
  Impl& m = *_impl;
  m.staging = std::move(staging);
  m.do_fsync = fsync;
  m.mode = mode;
  m.fault = fault;
  // pid + per-process counter: unique among live processes. A stale temp of a crashed process
  // that had the same pid makes O_EXCL fail with EEXIST, so move on to the next counter value.
  for (int attempt = 0;; ++attempt) {
    m.temp = detail::concat(_final, ".tmp-", ::getpid(), "-", g_temp_counter.fetch_add(1));
    try {
      m.open_files();
      break;
    } catch (const SysError& e) {
      if (e.code().value() != EEXIST || attempt >= 64) throw;
    }
  }
  try {
    m.io = std::thread([&m] { m.io_loop(); });
  } catch (...) {
    close_quietly(m.tail_fd);
    close_quietly(m.fd);
    ::unlink(m.temp.c_str());
    throw;
  }
}

FileWriter::~FileWriter() { abort(); }

bool FileWriter::direct() const noexcept { return _impl->direct.load(); }
bool FileWriter::committed() const noexcept { return _impl->state == Impl::State::Committed; }
const std::string& FileWriter::temp_path() const noexcept { return _impl->temp; }

std::uint64_t FileWriter::append(const void* data, std::size_t n) {
  Impl& m = *_impl;
  PYCKPT_EXPECT(m.state == Impl::State::Open, std::logic_error, "FileWriter '", _final,
                "': append() after ", m.state == Impl::State::Committed ? "commit()" : "abort()");
  m.rethrow_io_error();
  const std::uint64_t start = _size;
  const auto* src = static_cast<const std::uint8_t*>(data);
  while (n > 0) {
    if (!m.cur) {
      m.cur = m.staging->acquire();  // waits while every block is queued for writing
      m.cur_fill = 0;
    }
    const std::size_t take = std::min(n, m.cur.size() - m.cur_fill);
    std::memcpy(m.cur.data() + m.cur_fill, src, take);
    m.cur_fill += take;
    src += take;
    n -= take;
    _size += take;
    if (m.cur_fill == m.cur.size()) {
      const std::size_t len = m.cur_fill;
      m.submit(Impl::Job{std::move(m.cur), len, m.cur_offset});
      m.cur_offset += len;
      m.cur_fill = 0;
      m.rethrow_io_error();  // fail early instead of copying the rest of a lost file
    }
  }
  return start;
}

void FileWriter::commit() {
  Impl& m = *_impl;
  PYCKPT_EXPECT(m.state != Impl::State::Aborted, std::logic_error, "FileWriter '", _final,
                "': commit() after abort()");
  if (m.state == Impl::State::Committed) return;
  try {
    m.rethrow_io_error();
    std::uint8_t tail[kDirectAlign];
    std::size_t tail_len = 0;
    std::uint64_t tail_off = 0;
    if (m.cur && m.cur_fill > 0) {
      // Whole pages still go through the direct path; only the last partial page is buffered.
      // Copy it out first because the block itself goes to the I/O thread.
      std::size_t aligned = m.cur_fill;
      if (m.direct) {
        aligned = m.cur_fill & ~(kDirectAlign - 1);
        tail_len = m.cur_fill - aligned;
        tail_off = m.cur_offset + aligned;
        std::memcpy(tail, m.cur.data() + aligned, tail_len);
      }
      if (aligned > 0) {
        m.submit(Impl::Job{std::move(m.cur), aligned, m.cur_offset});
      }
      m.cur.reset();
      m.cur_fill = 0;
    }
    m.wait_idle();
    m.stop_io(false);
    m.rethrow_io_error();
    // The I/O thread is joined: fd/tail_fd/direct are ours again.
    if (tail_len > 0) {
      const int err = pwrite_full(m.direct ? m.tail_fd : m.fd, tail, tail_len, tail_off);
      if (err != 0) throw SysError(err, "pwrite", m.temp);
    }
    // fsync is per inode: it flushes the buffered tail and the metadata of the direct writes.
    if (m.do_fsync) PYCKPT_SYSCALL_CHECK(::fsync(m.fd), "fsync", m.temp);
    if (m.tail_fd >= 0) {
      const int tfd = m.tail_fd;
      m.tail_fd = -1;
      PYCKPT_SYSCALL_CHECK(::close(tfd), "close", m.temp);
    }
    {
      const int dfd = m.fd;
      m.fd = -1;
      PYCKPT_SYSCALL_CHECK(::close(dfd), "close", m.temp);
    }
    PYCKPT_SYSCALL_CHECK(::rename(m.temp.c_str(), _final.c_str()), "rename", _final);
    m.state = Impl::State::Committed;
    if (m.do_fsync) {
      // Makes the rename itself durable; without it a crash could lose the new name.
      const std::string dir = dir_of(_final);
      const int dirfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
      if (dirfd < 0) throw SysError(errno, "open", dir);
      const int r = ::fsync(dirfd);
      const int err = errno;
      ::close(dirfd);
      if (r != 0) throw SysError(err, "fsync", dir);
    }
  } catch (...) {
    abort();  // no-op once renamed: the file is complete, only the directory fsync failed
    throw;
  }
}

void FileWriter::abort() noexcept {
  Impl& m = *_impl;
  if (m.state != Impl::State::Open) return;
  m.state = Impl::State::Aborted;
  m.stop_io(true);
  m.cur.reset();
  close_quietly(m.tail_fd);
  close_quietly(m.fd);
  ::unlink(m.temp.c_str());
}

}  // namespace pyckpt
