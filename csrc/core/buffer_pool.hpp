#pragma once
/**
 * @file buffer_pool.hpp
 * @brief A bounded pool of fixed-size, 4 KiB-aligned host blocks handed out as move-only leases.
 *
 * Blocks are allocated on first demand, kept on a LIFO free list when released (so the most
 * recently touched, hot block is reused first) and freed only when the pool is destroyed.
 * The allocator is a policy: plain aligned host memory, or page-locked memory registered with the
 * CUDA runtime (see cuda_runtime.hpp), so one pool can serve both as a DMA target and as an
 * O_DIRECT source.
 *
 * Thread-safety: acquire()/try_acquire() and lease destruction may happen on any thread.
 * @note The pool object must outlive every lease it handed out (leases hold a shared_ptr to it).
 */
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace pyckpt {

/** @brief Alignment of every block: one page, which also satisfies O_DIRECT. */
constexpr std::size_t kBlockAlign = 4096;

/** @brief Rounds `n` up to a multiple of `align` (a power of two). */
constexpr std::size_t align_up(std::size_t n, std::size_t align) noexcept {
  return (n + align - 1) & ~(align - 1);
}

/** @brief Blocks at least this large are mapped with mmap and unmapped when freed. */
constexpr std::size_t kMapThreshold = std::size_t{1} << 20;

/**
 * @brief Default bound on the idle host memory the process keeps (see allocate_host), 128 MiB:
 *        a writer's encode and O_DIRECT blocks with 8 threads, or the scratch of 16 threads.
 */
constexpr std::size_t kHostCacheBytes = std::size_t{128} << 20;

/**
 * @brief Allocates `bytes` of host memory aligned to kBlockAlign.
 * @note Blocks of kMapThreshold bytes or more are anonymous mappings. Freed, they go to a
 *       bounded process-wide cache (set_host_cache_limit(), default kHostCacheBytes; the
 *       oldest are unmapped to make room) from
 *       which later allocations of the same size are served. The core's pools and per-thread
 *       scratch live for one writer, reader or call, and fresh memory costs a page fault per
 *       4 KiB on first touch (slow on VMs: DESIGN.md); with the cache, a new writer per
 *       checkpoint starts on the pages the previous one faulted in. Through malloc instead, a
 *       freed multi-MiB block could stay in the heap of whichever thread arena it came from: a
 *       process that creates a writer (and so new worker threads) per checkpoint then grew by a
 *       block per arena until every arena held one. The cache bounds what stays.
 * @throws std::bad_alloc.
 */
void* allocate_host(std::size_t bytes);

/** @brief Frees memory from allocate_host() or take_host() (pass its size again); never throws. */
void free_host(void* ptr, std::size_t bytes) noexcept;

/** @brief Host memory from take_host(): `bytes` usable bytes at `data`. */
struct HostBlock {
  void* data = nullptr;
  std::size_t bytes = 0;
};

/**
 * @brief Like allocate_host(), but any cached block of `lo` to `hi` bytes will do (the smallest
 *        is taken); a new block has `lo` bytes. Free it with free_host(data, bytes).
 * @throws std::bad_alloc.
 */
HostBlock take_host(std::size_t lo, std::size_t hi);

/** @return the bytes the host cache holds now (for tests and diagnostics). */
std::size_t host_cache_bytes() noexcept;

/** @brief Unmaps every cached block. */
void host_cache_clear() noexcept;

/** @brief Sets the bound on cached bytes (0: cache nothing) and unmaps the oldest blocks until
 *         the cache is within it. */
void set_host_cache_limit(std::size_t bytes) noexcept;

/** @return the bound on cached bytes. */
std::size_t host_cache_limit() noexcept;

/** @brief Allocation policy for pool blocks. */
class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  /**
   * @brief Allocates `bytes` (a multiple of kBlockAlign) aligned to kBlockAlign.
   * @throws std::bad_alloc or CudaError.
   */
  virtual void* allocate(std::size_t bytes) = 0;
  /** @brief Frees memory from allocate(); must not throw. */
  virtual void deallocate(void* ptr, std::size_t bytes) noexcept = 0;
  /** @return true when the memory is page-locked (usable for async DMA). */
  virtual bool pinned() const noexcept { return false; }
};

