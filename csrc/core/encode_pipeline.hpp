#pragma once
/**
 * @file encode_pipeline.hpp
 * @brief The parallel encode-and-append pipeline: items are cut into chunks, encoded on a thread
 *        pool and appended in order to a ChunkSink (storage.hpp), whatever its backend.
 *
 * Thread-safety: encode_and_write() may run concurrently on different sinks.
 */
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/buffer_pool.hpp"
#include "core/codec.hpp"
#include "core/storage.hpp"
#include "core/thread_pool.hpp"

namespace pyckpt {

/** @brief One item to encode and append. */
struct WriteRequest {
  std::string name;            ///< for error messages (e.g. the tensor's FQN)
  const void* data = nullptr;  ///< host bytes; must stay valid until the call returns
  std::uint64_t nbytes = 0;
  CodecParams params;  ///< valid (validate_params()); the bindings make them validated
};

/** @brief Where an item landed and how it was encoded. */
struct WrittenItem {
  std::uint64_t offset = 0;         ///< file offset of its first stored byte
  std::uint64_t stored_bytes = 0;   ///< total stored bytes
  std::vector<ChunkRecord> chunks;  ///< in raw order; chunk i holds raw [i*chunk_bytes, ...)
};

/**
 * @brief Encodes `items` in chunks of `chunk_bytes` on `pool` and appends them in order.
 *
 * At most 2 x pool.size() + 2 chunks are in flight; zstd chunks are encoded into blocks of
 * `blocks` (whose block size must be >= max_encoded_size(chunk_bytes)). Codec::None chunks are
 * only checksummed by the workers and appended straight from the source. Zero-byte items get
 * zero chunks (their offset is the file size at their turn). Chunk records carry file offsets.
 * @note SAFETY: every items[i].data must stay valid and unmodified until the call returns.
 * @throws the first error of any task (after all tasks are drained), with the item name in the
 *         message (same exception type; for SysError the name goes in detail()); the writer is
 *         then left uncommitted. std::invalid_argument for chunk_bytes == 0 or > kMaxChunkBytes,
 * bad params or a too small `blocks`.
 */
std::vector<WrittenItem> encode_and_write(ChunkSink& out, const std::vector<WriteRequest>& items,
                                          std::size_t chunk_bytes, ThreadPool& pool,
                                          BufferPool& blocks);

}  // namespace pyckpt
