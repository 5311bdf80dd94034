// XXH64, following the reference description (xxhash.h, "XXH64 algorithm"). The per-chunk
// checksum is part of the on-disk format, so this must equal the reference bit for bit; it is
// tested against published vectors and an independent Python implementation.
#include "core/checksum.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "core/thread_pool.hpp"

namespace pyckpt {

namespace {

constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ULL;
constexpr std::uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
constexpr std::uint64_t kP3 = 0x165667B19E3779F9ULL;
constexpr std::uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
constexpr std::uint64_t kP5 = 0x27D4EB2F165667C5ULL;

inline std::uint64_t rotl64(std::uint64_t x, int r) noexcept { return (x << r) | (x >> (64 - r)); }

// The algorithm is defined on little-endian words; memcpy keeps unaligned loads well defined and
// compiles to a single mov on x86/arm64.
inline std::uint64_t read64(const unsigned char* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

inline std::uint32_t read32(const unsigned char* p) noexcept {
  std::uint32_t v;
  std::memcpy(&v, p, sizeof v);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap32(v);
#endif
  return v;
}

inline std::uint64_t round(std::uint64_t acc, std::uint64_t input) noexcept {
  acc += input * kP2;
  acc = rotl64(acc, 31);
  return acc * kP1;
}

inline std::uint64_t merge_round(std::uint64_t acc, std::uint64_t val) noexcept {
  acc ^= round(0, val);
  return acc * kP1 + kP4;
}

}  // namespace

std::uint64_t xxh64(const void* data, std::size_t n, std::uint64_t seed) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* const end = p + n;
  std::uint64_t h;

