#pragma once
// Shared helpers of the C++ unit tests: deterministic test data and an in-memory ChunkSource.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/codec.hpp"
#include "core/error.hpp"
#include "core/storage.hpp"

namespace pyckpt::test {

/** @brief Codec parameters the tests use: raw, plain zstd, and grouped bf16/fp32/fp64. */
inline const CodecParams kRaw{Codec::None, 1, 1, Transform::None};
inline const CodecParams kZstd{Codec::Zstd, 1, 1, Transform::None};
inline const CodecParams kBf16{Codec::Zstd, 1, 2, Transform::ByteGroupRotl1};
inline const CodecParams kFp32{Codec::Zstd, 3, 4, Transform::ByteGroup};
inline const CodecParams kFp64{Codec::Zstd, 1, 8, Transform::ByteGroupRotl1};

/** @brief bf16 values like trained weights (normal, std 0.02), as little-endian bytes. */
inline std::vector<std::uint8_t> bf16_like(std::size_t n_elems, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 0.02f);
  std::vector<std::uint8_t> out(2 * n_elems);
  for (std::size_t i = 0; i < n_elems; ++i) {
    const float f = dist(gen);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const auto h = static_cast<std::uint16_t>(bits >> 16);
    out[2 * i] = static_cast<std::uint8_t>(h);
    out[2 * i + 1] = static_cast<std::uint8_t>(h >> 8);
  }
  return out;
}

/** @brief Uniformly random bytes. */
inline std::vector<std::uint8_t> random_bytes(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<std::uint8_t> out(n);
  for (auto& b : out) b = static_cast<std::uint8_t>(gen());
  return out;
}

/**
 * @brief A ChunkSource over bytes in memory (the shape of a non-POSIX backend); counts reads and
 *        records the largest one, so tests can prove nothing oversized was read or allocated.
 */
class VectorSource final : public ChunkSource {
 public:
  VectorSource(std::string name, std::vector<std::uint8_t> bytes, bool lend = false)
      : _name(std::move(name)), _bytes(std::move(bytes)), _lend(lend) {}
  const std::string& name() const noexcept override { return _name; }
  std::uint64_t size() const noexcept override { return _bytes.size(); }
  void read_at(std::uint64_t offset, std::size_t len, void* dst) override {
    ++reads;
    largest_read = std::max<std::uint64_t>(largest_read, len);
    PYCKPT_EXPECT_FORMAT(offset <= _bytes.size() && len <= _bytes.size() - offset,
                         FormatKind::Truncated, "memory source '", _name, "' ends at ",
                         _bytes.size());
    if (len) std::memcpy(dst, _bytes.data() + offset, len);
  }
  const std::uint8_t* view_at(std::uint64_t offset, std::size_t len) override {
    if (!_lend || offset > _bytes.size() || len > _bytes.size() - offset) return nullptr;
    ++views;
    return _bytes.data() + offset;
  }
  std::vector<std::uint8_t>& bytes() { return _bytes; }

  int reads = 0;
  int views = 0;
  std::uint64_t largest_read = 0;

 private:
  std::string _name;
  std::vector<std::uint8_t> _bytes;
  bool _lend;
};

}  // namespace pyckpt::test
