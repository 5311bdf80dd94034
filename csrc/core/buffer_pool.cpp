#include "core/buffer_pool.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <new>
#include <stdexcept>

namespace pyckpt {

void* allocate_host(std::size_t bytes) {
  if (bytes >= kMapThreshold) {
    // Page-aligned (kBlockAlign divides the page size); munmap in free_host gives it back.
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    return p;
  }
  void* p = nullptr;
  if (posix_memalign(&p, kBlockAlign, bytes) != 0 || p == nullptr) throw std::bad_alloc();
  return p;
}

void free_host(void* ptr, std::size_t bytes) noexcept {
  if (ptr == nullptr) return;
  if (bytes >= kMapThreshold) {
    ::munmap(ptr, bytes);
  } else {
    std::free(ptr);
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

}  // namespace pyckpt
