// Unit tests of the process-wide host cache (buffer_pool.hpp: allocate_host, take_host,
// free_host) and of the per-thread scratch built on it (core/detail/scratch.hpp): memory a pool or
// a thread gives up is handed to the next one that needs as much, the cache stays within its
// bound, and a small need does not take a large block.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <thread>
#include <vector>

#include "check.hpp"
#include "core/buffer_pool.hpp"
#include "core/detail/scratch.hpp"

using namespace pyckpt;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
}  // namespace

TEST(a_freed_block_serves_the_next_allocation_of_its_size) {
  host_cache_clear();
  void* a = allocate_host(4 * MiB);
  static_cast<std::uint8_t*>(a)[4 * MiB - 1] = 7;  // usable to its end
  free_host(a, 4 * MiB);
  CHECK(host_cache_bytes() == 4 * MiB);
  void* other = allocate_host(3 * MiB);  // allocate_host wants its exact size
  CHECK(other != a);
  void* b = allocate_host(4 * MiB);
  CHECK(b == a);
  CHECK(host_cache_bytes() == 0);
  free_host(other, 3 * MiB);
  free_host(b, 4 * MiB);
  CHECK(host_cache_bytes() == 7 * MiB);
  host_cache_clear();
  CHECK(host_cache_bytes() == 0);
  // Small blocks are malloc's: never cached.
  free_host(allocate_host(64 << 10), 64 << 10);
  CHECK(host_cache_bytes() == 0);
}

TEST(take_host_picks_the_smallest_cached_block_in_its_range) {
  host_cache_clear();
  const HostBlock big = take_host(8 * MiB, 8 * MiB);
  const HostBlock mid = take_host(2 * MiB, 2 * MiB);
  const HostBlock three = take_host(3 * MiB, 3 * MiB);
  free_host(big.data, big.bytes);
  free_host(three.data, three.bytes);
  free_host(mid.data, mid.bytes);
  const HostBlock t = take_host(2 * MiB, 6 * MiB);
  CHECK(t.data == mid.data && t.bytes == 2 * MiB);  // best fit, not the first or the newest
  const HostBlock u = take_host(2 * MiB, 6 * MiB);
  CHECK(u.data == three.data && u.bytes == 3 * MiB);
  const HostBlock v = take_host(2 * MiB, 6 * MiB);  // only 8 MiB left: out of range, a new one
  CHECK(v.data != big.data && v.bytes == 2 * MiB);
  CHECK(host_cache_bytes() == 8 * MiB);
  for (const HostBlock& b : {t, u, v}) free_host(b.data, b.bytes);
  host_cache_clear();
}

TEST(the_cache_keeps_at_most_its_bound_and_unmaps_the_oldest_first) {
  host_cache_clear();
  const std::size_t n = kHostCacheBytes / (16 * MiB);
  std::vector<void*> blocks;
  for (std::size_t i = 0; i < n + 2; ++i) blocks.push_back(allocate_host(16 * MiB));
  for (void* b : blocks) free_host(b, 16 * MiB);
  CHECK(host_cache_bytes() == n * 16 * MiB);
  void* again = allocate_host(16 * MiB);  // the two oldest were unmapped to make room
  CHECK(again == blocks[2]);
  free_host(again, 16 * MiB);
  host_cache_clear();
  // A block larger than the whole cache is unmapped at once.
  free_host(allocate_host(kHostCacheBytes + 4096), kHostCacheBytes + 4096);
  CHECK(host_cache_bytes() == 0);
}

TEST(a_lower_limit_unmaps_the_oldest_blocks_and_zero_caches_nothing) {
  host_cache_clear();
  CHECK(host_cache_limit() == kHostCacheBytes);
  void* a = allocate_host(4 * MiB);
  void* b = allocate_host(4 * MiB);
  free_host(a, 4 * MiB);
  free_host(b, 4 * MiB);
  set_host_cache_limit(5 * MiB);  // the older block goes
  CHECK(host_cache_bytes() == 4 * MiB);
  CHECK(allocate_host(4 * MiB) == b);
  free_host(b, 4 * MiB);
  free_host(allocate_host(8 * MiB), 8 * MiB);  // larger than the limit: unmapped at once
  CHECK(host_cache_bytes() == 4 * MiB);
  set_host_cache_limit(0);
  CHECK(host_cache_bytes() == 0);
  free_host(allocate_host(2 * MiB), 2 * MiB);
  CHECK(host_cache_bytes() == 0);
  set_host_cache_limit(kHostCacheBytes);
}

TEST(a_new_pool_reuses_the_blocks_of_a_destroyed_one) {
  host_cache_clear();
  std::byte* first = nullptr;
  {
    auto pool = BufferPool::create(8 * MiB, 2);
    Lease l = pool->acquire();
    first = l.data();
  }
  CHECK(host_cache_bytes() == 8 * MiB);
  auto pool = BufferPool::create(8 * MiB, 2);
  Lease l = pool->acquire();
  CHECK(l.data() == first);
  CHECK(host_cache_bytes() == 0);
  l.reset();
  pool.reset();
  host_cache_clear();
}

TEST(a_thread_that_ends_leaves_its_scratch_to_the_next_thread) {
  host_cache_clear();
  std::uint8_t* first = nullptr;
  std::thread([&] {
    thread_local detail::Scratch s;
    first = s.get(5 * MiB - 3);  // rounded to 5 MiB
    first[0] = 1;
  }).join();
  CHECK(host_cache_bytes() == 5 * MiB);
  std::uint8_t* second = nullptr;
  std::thread([&] {
    thread_local detail::Scratch s;
    second = s.get(4 * MiB);  // a cached block up to ~4x the need will do
    CHECK(s.capacity() == 5 * MiB);
    s.trim(8 * MiB);  // within the keep limit: held
    CHECK(s.capacity() == 5 * MiB);
    s.trim(MiB);  // above it: given up
    CHECK(s.capacity() == 0);
  }).join();
  CHECK(second == first);
  CHECK(host_cache_bytes() == 5 * MiB);
  // Small scratch rounds to 64 KiB; a zero-byte request still gets a usable buffer.
  detail::Scratch small;
  CHECK(small.get(0) != nullptr && small.capacity() == (64u << 10));
  CHECK(small.get(70 << 10) != nullptr && small.capacity() == (128u << 10));
  host_cache_clear();
}

TEST(a_forked_child_starts_a_cache_of_its_own) {
  host_cache_clear();
  free_host(allocate_host(2 * MiB), 2 * MiB);
  CHECK(host_cache_bytes() == 2 * MiB);
  const pid_t pid = fork();
  if (pid == 0) {
    // Whatever state the parent's cache was in, the child's is empty and usable.
    const bool empty = host_cache_bytes() == 0;
    void* p = allocate_host(2 * MiB);
    free_host(p, 2 * MiB);
    const bool cached = host_cache_bytes() == 2 * MiB && allocate_host(2 * MiB) == p;
    _exit(empty && cached ? 0 : 1);
  }
  int status = 0;
  CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(host_cache_bytes() == 2 * MiB);  // the parent's is untouched
  host_cache_clear();
}

PYCKPT_TEST_MAIN
