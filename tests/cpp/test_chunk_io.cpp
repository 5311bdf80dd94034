// Unit tests of the shared chunk path (chunk_io) and the reader/verifier above it, through an
// in-memory ChunkSource: the storage seam works without POSIX files.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/chunk_io.hpp"
#include "core/chunk_reader.hpp"
#include "core/codec.hpp"
#include "core/error.hpp"
#include "core/memory_storage.hpp"
#include "core/thread_pool.hpp"
#include "test_support.hpp"

using namespace pyckpt;
using namespace pyckpt::test;

namespace {

/** A "file" of chunks written back to back, and the item's raw bytes. */
struct Stored {
  std::vector<std::uint8_t> file;
  std::vector<ChunkRecord> chunks;
  std::vector<std::uint8_t> raw;
};

Stored store(std::size_t nbytes, std::size_t chunk, const CodecParams& p, std::size_t lead = 0) {
  Stored s;
  s.raw = bf16_like(nbytes / 2, 42);
  s.file.assign(lead, 0xAB);  // unrelated bytes before the first chunk
  for (std::size_t off = 0; off < nbytes; off += chunk) {
    const std::size_t n = std::min(chunk, nbytes - off);
    std::vector<std::uint8_t> buf(max_encoded_size(n, p));
    ChunkRecord r = encode_chunk(s.raw.data() + off, n, p, buf.data());
    r.file_offset = s.file.size();
    s.file.insert(s.file.end(), buf.begin(), buf.begin() + static_cast<long>(r.stored_len));
    s.chunks.push_back(r);
  }
  return s;
}

/** A SourceOpener over named in-memory files, keeping every opened source for inspection. */
struct Memory {
  std::map<std::string, std::vector<std::uint8_t>> files;
  std::map<std::string, VectorSource*> opened;
  SourceOpener opener() {
    return [this](const std::string& name) -> std::unique_ptr<ChunkSource> {
      auto it = files.find(name);
      PYCKPT_EXPECT(it != files.end(), std::invalid_argument, "no file ", name);
      auto src = std::make_unique<VectorSource>(name, it->second);
      opened[name] = src.get();
      return src;
    };
  }
};

}  // namespace

TEST(load_chunk_into_destination_scratch_and_lent_view) {
  const Stored s = store(20000, 8192, kBf16, 100);
  VectorSource src("f", s.file);
  for (std::size_t i = 0; i < s.chunks.size(); ++i) {
    const ChunkRecord& r = s.chunks[i];
    std::vector<std::uint8_t> dst(r.raw_len);
    CHECK(load_chunk(src, r, kBf16, dst.data()) == dst.data());
    CHECK(std::equal(dst.begin(), dst.end(), s.raw.begin() + static_cast<long>(i * 8192)));
    const std::uint8_t* p = load_chunk(src, r, kBf16, nullptr);
    CHECK(std::equal(dst.begin(), dst.end(), p));
    check_chunk(src, r, kBf16);
  }
  // A plain chunk from a lending source is verified in place: no read, no copy.
  const Stored raw = store(9000, 4096, kRaw);
  VectorSource lend("g", raw.file, true);
  const std::uint8_t* p = load_chunk(lend, raw.chunks[1], kRaw, nullptr);
  CHECK(p == lend.bytes().data() + raw.chunks[1].file_offset);
  CHECK(lend.reads == 0 && lend.views == 1);
  trim_chunk_scratch();
}

TEST(records_beyond_the_source_or_the_limit_are_rejected_before_reading) {
  const Stored s = store(8192, 8192, kBf16);
  VectorSource src("f", s.file);
  ChunkRecord r = s.chunks[0];
  // Claims a 1 TiB stored length: must fail on the size check, never allocate or read it.
  ChunkRecord huge = r;
  huge.planes[0].stored_len = std::uint64_t{1} << 40;
  huge.stored_len = huge.planes[0].stored_len + huge.planes[1].stored_len;
  huge.raw_len = std::uint64_t{1} << 41;
  CHECK_THROWS(load_chunk(src, huge, kBf16, nullptr), FormatError, "chunk size limit");
  // Within the limit but beyond the file: Truncated, from the size known at open.
  ChunkRecord past = r;
  past.file_offset = s.file.size() - 10;
  try {
    load_chunk(src, past, kBf16, nullptr);
    CHECK(false);
  } catch (const FormatError& e) {
    CHECK(e.kind() == FormatKind::Truncated);
  }
  ChunkRecord wrap = r;
  wrap.file_offset = UINT64_MAX - 5;  // offset + length overflows
  CHECK_THROWS(check_chunk(src, wrap, kBf16), FormatError, "file holds");
  CHECK(src.reads == 0);
  CHECK(src.largest_read == 0);
}

