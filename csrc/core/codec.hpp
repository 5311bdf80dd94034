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
 *    Grouped planes are compressed, for levels 1..3, with an entropy-oriented zstd profile
 *    (fast strategy, tiny hash table, 7-byte minimum match) that leaves near-i.i.d. exponent
 *    bytes to zstd's literal Huffman coder: smaller and faster than level 1 on such planes.
 *    Levels <= 0 and >= 4 use the standard parameters of that level.
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
  int level = 1;                ///< zstd level
  std::uint32_t elem_size = 1;  ///< element size in bytes, for grouping
  Transform transform = Transform::None;
  double raw_threshold = 0.97;  ///< store raw unless compressed < threshold * raw
};

/** @brief One stored plane of a chunk. */
struct PlaneRecord {
  PlaneMode mode;
  std::uint64_t stored_len;
};

/** @brief Description of one encoded chunk (what the metadata records). */
struct ChunkRecord {
  std::uint64_t file_offset = 0;          ///< where the stored bytes start in the data file
  std::uint64_t raw_len = 0;              ///< decoded length
  std::uint64_t stored_len = 0;           ///< sum of plane stored lengths
  std::uint64_t checksum = 0;             ///< XXH64 of the stored bytes
  Transform transform = Transform::None;  ///< transform actually applied to this chunk
  std::vector<PlaneRecord> planes;
};

/**
 * @return an upper bound of the stored size of a chunk of `raw_len` bytes.
 * @note The bound is `raw_len` for every codec: a plane is kept compressed only when it is
 *       smaller than its raw bytes, and zstd is run with an output capacity below the raw size,
 *       so no compressBound() slack is ever needed.
 */
std::size_t max_encoded_size(std::size_t raw_len, const CodecParams& params) noexcept;

/**
 * @brief Checks that `params` are usable: zstd level within libzstd's range, elem_size in
 *        {1, 2, 4, 8}, 0 < raw_threshold <= 1.
 * @throws std::invalid_argument naming the bad field.
 */
void validate_params(const CodecParams& params);

/**
 * @brief Splits `n_elems` elements of `elem_size` bytes into `elem_size` planes (plane p gets
 *        byte p of every element), rotating each element left by one bit first when `rotl1`.
 * @param src n_elems * elem_size bytes.
 * @param planes elem_size output pointers of n_elems bytes each (must not overlap src).
 * @throws std::invalid_argument when elem_size is not 1, 2, 4 or 8.
 * @note Exposed for benchmarks and tests; encode_chunk() uses it internally.
 */
void group_bytes(const void* src, std::size_t n_elems, std::uint32_t elem_size, bool rotl1,
                 std::uint8_t* const* planes);

/**
 * @brief Inverse of group_bytes(): interleaves `elem_size` planes back into elements and undoes
 *        the rotation when `rotl1`.
 * @throws std::invalid_argument when elem_size is not 1, 2, 4 or 8.
 */
void ungroup_bytes(const std::uint8_t* const* planes, std::size_t n_elems, std::uint32_t elem_size,
                   bool rotl1, void* dst);

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

/** @return true when the chunk's stored bytes are its raw bytes (one raw plane, no transform). */
bool is_plain_chunk(const ChunkRecord& rec) noexcept;

/**
 * @brief Checks a chunk record against the layout rules of the format, before any byte of the
 *        chunk is read or any buffer is sized from it.
 *
 * Rejects: unknown transform or plane mode codes; 0 or more than 8 planes; plane lengths that
 * overflow or do not sum to stored_len; stored_len > raw_len (the encoder never stores more than
 * it decodes to); a codec 'none' chunk that is not one raw plane; an untransformed chunk without
 * exactly 1 plane or whose raw plane is not raw_len bytes; a grouped chunk whose elem_size is not
 * 2, 4 or 8, whose raw_len is not a multiple of it, that does not have elem_size planes, or
 * whose raw planes are not raw_len / elem_size bytes (zstd planes at most that).
 * @throws FormatError(Header) naming the violated rule.
 */
void validate_record(const ChunkRecord& rec, const CodecParams& params);

/**
 * @brief Checks XXH64 of the chunk's rec.stored_len stored bytes against rec.checksum.
 * @note The message never contains the hash computed over the bytes read (it would disclose the
 *       contents of whatever file was read in place of the data file).
 * @throws FormatError(Checksum) whose message contains "checksum mismatch".
 */
