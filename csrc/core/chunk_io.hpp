#pragma once
/**
 * @file chunk_io.hpp
 * @brief The one chunk read path of the core: validate -> read -> verify -> decode, over any
 *        ChunkSource (storage.hpp). The reader (chunk_reader.hpp) and the stitcher both use it.
 *
 * Every length of a record is checked before anything is allocated or read for it: against the
 * format's chunk-size limit (kMaxChunkBytes), against the source's size, and against the layout
 * rules of validate_record(). Scratch buffers are per thread and bounded by the limit; after
 * each chunk, buffers above kScratchKeepBytes are freed (trim_chunk_scratch()), so memory is
 * O(threads x chunk size) during a call and O(threads x kScratchKeepBytes) between calls.
 *
 * Thread-safety: every function may run concurrently on different threads (the scratch is
 * thread-local); a pointer returned by load_chunk() is valid on its thread until the next
 * load_chunk() or trim_chunk_scratch() call there.
 */
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/codec.hpp"
#include "core/storage.hpp"

namespace pyckpt {

/**
 * @brief Largest raw_len (and so stored_len) of one chunk: the writer refuses larger chunk sizes
 *        and the readers reject larger records before allocating for them (256 MiB).
 */
constexpr std::uint64_t kMaxChunkBytes = std::uint64_t{256} << 20;

/** @brief Per-thread scratch kept from one chunk to the next (larger buffers are freed). */
constexpr std::size_t kScratchKeepBytes = std::size_t{64} << 20;

/**
 * @brief Checks a record before any read: validate_record(), raw_len <= kMaxChunkBytes, and the
 *        stored bytes [file_offset, file_offset + stored_len) inside a source of `source_size`
 *        bytes (no overflow).
 * @throws FormatError(Header) for a bad record or an oversized chunk; FormatError(Truncated) when
 *         the stored bytes leave the source.
 */
void validate_chunk(const ChunkRecord& rec, const CodecParams& params, std::uint64_t source_size);

/**
 * @brief Reads, verifies and decodes one chunk.
 * @param src where the stored bytes are (rec.file_offset is an offset in it).
 * @param rec the chunk's record.
 * @param params codec parameters of its segment.
 * @param dst rec.raw_len writable bytes to decode into, or nullptr to decode into this thread's
 *        scratch. A plain chunk is read straight into `dst` and verified there (no copy).
 * @return the decoded bytes: `dst`, or (dst == nullptr) a per-thread buffer or a view lent by the
 *         source, valid until the next load_chunk()/trim_chunk_scratch() on this thread.
 * @throws as validate_chunk(), ChunkSource::read_at() and decode_chunk().
 */
const std::uint8_t* load_chunk(ChunkSource& src, const ChunkRecord& rec, const CodecParams& params,
                               std::uint8_t* dst);

/**
 * @brief As load_chunk() into scratch, but a byte-grouped chunk is returned as its planes
 *        (decode_chunk_planes()), to be interleaved straight into its destinations with
 *        DecodedChunk::copy_out().
 * @return a view valid on this thread until the next load_chunk()/load_chunk_parts()/
 *         trim_chunk_scratch() there.
 * @throws as load_chunk().
 */
DecodedChunk load_chunk_parts(ChunkSource& src, const ChunkRecord& rec, const CodecParams& params);

/**
 * @brief Reads one chunk's stored bytes (rec.stored_len, as stored: compressed or raw) into `dst`
 *        and verifies their checksum, without decoding: what an owner sends to a peer rank.
 * @throws as validate_chunk(), ChunkSource::read_at() and verify_chunk_checksum().
 */
void read_stored_chunk(ChunkSource& src, const ChunkRecord& rec, const CodecParams& params,
                       std::uint8_t* dst);

/**
 * @brief Reads and fully checks one chunk (sizes, checksum, every zstd frame) without keeping
 *        its decoded bytes: memory is the stored bytes plus a fixed window (verify_chunk()).
 * @throws as load_chunk().
 */
void check_chunk(ChunkSource& src, const ChunkRecord& rec, const CodecParams& params);

/** @brief Gives up this thread's chunk and codec scratch buffers above `keep` bytes. */
void trim_chunk_scratch(std::size_t keep = kScratchKeepBytes) noexcept;

/**
 * @return "file '<path>', tensor '<item>', chunk at file offset <offset>": the context every
 *         chunk error carries (added with rethrow_with_context()).
 */
std::string chunk_context(const std::string& path, const std::string& item, std::uint64_t offset);

}  // namespace pyckpt
