#pragma once
/**
 * @file stitcher.hpp
 * @brief Copies row-major shard blocks into row-major full tensors inside pre-sized output files.
 *
 * The central primitive: a block is a hyper-rectangle `offsets`/`sizes` of a full tensor of
 * `shape`, whose elements are stored row-major and contiguously somewhere (a safetensors shard's
 * data range, or the decoded chunks of a pyckpt piece). Because both the block and the
 * full tensor are row-major, the position in the full tensor grows strictly with the position in
 * the block, so "the part of a block that lands in the full tensor's flat range [x, y)" is itself
 * a flat range [a, b) of the block. Copying [a, b) then walks maximal contiguous runs: every
 * trailing dimension that the block spans completely is merged into the run, so a dim-0 shard is
 * one run and a dim-1 shard of a matrix is one run per row.
 *
 * This serves:
 *  - splitting one big shard into bounded tasks (parallelism, bounded memory);
 *  - encoded pyckpt chunks: each chunk decodes to a flat range of its piece, which is scattered
 *    the same way (one task per chunk, decoded once into a reused per-thread buffer);
 *  - splitting one output tensor or file between ranks by byte range: each rank writes the flat
 *    range of each block that falls in its share.
 *
 * Thread-safety: BlockLayout is immutable after construction; stitch() and check_tiling() are
 * reentrant (stitch() runs its own fixed pool for the duration of the call).
 */
#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/codec.hpp"
#include "core/float_cast.hpp"

namespace pyckpt {

/**
 * @brief Row-major geometry of one block inside a full tensor, with trailing full dims coalesced.
 *
 * All positions are in elements. A scalar tensor (empty shape) is one element.
 */
class BlockLayout {
 public:
  /**
   * @param shape the full tensor's shape.
   * @param offsets the block's first index along each dimension.
   * @param sizes the block's extent along each dimension.
   * @throws std::invalid_argument when the ranks differ or the block leaves the tensor.
   */
  BlockLayout(const std::vector<std::uint64_t>& shape, const std::vector<std::uint64_t>& offsets,
              const std::vector<std::uint64_t>& sizes);

  /** @return the number of elements of the block. */
  std::uint64_t elements() const noexcept { return _elements; }
  /** @return the number of elements of the full tensor. */
  std::uint64_t tensor_elements() const noexcept { return _tensor_elements; }
  /** @return the length of each contiguous run in the full tensor, in elements. */
  std::uint64_t run_elements() const noexcept { return _run; }
  /**
   * @return the flat index in the full tensor of block element `k`.
   * @note k must be < elements().
   */
  std::uint64_t global_index(std::uint64_t k) const noexcept;
  /**
   * @return the smallest k with global_index(k) >= x, or elements() when there is none.
   * @note O(log(elements) * rank).
   */
  std::uint64_t lower_bound(std::uint64_t x) const noexcept;

  /**
   * @brief Calls fn(block_start, global_start, count) for each maximal contiguous run of the block
   *        elements [a, b), in increasing order.
   * @note requires a <= b <= elements().
   */
  template <typename Fn>
  void for_each_run(std::uint64_t a, std::uint64_t b, Fn&& fn) const {
    while (a < b) {
      const std::uint64_t within = a % _run;
      const std::uint64_t n = std::min<std::uint64_t>(_run - within, b - a);
      fn(a, run_start(a / _run) + within, n);
      a += n;
    }
  }

 private:
  std::uint64_t run_start(std::uint64_t r) const noexcept;

