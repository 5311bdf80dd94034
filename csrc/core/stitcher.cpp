#include "core/stitcher.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>

#include "core/error.hpp"
#include "core/thread_pool.hpp"

namespace pyckpt {

namespace {

bool mul_ok(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return false;
  out = a * b;
  return true;
}

std::uint64_t product(const std::vector<std::uint64_t>& v, const char* what) {
  std::uint64_t n = 1;
  for (std::uint64_t d : v) {
    PYCKPT_EXPECT(mul_ok(n, d, n), std::invalid_argument, what, " element count overflows");
  }
  return n;
}

std::string dims(const std::vector<std::uint64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

/** An open file, optionally mapped; closes and unmaps on destruction. */
class OpenFile {
 public:
  OpenFile(const std::string& path, bool writable) : _path(path) {
    _fd = ::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC);
    if (_fd == -1) throw SysError(errno, "open", path);
    struct stat st {};
    if (::fstat(_fd, &st) == -1) {
      const int err = errno;
      ::close(_fd);
      throw SysError(err, "fstat", path);
    }
    _size = static_cast<std::uint64_t>(st.st_size);
    _writable = writable;
  }
  ~OpenFile() {
    if (_map) ::munmap(_map, _size);
    if (_fd != -1) ::close(_fd);
  }
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;

  void map(bool sequential) {
    if (_map || _size == 0) return;
    const int prot = _writable ? (PROT_READ | PROT_WRITE) : PROT_READ;
    void* p = ::mmap(nullptr, _size, prot, MAP_SHARED, _fd, 0);
    if (p == MAP_FAILED) throw SysError(errno, "mmap", _path);
    _map = static_cast<std::byte*>(p);
    if (sequential) (void)::madvise(_map, _size, MADV_SEQUENTIAL);
  }
  void sync() {
    // Linux keeps MAP_SHARED pages in the page cache, so fsync() flushes what went through the
    // mapping as well as what pread() wrote into it.
    PYCKPT_SYSCALL_CHECK(::fsync(_fd), "fsync", _path);
  }
  int fd() const noexcept { return _fd; }
  std::byte* data() const noexcept { return _map; }
  std::uint64_t size() const noexcept { return _size; }
  const std::string& path() const noexcept { return _path; }

 private:
  std::string _path;
  int _fd = -1;
  std::uint64_t _size = 0;
  bool _writable = false;
  std::byte* _map = nullptr;
};

void pread_exact(const OpenFile& f, std::byte* dst, std::uint64_t n, std::uint64_t off,
                 const std::string& tensor) {
  std::uint64_t done = 0;
  while (done < n) {
    // Linux caps a single read at ~2 GiB; ask for at most 1 GiB per call.
    const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(n - done, 1u << 30));
    const ssize_t r = ::pread(f.fd(), dst + done, want, static_cast<off_t>(off + done));
    if (r == -1) {
      if (errno == EINTR) continue;
      throw SysError(errno, "pread", f.path(), "tensor '" + tensor + "'");
    }
    PYCKPT_EXPECT_FORMAT(r > 0, FormatKind::Truncated, "input file '", f.path(),
                         "' ended at offset ", off + done, " while reading tensor '", tensor, "'");
    done += static_cast<std::uint64_t>(r);
  }
}

struct Task {
  const StitchItem* item;
  const BlockLayout* layout;
  const OpenFile* in;
  OpenFile* out;
  std::uint64_t a;
  std::uint64_t b;
};

std::uint64_t run_task(const Task& t, InputMode mode) {
  const StitchItem& item = *t.item;
  const BlockLayout& layout = *t.layout;
  const std::uint64_t e = item.item_bytes;
  std::byte* dst = t.out->data() + item.out_offset;
  // Byte offset in the input of block element k (k >= block_lo; the source starts at block_lo).
  auto src_off = [&](std::uint64_t k) { return item.source.offset + (k - item.block_lo) * e; };
  std::uint64_t runs = 0;
  if (mode == InputMode::Mmap) {
    const std::byte* base = t.in->data();
    // Ask for the task's input pages up front: copying out of a cold mapping otherwise runs at
    // page-fault speed (readahead driven one fault at a time).
    const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
    const auto lo = reinterpret_cast<std::uintptr_t>(base + src_off(t.a)) & ~(page - 1);
    const auto hi = reinterpret_cast<std::uintptr_t>(base + src_off(t.b));
    (void)::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_WILLNEED);
    layout.for_each_run(t.a, t.b, [&](std::uint64_t k, std::uint64_t g, std::uint64_t n) {
      std::memcpy(dst + g * e, base + src_off(k), n * e);
      ++runs;
    });
    return runs;
  }
  const std::uint64_t first = layout.global_index(t.a);
  if (layout.global_index(t.b - 1) - first == t.b - 1 - t.a) {
    // The whole task lands contiguously: read straight into the output mapping (one copy).
    pread_exact(*t.in, dst + first * e, (t.b - t.a) * e, src_off(t.a), item.name);
    return 1;
  }
  // Scattered destination: one large read into a bounded per-thread buffer, then the runs.
  thread_local std::vector<std::byte> buffer;
  const std::uint64_t n_bytes = (t.b - t.a) * e;
  if (buffer.size() < n_bytes) buffer.resize(static_cast<std::size_t>(n_bytes));
  pread_exact(*t.in, buffer.data(), n_bytes, src_off(t.a), item.name);
  layout.for_each_run(t.a, t.b, [&](std::uint64_t k, std::uint64_t g, std::uint64_t n) {
    std::memcpy(dst + g * e, buffer.data() + (k - t.a) * e, n * e);
    ++runs;
  });
  return runs;
}

}  // namespace

