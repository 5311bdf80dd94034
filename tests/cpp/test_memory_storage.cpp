// Unit tests of the in-memory storage backends (memory_storage.hpp): BlockSink hands encoded
// chunks over in blocks, MemorySource serves them back from lent ranges, and the pipelines
// round-trip through them exactly as through files.
#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/buffer_pool.hpp"
#include "core/chunk_reader.hpp"
#include "core/codec.hpp"
#include "core/encode_pipeline.hpp"
#include "core/error.hpp"
#include "core/memory_storage.hpp"
#include "core/thread_pool.hpp"

using pyckpt::BlockSink;
using pyckpt::MemoryRange;
using pyckpt::MemorySource;

namespace {

std::vector<std::uint8_t> pattern(std::size_t n, unsigned seed) {
  std::vector<std::uint8_t> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::uint8_t>((x >> 24) & 0x3F);  // compressible
  }
  return v;
}

struct Blocks {
  std::vector<std::vector<std::uint8_t>> got;
  BlockSink::OnBlock cb() {
    return [this](std::vector<std::uint8_t>&& b) { got.push_back(std::move(b)); };
  }
  std::vector<MemoryRange> ranges() const {
    std::vector<MemoryRange> out;
    std::uint64_t off = 0;
    for (const auto& b : got) {
      out.push_back(MemoryRange{off, b.data(), b.size()});
      off += b.size();
    }
    return out;
  }
};

}  // namespace

TEST(block_sink_hands_over_exact_blocks_then_the_tail) {
  Blocks blocks;
  BlockSink sink("obj", 10, blocks.cb());
  const auto data = pattern(37, 1);
  CHECK(sink.append(data.data(), 3) == 0);
  CHECK(sink.append(data.data() + 3, 25) == 3);
  CHECK(blocks.got.size() == 2);
  CHECK(sink.append(data.data() + 28, 9) == 28);
  CHECK(blocks.got.size() == 3);
  sink.commit();
  CHECK(sink.committed());
  CHECK(blocks.got.size() == 4 && blocks.got[3].size() == 7);
  std::vector<std::uint8_t> all;
  for (const auto& b : blocks.got) all.insert(all.end(), b.begin(), b.end());
  CHECK(all == data);
  CHECK(sink.size() == 37);
  CHECK_THROWS(sink.append(data.data(), 1), std::logic_error, "after commit");
  sink.abort();  // no-op after commit
  CHECK(sink.committed());
}

TEST(block_sink_failed_callback_fails_the_sink) {
  int calls = 0;
  BlockSink sink("obj", 4, [&](std::vector<std::uint8_t>&&) {
    ++calls;
    throw std::runtime_error("upload refused");
  });
  const auto data = pattern(8, 2);
  CHECK_THROWS(sink.append(data.data(), 8), std::runtime_error, "upload refused");
  CHECK(calls == 1);
  CHECK_THROWS(sink.append(data.data(), 1), std::logic_error, "failure");
  CHECK_THROWS(sink.commit(), std::logic_error, "failure");
  CHECK_THROWS(BlockSink("x", 0, [](std::vector<std::uint8_t>&&) {}), std::invalid_argument,
               "block_bytes");
}

TEST(block_sink_reuses_buffers_given_back_and_keeps_the_bytes_exact) {
  auto recycler = std::make_shared<pyckpt::BlockRecycler>(2);
  std::vector<std::vector<std::uint8_t>> held;  // the "uploads" in flight
  std::vector<std::uint8_t> all;
  std::vector<const std::uint8_t*> buffers;
  BlockSink sink(
      "obj", 16,
      [&](std::vector<std::uint8_t>&& b) {
        all.insert(all.end(), b.begin(), b.end());
        buffers.push_back(b.data());
        held.push_back(std::move(b));
        if (held.size() == 2) {  // the oldest upload completes: its buffer comes back
          recycler->give(std::move(held.front()));
          held.erase(held.begin());
        }
      },
      recycler);
  const auto data = pattern(16 * 6 + 5, 7);
  for (std::size_t at = 0; at < data.size(); at += 7) {
    sink.append(data.data() + at, std::min<std::size_t>(7, data.size() - at));
  }
  sink.commit();
  CHECK(all == data);
  CHECK(buffers.size() == 7);
  // Blocks 0 and 1 are fresh; from then on each block reuses the buffer of the block two
  // before it, which its upload has given back.
  CHECK(recycler->reused() == 5);
  CHECK(buffers[2] == buffers[0] && buffers[3] == buffers[1] && buffers[4] == buffers[0]);
}