  std::vector<std::uint64_t> _outer_sizes;    // block sizes of the dims outside the run
  std::vector<std::uint64_t> _outer_strides;  // their full-tensor strides, in elements
  std::uint64_t _base = 0;                    // full-tensor index of block element 0
  std::uint64_t _run = 1;
  std::uint64_t _elements = 0;
  std::uint64_t _tensor_elements = 0;
};

/** @brief One hyper-rectangle of a tensor, for check_tiling(). */
struct TileBlock {
  std::vector<std::uint64_t> offsets;  ///< first index along each dimension
  std::vector<std::uint64_t> sizes;    ///< extent along each dimension
  std::string origin;                  ///< where it comes from (file name), for messages
};

/**
 * @brief Checks that `blocks` tile the tensor `shape` exactly: same rank, inside the tensor,
 *        pairwise disjoint, and together covering every element.
 * @param name the tensor's name, for messages.
 * @param shape the full shape.
 * @param blocks the blocks.
 * @throws FormatError(Mismatch) for a rank mismatch or a block outside the tensor,
 *         FormatError(Overlap) naming both blocks' origins, FormatError(Coverage) for a hole.
 */
void check_tiling(const std::string& name, const std::vector<std::uint64_t>& shape,
                  const std::vector<TileBlock>& blocks);

/**
 * @brief Where the row-major bytes of a block come from.
 *
 * Kind RawFile: `size` bytes at `offset` of the file `path` (a safetensors shard's data range).
 * The source holds block elements [StitchItem::block_lo, block_hi) starting at `offset`.
 *
 * Kind EncodedChunk: one independently decodable chunk of a pyckpt piece, stored in `path` at
 * `chunk.file_offset` (chunk.stored_len bytes, codec `params`). It decodes to chunk.raw_len
 * bytes, which are block elements [StitchItem::block_lo, block_hi) of the piece (so
 * (block_hi - block_lo) x item_bytes must equal chunk.raw_len; byte geometry with item_bytes 1
 * lets a chunk start or end inside an element). stitch() reads the stored bytes (pread, or the
 * input mapping in InputMode::Mmap), verifies the XXH64 checksum, decodes into a per-thread
 * scratch buffer and scatters the part that falls in the item's [lo, hi) into the output.
 */
struct StitchSource {
  /** @brief The source kinds. */
  enum class Kind : std::uint8_t { RawFile = 0, EncodedChunk = 1 };
  Kind kind = Kind::RawFile;  ///< which of the fields below apply
  std::string path;           ///< the input file (both kinds)
  std::uint64_t offset = 0;   ///< RawFile: absolute offset of the source's first byte
  ChunkRecord chunk;          ///< EncodedChunk: the chunk's record (absolute file_offset)
  CodecParams params;         ///< EncodedChunk: codec parameters of its segment
};

/** @brief Copy the part of one block that falls in [lo, hi) of its tensor into an output file. */
struct StitchItem {
  std::string name;                    ///< tensor name, for messages
  std::vector<std::uint64_t> shape;    ///< full tensor shape
  std::vector<std::uint64_t> offsets;  ///< block offsets
  std::vector<std::uint64_t> sizes;    ///< block sizes
  std::uint32_t item_bytes = 1;        ///< bytes per element (>= 1)
  StitchSource source;                 ///< the block's bytes
  std::string out_path;                ///< output file (already created and sized)
  std::uint64_t out_offset = 0;        ///< absolute offset of the full tensor's first byte
  std::uint64_t lo = 0;                ///< first flat element of the tensor to write
  std::uint64_t hi = 0;                ///< one past the last flat element to write
  /// The source holds only block elements [block_lo, block_hi) (a chunk of a piece); its first
  /// byte is block element block_lo. The default (0, max) means the whole block.
  std::uint64_t block_lo = 0;
  std::uint64_t block_hi = UINT64_MAX;  ///< clamped to the block's element count
  /// Elements are converted on the way (an export casting fp32 to bf16): item_bytes is then the
  /// source element size (float_format_bytes(cast.from)), positions stay in elements, and the
  /// output tensor at out_offset holds float_format_bytes(cast.to) bytes per element. Disabled
  /// by default (a byte-exact copy).
  FloatCast cast;
};

/** @brief How stitch() reads RawFile sources. */
enum class InputMode : std::uint8_t {
  /// pread for a contiguous range, or one preadv per 1024 scattered runs, into a bounded
  /// per-thread output buffer (then one pwrite per task)
  Pread = 0,
  Mmap = 1,  ///< copy from a read-only mapping with madvise(SEQUENTIAL | WILLNEED)
};

/** @brief Options of stitch(). */
struct StitchOptions {
  std::size_t threads = 1;             ///< worker threads (>= 1)
  std::size_t task_bytes = 16u << 20;  ///< bytes per task; also the per-thread buffer bound
  InputMode input = InputMode::Pread;  ///< how inputs are read
  bool fsync = true;                   ///< fsync each output file after writing
  /// EncodedChunk items of a tensor may supply only part of its [lo, hi) (the rest is written
  /// by other calls, e.g. as chunks arrive from peer ranks): the Coverage check is skipped, and
  /// the caller checks that the calls' byte counts add up.
  bool partial = false;
};

/** @brief What stitch() did. */
struct StitchStats {
  std::uint64_t bytes = 0;  ///< bytes copied into outputs
  std::uint64_t tasks = 0;  ///< tasks run
  std::uint64_t runs = 0;   ///< contiguous runs copied
};

/**
 * @brief Runs every item: each writes the elements of its block that fall in [lo, hi) of its
 *        tensor, at their place in the tensor stored at `out_offset` of `out_path`.
 *
 * Every input and output file is opened once; outputs must already have their final size (so
 * several processes can fill disjoint parts of one file). RawFile groups are split into tasks of
 * about `task_bytes` of output; each EncodedChunk item that overlaps [lo, hi) is one task (the
 * chunk is read, verified and decoded once, even when it lands in scattered runs). Outputs are
 * written with pwrite. When decoded chunks land in scattered runs shorter than 64 KiB (one
 * syscall per run would dominate), all chunks of a tensor whose range [lo, hi) is at most
 * 4 x task_bytes are one task that assembles the range in a per-thread window and writes it
 * with one pwrite (not with `partial`); for a larger range such runs are copied into a
 * MAP_SHARED mapping of the output. Small ranges (at most 256 KiB of output, either source
 * kind) that lie back to back in one output file form batches of at most 2 MiB (both bounds
 * also at most task_bytes): a batch is one task, assembled in the per-thread window and written
 * with one pwrite (with `partial`, only ranges whose chunks the call supplies in full), so a
 * model of thousands of small tensors costs a write per batch, not per tensor. A byte-grouped
 * chunk's planes are interleaved straight into each run (DecodedChunk::copy_out). Memory use
 * is bounded by threads x (4 x task_bytes + 3 x the largest chunk) plus the mappings. Items
 * with an enabled StitchItem::cast are converted in memory after reading or decoding, with one
 * more per-thread buffer of the converted bytes.
 * @param items the copies; items may share inputs and outputs; their destinations must not overlap.
 * @param options see StitchOptions.
 * @return counters.
 * The calling thread's progress counter (cancel.hpp, ScopedProgressCounter), if one is
 * installed, gets the output bytes of each task as it finishes.
 * Inputs and outputs are opened as PosixFile (posix_storage.hpp): regular files only, no symlink
 * followed at the last path component, no wait on a FIFO. Encoded chunks go through the shared
 * chunk path (chunk_io.hpp: validated against the input's size and kMaxChunkBytes first).
 * @throws SysError when a file cannot be opened (ELOOP for a symlink), read, mapped or synced
 *         (detail names the tensor); FormatError(Other) when an input or output is not a
 *         regular file.
 * @throws FormatError(Truncated) when an input is shorter than a block or chunk needs (naming
 *         file and tensor); FormatError(Checksum) for a corrupted chunk and CompressionError for
 *         an undecodable one (naming file, tensor and chunk offset); FormatError(Coverage) when
 *         the chunks of a tensor do not supply exactly its range [lo, hi);
 *         std::invalid_argument for inconsistent items (bad geometry, zero item size, an output
 *         range beyond the output file, a chunk whose raw_len does not match its block range,
 *         raw and encoded sources mixed in one tensor, a cast whose source size differs from
 *         item_bytes or that the items of one tensor disagree on). The first failure is thrown
 *         after every task has finished; outputs are then partially written (the caller owns
 *         cleanup).
 */
StitchStats stitch(const std::vector<StitchItem>& items, const StitchOptions& options);

}  // namespace pyckpt
