#include "core/buffer_pool.hpp"

#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>
#include <stdexcept>

namespace pyckpt {

namespace {

// Freed mappings kept for reuse, oldest first. Never destroyed: pools and thread-local scratch
// may give memory back after static destructors ran (the blocks stay reachable through it, so
// leak checkers do not report them).
struct HostCache {
  std::mutex mu;
  std::vector<HostBlock> blocks;
  std::size_t bytes = 0;
};

HostCache* g_cache = nullptr;
std::atomic<std::size_t> g_limit{kHostCacheBytes};
HostCache* g_before_fork = nullptr;  // keeps a forked child's inherited blocks reachable

// In a forked child only the forking thread exists, and another thread may have been inside the
// cache at the fork (mutex held, list half updated): the child starts a cache of its own and
// leaves the inherited one alone.
void start_child_cache() noexcept {
  g_before_fork = g_cache;
  g_cache = new (std::nothrow) HostCache;
}

// The cache, or null when none could be made (then memory is mapped and unmapped directly).
HostCache* host_cache() noexcept {
  static const bool once = [] {
    g_cache = new (std::nothrow) HostCache;
    pthread_atfork(nullptr, nullptr, start_child_cache);
    return true;
  }();
  (void)once;
  return g_cache;
}

// Unmaps the oldest cached blocks until at most `target` bytes stay; `c.mu` must be held (rare:
// the cache is full, its bound was lowered, or it is cleared).
void evict_locked(HostCache& c, std::size_t target) noexcept {
  std::size_t drop = 0;
  for (; drop < c.blocks.size() && c.bytes > target; ++drop) {
    ::munmap(c.blocks[drop].data, c.blocks[drop].bytes);
    c.bytes -= c.blocks[drop].bytes;
  }
  c.blocks.erase(c.blocks.begin(), c.blocks.begin() + static_cast<std::ptrdiff_t>(drop));
}

void* map_host(std::size_t bytes) {
  // Page-aligned (kBlockAlign divides the page size).
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
  return p;
}

}  // namespace

HostBlock take_host(std::size_t lo, std::size_t hi) {
  lo = std::max<std::size_t>(lo, 1);
  if (lo < kMapThreshold) {
    void* p = nullptr;
    if (posix_memalign(&p, kBlockAlign, lo) != 0 || p == nullptr) throw std::bad_alloc();
    return HostBlock{p, lo};
  }
  if (HostCache* cache = host_cache()) {
    HostCache& c = *cache;
    std::lock_guard<std::mutex> lock(c.mu);
    auto best = c.blocks.end();
    for (auto it = c.blocks.begin(); it != c.blocks.end(); ++it) {
      if (it->bytes >= lo && it->bytes <= hi &&
          (best == c.blocks.end() || it->bytes < best->bytes)) {
        best = it;
      }
    }
    if (best != c.blocks.end()) {
      const HostBlock b = *best;
      c.blocks.erase(best);
      c.bytes -= b.bytes;
      return b;
    }
  }
  return HostBlock{map_host(lo), lo};
}

void* allocate_host(std::size_t bytes) { return take_host(bytes, bytes).data; }

void free_host(void* ptr, std::size_t bytes) noexcept {
  if (ptr == nullptr) return;
  if (bytes < kMapThreshold) {
    std::free(ptr);
    return;
  }
  HostCache* cache = host_cache();
  const std::size_t limit = g_limit.load(std::memory_order_relaxed);
  if (bytes > limit || cache == nullptr) {
    ::munmap(ptr, bytes);
    return;
  }
  HostCache& c = *cache;
  std::lock_guard<std::mutex> lock(c.mu);
  evict_locked(c, limit - bytes);
  try {
    c.blocks.push_back(HostBlock{ptr, bytes});
    c.bytes += bytes;
  } catch (...) {  // no memory for the bookkeeping: unmapped instead
    ::munmap(ptr, bytes);
  }
}

std::size_t host_cache_bytes() noexcept {
  HostCache* c = host_cache();
  if (c == nullptr) return 0;
  std::lock_guard<std::mutex> lock(c->mu);
  return c->bytes;
}

void host_cache_clear() noexcept {
  if (HostCache* c = host_cache()) {
    std::lock_guard<std::mutex> lock(c->mu);
    evict_locked(*c, 0);
  }
}

void* AlignedHostAllocator::allocate(std::size_t bytes) { return allocate_host(bytes); }

void AlignedHostAllocator::deallocate(void* ptr, std::size_t bytes) noexcept {
  free_host(ptr, bytes);
}

Lease::Lease(Lease&& other) noexcept
    : _pool(std::move(other._pool)), _data(other._data), _size(other._size) {
  other._data = nullptr;
  other._size = 0;
}

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    reset();
    _pool = std::move(other._pool);
    _data = other._data;
    _size = other._size;
    other._data = nullptr;
    other._size = 0;
  }
  return *this;
}

