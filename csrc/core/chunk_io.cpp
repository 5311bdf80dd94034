// The shared chunk read path. See chunk_io.hpp for the contracts.
#include "core/chunk_io.hpp"

#include "core/detail/scratch.hpp"
#include "core/error.hpp"

namespace pyckpt {

namespace {

/** Per-thread buffers: stored bytes read from the source, and decoded bytes of a partial read. */
struct ChunkScratch {
  detail::Scratch stored;
  detail::Scratch decoded;
};

ChunkScratch& scratch() {
  thread_local ChunkScratch s;
  return s;
}

// The stored bytes of a validated record: lent by the source when it can, else read into `into`
// (caller memory of at least stored_len bytes) or, when `into` is null, into thread scratch.
const std::uint8_t* stored_bytes(ChunkSource& src, const ChunkRecord& rec, std::uint8_t* into) {
  const auto len = static_cast<std::size_t>(rec.stored_len);
  if (into == nullptr) {
    if (const std::uint8_t* view = src.view_at(rec.file_offset, len)) return view;
    into = scratch().stored.get(len);
  }
  src.read_at(rec.file_offset, len, into);
  return into;
}

}  // namespace

void validate_chunk(const ChunkRecord& rec, const CodecParams& params, std::uint64_t source_size) {
  PYCKPT_EXPECT_FORMAT(rec.raw_len <= kMaxChunkBytes, FormatKind::Header, "chunk of ", rec.raw_len,
                       " decoded bytes exceeds the ", kMaxChunkBytes, "-byte chunk size limit");
  validate_record(rec, params);  // also stored_len <= raw_len
  PYCKPT_EXPECT_FORMAT(
      rec.file_offset <= source_size && rec.stored_len <= source_size - rec.file_offset,
      FormatKind::Truncated, "chunk needs stored bytes [", rec.file_offset, ", ",
      rec.file_offset + rec.stored_len, ") but the file holds ", source_size, " bytes");
}

const std::uint8_t* load_chunk(ChunkSource& src, const ChunkRecord& rec, const CodecParams& params,
                               std::uint8_t* dst) {
  validate_chunk(rec, params, src.size());
  if (is_plain_chunk(rec)) {
    // Raw chunk: its stored bytes are its decoded bytes; read them where they are wanted.
    const std::uint8_t* raw = stored_bytes(src, rec, dst);
    verify_chunk_checksum(raw, rec);
    return raw;
  }
  const std::uint8_t* stored = stored_bytes(src, rec, nullptr);
  std::uint8_t* out = dst ? dst : scratch().decoded.get(static_cast<std::size_t>(rec.raw_len));
  decode_chunk(stored, rec, params, out);
  return out;
}

DecodedChunk load_chunk_parts(ChunkSource& src, const ChunkRecord& rec, const CodecParams& params) {
  validate_chunk(rec, params, src.size());
  const std::uint8_t* stored = stored_bytes(src, rec, nullptr);
  if (is_plain_chunk(rec)) {
    verify_chunk_checksum(stored, rec);
    return DecodedChunk::flat(stored, rec.raw_len);
  }
  return decode_chunk_planes(stored, rec, params);
}

void read_stored_chunk(ChunkSource& src, const ChunkRecord& rec, const CodecParams& params,
                       std::uint8_t* dst) {
  validate_chunk(rec, params, src.size());
  src.read_at(rec.file_offset, static_cast<std::size_t>(rec.stored_len), dst);
  verify_chunk_checksum(dst, rec);
}

void check_chunk(ChunkSource& src, const ChunkRecord& rec, const CodecParams& params) {
  validate_chunk(rec, params, src.size());
  verify_chunk(stored_bytes(src, rec, nullptr), rec, params);
}

void trim_chunk_scratch(std::size_t keep) noexcept {
  ChunkScratch& s = scratch();
  s.stored.trim(keep);
  s.decoded.trim(keep);
  trim_codec_scratch(keep);
}

std::string chunk_context(const std::string& path, const std::string& item, std::uint64_t offset) {
  return detail::concat("file '", path, "', tensor '", item, "', chunk at file offset ", offset);
}

}  // namespace pyckpt
