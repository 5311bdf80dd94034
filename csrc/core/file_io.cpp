// Data-file writer, encode+write pipeline and parallel chunk reader. See file_io.hpp for the
// contracts; comments here explain the mechanics.
#include "core/file_io.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "core/checksum.hpp"
#include "core/detail/scratch.hpp"
#include "core/error.hpp"

namespace pyckpt {

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

// Writes all of [p, p+n) at `off`, looping on partial writes and EINTR. Returns 0 or an errno.
int pwrite_all(int fd, const std::uint8_t* p, std::size_t n, std::uint64_t off) {
  while (n > 0) {
    const ssize_t r = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return EIO;  // a regular file never accepts 0 of n > 0 bytes; do not spin
    p += r;
    n -= static_cast<std::size_t>(r);
    off += static_cast<std::uint64_t>(r);
  }
  return 0;
}

void close_quietly(int& fd) noexcept {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// FileWriter
// ---------------------------------------------------------------------------------------------

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
  Lease cur;                 // block being filled by append()
  std::size_t cur_fill = 0;  // bytes used in `cur`
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
  if (!direct) return pwrite_all(fd, p, job.len, job.offset);

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
      return pwrite_all(tail_fd, p + done, job.len - done, job.offset + done);
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
    return pwrite_all(fd, p, job.len, job.offset);
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
      const int err = pwrite_all(m.direct ? m.tail_fd : m.fd, tail, tail_len, tail_off);
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

// ---------------------------------------------------------------------------------------------
// encode_and_write
// ---------------------------------------------------------------------------------------------

namespace {

struct Slot {
  std::size_t item = 0;
  bool empty_item = false;         // zero-byte item: keeps its place in the order, no task
  const std::uint8_t* src = nullptr;
  std::size_t len = 0;
  Lease lease;                     // encoded bytes (zstd); empty for Codec::None
  ChunkRecord rec;
  std::future<void> done;
};

// Waits for every submitted task; never throws. Tasks reference Slots and caller memory, so no
// exit path of encode_and_write may return before they finish.
void drain(std::deque<std::unique_ptr<Slot>>& q) noexcept {
  for (auto& s : q) {
    if (s->done.valid()) s->done.wait();
  }
}

std::string item_context(const std::string& name) { return "tensor '" + name + "'"; }

}  // namespace

std::vector<WrittenItem> encode_and_write(FileWriter& out, const std::vector<WriteRequest>& items,
                                          std::size_t chunk_bytes, ThreadPool& pool,
                                          BufferPool& blocks) {
  PYCKPT_EXPECT(chunk_bytes > 0, std::invalid_argument, "chunk_bytes must be > 0");
  for (const WriteRequest& it : items) {
    try {
      validate_params(it.params);
    } catch (...) {
      rethrow_with_context(std::current_exception(), item_context(it.name));
    }
    PYCKPT_EXPECT(it.nbytes == 0 || it.data != nullptr, std::invalid_argument, "tensor '",
                  it.name, "': null data pointer for ", it.nbytes, " bytes");
    if (it.params.codec == Codec::Zstd && it.nbytes > 0) {
      const std::size_t need = max_encoded_size(std::min<std::uint64_t>(chunk_bytes, it.nbytes),
                                                it.params);
      PYCKPT_EXPECT(blocks.block_bytes() >= need, std::invalid_argument,
                    "encode blocks of ", blocks.block_bytes(), " bytes are smaller than ", need,
                    " (max_encoded_size of chunk_bytes=", chunk_bytes, ")");
    }
  }

  std::vector<WrittenItem> results(items.size());
  const std::size_t max_inflight = 2 * pool.size() + 2;
  std::deque<std::unique_ptr<Slot>> inflight;

  // Consumes the oldest slot in order: wait, append, record. On failure drains everything
  // first (tasks still use caller memory and pool blocks), then rethrows naming the item.
  auto consume_one = [&]() {
    Slot& s = *inflight.front();
    WrittenItem& w = results[s.item];
    if (s.empty_item) {
      w.offset = out.size();
      inflight.pop_front();
      return;
    }
    try {
      s.done.get();
      const std::uint8_t* bytes =
          s.lease ? reinterpret_cast<const std::uint8_t*>(s.lease.data()) : s.src;
      s.rec.file_offset = out.append(bytes, s.rec.stored_len);
    } catch (...) {
      const std::exception_ptr err = std::current_exception();
      drain(inflight);
      rethrow_with_context(err, item_context(items[s.item].name));
    }
    if (w.chunks.empty()) w.offset = s.rec.file_offset;
    w.stored_bytes += s.rec.stored_len;
    w.chunks.push_back(std::move(s.rec));
    inflight.pop_front();  // returns the lease
  };

  try {
    for (std::size_t i = 0; i < items.size(); ++i) {
      const WriteRequest& it = items[i];
      const auto* base = static_cast<const std::uint8_t*>(it.data);
      if (it.nbytes == 0) {
        auto s = std::make_unique<Slot>();
        s->item = i;
        s->empty_item = true;
        inflight.push_back(std::move(s));
        continue;
      }
      for (std::uint64_t off = 0; off < it.nbytes; off += chunk_bytes) {
        while (inflight.size() >= max_inflight) consume_one();
        auto s = std::make_unique<Slot>();
        s->item = i;
        s->src = base + off;
        s->len = static_cast<std::size_t>(std::min<std::uint64_t>(chunk_bytes, it.nbytes - off));
        if (it.params.codec == Codec::Zstd) {
          // Take the block here, in order, never inside a task: a task blocked on the pool
          // while the caller waits for it (and holds the blocks of later chunks) would deadlock.
          // When none is free, retire our own oldest chunk to free one; block only when the
          // pool is held by someone else.
          Lease l = blocks.try_acquire();
          while (!l) {
            if (inflight.empty()) {
              l = blocks.acquire();
            } else {
              consume_one();
              l = blocks.try_acquire();
            }
          }
          s->lease = std::move(l);
        }
        Slot* sp = s.get();
        const CodecParams* params = &it.params;
        s->done = pool.submit([sp, params] {
          if (sp->lease) {
            sp->rec = encode_chunk(sp->src, sp->len, *params, sp->lease.data());
          } else {
            // Codec::None: stored bytes are the source bytes; the caller appends them directly.
            sp->rec.raw_len = sp->len;
            sp->rec.stored_len = sp->len;
            sp->rec.transform = Transform::None;
            sp->rec.planes.push_back(PlaneRecord{PlaneMode::Raw, sp->len});
            sp->rec.checksum = xxh64(sp->src, sp->len);
          }
        });
        inflight.push_back(std::move(s));
      }
    }
    while (!inflight.empty()) consume_one();
  } catch (...) {
    drain(inflight);  // e.g. submit() on a shut-down pool; consume_one already drained
    throw;
  }
  return results;
}

// ---------------------------------------------------------------------------------------------
// read_requests
// ---------------------------------------------------------------------------------------------

namespace {

struct OpenFiles {
  std::map<std::string, int> fds;
  ~OpenFiles() {
    for (auto& kv : fds) ::close(kv.second);
  }
};

struct ChunkTask {
  const ReadRequest* req;
  const ReadSegment* seg;
  const ChunkRecord* rec;
  int fd;
  std::uint64_t raw_off;  // chunk's first raw byte within the item
};

struct ReadScratch {
  detail::Scratch stored;   // stored bytes read from the file
  detail::Scratch decoded;  // a chunk that only partly overlaps [lo, hi)
};

ReadScratch& read_scratch() {
  thread_local ReadScratch s;
  return s;
}

void pread_exact(int fd, std::uint8_t* dst, std::size_t n, std::uint64_t off,
                 const std::string& path) {
  std::size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, dst + got, n - got, static_cast<off_t>(off + got));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw SysError(errno, "pread", path);
    }
    if (r == 0) {
      throw FormatError(FormatKind::Truncated,
                        detail::concat("file '", path, "' is truncated: chunk needs bytes [", off,
                                       ", ", off + n, ") but the file ends at ", off + got));
    }
    got += static_cast<std::size_t>(r);
  }
}