Lease::~Lease() { reset(); }

void Lease::reset() noexcept {
  if (_data != nullptr && _pool) _pool->release(_data);
  _data = nullptr;
  _size = 0;
  _pool.reset();
}

std::shared_ptr<BufferPool> BufferPool::create(std::size_t block_bytes, std::size_t max_blocks,
                                               std::shared_ptr<HostAllocator> allocator) {
  if (block_bytes == 0) throw std::invalid_argument("BufferPool: block_bytes must be > 0");
  if (max_blocks == 0) throw std::invalid_argument("BufferPool: max_blocks must be > 0");
  if (!allocator) allocator = std::make_shared<AlignedHostAllocator>();
  return std::shared_ptr<BufferPool>(
      new BufferPool(align_up(block_bytes, kBlockAlign), max_blocks, std::move(allocator)));
}

BufferPool::BufferPool(std::size_t block_bytes, std::size_t max_blocks,
                       std::shared_ptr<HostAllocator> allocator)
    : _block_bytes(block_bytes), _max_blocks(max_blocks), _allocator(std::move(allocator)) {}

BufferPool::~BufferPool() {
  for (std::byte* p : _all) _allocator->deallocate(p, _block_bytes);
}

Lease BufferPool::take_locked(std::unique_lock<std::mutex>&) {
  std::byte* p;
  if (!_free.empty()) {
    p = _free.back();
    _free.pop_back();
  } else {
    p = static_cast<std::byte*>(_allocator->allocate(_block_bytes));
    _all.push_back(p);
  }
  ++_in_use;
  ++_acquires;
  if (_in_use > _peak) _peak = _in_use;
  return Lease(shared_from_this(), p, _block_bytes);
}

Lease BufferPool::acquire() {
  std::unique_lock<std::mutex> lock(_mu);
  _cv.wait(lock, [this] { return !_free.empty() || _all.size() < _max_blocks; });
  return take_locked(lock);
}

Lease BufferPool::try_acquire() {
  std::unique_lock<std::mutex> lock(_mu);
  if (_free.empty() && _all.size() >= _max_blocks) return Lease();
  return take_locked(lock);
}

void BufferPool::release(std::byte* data) noexcept {
  {
    std::lock_guard<std::mutex> lock(_mu);
    _free.push_back(data);
    --_in_use;
  }
  _cv.notify_one();
}

PoolStats BufferPool::stats() const {
  std::lock_guard<std::mutex> lock(_mu);
  return PoolStats{_block_bytes, _max_blocks, _all.size(),         _in_use,
                   _peak,        _acquires,   _allocator->pinned()};
}

void set_host_cache_limit(std::size_t bytes) noexcept {
  g_limit.store(bytes, std::memory_order_relaxed);
  if (HostCache* c = host_cache()) {
    std::lock_guard<std::mutex> lock(c->mu);
    evict_locked(*c, bytes);
  }
}

std::size_t host_cache_limit() noexcept { return g_limit.load(std::memory_order_relaxed); }

}  // namespace pyckpt
