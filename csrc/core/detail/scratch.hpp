#pragma once
/**
 * @file scratch.hpp
 * @brief Uninitialised byte buffer used as per-thread scratch by the core; grows on demand and
 *        is trimmed by its owner so that idle threads do not keep a large chunk's worth.
 *
 * Internal to csrc/core. The memory comes from take_host() and goes back through free_host()
 * (buffer_pool.hpp): buffers of 1 MiB or more return to the process-wide host cache when the
 * thread ends (its pool lives for one call), trims or grows, and the next thread that needs as
 * much takes those pages, already faulted in. A first-call export of a 19 MiB zstd checkpoint
 * spent ~1,600 of its ~2,100 page faults reading into fresh scratch (perf, 2-core VM, ~4-5 us a
 * fault). The bytes are uninitialised: the scratch is always overwritten before it is read, so
 * zero-filling would only cost a pass over memory.
 *
 * Thread-safety: none; meant to live in a `thread_local`.
 */
#include <cstddef>
#include <cstdint>

#include "core/buffer_pool.hpp"

namespace pyckpt::detail {

/** @brief A buffer that grows on demand; contents are unspecified after get() and trim(). */
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { release(); }

  /**
   * @return a buffer of at least `n` bytes; previous contents are lost when it grows. A new
   *         buffer is rounded up (to 64 KiB, or to whole MiB from 1 MiB on) so that slowly
   *         growing sizes do not reallocate at every step; a cached one may be up to about 4x
   *         `n` (a small need does not take the memory a large one will want).
   * @throws std::bad_alloc.
   */
  std::uint8_t* get(std::size_t n) {
    if (n > _b.bytes || _b.data == nullptr) {
      release();  // first: peak memory stays at one buffer, and the cache may hand it back
      const std::size_t lo = n >= kMapThreshold ? round_up(n, kMapThreshold)
                                                : round_up(n == 0 ? 1 : n, std::size_t{64} << 10);
      _b = take_host(lo, 4 * lo + kMapThreshold);
    }
    return static_cast<std::uint8_t*>(_b.data);
  }

  /** @brief Gives the buffer up when it holds more than `keep` bytes. Never throws. */
  void trim(std::size_t keep) noexcept {
    if (_b.bytes > keep) release();
  }

  /** @return the bytes currently allocated. */
  std::size_t capacity() const noexcept { return _b.bytes; }

 private:
  static constexpr std::size_t round_up(std::size_t n, std::size_t to) noexcept {
    return (n + to - 1) / to * to;
  }
  void release() noexcept {
    free_host(_b.data, _b.bytes);
    _b = HostBlock{};
  }

  HostBlock _b;
};

}  // namespace pyckpt::detail
