#include "core/stitcher.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <stdexcept>

#include "core/chunk_io.hpp"
#include "core/codec.hpp"
#include "core/detail/scratch.hpp"
#include "core/error.hpp"
#include "core/float_cast.hpp"
#include "core/posix_storage.hpp"
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

// Reads input bytes for `tensor`; errors name the file (pread_full) and the tensor.
void pread_input(PosixFile& f, void* dst, std::uint64_t n, std::uint64_t off,
                 const std::string& tensor) {
  try {
    pread_full(f.fd(), dst, n, off, f.path());
  } catch (...) {
    rethrow_with_context(std::current_exception(), "tensor '" + tensor + "'");
  }
}

// Writes output bytes; errors name the file and `what` (e.g. "tensor 'w'").
void pwrite_to(const PosixFile& f, const void* src, std::uint64_t n, std::uint64_t off,
               const std::string& what) {
  const int err = pwrite_full(f.fd(), src, n, off);
  if (err != 0) throw SysError(err, "pwrite", f.path(), what);
}

void pwrite_output(const PosixFile& f, const void* src, std::uint64_t n, std::uint64_t off,
                   const std::string& tensor) {
  pwrite_to(f, src, n, off, "tensor '" + tensor + "'");
}

/** One block of a tensor (or one encoded chunk of it), ready to copy. */
struct Part {
  const StitchItem* item;
  BlockLayout layout;
  PosixFile* in;
  std::uint64_t block_hi;  // clamped
};

/** All blocks of one output tensor and the flat range [lo, hi) this call writes. */
struct Group {
  std::string name;
  PosixFile* out = nullptr;
  std::uint64_t out_offset = 0;
  std::uint64_t item_bytes = 1;      // source bytes per element
  std::uint64_t out_item_bytes = 1;  // output bytes per element (differs only under a cast)
  FloatCast cast;                    // conversion on the way (disabled: a byte copy)
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  bool encoded = false;  // every part is an EncodedChunk source (never mixed with RawFile)
  std::vector<Part> parts;
};

/** Source-driven task: decode one chunk, write its block elements [a, b) (within [lo, hi)). */
struct ChunkTask {
  const Group* group;
  const Part* part;
  std::uint64_t a;
  std::uint64_t b;
  bool map_out;  // scattered short runs: memcpy into the output mapping instead of pwrite
};

/** A tensor range in a Batch: a whole RawFile task, or the chunk tasks of an encoded group
 *  (batch_chunks[begin, end)); `at` is where its range [lo, hi) starts in the batch's buffer. */
struct BatchUnit {
  const Group* group;
  bool encoded;
  std::size_t begin;
  std::size_t end;
  std::uint64_t at;
};

/** Tensor ranges that lie back to back in one output file, assembled in one per-thread buffer
 *  (the window) and written with one pwrite: small ranges (a model of thousands of small tensors
 *  otherwise costs a write system call per tensor, which took twice the time of 1 MiB writes on
 *  ext4), or one range whose chunks land in short scattered runs (no syscall per run, no output
 *  mapping). */
struct Batch {
  PosixFile* out;
  std::uint64_t offset;  // in the output file
  std::uint64_t bytes;
  std::size_t begin;  // its units: batch_units[begin, end)
  std::size_t end;
};

// Buffers per preadv() batch when scattering runs from a source (the kernel's UIO_MAXIOV).
constexpr std::size_t kIovBatch = 1024;

// Runs shorter than this are copied into the output mapping rather than written one pwrite each.
constexpr std::uint64_t kMinPwriteRun = 64u << 10;

// A tensor (range) of encoded chunks with such runs is assembled in one in-memory window when it
// is at most this many times StitchOptions::task_bytes.
constexpr std::uint64_t kWindowTasks = 4;

// Bytes a contiguous byte-grouped chunk is interleaved into at a time before they are written to
// the output file (the buffer stays in cache between the interleave and the kernel's copy).
constexpr std::uint64_t kSliceBytes = 512u << 10;

