#pragma once
/**
 * @file codec.hpp
 * @brief Chunk codec: optional byte grouping + zstd per plane (or raw) + XXH64 checksum.
 *
 * A tensor's bytes are cut into independent chunks of `chunk_bytes` raw bytes (the last may be
 * shorter). Each chunk is encoded on its own so that a reader can decode any subset in parallel.
 *
 * Encoding of one chunk of raw length L with params {codec, level, elem_size E, transform}:
 *  - codec None: the stored bytes are the raw bytes (1 plane, mode Raw).
 *  - codec Zstd, transform None: one plane, a single zstd frame of the raw bytes, or the raw
 *    bytes when zstd does not shrink them below `raw_threshold` of L.
 *  - codec Zstd, transform ByteGroup / ByteGroupRotl1 (requires L % E == 0 and E in {2,4,8}):
 *    elements are (for Rotl1, first rotated left by one bit within E bytes, which moves the
 *    IEEE sign bit to the bottom and the whole exponent into the top byte for bf16 and fp32),
 *    then split into E planes, plane p holding byte p (little-endian) of every element. Each plane
 *    is stored either as one zstd frame or raw, whichever is smaller after an entropy pre-check
 *    that skips compressing near-random planes. Planes are stored back to back in plane order.
 *    If L % E != 0 the chunk is encoded as transform None.
 * The checksum is XXH64 over the chunk's stored bytes (all planes, as stored).
 *
 * Every zstd frame is a standard frame with the content size set: it decodes with any zstd.
 *
 * Thread-safety: encode_chunk/decode_chunk are thread-safe; each thread uses its own thread-local
 * zstd contexts (one reused context per worker).
 */
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyckpt {

/** @brief Chunk codec identifiers (stored in metadata as strings "none", "zstd"). */
enum class Codec : std::uint8_t { None = 0, Zstd = 1 };

/** @brief Byte transform applied before compression (metadata: "none", "group", "group_rotl1"). */
enum class Transform : std::uint8_t { None = 0, ByteGroup = 1, ByteGroupRotl1 = 2 };

/** @brief How one plane is stored. */
enum class PlaneMode : std::uint8_t { Raw = 0, Zstd = 1 };

/** @brief Encoding parameters for a run of chunks. */
struct CodecParams {
  Codec codec = Codec::None;
  int level = 1;                      ///< zstd level
  std::uint32_t elem_size = 1;        ///< element size in bytes, for grouping
  Transform transform = Transform::None;
  double raw_threshold = 0.97;        ///< store raw unless compressed < threshold * raw
};

/** @brief One stored plane of a chunk. */
struct PlaneRecord {
  PlaneMode mode;
  std::uint64_t stored_len;
};

/** @brief Description of one encoded chunk (what the metadata records). */
struct ChunkRecord {
  std::uint64_t file_offset = 0;  ///< where the stored bytes start in the data file
  std::uint64_t raw_len = 0;      ///< decoded length
  std::uint64_t stored_len = 0;   ///< sum of plane stored lengths
  std::uint64_t checksum = 0;     ///< XXH64 of the stored bytes
  Transform transform = Transform::None;  ///< transform actually applied to this chunk
  std::vector<PlaneRecord> planes;
};

/** @return an upper bound of the stored size of a chunk of `raw_len` bytes. */
std::size_t max_encoded_size(std::size_t raw_len, const CodecParams& params) noexcept;

/**
 * @brief Encodes one chunk into `dst`.
 * @param src raw bytes (any alignment).
 * @param raw_len number of raw bytes.
 * @param params codec parameters.
 * @param dst output buffer of at least max_encoded_size(raw_len, params) bytes.
 * @return the chunk record (file_offset left 0).
 * @throws CompressionError on a zstd failure; std::invalid_argument on bad params.
 */
ChunkRecord encode_chunk(const void* src, std::size_t raw_len, const CodecParams& params,
                         void* dst);

/**
 * @brief Verifies and decodes one chunk.
 * @param stored the chunk's stored bytes (rec.stored_len of them).
 * @param rec its record.
 * @param params codec parameters of its piece (elem_size is needed for ungrouping).
 * @param dst output of rec.raw_len bytes.
 * @throws FormatError(Checksum) when the checksum does not match, FormatError(Header) on an
 *         inconsistent record, CompressionError when a zstd frame fails to decode.
 */
void decode_chunk(const void* stored, const ChunkRecord& rec, const CodecParams& params,
                  void* dst);

}  // namespace pyckpt
