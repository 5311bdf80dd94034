#pragma once
/**
 * @file stager.hpp
 * @brief Device <-> host staging through page-locked pool blocks on a side stream.
 *
 * Save direction (device -> host):
 *  - A Stager owns one non-blocking side stream per device, created once.
 *  - Every transfer starts with a *fence*: an event recorded on the caller's current stream that
 *    the side stream waits for (`cudaStreamWaitEvent`), so the copies see every kernel the caller
 *    queued before, and nothing else waits: never a device-wide sync.
 *  - D2HStream cuts a list of device ranges into pool blocks (packing small items, splitting
 *    items larger than a block), issues one `cudaMemcpyAsync` per piece and records one event per
 *    block. A consumer (compression, writing) waits on block k's event while block k+1 is still
 *    being copied; the block returns to the pool only when the consumer drops it, so pinned
 *    memory is bounded by the pool and a block is never refilled before it was consumed.
 *  - Stager::copy_into() copies many ranges into one caller-held region (async checkpointing).
 *
 * Load direction (host -> device): the caller fills a block from acquire_upload_block(), hands it
 * to upload(), which queues the copies and keeps the block until their event completed; the
 * block is then recycled by a later acquire_upload_block(). finish_uploads() orders the caller's
 * stream after every upload (again by event, without a host sync).
 *
 * Thread-safety: Stager methods may be called from several threads; a D2HStream, StagedBlock or
 * StagerEvent is used by one thread at a time (they may move between threads).
 */
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/buffer_pool.hpp"
#include "core/cuda_runtime.hpp"

namespace pyckpt {

/**
 * @brief Page-locked 4 KiB-aligned host memory: allocate_host + cudaHostRegister.
 * @note Blocks are unregistered before they are freed; the runtime is kept alive by a shared_ptr.
 */
class PinnedHostAllocator final : public HostAllocator {
 public:
  /**
   * @param runtime an available CUDA runtime.
   * @throws CudaError if the runtime is unavailable.
   */
  explicit PinnedHostAllocator(std::shared_ptr<const CudaRuntime> runtime);
  /** @throws std::bad_alloc, CudaError (registration failed; nothing leaks). */
  void* allocate(std::size_t bytes) override;
  void deallocate(void* ptr, std::size_t bytes) noexcept override;
  bool pinned() const noexcept override { return true; }

 private:
  std::shared_ptr<const CudaRuntime> _rt;
};

/** @brief One device range to stage: a tensor's bytes (or a slice of them). */
struct StageItem {
  std::string name;           ///< used in error messages (the tensor's FQN)
  std::uintptr_t device_ptr;  ///< SAFETY: must stay allocated until its block's event completed
  std::size_t nbytes;         ///< length in bytes (0 allowed)
};

/** @brief Where a piece of an item landed in a block. */
struct StagePiece {
  std::size_t item;          ///< index in the list given to Stager::stream_to_host
  std::size_t item_offset;   ///< first byte of the item this piece holds
  std::size_t block_offset;  ///< its position in the block
  std::size_t nbytes;        ///< its length
};

/** @brief One copy between a host region (by offset) and device memory. */
struct CopySpec {
  std::size_t host_offset;    ///< offset in the host block/region
  std::uintptr_t device_ptr;  ///< device address
  std::size_t nbytes;         ///< length
  std::string name;           ///< used in error messages
};

/** @brief Counters of a Stager (monotonic). */
struct StagerStats {
  std::size_t d2h_copies;       ///< cudaMemcpyAsync device->host issued
  std::size_t d2h_bytes;        ///< bytes copied device->host
  std::size_t h2d_copies;       ///< cudaMemcpyAsync host->device issued
  std::size_t h2d_bytes;        ///< bytes copied host->device
  std::size_t fences;           ///< caller-stream fences (event record + stream wait)
  std::size_t events_created;   ///< events ever created (they are recycled)
  std::size_t uploads_pending;  ///< upload blocks whose copies were not yet seen complete
};

class Stager;

/**
 * @brief Completion of work queued on a Stager's side stream. Move-only; the event is recycled
 *        by the stager when this object dies.
 */
class StagerEvent {
 public:
  StagerEvent() = default;
  StagerEvent(StagerEvent&& other) noexcept;
  StagerEvent& operator=(StagerEvent&& other) noexcept;
  StagerEvent(const StagerEvent&) = delete;
  StagerEvent& operator=(const StagerEvent&) = delete;
  ~StagerEvent();