// A tensor range of at most this many output bytes (and at most StitchOptions::task_bytes) joins
// its neighbours in the output file in a Batch of at most kBatchBytes (and task_bytes): one pwrite
// for many small tensors. Measured on ext4 (2-core VM, 62 MiB into a preallocated file): 16 KiB
// pwrites 15.6 ms, 64 KiB 9.7 ms, 1 MiB 7.8 ms, 16 MiB 8.1 ms.
constexpr std::uint64_t kBatchItemBytes = 256u << 10;
constexpr std::uint64_t kBatchBytes = 2u << 20;

// A call whose tasks write at most this many bytes in all (or that may use one thread) runs them
// on the calling thread: a worker would only be started, handed the work and joined (a fixed cost
// that dominates small exports, and on a busy machine waits for the scheduler). Also what the
// calling thread's per-thread buffers keep after the call.
constexpr std::uint64_t kInlineBytes = 4u << 20;

/** Output-driven task: the tensor elements [x, y) of one group. */
struct Task {
  const Group* group;
  std::uint64_t x;
  std::uint64_t y;
};

struct TaskResult {
  std::uint64_t runs = 0;
};

// This thread's scratch buffer number `Slot`. Its memory comes from and returns to the
// process-wide host cache (buffer_pool.hpp), so a new pool thread reuses the pages an earlier one
// faulted in. Slots: 0 gathered output, 1 cast output, 2 a slice or run on its way to the file,
// 3 a window.
template <int Slot>
detail::Scratch& scratch_slot() {
  thread_local detail::Scratch s;
  return s;
}

// Slot `Slot`'s buffer of at least `n` bytes (uninitialised).
template <int Slot>
std::byte* scratch_bytes(std::uint64_t n) {
  return reinterpret_cast<std::byte*>(scratch_slot<Slot>().get(static_cast<std::size_t>(n)));
}

// Gives up the calling thread's buffers above `keep` bytes (after work run inline).
void trim_thread_scratch(std::size_t keep) noexcept {
  scratch_slot<0>().trim(keep);
  scratch_slot<1>().trim(keep);
  scratch_slot<2>().trim(keep);
  scratch_slot<3>().trim(keep);
  trim_chunk_scratch(keep);
}

// Reads source bytes [src_off, src_off + n) of a part into dst.
void read_source(const Part& p, std::uint64_t src_off, std::uint64_t n, std::byte* dst,
                 InputMode mode) {
  if (mode == InputMode::Mmap) {
    if (n > 0) std::memcpy(dst, p.in->view_at(src_off, static_cast<std::size_t>(n)), n);
  } else {
    pread_input(*p.in, dst, n, src_off, p.item->name);
  }
}

