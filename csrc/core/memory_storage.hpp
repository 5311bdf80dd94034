#pragma once
/**
 * @file memory_storage.hpp
 * @brief In-memory backends of the storage seam (storage.hpp), for stores reached through a
 *        client library (object stores): chunks are handed over in blocks, and read back from
 *        buffers the client already downloaded.
 *
 * BlockSink gathers appended bytes into blocks and hands each full block to a callback that
 * owns it from then on (an uploader); MemorySource serves positional reads of an object from
 * ranges downloaded earlier, and lends them through view_at() so chunks are verified and
 * decoded in place.
 *
 * Thread-safety: as ChunkSink / ChunkSource.
 */
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/storage.hpp"

namespace pyckpt {

/**
 * @brief Spare block buffers for BlockSinks. A block handed over comes back through give() once
 *        its uploader is done with it, and take() lends its memory to the next block, so a
 *        long upload writes into pages it already touched instead of faulting in fresh
 *        zero-filled ones for every block. Never blocks: without a spare, take() allocates.
 *
 * Thread-safe.
 */
class BlockRecycler {
 public:
  /** @param max_spare spare blocks kept at most; more given back are freed. */
  explicit BlockRecycler(std::size_t max_spare) : _max_spare(max_spare) {}

  /** @return an empty buffer with capacity >= `capacity` (a spare if one is large enough). */
  std::vector<std::uint8_t> take(std::size_t capacity);
  /** @brief Keeps `block` as a spare while fewer than max_spare are held, else frees it. */
  void give(std::vector<std::uint8_t>&& block) noexcept;
  /** @return how many take() calls a spare served. */
  std::size_t reused() const;
  /** @brief Frees the spares, and from now on every block given back (the upload is over). */
  void close() noexcept;

 private:
  std::size_t _max_spare;
  mutable std::mutex _mu;
  std::vector<std::vector<std::uint8_t>> _spare;
  std::size_t _reused = 0;
};

/**
 * @brief A ChunkSink that copies appended bytes into blocks of about `block_bytes` and hands
 *        each full block to `on_block` (then the last, partial one in commit()).
 *
 * The callback runs on the appending thread; an exception it throws propagates from append()
 * or commit() and leaves the sink failed (later appends throw std::logic_error). Nothing is
 * visible under the name until the uploader behind the callback completes it.
 */
class BlockSink final : public ChunkSink {
 public:
  using OnBlock = std::function<void(std::vector<std::uint8_t>&& block)>;

  /**
   * @param name the final object name (for messages).
   * @param block_bytes bytes per block handed over (>= 1).
   * @param on_block receives each block.
   * @param recycler where each new block's buffer comes from (null: a fresh allocation).
   * @throws std::invalid_argument for block_bytes == 0 or an empty callback.
   */
  BlockSink(std::string name, std::size_t block_bytes, OnBlock on_block,
            std::shared_ptr<BlockRecycler> recycler = nullptr);

  const std::string& name() const noexcept override { return _name; }
  /** @throws std::logic_error after commit(), abort() or a failed callback. */
  std::uint64_t append(const void* data, std::size_t n) override;
  std::uint64_t size() const noexcept override { return _size; }
  /** @brief Hands over the last block. */
  void commit() override;
  void abort() noexcept override;
  bool committed() const noexcept { return _state == State::Committed; }

 private:
  enum class State : std::uint8_t { Open, Committed, Failed };
  void flush();

  std::string _name;
  std::size_t _block_bytes;
  OnBlock _on_block;
  std::shared_ptr<BlockRecycler> _recycler;
  std::vector<std::uint8_t> _block;
  std::uint64_t _size = 0;
  State _state = State::Open;
};

/** @brief A range of an object held in memory: bytes [offset, offset + len) at `data`. */
struct MemoryRange {
  std::uint64_t offset = 0;
  const std::uint8_t* data = nullptr;
  std::size_t len = 0;
};

/**
 * @brief A ChunkSource over non-overlapping ranges of an object of `size` bytes held in memory
 * (lent by the caller, who keeps them alive while the source lives).
 *
 * view_at() lends a pointer into the range holding all requested bytes; read_at() copies from
 * it. A request outside every range is a logic error of the caller (it fetched too little) and
 * throws SysError(EIO) naming the object; one past `size` throws FormatError(Truncated).
 */
class MemorySource final : public ChunkSource {
 public:
  MemorySource(std::string name, std::uint64_t size, std::vector<MemoryRange> ranges);

  const std::string& name() const noexcept override { return _name; }
  std::uint64_t size() const noexcept override { return _size; }
  void read_at(std::uint64_t offset, std::size_t len, void* dst) override;
  const std::uint8_t* view_at(std::uint64_t offset, std::size_t len) override;

 private:
  const MemoryRange* find(std::uint64_t offset, std::size_t len) const noexcept;

  std::string _name;
  std::uint64_t _size;
  std::vector<MemoryRange> _ranges;  // sorted by offset
};

}  // namespace pyckpt