void verify_chunk_checksum(const void* stored, const ChunkRecord& rec);

/**
 * @brief Validates, verifies and decodes one chunk.
 *
 * Each zstd plane's frame header must declare exactly the plane's decoded size and the frame
 * must span exactly the plane's stored bytes; this is checked before decoding, and the decoder's
 * output capacity is the plane size, so no input decodes to more than raw_len bytes.
 * @param stored the chunk's stored bytes (rec.stored_len of them).
 * @param rec its record.
 * @param params codec parameters of its piece (elem_size is needed for ungrouping).
 * @param dst output of rec.raw_len bytes.
 * @throws FormatError(Header) for a record rejected by validate_record() or a frame whose size
 *         disagrees with it, FormatError(Checksum) when the checksum does not match,
 *         CompressionError when a zstd frame fails to decode.
 */
void decode_chunk(const void* stored, const ChunkRecord& rec, const CodecParams& params, void* dst);

/**
 * @brief A decoded chunk held as one flat byte range or as its byte planes, not yet
 *        interleaved; copy_out() writes any byte range of the decoded chunk, ungrouping on the
 *        way, so a chunk scattered into many runs of an output is interleaved straight into them
 *        (one pass over the bytes instead of ungroup-then-copy).
 *
 * A view: it points into the stored bytes and this thread's codec scratch, and is valid on its
 * thread until the next decode there (or trim_codec_scratch()).
 */
class DecodedChunk {
 public:
  /** @brief A chunk whose decoded bytes are the `size` bytes at `flat`. */
  static DecodedChunk flat(const std::uint8_t* flat, std::uint64_t size) noexcept {
    DecodedChunk d;
    d._flat = flat;
    d._size = size;
    return d;
  }
  /** @return the decoded size in bytes (the record's raw_len). */
  std::uint64_t size() const noexcept { return _size; }
  /** @return the decoded bytes when they are one flat range, else nullptr (planes). */
  const std::uint8_t* flat_bytes() const noexcept { return _flat; }
  /**
   * @brief Writes decoded bytes [offset, offset + n) to dst. The range may start or end inside
   *        an element (byte geometry).
   * @note requires offset + n <= size().
   */
  void copy_out(std::uint64_t offset, std::uint64_t n, void* dst) const;

 private:
  friend DecodedChunk decode_chunk_planes(const void*, const ChunkRecord&, const CodecParams&);
  const std::uint8_t* _flat = nullptr;
  const std::uint8_t* _planes[8] = {};
  std::uint32_t _elem = 1;
  bool _rotl1 = false;
  std::uint64_t _size = 0;
};

/**
 * @brief As decode_chunk(), but leaves a byte-grouped chunk's planes un-interleaved (zstd planes
 *        decoded into this thread's codec scratch, raw planes read in place from `stored`).
 * @return the chunk as a view (see DecodedChunk); `stored` must outlive it.
 * @throws as decode_chunk().
 */
DecodedChunk decode_chunk_planes(const void* stored, const ChunkRecord& rec,
                                 const CodecParams& params);

/**
 * @brief Checks everything decode_chunk() checks without producing the decoded bytes: each zstd
 *        plane is decoded once through a fixed 128 KiB per-thread window, so memory does not
 *        grow with the chunk's raw size.
 * @throws as decode_chunk().
 */
void verify_chunk(const void* stored, const ChunkRecord& rec, const CodecParams& params);

/**
 * @brief One standard zstd frame of `len` bytes at `src`, with its content size (for metadata
 *        that is not a chunk: a version-4 metadata shard).
 * @throws CompressionError if zstd fails.
 */
std::vector<std::uint8_t> zstd_frame(const void* src, std::size_t len, int level);

/**
 * @brief The content of exactly one standard zstd frame that declares its content size, checked
 *        from the frame header before anything is decoded.
 * @throws CompressionError if `src` is not such a frame or does not decode;
 *         FormatError (Header) if it declares more than `max_len` bytes, has bytes after the
 *         frame or decodes to other than it declares.
 */
std::vector<std::uint8_t> zstd_unframe(const void* src, std::size_t len, std::size_t max_len);

/**
 * @brief Frees this thread's codec scratch (grouped planes) when it holds more than `keep` bytes.
 */
void trim_codec_scratch(std::size_t keep) noexcept;

}  // namespace pyckpt