std::uint64_t read_chunk(const ChunkTask& t) {
  const ReadRequest& req = *t.req;
  const ChunkRecord& rec = *t.rec;
  const std::uint64_t a = t.raw_off;
  const std::uint64_t b = a + rec.raw_len;
  const bool full = a >= req.lo && b <= req.hi;
  auto* dst = static_cast<std::uint8_t*>(req.dst);

  const bool plain = rec.transform == Transform::None && rec.planes.size() == 1 &&
                     rec.planes[0].mode == PlaneMode::Raw && rec.stored_len == rec.raw_len;
  if (full && plain) {
    // Raw chunk wholly wanted: read straight into the destination, then verify it there.
    std::uint8_t* d = dst + (a - req.lo);
    pread_exact(t.fd, d, rec.stored_len, rec.file_offset, t.seg->path);
    verify_chunk_checksum(d, rec);
    return rec.stored_len;
  }
  ReadScratch& rs = read_scratch();
  std::uint8_t* stored = rs.stored.get(rec.stored_len);
  pread_exact(t.fd, stored, rec.stored_len, rec.file_offset, t.seg->path);
  if (full) {
    decode_chunk(stored, rec, t.seg->params, dst + (a - req.lo));
  } else {
    // The whole chunk must be decoded (and checksummed) to get any part of it.
    std::uint8_t* tmp = rs.decoded.get(rec.raw_len);
    decode_chunk(stored, rec, t.seg->params, tmp);
    const std::uint64_t from = std::max(a, req.lo);
    const std::uint64_t to = std::min(b, req.hi);
    std::memcpy(dst + (from - req.lo), tmp + (from - a), to - from);
  }
  return rec.stored_len;
}

}  // namespace