  /** @brief Blocks until the work completed. @throws CudaError naming what was copied. */
  void wait() const;
  /** @return true when the work completed. @throws CudaError naming what was copied. */
  bool ready() const;
  /** @return true when this object holds an event. */
  explicit operator bool() const noexcept { return _event != nullptr; }

 private:
  friend class Stager;
  StagerEvent(std::shared_ptr<Stager> stager, cuda::Event event, std::string context) noexcept
      : _stager(std::move(stager)), _event(event), _context(std::move(context)) {}
  void reset() noexcept;
  std::shared_ptr<Stager> _stager;
  cuda::Event _event = nullptr;
  std::string _context;
};

/**
 * @brief A pool block filled (or being filled) by device->host copies, with its completion event.
 * @note Read data() only after wait(). Dropping the block (or reset()) returns it to the pool; if
 *       its copies might still be running, the destructor waits for them first.
 */
class StagedBlock {
 public:
  StagedBlock() = default;
  StagedBlock(StagedBlock&&) noexcept = default;
  StagedBlock& operator=(StagedBlock&&) noexcept;
  StagedBlock(const StagedBlock&) = delete;
  StagedBlock& operator=(const StagedBlock&) = delete;
  ~StagedBlock();

  /** @brief Blocks until every copy into this block completed. @throws CudaError. */
  void wait();
  /** @return true when every copy completed. @throws CudaError. */
  bool ready() const;
  /** @return the block's memory (block_bytes long, kBlockAlign-aligned). */
  std::byte* data() const noexcept { return _lease.data(); }
  /** @return the pool's block size. */
  std::size_t capacity() const noexcept { return _lease.size(); }
  /** @return bytes of the block in use (end of the last piece). */
  std::size_t used() const noexcept { return _used; }
  /** @return where each item's piece lies. */
  const std::vector<StagePiece>& pieces() const noexcept { return _pieces; }
  /** @return true when this object holds a block. */
  explicit operator bool() const noexcept { return static_cast<bool>(_lease); }
  /** @brief Waits for pending copies (ignoring errors) and returns the block to the pool. */
  void reset() noexcept;

 private:
  friend class D2HStream;
  Lease _lease;
  StagerEvent _event;
  std::vector<StagePiece> _pieces;
  std::size_t _used = 0;
  bool _waited = false;
};

/**
 * @brief An ordered device->host transfer of several items through pool blocks.
 * @note Items smaller than a block are never split across blocks; larger ones start at a block
 *       boundary and fill whole blocks, so every piece of a large item is block-aligned.
 *       Piece starts are aligned to kPieceAlign bytes.
 */
class D2HStream {
 public:
  /** @brief Alignment of each piece inside a block. */
  static constexpr std::size_t kPieceAlign = 256;

  D2HStream(D2HStream&&) noexcept = default;
  D2HStream& operator=(D2HStream&&) noexcept = default;
  D2HStream(const D2HStream&) = delete;
  D2HStream& operator=(const D2HStream&) = delete;

  /**
   * @brief Leases the next block (blocking while the pool is exhausted), queues the copies of the
   *        pieces it will hold on the side stream and records its event; returns at once.
   * @return the block, or an empty StagedBlock when every item was issued.
   * @throws CudaError naming the item whose copy could not be queued.
   */
  StagedBlock next();
  /** @return true once every item was issued. */
  bool done() const noexcept { return _item >= _items.size(); }
  /** @return the items, in order. */
  const std::vector<StageItem>& items() const noexcept { return _items; }
  /** @return the pool the blocks come from. */
  const std::shared_ptr<BufferPool>& pool() const noexcept;

 private:
  friend class Stager;
  D2HStream(std::shared_ptr<Stager> stager, std::vector<StageItem> items)
      : _stager(std::move(stager)), _items(std::move(items)) {}
  std::shared_ptr<Stager> _stager;
  std::vector<StageItem> _items;
  std::size_t _item = 0;
  std::size_t _offset = 0;
};

/**
 * @brief Owns a side stream on one device, recycled events and the block pool staging uses.
 *        Create with Stager::create (it must be owned by a shared_ptr).
 */
class Stager : public std::enable_shared_from_this<Stager> {
 public:
  /**
   * @brief Creates the side stream (non-blocking) on `device`.
   * @param runtime an available runtime.
   * @param pool block pool (pinned for real asynchronous copies).
   * @param device the device whose memory is staged.
   * @throws CudaError if the runtime is unavailable or the stream cannot be created;
   *         std::invalid_argument on a null pool or negative device.
   */
  static std::shared_ptr<Stager> create(std::shared_ptr<const CudaRuntime> runtime,
                                        std::shared_ptr<BufferPool> pool, int device);
  /** @brief Waits for the side stream (ignoring errors), then destroys it and every event. */
  ~Stager();
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;