// `dst`: when not null, where the range [x, y)'s output bytes go (a Batch's buffer) instead of
// the output file.
TaskResult run_task(const Task& t, InputMode mode, std::byte* dst = nullptr) {
  const Group& g = *t.group;
  const std::uint64_t e = g.item_bytes;
  const std::uint64_t out_bytes = (t.y - t.x) * e;  // source bytes of the range
  TaskResult res;
  // Gather every block's part of [x, y) into a bounded output buffer, then one pwrite. Each
  // block contributes one contiguous source range (row-major order is preserved). Contiguous
  // runs (dim-0 shards) are read with one pread each too: an A/B against an in-kernel
  // copy_file_range per run (ext4, 2-core VM, 1-320 MiB) found pread + pwrite as fast or faster
  // (BENCHMARKS.md, "Small and medium exports").
  std::byte* const obuf = dst && !g.cast.enabled() ? dst : scratch_bytes<0>(out_bytes);
  std::uint64_t filled = 0;
  for (const Part& p : g.parts) {
    const std::uint64_t a = std::max(p.layout.lower_bound(t.x), p.item->block_lo);
    const std::uint64_t b = std::min(p.layout.lower_bound(t.y), p.block_hi);
    if (a >= b) continue;
    const std::uint64_t src_off = p.item->source.offset + (a - p.item->block_lo) * e;
    const std::uint64_t n = (b - a) * e;
    const std::uint64_t first = p.layout.global_index(a);
    if (p.layout.global_index(b - 1) - first == b - 1 - a) {
      read_source(p, src_off, n, obuf + (first - t.x) * e, mode);
      ++res.runs;
    } else if (mode == InputMode::Mmap) {
      // Scatter the runs straight from the input mapping.
      const std::uint8_t* in = p.in->view_at(src_off, static_cast<std::size_t>(n));
      p.layout.for_each_run(a, b, [&](std::uint64_t k, std::uint64_t gi, std::uint64_t cnt) {
        std::memcpy(obuf + (gi - t.x) * e, in + (k - a) * e, cnt * e);
        ++res.runs;
      });
    } else {
      // One preadv per batch of runs: the kernel copies the contiguous source range straight
      // into the runs' places in the output buffer (no bounce buffer, no second pass).
      thread_local std::vector<struct iovec> iov;
      iov.clear();
      std::uint64_t batch_off = src_off;
      std::uint64_t batch_bytes = 0;
      const auto flush = [&] {
        if (iov.empty()) return;
        try {
          preadv_full(p.in->fd(), iov.data(), static_cast<int>(iov.size()), batch_off,
                      p.in->path());
        } catch (...) {
          rethrow_with_context(std::current_exception(), "tensor '" + p.item->name + "'");
        }
        batch_off += batch_bytes;
        batch_bytes = 0;
        iov.clear();
      };
      p.layout.for_each_run(a, b, [&](std::uint64_t, std::uint64_t gi, std::uint64_t cnt) {
        iov.push_back({obuf + (gi - t.x) * e, static_cast<std::size_t>(cnt * e)});
        batch_bytes += cnt * e;
        ++res.runs;
        if (iov.size() == kIovBatch) flush();
      });
      flush();
    }
    filled += n;
  }
  PYCKPT_EXPECT_FORMAT(filled == out_bytes, FormatKind::Coverage, "tensor '", g.name,
                       "': its shards supply ", filled, " of the ", out_bytes,
                       " bytes of elements [", t.x, ", ", t.y, ")");
  if (g.cast.enabled()) {
    const std::uint64_t n = (t.y - t.x) * g.out_item_bytes;
    std::byte* const cbuf = dst ? dst : scratch_bytes<1>(n);
    convert_floats(g.cast.from, g.cast.to, obuf, cbuf, t.y - t.x);
    if (!dst) pwrite_output(*g.out, cbuf, n, g.out_offset + t.x * g.out_item_bytes, g.name);
    return res;
  }
  if (!dst) pwrite_output(*g.out, obuf, out_bytes, g.out_offset + t.x * e, g.name);
  return res;
}

