#pragma once
/**
 * @file scratch.hpp
 * @brief Uninitialised byte buffer used as per-thread scratch by the core; grows on demand and
 *        is trimmed by its owner so that idle threads do not keep a large chunk's worth.
 *
 * Internal to csrc/core. Growing uses `new std::uint8_t[n]`, which leaves the bytes
 * uninitialised: the scratch is always overwritten before it is read, so zero-filling would only
 * cost a pass over memory (and first-touch page faults) on the hot path.
 *
 * Thread-safety: none; meant to live in a `thread_local`.
 */
#include <cstddef>
#include <cstdint>
#include <memory>

namespace pyckpt::detail {

/** @brief A buffer that grows on demand; contents are unspecified after get() and trim(). */
class Scratch {
 public:
  /**
   * @return a buffer of at least `n` bytes; previous contents are lost when it grows.
   * @throws std::bad_alloc.
   */
  std::uint8_t* get(std::size_t n) {
    if (n > _cap) {
      _buf.reset();  // free first: peak memory stays at one buffer
      _buf.reset(new std::uint8_t[n]);
      _cap = n;
    }
    return _buf.get();
  }

  /** @brief Frees the buffer when it holds more than `keep` bytes. Never throws. */
  void trim(std::size_t keep) noexcept {
    if (_cap > keep) {
      _buf.reset();
      _cap = 0;
    }
  }

  /** @return the bytes currently allocated. */
  std::size_t capacity() const noexcept { return _cap; }

 private:
  std::unique_ptr<std::uint8_t[]> _buf;
  std::size_t _cap = 0;
};

}  // namespace pyckpt::detail
