#pragma once
/**
 * @file chunk_reader.hpp
 * @brief The parallel reader: fills caller buffers with byte ranges of items stored as chunks in
 *        any ChunkSource (storage.hpp), and the chunk verifier behind `pyckpt verify`.
 *
 * Both run every chunk through the one chunk path of chunk_io.hpp.
 *
 * Thread-safety: read_requests() and verify_segments() may run concurrently.
 */
#include <cstdint>
#include <string>
#include <vector>

#include "core/codec.hpp"
#include "core/posix_storage.hpp"
#include "core/storage.hpp"
#include "core/thread_pool.hpp"

namespace pyckpt {

/** @brief A run of consecutive chunks of an item stored in one file. */
struct ReadSegment {
  std::string path;             ///< data file
  std::uint64_t raw_begin = 0;  ///< offset of the segment's first raw byte within the item
  CodecParams params;           ///< codec parameters (elem_size needed to ungroup)
  std::vector<ChunkRecord> chunks;
};

/** @brief Fill dst with raw bytes [lo, hi) of an item made of `segments`. */
struct ReadRequest {
  std::string name;
  std::vector<ReadSegment> segments;
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  void* dst = nullptr;  ///< hi - lo writable bytes; must stay valid until the call returns
};

/** @brief What a read_requests() call did. */
struct ReadStats {
  std::uint64_t bytes_read = 0;      ///< stored bytes read from files
  std::uint64_t chunks_decoded = 0;  ///< chunks read, verified and decoded
};

/**
 * @brief Reads the stored bytes of every chunk of each request's segments, back to back in
 *        segment and chunk order, into the request's `dst` (the sum of their stored_len bytes;
 *        lo and hi are ignored), validating each record and verifying its checksum but not
 *        decoding: the bytes an owner rank sends to a peer (compressed, as stored).
 * @throws as read_requests() (no Coverage/Overlap checks: the segments are taken whole).
 */
ReadStats read_stored(const std::vector<ReadRequest>& requests, ThreadPool& pool,
                      const SourceOpener& open = open_posix_source);

/**
 * @brief Reads, verifies and decodes, in parallel, only the chunks overlapping each [lo, hi).
 *
 * Sources are opened with `open` (once per name, only when one of their chunks is needed).
 * Every record is checked (validate_chunk()) before anything is allocated for it. A chunk wholly
 * inside [lo, hi) is read or decoded straight into the destination; a partly wanted one is
 * decoded into bounded per-thread scratch and the wanted part copied out.
 * @throws SysError for a missing or unreadable file (ELOOP for a symlink); FormatError(Other) for
 *         a data file that is not a regular file; FormatError(Truncated) when a file is shorter
 *         than a recorded chunk; FormatError(Header) for an impossible record or one above the
 *         chunk-size limit; FormatError(Checksum) on corruption; FormatError(Coverage/Overlap)
 *         when the segments do not tile [lo, hi); CompressionError for an undecodable frame.
 *         Messages name the file, the item and the chunk's file offset.
 */
ReadStats read_requests(const std::vector<ReadRequest>& requests, ThreadPool& pool,
                        const SourceOpener& open = open_posix_source);

/**
 * @brief Reads and fully checks every chunk of `segments` (an item named `name`): sizes against
 *        the files and the chunk-size limit, checksums, and that every zstd frame decodes to its
 *        recorded size. Each chunk is decoded once, in parallel, and its output discarded
 *        (check_chunk()), so memory is O(threads x stored chunk size) whatever the raw sizes.
 * @return bytes read and chunks checked (ReadStats::chunks_decoded).
 * @throws the first failure in chunk order, after every task has finished, as read_requests():
 *         SysError (missing/unreadable file), FormatError(Truncated / Header / Other),
 *         FormatError(Checksum), CompressionError; messages name the file, the item and the
 *         chunk's file offset.
 */
ReadStats verify_segments(const std::string& name, const std::vector<ReadSegment>& segments,
                          ThreadPool& pool, const SourceOpener& open = open_posix_source);

}  // namespace pyckpt