// `window`: when not null, the group's range [lo, hi) in memory, where the elements go instead
// of the output file.
std::uint64_t run_chunk_task(const ChunkTask& t, std::byte* window) {
  const Group& g = *t.group;
  const Part& p = *t.part;
  const StitchSource& src = p.item->source;
  const std::uint64_t e = g.item_bytes;
  const std::uint64_t oe = g.out_item_bytes;
  const std::uint64_t first = p.layout.global_index(t.a);
  const bool contiguous = p.layout.global_index(t.b - 1) - first == t.b - 1 - t.a;
  const std::uint64_t block_lo = p.item->block_lo;

  // The whole chunk is read and verified even when only part of it is wanted: the checksum
  // covers all stored bytes, and a zstd frame decodes only whole. With InputMode::Mmap the
  // input lends its mapping (PosixFile::view_at), so the stored bytes are not copied.
  const std::byte* from = nullptr;  // element t.a, in output elements (after any cast)
  DecodedChunk parts;
  if (g.cast.enabled()) {
    // Convert the wanted elements once into a per-thread buffer; runs below then walk it in
    // output elements.
    const std::uint8_t* raw = load_chunk(*p.in, src.chunk, src.params, nullptr);
    std::byte* const cbuf = scratch_bytes<1>((t.b - t.a) * oe);
    convert_floats(g.cast.from, g.cast.to, raw + (t.a - block_lo) * e, cbuf, t.b - t.a);
    from = cbuf;
  } else {
    // A byte-grouped chunk stays as planes and is interleaved straight into each destination:
    // the window, the output mapping, or (written to the file) a small reused slice buffer. No
    // chunk-sized buffer of decoded bytes: each thread's memory is the stored bytes and the
    // planes that were compressed.
    parts = load_chunk_parts(*p.in, src.chunk, src.params);
    if (const std::uint8_t* flat = parts.flat_bytes()) {
      from = reinterpret_cast<const std::byte*>(flat + (t.a - block_lo) * e);
    }
  }
  // Writes the wanted elements [k, k + cnt) (k in block elements) to `dst`.
  const auto put = [&](std::uint64_t k, std::uint64_t cnt, void* dst) {
    if (from) {
      std::memcpy(dst, from + (k - t.a) * oe, cnt * oe);
    } else {
      parts.copy_out((k - block_lo) * e, cnt * e, dst);
    }
  };
  if (contiguous) {
    if (window) {
      put(t.a, t.b - t.a, window + (first - g.lo) * oe);
    } else if (from) {
      pwrite_output(*g.out, from, (t.b - t.a) * oe, g.out_offset + first * oe, g.name);
    } else {
      std::byte* const slice = scratch_bytes<2>(kSliceBytes);
      for (std::uint64_t k = t.a; k < t.b;) {
        const std::uint64_t cnt = std::min<std::uint64_t>(t.b - k, kSliceBytes / oe);
        put(k, cnt, slice);
        pwrite_output(*g.out, slice, cnt * oe, g.out_offset + (first + k - t.a) * oe, g.name);
        k += cnt;
      }
    }
    return 1;
  }
  std::uint64_t runs = 0;
  p.layout.for_each_run(t.a, t.b, [&](std::uint64_t k, std::uint64_t gi, std::uint64_t cnt) {
    const std::uint64_t dst = g.out_offset + gi * oe;
    if (window) {
      put(k, cnt, window + (gi - g.lo) * oe);
    } else if (t.map_out) {
      put(k, cnt, g.out->data() + dst);
    } else if (from) {
      pwrite_output(*g.out, from + (k - t.a) * oe, cnt * oe, dst, g.name);
    } else {
      std::byte* const rbuf = scratch_bytes<2>(cnt * oe);
      put(k, cnt, rbuf);
      pwrite_output(*g.out, rbuf, cnt * oe, dst, g.name);
    }
    ++runs;
  });
  return runs;
}

