#pragma once
/**
 * @file pyckpt_index.hpp
 * @brief The native reader of `pyckpt.json` (docs/FORMAT.md): parses and validates a metadata
 *        document in one pass into flat tables, for checkpoints of many tensors and pieces.
 *
 * It accepts a strict subset of what the format allows: format version 3 in the form this pyckpt
 * writes it (every object's keys in the writer's order, integers within 64 bits, no repeated key,
 * no unpaired surrogate escape). Everything else, including every damaged or hostile document, is
 * refused with FormatError. The caller (pyckpt._format.read_index) then runs the reference
 * validator in Python, which accepts the rest of the format and names what is wrong; so a refusal
 * here costs time, never a wrong answer, and this reader may be stricter than the format but
 * never looser. Within that subset it checks everything the reference validator checks except
 * the data files on disk (which the caller checks, as its backends know how): exact keys and
 * types, ranges and documented limits, data file names, codec fields against the dtype, every
 * chunk record, segments covering each piece, pieces tiling each tensor, and each data file
 * being its chunks back to back. Chunk checksums are returned unbound from their place.
 *
 * Memory: the result is flat vectors (no object per value); the document is not copied.
 * Thread-safety: a pure function of its input.
 */
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pyckpt {

/** @brief Codec fields of segments, one entry per distinct (dtype, fields) of a document. */
struct IdxCodec {
  std::string dtype;  ///< the pyckpt dtype name of the items using it ("uint8" for bytes)
  std::string codec;  ///< "none" or "zstd"
  std::int64_t level = 0;
  std::uint32_t elem_size = 1;
  std::string transform;  ///< "none", "group" or "group_rotl1"
};

/** @brief One chunk record; its plane (mode, length) pairs are `planes[planes_at...]`. */
struct IdxChunk {
  std::uint64_t file_offset = 0;
  std::uint64_t raw_len = 0;
  std::uint64_t xxh64 = 0;  ///< of the stored bytes (unbound from the chunk's place)
  std::uint32_t transform = 0;
  std::uint32_t nplanes = 0;
  std::size_t planes_at = 0;
};

/** @brief A segment: chunks `[chunks_begin, chunks_end)` of `files[file]`. */
struct IdxSegment {
  std::uint32_t file = 0;
  std::uint32_t codec = 0;  ///< index into PyckptIndex::codecs
  std::uint64_t raw_begin = 0;
  std::size_t chunks_begin = 0, chunks_end = 0;
};

/** @brief A stored piece: offsets then sizes at `dims[dims_at...]` (ndim each). */
struct IdxPiece {
  std::size_t dims_at = 0;
  std::uint64_t nbytes = 0;
  std::size_t segments_begin = 0, segments_end = 0;
};

/** @brief An entry of "items": a tensor (pieces) or a bytes item (segments). */
struct IdxItem {
  std::string fqn;
  bool tensor = true;
  std::string dtype;       ///< tensor only
  std::uint32_t ndim = 0;  ///< tensor only; the shape is `dims[shape_at...]`
  std::size_t shape_at = 0;
  bool requires_grad = false;
  std::string memory_format;
  std::size_t pieces_begin = 0, pieces_end = 0;      ///< tensor only
  std::uint64_t nbytes = 0;                          ///< bytes item only
  std::size_t segments_begin = 0, segments_end = 0;  ///< bytes item only
};

/** @brief A validated metadata document (format version 3). */
struct PyckptIndex {
  int version = 0;
  std::string created_by;
  std::string save_id;
  bool has_dcp_version = false;
  std::string dcp_version;
  std::vector<std::string> modules;  ///< storage_meta.modules
  /// planner_data's JSON text is `[planner_begin, planner_end)` of the document (checked: no
  /// repeated key, nesting within the limit, every {"__tuple__": ...} exactly that key and a list).
  std::size_t planner_begin = 0, planner_end = 0;
  std::vector<std::string> file_names;
  std::vector<std::uint64_t> file_sizes;
  std::vector<IdxItem> items;
  std::vector<IdxPiece> pieces;
  std::vector<IdxSegment> segments;
  std::vector<IdxChunk> chunks;
  std::vector<std::uint64_t> planes;  ///< (mode, length) pairs of every chunk
  std::vector<std::uint64_t> dims;    ///< shapes, offsets and sizes
  std::vector<IdxCodec> codecs;
};

/** @brief The format's tables and limits this reader enforces (compared with Python's in tests). */
struct PyckptIndexLimits {
  std::uint64_t max_items, max_files, max_pieces, max_segments, max_chunks, max_chunk_bytes;
  std::uint64_t max_ndim, max_numel, max_item_bytes, max_file_bytes, max_planner_depth;
  std::uint64_t max_irregular_pieces, zstd_max_ratio;
  std::int64_t zstd_min_level, zstd_max_level;
};
PyckptIndexLimits pyckpt_index_limits() noexcept;

/** @brief (name, element size, byte planes, transform) of every dtype the format stores. */
struct PyckptDtype {
  const char* name;
  std::uint32_t size;
  std::uint32_t planes;   ///< byte planes when grouped (1: never grouped)
  const char* transform;  ///< grouping transform ("none" when never grouped)
};
const std::vector<PyckptDtype>& pyckpt_dtypes();

/**
 * @brief Parses and validates `doc`, the whole `pyckpt.json` (its checksum already verified).
 * @param origin the file, for messages.
 * @throws FormatError(Header) for any document outside the subset described above.
 */
PyckptIndex parse_pyckpt_index(std::string_view doc, const std::string& origin);

}  // namespace pyckpt
