#pragma once
/**
 * @file pyckpt_index.hpp
 * @brief The metadata reader: parses and validates `pyckpt.json` (docs/FORMAT.md, "Strict
 *        schema") in one pass into flat tables, for checkpoints of many tensors and pieces.
 *
 * The one reader of the format: every version this pyckpt reads (1, 2, 3), the members of every
 * object in any order, JSON read as Python's json module reads it (core/json_tape.hpp). It
 * verifies the metadata checksum, then checks everything the specification lists except the data
 * files on disk (which the caller checks, as its backends know where they are): exact keys and
 * types, ranges and documented limits, data file names, codec fields against the dtype, every
 * chunk record, segments covering each piece, pieces tiling each tensor, and each data file being
 * its chunks back to back. Chunk checksums are returned unbound from their place. A refusal is a
 * FormatError (UnsupportedDtype for an unknown dtype) whose message names the file and the key
 * path of the offending value, worded as the specification's checks are listed.
 *
 * Memory: the result is flat vectors (no object per value); while parsing, 16 bytes per JSON
 * value of the document. The document is not copied.
 * Thread-safety: a pure function of its input.
 */
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"
#include "core/json_tape.hpp"

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

/** @brief A validated metadata document. */
struct PyckptIndex {
  int version = 0;
  std::string created_by;
  std::string save_id;
  bool has_dcp_version = false;
  std::string dcp_version;
  std::vector<std::string> modules;  ///< storage_meta.modules
  /// The parsed document (it views the caller's bytes: valid while they are) and the index of
  /// planner_data in it (checked: nesting within the limit, every {"__tuple__": ...} exactly
  /// that key holding a list). The caller may drop it once planner_data is converted.
  std::unique_ptr<JsonTape> tape;
  std::size_t planner = 0;
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

/** @brief A tensor's dtype is not one the format stores (Python: UnsupportedDtypeError). */
class UnsupportedDtype : public FormatError {
 public:
  explicit UnsupportedDtype(const std::string& what) : FormatError(FormatKind::Mismatch, what) {}
};

/** @brief How the pieces of a tensor must cover it, and the limits enforced. */
struct PyckptIndexOptions {
  /// 0: the pieces of each tensor tile it. n > 0: a rank-local part (pyckpt._ranklocal): at
  /// most n non-empty pieces per tensor, no two overlapping, holes allowed.
  std::size_t disjoint_pieces = 0;
  /// >= 0: a rank-local part of this rank: every data file it lists must be the rank's.
  std::int64_t only_rank = -1;
  PyckptIndexLimits limits = pyckpt_index_limits();
};

/**
 * @brief Verifies, parses and validates `doc`, the whole `pyckpt.json`.
 * @param origin the file, for messages ("<origin>: <key path>: <what is wrong>").
 * @throws FormatError(Header) for a damaged or invalid document, UnsupportedDtype for a dtype
 *         outside the table.
 */
PyckptIndex parse_pyckpt_index(std::string_view doc, const std::string& origin,
                               const PyckptIndexOptions& options = {});

}  // namespace pyckpt