/** @brief Plain 4 KiB-aligned host memory (allocate_host / free_host). */
class AlignedHostAllocator final : public HostAllocator {
 public:
  void* allocate(std::size_t bytes) override;
  void deallocate(void* ptr, std::size_t bytes) noexcept override;
};

class BufferPool;

/**
 * @brief Exclusive use of one pool block; returns it to the pool when destroyed. Move-only.
 */
class Lease {
 public:
  Lease() = default;
  Lease(Lease&& other) noexcept;
  Lease& operator=(Lease&& other) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease();

  /** @return the block's first byte (kBlockAlign-aligned), or nullptr for an empty lease. */
  std::byte* data() const noexcept { return _data; }
  /** @return the block size in bytes. */
  std::size_t size() const noexcept { return _size; }
  /** @return true when this lease holds a block. */
  explicit operator bool() const noexcept { return _data != nullptr; }
  /** @brief Returns the block to the pool now. */
  void reset() noexcept;

 private:
  friend class BufferPool;
  Lease(std::shared_ptr<BufferPool> pool, std::byte* data, std::size_t size) noexcept
      : _pool(std::move(pool)), _data(data), _size(size) {}
  std::shared_ptr<BufferPool> _pool;
  std::byte* _data = nullptr;
  std::size_t _size = 0;
};

/** @brief Counters describing a pool. */
struct PoolStats {
  std::size_t block_bytes;  ///< size of each block
  std::size_t max_blocks;   ///< bound on allocated blocks
  std::size_t allocated;    ///< blocks allocated so far (never shrinks until destruction)
  std::size_t in_use;       ///< blocks currently leased
  std::size_t peak_in_use;  ///< highest in_use seen
  std::size_t acquires;     ///< number of successful acquisitions
  bool pinned;              ///< allocator reports page-locked memory
};

/**
 * @brief Fixed-size block pool. Create with BufferPool::create (it must be owned by a shared_ptr).
 */
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  /**
   * @brief Creates a pool.
   * @param block_bytes block size; rounded up to kBlockAlign.
   * @param max_blocks upper bound on blocks ever allocated (>= 1).
   * @param allocator allocation policy (null -> AlignedHostAllocator).
   * @throws std::invalid_argument on a zero size or count.
   */
  static std::shared_ptr<BufferPool> create(std::size_t block_bytes, std::size_t max_blocks,
                                            std::shared_ptr<HostAllocator> allocator = nullptr);
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /** @brief Blocks until a block is free (or can be allocated) and leases it. */
  Lease acquire();
  /** @brief Leases a block if one is free or allocatable now, else returns an empty lease. */
  Lease try_acquire();
  /** @return block size in bytes. */
  std::size_t block_bytes() const noexcept { return _block_bytes; }
  /** @return current counters. */
  PoolStats stats() const;

 private:
  BufferPool(std::size_t block_bytes, std::size_t max_blocks,
             std::shared_ptr<HostAllocator> allocator);
  friend class Lease;
  void release(std::byte* data) noexcept;
  Lease take_locked(std::unique_lock<std::mutex>& lock);

  std::size_t _block_bytes;
  std::size_t _max_blocks;
  std::shared_ptr<HostAllocator> _allocator;
  mutable std::mutex _mu;
  std::condition_variable _cv;
  std::vector<std::byte*> _free;  // LIFO
  std::vector<std::byte*> _all;
  std::size_t _in_use = 0;
  std::size_t _peak = 0;
  std::size_t _acquires = 0;
};

}  // namespace pyckpt