  /**
   * @brief Starts a device->host transfer of `items`, ordered after `caller_stream`.
   * @param items device ranges; SAFETY: each must stay allocated and unmodified by the caller's
   *        later work until the block holding it was waited on.
   * @param caller_stream the caller's current stream (`cudaStream_t` as an integer; 0 = legacy).
   * @throws CudaError when the fence cannot be queued.
   */
  D2HStream stream_to_host(std::vector<StageItem> items, std::uintptr_t caller_stream);

  /**
   * @brief Copies device ranges into one caller-held block (e.g. a region for async save),
   *        ordered after `caller_stream`; returns the event marking their completion.
   * @param region destination block; must outlive the returned event's wait().
   * @throws std::invalid_argument when a spec falls outside the region; CudaError naming the
   *         item (pending copies are drained before the exception leaves).
   */
  StagerEvent copy_into(const Lease& region, const std::vector<CopySpec>& specs,
                        std::uintptr_t caller_stream);

  /**
   * @brief A block for the host side of a load to fill. Recycles blocks whose uploads completed;
   *        when the pool is exhausted, waits for the oldest pending upload.
   * @throws CudaError when waiting on a pending upload fails.
   */
  Lease acquire_upload_block();

  /**
   * @brief Queues host->device copies from `block` and keeps the block until they completed.
   * @param block filled block (taken over).
   * @param specs host_offset in the block -> device_ptr.
   * @throws std::invalid_argument (block empty or spec outside it); CudaError naming the item.
   */
  void upload(Lease block, const std::vector<CopySpec>& specs);

  /**
   * @brief Orders the side stream after the work queued so far on `caller_stream` (a fence);
   *        call it before the first upload() into memory the caller's stream may still use.
   * @throws CudaError.
   */
  void order_after(std::uintptr_t caller_stream);

  /**
   * @brief Orders `caller_stream` after every upload queued so far (event + stream wait).
   * @throws CudaError.
   */
  void finish_uploads(std::uintptr_t caller_stream);

  /**
   * @brief Blocks until the side stream is idle and recycles every upload block.
   * @throws CudaError.
   */
  void synchronize();

  /** @return the side stream (`cudaStream_t` as an integer). */
  std::uintptr_t side_stream() const noexcept { return reinterpret_cast<std::uintptr_t>(_stream); }
  /** @return the device. */
  int device() const noexcept { return _device; }
  /** @return the block pool. */
  const std::shared_ptr<BufferPool>& pool() const noexcept { return _pool; }
  /** @return the runtime. */
  const std::shared_ptr<const CudaRuntime>& runtime() const noexcept { return _rt; }
  /** @return counters. */
  StagerStats stats() const;

 private:
  friend class StagerEvent;
  friend class StagedBlock;
  friend class D2HStream;
  Stager(std::shared_ptr<const CudaRuntime> runtime, std::shared_ptr<BufferPool> pool, int device);
  cuda::Event take_event();
  void give_event(cuda::Event e) noexcept;
  void fence(std::uintptr_t caller_stream);
  StagerEvent record(std::string context);
  void drain_noexcept() noexcept;
  void copy_d2h(void* dst, const StageItem& item, std::size_t offset, std::size_t n);
  void reclaim_completed_uploads();

  std::shared_ptr<const CudaRuntime> _rt;
  std::shared_ptr<BufferPool> _pool;
  int _device;
  cuda::Stream _stream = nullptr;

  mutable std::mutex _mu;  // guards the members below
  std::vector<cuda::Event> _free_events;
  std::vector<cuda::Event> _all_events;
  // Raw events here (not StagerEvent): a StagerEvent owns the stager, which would form a cycle.
  struct PendingUpload {
    Lease block;
    cuda::Event done;
    std::string name;
  };
  std::deque<PendingUpload> _uploads;
  StagerStats _stats{};
};

}  // namespace pyckpt