TEST(read_requests_through_a_memory_backend_full_and_partial) {
  const Stored s = store(50000, 8192, kBf16, 7);
  Memory mem;
  mem.files["a"] = s.file;
  ThreadPool pool(3);
  const ReadSegment seg{"a", 0, kBf16, s.chunks};
  for (const auto& [lo, hi] : std::vector<std::pair<std::uint64_t, std::uint64_t>>{
           {0, 50000}, {1, 49999}, {8191, 8193}, {16384, 24576}, {49000, 50000}}) {
    std::vector<std::uint8_t> dst(hi - lo);
    ReadRequest req{"t", {seg}, lo, hi, dst.data()};
    const ReadStats st = read_requests({req}, pool, mem.opener());
    CHECK(std::equal(dst.begin(), dst.end(), s.raw.begin() + static_cast<long>(lo)));
    CHECK(st.chunks_decoded >= 1);
  }
  const ReadStats v = verify_segments("t", {seg}, pool, mem.opener());
  CHECK(v.chunks_decoded == s.chunks.size());
  CHECK(v.bytes_read == s.file.size() - 7);
}

TEST(read_stored_then_decode_from_a_received_buffer) {
  // What a node-local load does: the owner reads the stored bytes of some chunks back to back
  // (verified, not decoded); the receiver decodes them from that buffer in place.
  const Stored s = store(40000, 8192, kBf16, 5);
  Memory mem;
  mem.files["owner"] = s.file;
  ThreadPool pool(2);
  const std::vector<ChunkRecord> wanted{s.chunks[1], s.chunks[3]};
  std::uint64_t total = 0;
  for (const ChunkRecord& r : wanted) total += r.stored_len;
  std::vector<std::uint8_t> sent(total);
  ReadRequest out{"t", {ReadSegment{"owner", 0, kBf16, wanted}}, 0, 0, sent.data()};
  const ReadStats st = read_stored({out}, pool, mem.opener());
  CHECK(st.bytes_read == total && st.chunks_decoded == 2);

  // Receiver: records remapped into the received buffer, decoded through pyckpt::MemorySource.
  ChunkRecord a = wanted[0], b = wanted[1];
  a.file_offset = 0;
  b.file_offset = a.stored_len;
  const SourceOpener received = [&sent](const std::string& name) -> std::unique_ptr<ChunkSource> {
    return std::make_unique<pyckpt::MemorySource>(
        name, sent.size(), std::vector<pyckpt::MemoryRange>{{0, sent.data(), sent.size()}});
  };
  std::vector<std::uint8_t> dst(8192);
  ReadRequest r1{"t", {ReadSegment{"peer", 8192, kBf16, {a}}}, 8192, 16384, dst.data()};
  read_requests({r1}, pool, received);
  CHECK(std::equal(dst.begin(), dst.end(), s.raw.begin() + 8192));
  ReadRequest r3{
      "t", {ReadSegment{"peer", 3 * 8192, kBf16, {b}}}, 3 * 8192 + 10, 4 * 8192, dst.data()};
  read_requests({r3}, pool, received);
  CHECK(std::equal(dst.begin(), dst.begin() + 8182, s.raw.begin() + 3 * 8192 + 10));

  // A corrupt stored byte on the owner is caught before anything is sent.
  mem.files["owner"][wanted[1].file_offset + 3] ^= 0x40;
  CHECK_THROWS(read_stored({out}, pool, mem.opener()), FormatError, "checksum");
  // A record beyond the received buffer is refused before any read.
  ChunkRecord far = b;
  far.file_offset = sent.size();
  ReadRequest bad{
      "t", {ReadSegment{"peer", 3 * 8192, kBf16, {far}}}, 3 * 8192, 4 * 8192, dst.data()};
  CHECK_THROWS(read_requests({bad}, pool, received), FormatError, "");
}

