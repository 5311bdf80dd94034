// Unit tests of the replica-check digests built on XXH64: block digests, the sampled blocks and
// the sampled digests (parallel results equal serial ones; the sample's documented structure).
#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "check.hpp"
#include "core/checksum.hpp"

using namespace pyckpt;

namespace {

constexpr std::size_t kBlock = 16 << 10;
constexpr std::size_t kCount = 64;

std::vector<std::uint8_t> bytes(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint8_t> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::uint8_t>(x >> 24);
  }
  return v;
}

// The definition, serially: XXH64 (seed) of the little-endian XXH64s of the block pieces.
std::uint64_t reference(const std::uint8_t* p, std::size_t n, std::size_t block,
                        std::uint64_t seed) {
  std::vector<std::uint64_t> d;
  std::size_t pos = 0;
  do {
    const std::size_t len = std::min(block, n - pos);
    d.push_back(xxh64(p + pos, len, 0));
    pos += len;
  } while (pos < n);
  return xxh64(d.data(), d.size() * 8, seed);  // little-endian host
}

}  // namespace

TEST(block_digests_match_the_definition_on_any_thread_count) {
  const auto a = bytes(10 * kBlock + 7, 1), b = bytes(3, 2);
  const std::vector<ByteSpan> spans = {{a.data(), a.size()}, {b.data(), b.size()}, {a.data(), 0}};
  const std::vector<std::uint64_t> seeds = {a.size(), b.size(), 0};
  const auto one = block_digests(spans, seeds, kBlock, 1);
  CHECK(one.size() == 3);
  CHECK(one[0] == reference(a.data(), a.size(), kBlock, a.size()));
  CHECK(one[1] == reference(b.data(), b.size(), kBlock, b.size()));
  CHECK(one[2] == reference(a.data(), 0, kBlock, 0));
  for (std::size_t threads : {2, 3, 8, 64})
    CHECK(block_digests(spans, seeds, kBlock, threads) == one);
  CHECK_THROWS(block_digests(spans, {1}, kBlock, 1), std::invalid_argument, "one seed per span");
  CHECK_THROWS(block_digests(spans, seeds, 0, 1), std::invalid_argument, "block size");
}

TEST(sampled_blocks_are_the_ends_and_one_per_stratum) {
  CHECK(sampled_blocks(0, kBlock, kCount, 1, 2) == std::vector<std::uint64_t>{0});
  CHECK(sampled_blocks(kBlock * kCount, kBlock, kCount, 1, 2).size() == kCount);
  for (std::uint64_t n : {std::uint64_t{kBlock * kCount + 1}, std::uint64_t{(100 << 20) + 3},
                          std::uint64_t{1} << 62}) {
    const auto s = sampled_blocks(n, kBlock, kCount, 1, 2);
    const std::uint64_t m = (n - 1) / kBlock + 1;
    CHECK(s.size() == kCount);
    CHECK(s.front() == 0 && s.back() == m - 1);
    for (std::uint64_t j = 0; j + 2 < kCount; ++j) {  // j * (m - 2) < 2^54 here
      const std::uint64_t lo = 1 + j * (m - 2) / (kCount - 2);
      const std::uint64_t hi = 1 + (j + 1) * (m - 2) / (kCount - 2);
      CHECK(lo <= s[j + 1] && s[j + 1] < hi);
    }
  }
  const auto s = sampled_blocks(64 << 20, kBlock, kCount, 1, 2);
  CHECK(s == sampled_blocks(64 << 20, kBlock, kCount, 1, 2));
  CHECK(s != sampled_blocks(64 << 20, kBlock, kCount, 1, 3));
  CHECK_THROWS(sampled_blocks(1, kBlock, 2, 1, 2), std::invalid_argument, "count");
}

TEST(sampled_digest_is_the_block_digest_of_the_sample) {
  auto a = bytes(200 * kBlock + 11, 3);
  const std::vector<ByteSpan> spans = {{a.data(), a.size()}, {a.data(), 5 * kBlock}};
  const auto one = sampled_digests(spans, kBlock, kCount, 1);
  CHECK(sampled_digests(spans, kBlock, kCount, 4) == one);
  // Small: every block.
  CHECK(one[1] == reference(a.data(), 5 * kBlock, kBlock, 5 * kBlock));
  // Large: the chosen blocks, gathered in order.
  const std::uint64_t m = (a.size() - 1) / kBlock + 1;
  const auto chosen = sampled_blocks(a.size(), kBlock, kCount, xxh64(a.data(), kBlock, 0),
                                     xxh64(a.data() + (m - 1) * kBlock, 11, 0));
  std::vector<std::uint8_t> gathered;
  for (auto b : chosen) {
    const std::size_t start = b * kBlock, len = std::min<std::size_t>(kBlock, a.size() - start);
    gathered.insert(gathered.end(), a.begin() + start, a.begin() + start + len);
  }
  CHECK(one[0] == reference(gathered.data(), gathered.size(), kBlock, a.size()));
  // A byte in a sampled middle block changes the digest; one in an unsampled block does not.
  std::uint64_t outside = 1;
  while (std::find(chosen.begin(), chosen.end(), outside) != chosen.end()) ++outside;
  a[chosen[5] * kBlock + 9] ^= 1;
  CHECK(sampled_digests(spans, kBlock, kCount, 2)[0] != one[0]);
  a[chosen[5] * kBlock + 9] ^= 1;
  a[outside * kBlock + 9] ^= 1;
  CHECK(sampled_digests(spans, kBlock, kCount, 2)[0] == one[0]);
}

PYCKPT_TEST_MAIN