// run_chunk_task(); failures name the file, tensor and chunk (known here). The chunk scratch is
// trimmed after each chunk either way.
std::uint64_t run_chunk_task_named(const ChunkTask& t, std::byte* window) {
  const StitchItem& it = *t.part->item;
  std::uint64_t runs = 0;
  try {
    runs = run_chunk_task(t, window);
  } catch (...) {
    trim_chunk_scratch();
    rethrow_with_context(std::current_exception(),
                         chunk_context(it.source.path, it.name, it.source.chunk.file_offset));
  }
  trim_chunk_scratch();
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
        overlap =
            a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d];
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

  std::map<std::string, std::unique_ptr<PosixFile>> inputs;
  std::map<std::string, std::unique_ptr<PosixFile>> outputs;
  // Items writing the same tensor (same output file and offset) form one group.
  std::map<std::pair<std::string, std::uint64_t>, Group> groups;

  for (const StitchItem& item : items) {
    PYCKPT_EXPECT(item.item_bytes >= 1, std::invalid_argument, "tensor '", item.name,
                  "': item_bytes must be >= 1");
    BlockLayout layout(item.shape, item.offsets, item.sizes);
    const std::uint64_t e = item.item_bytes;
    std::uint64_t oe = e;  // output bytes per element
    if (item.cast.enabled()) {
      PYCKPT_EXPECT(e == float_format_bytes(item.cast.from) && item.cast.to != FloatFormat::F64,
                    std::invalid_argument, "tensor '", item.name, "': cannot cast ",
                    float_format_name(item.cast.from), " to ", float_format_name(item.cast.to),
                    " with item_bytes ", e);
      oe = float_format_bytes(item.cast.to);
    }
    PYCKPT_EXPECT(item.lo <= item.hi && item.hi <= layout.tensor_elements(), std::invalid_argument,
                  "tensor '", item.name, "': range [", item.lo, ", ", item.hi, ") outside its ",
                  layout.tensor_elements(), " elements");

    auto& in = inputs[item.source.path];
    if (!in) {
      in = std::make_unique<PosixFile>(item.source.path, OpenFor::Read);
      if (options.input == InputMode::Mmap) in->map(true);
    }
    const std::uint64_t block_hi = std::min(item.block_hi, layout.elements());
    PYCKPT_EXPECT(item.block_lo <= block_hi, std::invalid_argument, "tensor '", item.name,
                  "': source range [", item.block_lo, ", ", block_hi, ") is reversed");
    std::uint64_t block_bytes = 0;
    PYCKPT_EXPECT(mul_ok(block_hi - item.block_lo, e, block_bytes), std::invalid_argument,
                  "tensor '", item.name, "' block size overflows");
    const bool encoded = item.source.kind == StitchSource::Kind::EncodedChunk;
    if (encoded) {
      const ChunkRecord& rec = item.source.chunk;
      PYCKPT_EXPECT(block_bytes == rec.raw_len, std::invalid_argument, "tensor '", item.name,
                    "': the chunk at offset ", rec.file_offset, " of '", item.source.path,
                    "' decodes to ", rec.raw_len, " bytes but is given block elements [",
                    item.block_lo, ", ", block_hi, ") (", block_bytes, " bytes)");
      PYCKPT_EXPECT_FORMAT(
          rec.file_offset <= in->size() && rec.stored_len <= in->size() - rec.file_offset,
          FormatKind::Truncated, "input file '", item.source.path, "' is ", in->size(),
          " bytes but tensor '", item.name, "' has a chunk stored at bytes [", rec.file_offset,
          ", ", rec.file_offset + rec.stored_len, ")");
    } else {
      PYCKPT_EXPECT_FORMAT(
          item.source.offset <= in->size() && block_bytes <= in->size() - item.source.offset,
          FormatKind::Truncated, "input file '", item.source.path, "' is ", in->size(),
          " bytes but tensor '", item.name, "' needs bytes [", item.source.offset, ", ",
          item.source.offset + block_bytes, ")");
    }

    auto& out = outputs[item.out_path];
    if (!out) out = std::make_unique<PosixFile>(item.out_path, OpenFor::ReadWrite);
    std::uint64_t tensor_bytes = 0;  // checked at the larger element size: buffers use both
    PYCKPT_EXPECT(mul_ok(layout.tensor_elements(), std::max(e, oe), tensor_bytes),
                  std::invalid_argument, "tensor '", item.name, "' size overflows");
    tensor_bytes = layout.tensor_elements() * oe;
    PYCKPT_EXPECT(item.out_offset <= out->size() && tensor_bytes <= out->size() - item.out_offset,
                  std::invalid_argument, "output file '", item.out_path, "' is ", out->size(),
                  " bytes, too short for tensor '", item.name, "' at offset ", item.out_offset);

    Group& g = groups[{item.out_path, item.out_offset}];
    if (g.parts.empty()) {
      g.name = item.name;
      g.out = out.get();
      g.out_offset = item.out_offset;
      g.item_bytes = e;
      g.out_item_bytes = oe;
      g.cast = item.cast;
      g.lo = item.lo;
      g.hi = item.hi;
      g.encoded = encoded;
    } else {
      PYCKPT_EXPECT(g.item_bytes == e && g.lo == item.lo && g.hi == item.hi && g.name == item.name,
                    std::invalid_argument, "items writing tensor '", g.name,
                    "' disagree on name, item size or range");
      PYCKPT_EXPECT(g.encoded == encoded, std::invalid_argument, "items writing tensor '", g.name,
                    "' mix raw-file and encoded-chunk sources");
      PYCKPT_EXPECT(g.cast == item.cast, std::invalid_argument, "items writing tensor '", g.name,
                    "' disagree on its cast");
    }
    g.parts.push_back(Part{&item, std::move(layout), in.get(), block_hi});
  }

  std::vector<Task> tasks;
  std::vector<ChunkTask> chunk_tasks;
  std::vector<Batch> batches;
  std::vector<BatchUnit> batch_units;
  std::vector<Task> batch_tasks;
  std::vector<ChunkTask> batch_chunks;
  const std::uint64_t batch_cap = std::min<std::uint64_t>(kBatchBytes, options.task_bytes);
  const std::uint64_t batch_item = std::min<std::uint64_t>(kBatchItemBytes, options.task_bytes);
  // Adds group g's range (n output bytes) to the open batch when it continues it in the same
  // file and fits, else opens a new one (a window over batch_cap gets a batch of its own).
  // Groups come in (file, offset) order (the map's).
  const auto batch_add = [&](const Group& g, bool encoded, std::size_t begin, std::size_t end,
                             std::uint64_t n) {
    const std::uint64_t at = g.out_offset + g.lo * g.out_item_bytes;
    if (batches.empty() || batches.back().out != g.out ||
        batches.back().offset + batches.back().bytes != at ||
        batches.back().bytes + n > batch_cap) {
      batches.push_back(Batch{g.out, at, 0, batch_units.size(), batch_units.size()});
    }
    Batch& b = batches.back();
    batch_units.push_back(BatchUnit{&g, encoded, begin, end, b.bytes});
    b.bytes += n;
    b.end = batch_units.size();
  };
  for (auto& [key, g] : groups) {
    // A small range goes into a batch: a whole RawFile range, or an encoded one whose chunks
    // this call supplies in full (in a partial call, other calls may write the rest of a range:
    // a batch would overwrite it).
    const std::uint64_t out_n = (g.hi - g.lo) * g.out_item_bytes;
    const bool small =
        out_n > 0 && out_n <= batch_item && (g.hi - g.lo) * g.item_bytes <= options.task_bytes;
    if (!g.encoded && small) {
      batch_tasks.push_back(Task{&g, g.lo, g.hi});
      batch_add(g, false, batch_tasks.size() - 1, batch_tasks.size(), out_n);
      continue;
    }
    if (!g.encoded) {
      const std::uint64_t step =
          std::max<std::uint64_t>(1, options.task_bytes / std::max(g.item_bytes, g.out_item_bytes));
      for (std::uint64_t x = g.lo; x < g.hi; x += step) {
        tasks.push_back(Task{&g, x, std::min(g.hi, x + step)});
      }
      continue;
    }
    // One task per chunk that overlaps [lo, hi): its block elements [a, b) land there. When
    // some land in short scattered runs, the chunks of a range that fits a window are assembled
    // in one (a batch of their own, or joining small neighbours; not for a partial call, whose
    // other calls write the rest of the range); otherwise short runs go through the output
    // mapping.
    std::vector<ChunkTask> mine;
    std::uint64_t supplied = 0;
    bool short_runs = false;
    for (const Part& p : g.parts) {
      const std::uint64_t a = std::max(p.layout.lower_bound(g.lo), p.item->block_lo);
      const std::uint64_t b = std::min(p.layout.lower_bound(g.hi), p.block_hi);
      if (a >= b) continue;
      supplied += b - a;
      const bool scattered = p.layout.global_index(b - 1) - p.layout.global_index(a) != b - 1 - a;
      const bool map_out = scattered && p.layout.run_elements() * g.out_item_bytes < kMinPwriteRun;
      short_runs = short_runs || map_out;
      mine.push_back(ChunkTask{&g, &p, a, b, map_out});
    }
    const bool windowed = short_runs && !options.partial &&
                          (g.hi - g.lo) * g.out_item_bytes <= kWindowTasks * options.task_bytes;
    if ((small || windowed) && supplied == g.hi - g.lo) {
      batch_add(g, true, batch_chunks.size(), batch_chunks.size() + mine.size(), out_n);
      batch_chunks.insert(batch_chunks.end(), mine.begin(), mine.end());
    } else {
      if (short_runs) g.out->map(false);  // before any task runs: map() is not thread-safe
      chunk_tasks.insert(chunk_tasks.end(), mine.begin(), mine.end());
    }
    // Pieces were checked to tile the tensor and chunks to tile each piece, so a count that
    // differs means the items themselves are inconsistent.
    PYCKPT_EXPECT_FORMAT(options.partial ? supplied <= g.hi - g.lo : supplied == g.hi - g.lo,
                         FormatKind::Coverage, "tensor '", g.name, "': its chunks supply ",
                         supplied, " of the ", g.hi - g.lo, " elements [", g.lo, ", ", g.hi, ")");
  }

  StitchStats stats;
  std::atomic<std::uint64_t> runs{0};
  {
    const std::size_t nsingle = tasks.size() + chunk_tasks.size();
    const std::size_t ntasks = nsingle + batches.size();
    const InputMode mode = options.input;
    // The caller's progress counter (cancel.hpp), if any: bytes done, added per task.
    std::atomic<std::uint64_t>* const progress = progress_counter();
    const auto run_one = [&](std::size_t i) {
      std::uint64_t done = 0;
      if (i < tasks.size()) {
        const Task& t = tasks[i];
        runs.fetch_add(run_task(t, mode).runs, std::memory_order_relaxed);
        done = (t.y - t.x) * t.group->out_item_bytes;
      } else if (i < tasks.size() + chunk_tasks.size()) {
        const ChunkTask& t = chunk_tasks[i - tasks.size()];
        runs.fetch_add(run_chunk_task_named(t, nullptr), std::memory_order_relaxed);
        done = (t.b - t.a) * t.group->out_item_bytes;
      } else {
        const Batch& b = batches[i - nsingle];
        std::byte* const buf = scratch_bytes<3>(b.bytes);
        std::uint64_t r = 0;
        for (std::size_t u = b.begin; u < b.end; ++u) {
          const BatchUnit& unit = batch_units[u];
          if (!unit.encoded) {
            r += run_task(batch_tasks[unit.begin], mode, buf + unit.at).runs;
            continue;
          }
          for (std::size_t c = unit.begin; c < unit.end; ++c) {
            r += run_chunk_task_named(batch_chunks[c], buf + unit.at);
          }
        }
        const Group& first = *batch_units[b.begin].group;
        const Group& last = *batch_units[b.end - 1].group;
        pwrite_to(*b.out, buf, b.bytes, b.offset,
                  b.end - b.begin == 1 ? "tensor '" + first.name + "'"
                                       : detail::concat(b.end - b.begin, " tensors, '", first.name,
                                                        "' to '", last.name, "'"));
        runs.fetch_add(r, std::memory_order_relaxed);
        done = b.bytes;
      }
      if (progress) progress->fetch_add(done, std::memory_order_relaxed);
    };
    for (const Task& t : tasks) stats.bytes += (t.y - t.x) * t.group->out_item_bytes;
    for (const ChunkTask& t : chunk_tasks) stats.bytes += (t.b - t.a) * t.group->out_item_bytes;
    for (const Batch& b : batches) stats.bytes += b.bytes;
    if (stats.bytes <= kInlineBytes || options.threads == 1) {
      // On this thread, checking for an interrupt (Ctrl-C) between tasks as run_all does.
      try {
        for (std::size_t i = 0; i < ntasks; ++i) {
          poll_interrupt();
          run_one(i);
        }
      } catch (...) {
        trim_thread_scratch(kInlineBytes);
        throw;
      }
      trim_thread_scratch(kInlineBytes);
    } else {
      ThreadPool pool(std::min<std::size_t>(options.threads, ntasks));
      // Every task is drained before the first failure is reported (run_all), so no worker
      // touches a file after it is closed.
      run_all(pool, ntasks, run_one);
    }
  }
  stats.tasks = tasks.size() + chunk_tasks.size() + batches.size();
  stats.runs = runs.load();
  if (options.fsync) {
    for (auto& [path, out] : outputs) out->sync();
  }
  return stats;
}

}  // namespace pyckpt
