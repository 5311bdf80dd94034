// Parallel chunk reader and verifier. See chunk_reader.hpp for the contracts.
#include "core/chunk_reader.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <utility>

#include "core/cancel.hpp"
#include "core/chunk_io.hpp"
#include "core/error.hpp"

namespace pyckpt {

namespace {

/** Sources opened by one call, once per name, only when one of their chunks is needed. */
class Sources {
 public:
  explicit Sources(const SourceOpener& open) : _open(open) {}

  ChunkSource& get(const std::string& name, const std::string& item) {
    auto found = _sources.find(name);
    if (found == _sources.end()) {
      std::unique_ptr<ChunkSource> src;
      try {
        src = _open(name);
      } catch (...) {
        rethrow_with_context(std::current_exception(), "tensor '" + item + "'");
      }
      found = _sources.emplace(name, std::move(src)).first;
    }
    return *found->second;
  }

 private:
  const SourceOpener& _open;
  std::map<std::string, std::unique_ptr<ChunkSource>> _sources;
};

struct ChunkTask {
  const ReadRequest* req;
  const ReadSegment* seg;
  const ChunkRecord* rec;
  ChunkSource* src;
  std::uint64_t raw_off;  // chunk's first raw byte within the item
};

std::uint64_t read_chunk(const ChunkTask& t) {
  const ReadRequest& req = *t.req;
  const ChunkRecord& rec = *t.rec;
  const std::uint64_t a = t.raw_off;
  const std::uint64_t b = a + rec.raw_len;
  auto* dst = static_cast<std::uint8_t*>(req.dst);
  if (a >= req.lo && b <= req.hi) {
    load_chunk(*t.src, rec, t.seg->params, dst + (a - req.lo));
  } else {
    // The whole chunk must be decoded (and checksummed) to get any part of it.
    const std::uint8_t* raw = load_chunk(*t.src, rec, t.seg->params, nullptr);
    const std::uint64_t from = std::max(a, req.lo);
    const std::uint64_t to = std::min(b, req.hi);
    std::memcpy(dst + (from - req.lo), raw + (from - a), to - from);
  }
  return rec.stored_len;
}

// Runs tasks[i] through `work` on the pool, naming the file, item and chunk in any failure, and
// trimming the thread's scratch after each chunk.
template <typename Work>
ReadStats run_chunk_tasks(const std::vector<ChunkTask>& tasks, ThreadPool& pool, const Work& work) {
  std::atomic<std::uint64_t> bytes{0};
  std::atomic<std::uint64_t>* const progress = progress_counter();  // the caller's, if any
  run_all(pool, tasks.size(), [&](std::size_t i) {
    const ChunkTask& t = tasks[i];
    try {
      bytes.fetch_add(work(t), std::memory_order_relaxed);
      if (progress) {  // the raw bytes of [lo, hi) this chunk delivered (or checked)
        const std::uint64_t a = std::max(t.raw_off, t.req->lo);
        const std::uint64_t b = std::min(t.raw_off + t.rec->raw_len, t.req->hi);
        if (b > a) progress->fetch_add(b - a, std::memory_order_relaxed);
      }
    } catch (...) {
      trim_chunk_scratch();
      rethrow_with_context(std::current_exception(),
                           chunk_context(t.seg->path, t.req->name, t.rec->file_offset));
    }
    trim_chunk_scratch();
  });
  ReadStats stats;
  stats.bytes_read = bytes.load();
  stats.chunks_decoded = tasks.size();
  return stats;
}

}  // namespace

ReadStats read_requests(const std::vector<ReadRequest>& requests, ThreadPool& pool,
                        const SourceOpener& open) {
  Sources sources(open);
  std::vector<ChunkTask> tasks;

  for (const ReadRequest& req : requests) {
    PYCKPT_EXPECT(req.hi >= req.lo, std::invalid_argument, "tensor '", req.name, "': read range [",
                  req.lo, ", ", req.hi, ") is inverted");
    if (req.hi == req.lo) continue;
    PYCKPT_EXPECT(req.dst != nullptr, std::invalid_argument, "tensor '", req.name,
                  "': null destination");
    std::vector<std::pair<std::uint64_t, std::uint64_t>> covered;
    for (const ReadSegment& seg : req.segments) {
      std::uint64_t pos = seg.raw_begin;
      ChunkSource* src = nullptr;
      for (const ChunkRecord& rec : seg.chunks) {
        PYCKPT_EXPECT_FORMAT(rec.raw_len <= UINT64_MAX - pos, FormatKind::Header, "tensor '",
                             req.name, "': chunk raw offsets overflow in '", seg.path, "'");
        const std::uint64_t a = pos;
        const std::uint64_t b = pos + rec.raw_len;
        pos = b;
        if (rec.raw_len == 0 || b <= req.lo || a >= req.hi) continue;
        if (src == nullptr) src = &sources.get(seg.path, req.name);
        tasks.push_back(ChunkTask{&req, &seg, &rec, src, a});
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
  return run_chunk_tasks(tasks, pool, read_chunk);
}

ReadStats read_stored(const std::vector<ReadRequest>& requests, ThreadPool& pool,
                      const SourceOpener& open) {
  Sources sources(open);
  std::vector<ChunkTask> tasks;  // raw_off: where the chunk's stored bytes go in req.dst
  for (const ReadRequest& req : requests) {
    std::uint64_t out = 0;
    for (const ReadSegment& seg : req.segments) {
      ChunkSource* src = nullptr;
      for (const ChunkRecord& rec : seg.chunks) {
        if (src == nullptr) src = &sources.get(seg.path, req.name);
        PYCKPT_EXPECT(req.dst != nullptr, std::invalid_argument, "tensor '", req.name,
                      "': null destination");
        tasks.push_back(ChunkTask{&req, &seg, &rec, src, out});
        out += rec.stored_len;
      }
    }
  }
  return run_chunk_tasks(tasks, pool, [](const ChunkTask& t) -> std::uint64_t {
    auto* dst = static_cast<std::uint8_t*>(t.req->dst) + t.raw_off;
    read_stored_chunk(*t.src, *t.rec, t.seg->params, dst);
    return t.rec->stored_len;
  });
}

ReadStats verify_segments(const std::string& name, const std::vector<ReadSegment>& segments,
                          ThreadPool& pool, const SourceOpener& open) {
  Sources sources(open);
  ReadRequest req;  // names the item in task errors; no destination
  req.name = name;
  req.hi = UINT64_MAX;  // every chunk is "wanted": progress counts all of them
  std::vector<ChunkTask> tasks;
  for (const ReadSegment& seg : segments) {
    std::uint64_t pos = seg.raw_begin;
    for (const ChunkRecord& rec : seg.chunks) {
      PYCKPT_EXPECT_FORMAT(rec.raw_len <= UINT64_MAX - pos, FormatKind::Header, "tensor '", name,
                           "': chunk raw offsets overflow in '", seg.path, "'");
      tasks.push_back(ChunkTask{&req, &seg, &rec, &sources.get(seg.path, name), pos});
      pos += rec.raw_len;
    }
  }
  return run_chunk_tasks(tasks, pool, [](const ChunkTask& t) -> std::uint64_t {
    check_chunk(*t.src, *t.rec, t.seg->params);
    return t.rec->stored_len;
  });
}

}  // namespace pyckpt