ReadStats read_requests(const std::vector<ReadRequest>& requests, ThreadPool& pool) {
  OpenFiles files;
  std::vector<ChunkTask> tasks;

  for (const ReadRequest& req : requests) {
    PYCKPT_EXPECT(req.hi >= req.lo, std::invalid_argument, "tensor '", req.name,
                  "': read range [", req.lo, ", ", req.hi, ") is inverted");
    if (req.hi == req.lo) continue;
    PYCKPT_EXPECT(req.dst != nullptr, std::invalid_argument, "tensor '", req.name,
                  "': null destination");
    std::vector<std::pair<std::uint64_t, std::uint64_t>> covered;
    for (const ReadSegment& seg : req.segments) {
      std::uint64_t pos = seg.raw_begin;
      int fd = -1;
      for (const ChunkRecord& rec : seg.chunks) {
        const std::uint64_t a = pos;
        const std::uint64_t b = pos + rec.raw_len;
        pos = b;
        if (rec.raw_len == 0 || b <= req.lo || a >= req.hi) continue;
        if (fd < 0) {
          // Opened once per distinct path, and only when a chunk of it is actually needed.
          auto found = files.fds.find(seg.path);
          if (found == files.fds.end()) {
            const int f = ::open(seg.path.c_str(), O_RDONLY | O_CLOEXEC);
            if (f < 0) throw SysError(errno, "open", seg.path, item_context(req.name));
            found = files.fds.emplace(seg.path, f).first;
          }
          fd = found->second;
        }
        tasks.push_back(ChunkTask{&req, &seg, &rec, fd, a});
        covered.emplace_back(std::max(a, req.lo), std::min(b, req.hi));
      }
    }
    std::sort(covered.begin(), covered.end());
    std::uint64_t cur = req.lo;
    for (const auto& iv : covered) {
      PYCKPT_EXPECT_FORMAT(iv.first <= cur, FormatKind::Coverage, "tensor '", req.name,
                           "': no chunk covers raw bytes [", cur, ", ", iv.first,
                           ") of the requested range [", req.lo, ", ", req.hi, ")");
      PYCKPT_EXPECT_FORMAT(iv.first >= cur, FormatKind::Overlap, "tensor '", req.name,
                           "': chunks overlap at raw bytes [", iv.first, ", ",
                           std::min(cur, iv.second), ")");
      cur = iv.second;
    }
    PYCKPT_EXPECT_FORMAT(cur >= req.hi, FormatKind::Coverage, "tensor '", req.name,
                         "': no chunk covers raw bytes [", cur, ", ", req.hi,
                         ") of the requested range [", req.lo, ", ", req.hi, ")");
  }

  std::vector<std::future<std::uint64_t>> futures;
  futures.reserve(tasks.size());
  std::exception_ptr first;
  try {
    for (const ChunkTask& t : tasks) {
      futures.push_back(pool.submit([&t]() -> std::uint64_t {
        try {
          return read_chunk(t);
        } catch (...) {
          // Name the file, item and offset here, where they are known.
          rethrow_with_context(std::current_exception(),
                               detail::concat("file '", t.seg->path, "', tensor '", t.req->name,
                                              "', chunk at file offset ", t.rec->file_offset));
        }
      }));
    }
  } catch (...) {
    first = std::current_exception();
  }
  ReadStats stats;
  for (auto& f : futures) {
    try {
      stats.bytes_read += f.get();
      ++stats.chunks_decoded;
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
  return stats;
}

}  // namespace pyckpt
