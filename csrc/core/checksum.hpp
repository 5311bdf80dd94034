#pragma once
/**
 * @file checksum.hpp
 * @brief XXH64 (seed 0) of a byte range: the per-chunk checksum of the pyckpt format; and the
 *        block digests built on it that compare copies of replicated state.
 *
 * Implemented here (not taken from libzstd, whose XXH64 symbols are private) so that the format
 * does not depend on how libzstd was built. Output equals the reference xxHash XXH64.
 */
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pyckpt {

/** @return XXH64(data[0:n], seed). Thread-safe, no allocation. */
std::uint64_t xxh64(const void* data, std::size_t n, std::uint64_t seed = 0) noexcept;

/** @brief A read-only byte range. */
struct ByteSpan {
  const void* data;
  std::size_t size;
};

/**
 * @brief Block digests, the content digests that pyckpt's planner compares across replicas.
 *
 * The block digest of a span with seed `s` is the XXH64 (seed `s`) of the little-endian array
 * of the XXH64s (seed 0) of its consecutive `block`-byte pieces, the last one possibly shorter
 * (an empty span is one empty piece). The pieces of all spans are hashed in parallel.
 *
 * @param seeds one seed per span.
 * @param threads at most this many threads (1: the calling thread only).
 * @return one digest per span, in order.
 * @throws std::invalid_argument if block is 0 or seeds and spans differ in length.
 * @note The spans must stay valid and unchanged during the call; no Python is touched.
 */
std::vector<std::uint64_t> block_digests(const std::vector<ByteSpan>& spans,
                                         const std::vector<std::uint64_t>& seeds, std::size_t block,
                                         std::size_t threads);

/**
 * @brief The blocks that a sampled digest of `n` bytes reads, in increasing order.
 *
 * With `m = ceil(n / block)` blocks: all of them if `m <= count`; otherwise `count` of them:
 * the first, the last, and one in each of `count - 2` equal strata of the blocks between,
 * chosen by a generator seeded from the content of the first and last blocks (`first` and
 * `last` are their XXH64s, seed 0). Equal content thus always gives equal blocks, and the
 * sample moves when the content changes.
 *
 * @throws std::invalid_argument if block is 0 or count is outside [3, 2^30].
 */
std::vector<std::uint64_t> sampled_blocks(std::uint64_t n, std::size_t block, std::size_t count,
                                          std::uint64_t first, std::uint64_t last);

/**
 * @brief Sampled digests: for each span of `n` bytes, the block digest (seed `n`) of the
 *        concatenation, in order, of the blocks chosen by sampled_blocks(). Each span costs
 *        at most `count * block` bytes of reading; spans are hashed in parallel.
 * @throws std::invalid_argument if block is 0 or count is outside [3, 2^30].
 */
std::vector<std::uint64_t> sampled_digests(const std::vector<ByteSpan>& spans, std::size_t block,
                                           std::size_t count, std::size_t threads);

}  // namespace pyckpt