BlockLayout::BlockLayout(const std::vector<std::uint64_t>& shape,
                         const std::vector<std::uint64_t>& offsets,
                         const std::vector<std::uint64_t>& sizes) {
  const std::size_t n = shape.size();
  PYCKPT_EXPECT(offsets.size() == n && sizes.size() == n, std::invalid_argument,
                "block rank (offsets ", offsets.size(), ", sizes ", sizes.size(),
                ") differs from tensor rank ", n);
  for (std::size_t d = 0; d < n; ++d) {
    PYCKPT_EXPECT(offsets[d] <= shape[d] && sizes[d] <= shape[d] - offsets[d],
                  std::invalid_argument, "block offsets ", dims(offsets), " sizes ", dims(sizes),
                  " leave tensor of shape ", dims(shape));
  }
  _tensor_elements = product(shape, "tensor");
  _elements = product(sizes, "block");
  // Strides of the full tensor, in elements.
  std::vector<std::uint64_t> strides(n, 1);
  for (std::size_t d = n; d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  // Merge the trailing dimensions the block spans completely into one run.
  std::size_t j = n;
  std::uint64_t inner = 1;
  while (j > 0 && sizes[j - 1] == shape[j - 1]) {
    inner *= shape[j - 1];
    --j;
  }
  if (j == 0) {  // the block is the whole tensor
    _run = std::max<std::uint64_t>(_tensor_elements, 1);
    _base = 0;
    return;
  }
  const std::size_t rd = j - 1;  // the run's dimension
  _run = std::max<std::uint64_t>(sizes[rd] * inner, 1);
  _base = offsets[rd] * inner;
  for (std::size_t d = 0; d < rd; ++d) {
    _base += offsets[d] * strides[d];
    if (sizes[d] != 1) {  // size-1 dims only move the base
      _outer_sizes.push_back(sizes[d]);
      _outer_strides.push_back(strides[d]);
    }
  }
}

std::uint64_t BlockLayout::run_start(std::uint64_t r) const noexcept {
  std::uint64_t idx = _base;
  for (std::size_t d = _outer_sizes.size(); d-- > 0;) {
    idx += (r % _outer_sizes[d]) * _outer_strides[d];
    r /= _outer_sizes[d];
  }
  return idx;
}

std::uint64_t BlockLayout::global_index(std::uint64_t k) const noexcept {
  return run_start(k / _run) + k % _run;
}

std::uint64_t BlockLayout::lower_bound(std::uint64_t x) const noexcept {
  std::uint64_t lo = 0;
  std::uint64_t hi = _elements;
  while (lo < hi) {
    const std::uint64_t mid = lo + (hi - lo) / 2;
    if (global_index(mid) < x) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

void check_tiling(const std::string& name, const std::vector<std::uint64_t>& shape,
                  const std::vector<TileBlock>& blocks) {
  const std::size_t n = shape.size();
  std::uint64_t total = 1;
  for (std::uint64_t d : shape) {
    PYCKPT_EXPECT_FORMAT(mul_ok(total, d, total), FormatKind::Mismatch, "tensor '", name,
                         "' shape ", dims(shape), " overflows");
  }
  std::vector<std::size_t> nonempty;
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const TileBlock& b = blocks[i];
    PYCKPT_EXPECT_FORMAT(b.offsets.size() == n && b.sizes.size() == n, FormatKind::Mismatch,
                         "tensor '", name, "': the shard in '", b.origin, "' has rank ",
                         b.sizes.size(), " (offsets rank ", b.offsets.size(),
                         ") but the tensor has rank ", n);
    std::uint64_t vol = 1;
    for (std::size_t d = 0; d < n; ++d) {
      PYCKPT_EXPECT_FORMAT(b.offsets[d] <= shape[d] && b.sizes[d] <= shape[d] - b.offsets[d],
                           FormatKind::Mismatch, "tensor '", name, "': the shard in '", b.origin,
                           "' (offsets ", dims(b.offsets), ", sizes ", dims(b.sizes),
                           ") leaves the tensor's shape ", dims(shape));
      vol *= b.sizes[d];  // cannot overflow: bounded by the tensor's element count
    }
    if (vol == 0) continue;
    nonempty.push_back(i);
    covered += vol;  // sums of disjoint volumes stay <= total; checked after the overlap test
    if (covered > total) break;  // some pair must overlap; the sweep below finds it
  }
  // Sweep along the dimension with the most distinct offsets so that the common shardings
  // (every shard along one dimension) compare each block only with its neighbours.
  std::size_t sweep = 0;
  if (n > 0) {
    std::size_t best = 0;
    for (std::size_t d = 0; d < n; ++d) {
      std::vector<std::uint64_t> offs;
      for (std::size_t i : nonempty) offs.push_back(blocks[i].offsets[d]);
      std::sort(offs.begin(), offs.end());
      const auto distinct =
          static_cast<std::size_t>(std::unique(offs.begin(), offs.end()) - offs.begin());
      if (distinct > best) {
        best = distinct;
        sweep = d;
      }
    }
    std::sort(nonempty.begin(), nonempty.end(), [&](std::size_t x, std::size_t y) {
      return blocks[x].offsets[sweep] < blocks[y].offsets[sweep];
    });
  }
  for (std::size_t p = 0; p < nonempty.size(); ++p) {
    const TileBlock& a = blocks[nonempty[p]];
    for (std::size_t q = p + 1; q < nonempty.size(); ++q) {
      const TileBlock& b = blocks[nonempty[q]];
      if (n > 0 && b.offsets[sweep] >= a.offsets[sweep] + a.sizes[sweep]) break;
      bool overlap = true;
      for (std::size_t d = 0; d < n && overlap; ++d) {
        overlap = a.offsets[d] < b.offsets[d] + b.sizes[d] &&
                  b.offsets[d] < a.offsets[d] + a.sizes[d];
      }
      PYCKPT_EXPECT_FORMAT(!overlap, FormatKind::Overlap, "tensor '", name, "': the shard in '",
                           a.origin, "' (offsets ", dims(a.offsets), ", sizes ", dims(a.sizes),
                           ") overlaps the shard in '", b.origin, "' (offsets ", dims(b.offsets),
                           ", sizes ", dims(b.sizes), ")");
    }
  }
  PYCKPT_EXPECT_FORMAT(covered == total, FormatKind::Coverage, "tensor '", name, "' of shape ",
                       dims(shape), ": its shards cover ", covered, " of ", total,
                       " elements (a shard is missing)");
}

StitchStats stitch(const std::vector<StitchItem>& items, const StitchOptions& options) {
  PYCKPT_EXPECT(options.threads >= 1, std::invalid_argument, "stitch needs at least one thread");
  PYCKPT_EXPECT(options.task_bytes >= 1, std::invalid_argument, "task_bytes must be positive");

  std::map<std::string, std::unique_ptr<OpenFile>> inputs;
  std::map<std::string, std::unique_ptr<OpenFile>> outputs;
  std::vector<BlockLayout> layouts;
  layouts.reserve(items.size());
  std::vector<Task> tasks;

  for (const StitchItem& item : items) {
    PYCKPT_EXPECT(item.item_bytes >= 1, std::invalid_argument, "tensor '", item.name,
                  "': item_bytes must be >= 1");
    layouts.emplace_back(item.shape, item.offsets, item.sizes);
    const BlockLayout& layout = layouts.back();
    const std::uint64_t e = item.item_bytes;
    PYCKPT_EXPECT(item.lo <= item.hi && item.hi <= layout.tensor_elements(),
                  std::invalid_argument, "tensor '", item.name, "': range [", item.lo, ", ",
                  item.hi, ") outside its ", layout.tensor_elements(), " elements");

    auto& in = inputs[item.source.path];
    if (!in) {
      in = std::make_unique<OpenFile>(item.source.path, false);
      if (options.input == InputMode::Mmap) in->map(true);
    }
    const std::uint64_t block_hi = std::min(item.block_hi, layout.elements());
    PYCKPT_EXPECT(item.block_lo <= block_hi, std::invalid_argument, "tensor '", item.name,
                  "': source range [", item.block_lo, ", ", block_hi, ") is empty or reversed");
    std::uint64_t block_bytes = 0;
    PYCKPT_EXPECT(mul_ok(block_hi - item.block_lo, e, block_bytes), std::invalid_argument,
                  "tensor '", item.name, "' block size overflows");
    PYCKPT_EXPECT_FORMAT(item.source.offset <= in->size() &&
                             block_bytes <= in->size() - item.source.offset,
                         FormatKind::Truncated, "input file '", item.source.path, "' is ",
                         in->size(), " bytes but tensor '", item.name, "' needs bytes [",
                         item.source.offset, ", ", item.source.offset + block_bytes, ")");

    auto& out = outputs[item.out_path];
    if (!out) {
      out = std::make_unique<OpenFile>(item.out_path, true);
      out->map(false);
    }
    std::uint64_t tensor_bytes = 0;
    PYCKPT_EXPECT(mul_ok(layout.tensor_elements(), e, tensor_bytes), std::invalid_argument,
                  "tensor '", item.name, "' size overflows");
    PYCKPT_EXPECT(item.out_offset <= out->size() && tensor_bytes <= out->size() - item.out_offset,
                  std::invalid_argument, "output file '", item.out_path, "' is ", out->size(),
                  " bytes, too short for tensor '", item.name, "' at offset ", item.out_offset);

    const std::uint64_t a = std::max(layout.lower_bound(item.lo), item.block_lo);
    const std::uint64_t b = std::min(layout.lower_bound(item.hi), block_hi);
    if (a >= b) continue;
    std::uint64_t step = std::max<std::uint64_t>(1, options.task_bytes / e);
    // Keep tasks made of whole runs when runs are shorter than a task (fewer partial copies).
    if (layout.run_elements() < step) step -= step % layout.run_elements();
    for (std::uint64_t s = a; s < b; s += step) {
      tasks.push_back(Task{&item, &layout, in.get(), out.get(), s, std::min(b, s + step)});
    }
  }

  StitchStats stats;
  std::atomic<std::uint64_t> runs{0};
  std::exception_ptr first_error;
  {
    ThreadPool pool(std::min<std::size_t>(options.threads, std::max<std::size_t>(tasks.size(), 1)));
    std::vector<std::future<void>> futures;
    futures.reserve(tasks.size());
    const InputMode mode = options.input;
    std::atomic<std::uint64_t>* progress = options.progress;
    for (const Task& t : tasks) {
      futures.push_back(pool.submit([&t, mode, progress, &runs] {
        runs.fetch_add(run_task(t, mode), std::memory_order_relaxed);
        if (progress) {
          progress->fetch_add((t.b - t.a) * t.item->item_bytes, std::memory_order_relaxed);
        }
      }));
    }
    // Drain every task before reporting, so no worker touches a mapping after it is unmapped.
    for (auto& f : futures) {
      try {
        f.get();
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
      }
    }
  }
  if (first_error) std::rethrow_exception(first_error);
  for (const Task& t : tasks) stats.bytes += (t.b - t.a) * t.item->item_bytes;
  stats.tasks = tasks.size();
  stats.runs = runs.load();
  if (options.fsync) {
    for (auto& [path, out] : outputs) out->sync();
  }
  return stats;
}

}  // namespace pyckpt