TEST(overlapping_and_missing_chunks_are_format_errors) {
  const Stored s = store(16384, 8192, kBf16);
  Memory mem;
  mem.files["a"] = s.file;
  ThreadPool pool(2);
  std::vector<std::uint8_t> dst(16384);
  // The second segment restarts at raw byte 4096: overlaps the first.
  const ReadSegment first{"a", 0, kBf16, {s.chunks[0]}};
  const ReadSegment overlap{"a", 4096, kBf16, {s.chunks[1]}};
  try {
    read_requests({ReadRequest{"t", {first, overlap}, 0, 12288, dst.data()}}, pool, mem.opener());
    CHECK(false);
  } catch (const FormatError& e) {
    CHECK(e.kind() == FormatKind::Overlap);
  }
  const ReadSegment hole{"a", 9000, kBf16, {s.chunks[1]}};
  try {
    read_requests({ReadRequest{"t", {first, hole}, 0, 16384, dst.data()}}, pool, mem.opener());
    CHECK(false);
  } catch (const FormatError& e) {
    CHECK(e.kind() == FormatKind::Coverage);
  }
}

TEST(truncated_file_and_corrupt_chunk_name_file_item_and_offset) {
  Stored s = store(16384, 8192, kBf16);
  Memory mem;
  mem.files["short"] = std::vector<std::uint8_t>(s.file.begin(), s.file.end() - 1);
  s.file[s.chunks[1].file_offset + 3] ^= 1;
  mem.files["bad"] = s.file;
  ThreadPool pool(2);
  std::vector<std::uint8_t> dst(16384);
  try {
    read_requests(
        {ReadRequest{"w", {ReadSegment{"short", 0, kBf16, s.chunks}}, 0, 16384, dst.data()}}, pool,
        mem.opener());
    CHECK(false);
  } catch (const FormatError& e) {
    CHECK(e.kind() == FormatKind::Truncated);
    CHECK(std::string(e.what()).find("file 'short', tensor 'w', chunk at file offset") !=
          std::string::npos);
  }
  try {
    verify_segments("w", {ReadSegment{"bad", 0, kBf16, s.chunks}}, pool, mem.opener());
    CHECK(false);
  } catch (const FormatError& e) {
    CHECK(e.kind() == FormatKind::Checksum);
    const std::string msg = e.what();
    CHECK(msg.find("chunk at file offset " + std::to_string(s.chunks[1].file_offset)) !=
          std::string::npos);
  }
}

TEST(scratch_is_trimmed_after_a_large_chunk) {
  // A legitimately large zero chunk decoded into scratch, then trimmed: a later small read
  // must not keep the large buffer alive (checked through the public behaviour: no crash, and
  // the second read is correct after the buffers were freed).
  const std::vector<std::uint8_t> zeros(std::size_t{80} << 20, 0);
  std::vector<std::uint8_t> buf(zeros.size());
  ChunkRecord r = encode_chunk(zeros.data(), zeros.size(),
                               CodecParams{Codec::Zstd, 1, 1, Transform::None}, buf.data());
  buf.resize(r.stored_len);
  VectorSource src("z", buf);
  const std::uint8_t* p =
      load_chunk(src, r, CodecParams{Codec::Zstd, 1, 1, Transform::None}, nullptr);
  CHECK(p[0] == 0 && p[zeros.size() - 1] == 0);
  trim_chunk_scratch();
  const Stored s = store(4096, 4096, kBf16);
  VectorSource small("s", s.file);
  std::vector<std::uint8_t> out(4096);
  load_chunk(small, s.chunks[0], kBf16, out.data());
  CHECK(out == s.raw);
}

PYCKPT_TEST_MAIN
