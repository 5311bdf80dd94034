#pragma once
/**
 * @file checksum.hpp
 * @brief XXH64 (seed 0) of a byte range: the per-chunk checksum of the pyckpt format.
 *
 * Implemented here (not taken from libzstd, whose XXH64 symbols are private) so that the format
 * does not depend on how libzstd was built. Output equals the reference xxHash XXH64.
 */
#include <cstddef>
#include <cstdint>

namespace pyckpt {

/** @return XXH64(data[0:n], seed). Thread-safe, no allocation. */
std::uint64_t xxh64(const void* data, std::size_t n, std::uint64_t seed = 0) noexcept;

}  // namespace pyckpt