TEST(block_recycler_keeps_at_most_max_spare_and_skips_small_buffers) {
  pyckpt::BlockRecycler r(1);
  std::vector<std::uint8_t> a;
  a.reserve(64);
  const std::uint8_t* pa = a.data();
  std::vector<std::uint8_t> b;
  b.reserve(64);
  r.give(std::move(a));
  r.give(std::move(b));  // over max_spare: freed
  auto t = r.take(64);
  CHECK(t.data() == pa && t.empty() && t.capacity() >= 64);
  CHECK(r.reused() == 1);
  auto u = r.take(64);  // no spare left: a fresh buffer
  CHECK(u.capacity() >= 64 && u.data() != pa);
  std::vector<std::uint8_t> small;
  small.reserve(8);
  r.give(std::move(small));
  auto v = r.take(64);  // the spare is too small for this block
  CHECK(v.capacity() >= 64);
  CHECK(r.reused() == 1);
  // Closed (the upload is over): nothing given back is kept.
  r.give(std::move(v));
  r.close();
  r.give(std::move(u));
  auto w = r.take(64);
  CHECK(w.capacity() >= 64);
  CHECK(r.reused() == 1);
}

TEST(memory_source_lends_inside_one_range_only) {
  const auto a = pattern(100, 3);
  const auto b = pattern(50, 4);
  MemorySource src("s3://b/k", 1000,
                   {MemoryRange{500, b.data(), b.size()}, MemoryRange{0, a.data(), a.size()}});
  CHECK(src.size() == 1000 && src.name() == "s3://b/k");
  CHECK(src.view_at(10, 90) == a.data() + 10);
  CHECK(src.view_at(500, 50) == b.data());
  CHECK(src.view_at(90, 20) == nullptr);   // runs past the first range
  CHECK(src.view_at(200, 10) == nullptr);  // never downloaded
  std::uint8_t out[8];
  src.read_at(520, 8, out);
  CHECK(std::memcmp(out, b.data() + 20, 8) == 0);
  CHECK_THROWS(src.read_at(200, 8, out), pyckpt::SysError, "not downloaded");
  CHECK_THROWS(src.read_at(996, 8, out), pyckpt::FormatError, "past its end");
}

TEST(pipeline_round_trip_through_blocks) {
  pyckpt::ThreadPool pool(3);
  const pyckpt::CodecParams zstd{pyckpt::Codec::Zstd, 1, 2, pyckpt::Transform::ByteGroupRotl1};
  const std::size_t chunk = 4096;
  auto enc = pyckpt::BufferPool::create(pyckpt::max_encoded_size(chunk, zstd), 2 * pool.size() + 2);
  const auto raw = pattern(50000, 5);
  Blocks blocks;
  BlockSink sink("s3://b/p/0-0.x.pyckpt", 6000, blocks.cb());
  std::vector<pyckpt::WriteRequest> items(1);
  items[0].name = "w";
  items[0].data = raw.data();
  items[0].nbytes = raw.size();
  items[0].params = zstd;
  const auto written = pyckpt::encode_and_write(sink, items, chunk, pool, *enc);
  sink.commit();
  CHECK(written.size() == 1 && written[0].chunks.size() == 13);

  pyckpt::ReadSegment seg;
  seg.path = "s3://b/p/0-0.x.pyckpt";
  seg.params = zstd;
  seg.chunks = written[0].chunks;
  std::vector<std::uint8_t> out(raw.size() - 7000);
  pyckpt::ReadRequest req;
  req.name = "w";
  req.segments = {seg};
  req.lo = 5000;  // inside chunk 1: partial chunks at both ends
  req.hi = raw.size() - 2000;
  req.dst = out.data();
  const auto ranges = blocks.ranges();
  const std::uint64_t total = sink.size();
  auto open = [&](const std::string& name) -> std::unique_ptr<pyckpt::ChunkSource> {
    return std::make_unique<MemorySource>(name, total, ranges);
  };
  // Blocks cut chunks apart: a chunk spanning two blocks is copied (read_at fails: not lent
  // whole), so hand the reader one range holding everything instead.
  std::vector<std::uint8_t> whole;
  for (const auto& b : blocks.got) whole.insert(whole.end(), b.begin(), b.end());
  auto open_whole = [&](const std::string& name) -> std::unique_ptr<pyckpt::ChunkSource> {
    return std::make_unique<MemorySource>(
        name, total, std::vector<MemoryRange>{{0, whole.data(), whole.size()}});
  };
  const auto st = pyckpt::read_requests({req}, pool, open_whole);
  CHECK(std::memcmp(out.data(), raw.data() + 5000, out.size()) == 0);
  CHECK(st.chunks_decoded == 11);  // chunks 1..11 overlap [5000, 48000)
  // Over the block ranges, the chunks that straddle a block boundary cannot be served.
  CHECK_THROWS(pyckpt::read_requests({req}, pool, open), pyckpt::SysError, "not downloaded");
}

PYCKPT_TEST_MAIN