  if (n >= 32) {
    // Four independent lanes: the loop body has no cross-lane dependency, so it runs at several
    // GB/s (the checksum is on the hot path of every chunk written and read).
    std::uint64_t v1 = seed + kP1 + kP2;
    std::uint64_t v2 = seed + kP2;
    std::uint64_t v3 = seed;
    std::uint64_t v4 = seed - kP1;
    const unsigned char* const limit = end - 32;
    do {
      v1 = round(v1, read64(p));
      v2 = round(v2, read64(p + 8));
      v3 = round(v3, read64(p + 16));
      v4 = round(v4, read64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
    h = merge_round(h, v1);
    h = merge_round(h, v2);
    h = merge_round(h, v3);
    h = merge_round(h, v4);
  } else {
    h = seed + kP5;
  }

  h += static_cast<std::uint64_t>(n);

  while (end - p >= 8) {
    h ^= round(0, read64(p));
    h = rotl64(h, 27) * kP1 + kP4;
    p += 8;
  }
  if (end - p >= 4) {
    h ^= static_cast<std::uint64_t>(read32(p)) * kP1;
    h = rotl64(h, 23) * kP2 + kP3;
    p += 4;
  }
  while (p < end) {
    h ^= static_cast<std::uint64_t>(*p) * kP5;
    h = rotl64(h, 11) * kP1;
    ++p;
  }

  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

}  // namespace pyckpt

// --- block digests (replica check) ----------------------------------------------------------

namespace pyckpt {

namespace {

// XXH64 of the little-endian array of `digests`, seeded with `seed`.
std::uint64_t combine(std::vector<std::uint64_t> digests, std::uint64_t seed) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  for (auto& d : digests) d = __builtin_bswap64(d);
#endif
  return xxh64(digests.data(), digests.size() * sizeof(std::uint64_t), seed);
}

std::uint64_t splitmix64(std::uint64_t& state) noexcept {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// floor(j * a / b) without overflow for j <= b < 2^32: a = q * b + r, j * r < b^2.
std::uint64_t floor_scaled(std::uint64_t j, std::uint64_t a, std::uint64_t b) noexcept {
  return j * (a / b) + j * (a % b) / b;
}

std::uint64_t block_count(std::uint64_t n, std::size_t block) noexcept {
  return n == 0 ? 1 : (n - 1) / block + 1;
}

// XXH64 (seed 0) of block `b` of span `s`.
std::uint64_t hash_block(const ByteSpan& s, std::uint64_t b, std::size_t block) noexcept {
  const std::uint64_t start = b * block;
  const std::size_t len = static_cast<std::size_t>(std::min<std::uint64_t>(block, s.size - start));
  return xxh64(static_cast<const unsigned char*>(s.data) + start, len, 0);
}

// Runs work(0) ... work(units - 1) on up to `threads` threads, each pulling the next unit.
template <typename Work>
void parallel_units(std::size_t units, std::size_t threads, const Work& work) {
  const std::size_t workers = std::min(std::max<std::size_t>(threads, 1), units);
  if (workers <= 1) {
    for (std::size_t u = 0; u < units; ++u) work(u);
    return;
  }
  std::atomic<std::size_t> next{0};
  ThreadPool pool(workers);
  run_all(pool, workers, [&](std::size_t) {
    for (std::size_t u = next.fetch_add(1); u < units; u = next.fetch_add(1)) work(u);
  });
}

void check_block(std::size_t block) {
  if (block == 0) throw std::invalid_argument("block digests: block size must be positive");
}

void check_count(std::size_t count) {
  if (count < 3 || count > (std::size_t{1} << 30)) {
    throw std::invalid_argument("sampled digests: count must be in [3, 2^30]");
  }
}

}  // namespace

std::vector<std::uint64_t> block_digests(const std::vector<ByteSpan>& spans,
                                         const std::vector<std::uint64_t>& seeds, std::size_t block,
                                         std::size_t threads) {
  check_block(block);
  if (seeds.size() != spans.size()) {
    throw std::invalid_argument("block digests: one seed per span is needed");
  }
  std::vector<std::vector<std::uint64_t>> blocks(spans.size());
  std::vector<std::pair<std::size_t, std::uint64_t>> units;  // (span, block)
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const std::uint64_t m = block_count(spans[i].size, block);
    blocks[i].resize(static_cast<std::size_t>(m));
    for (std::uint64_t b = 0; b < m; ++b) units.emplace_back(i, b);
  }
  parallel_units(units.size(), threads, [&](std::size_t u) {
    const auto [i, b] = units[u];
    blocks[i][static_cast<std::size_t>(b)] = hash_block(spans[i], b, block);
  });
  std::vector<std::uint64_t> out(spans.size());
  for (std::size_t i = 0; i < spans.size(); ++i) out[i] = combine(std::move(blocks[i]), seeds[i]);
  return out;
}

std::vector<std::uint64_t> sampled_blocks(std::uint64_t n, std::size_t block, std::size_t count,
                                          std::uint64_t first, std::uint64_t last) {
  check_block(block);
  check_count(count);
  const std::uint64_t m = block_count(n, block);
  std::vector<std::uint64_t> out;
  if (m <= count) {
    out.resize(static_cast<std::size_t>(m));
    for (std::uint64_t b = 0; b < m; ++b) out[static_cast<std::size_t>(b)] = b;
    return out;
  }
  std::uint64_t state = combine({first, last}, n);
  const std::uint64_t inner = m - 2, strata = count - 2;  // inner > strata: no stratum is empty
  out.reserve(count);
  out.push_back(0);
  for (std::uint64_t j = 0; j < strata; ++j) {
    // Stratum j: blocks [1 + floor(j * inner / strata), 1 + floor((j + 1) * inner / strata)).
    const std::uint64_t lo = 1 + floor_scaled(j, inner, strata);
    const std::uint64_t hi = 1 + floor_scaled(j + 1, inner, strata);
    out.push_back(lo + splitmix64(state) % (hi - lo));
  }
  out.push_back(m - 1);
  return out;
}

std::vector<std::uint64_t> sampled_digests(const std::vector<ByteSpan>& spans, std::size_t block,
                                           std::size_t count, std::size_t threads) {
  check_block(block);
  check_count(count);
  std::vector<std::uint64_t> out(spans.size());
  parallel_units(spans.size(), threads, [&](std::size_t i) {
    const ByteSpan& s = spans[i];
    const std::uint64_t m = block_count(s.size, block);
    const std::uint64_t first = hash_block(s, 0, block);
    const std::uint64_t last = m > 1 ? hash_block(s, m - 1, block) : first;
    const std::vector<std::uint64_t> chosen = sampled_blocks(s.size, block, count, first, last);
    std::vector<std::uint64_t> digests(chosen.size());
    for (std::size_t k = 0; k < chosen.size(); ++k) {
      const std::uint64_t b = chosen[k];
      digests[k] = b == 0 ? first : b == m - 1 ? last : hash_block(s, b, block);
    }
    out[i] = combine(std::move(digests), s.size);
  });
  return out;
}

}  // namespace pyckpt
