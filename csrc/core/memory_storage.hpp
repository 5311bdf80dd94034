#pragma once
/**
 * @file memory_storage.hpp
 * @brief A ChunkSource over bytes already in memory (e.g. chunks received from a peer rank).
 *
 * The bytes belong to the caller and must stay valid and unmodified while the source is used;
 * view_at() lends them, so the chunk path verifies and decodes them in place (no copy).
 * Thread-safe (read-only).
 */
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#include "core/error.hpp"
#include "core/storage.hpp"

namespace pyckpt {

class BufferSource final : public ChunkSource {
 public:
  BufferSource(std::string name, const std::uint8_t* data, std::uint64_t size)
      : _name(std::move(name)), _data(data), _size(size) {}

  const std::string& name() const noexcept override { return _name; }
  std::uint64_t size() const noexcept override { return _size; }

  void read_at(std::uint64_t offset, std::size_t len, void* dst) override {
    PYCKPT_EXPECT_FORMAT(offset <= _size && len <= _size - offset, FormatKind::Truncated, "'",
                         _name, "': bytes [", offset, ", ", offset + len, ") lie beyond its ",
                         _size, " bytes");
    if (len != 0) std::memcpy(dst, _data + offset, len);
  }

  const std::uint8_t* view_at(std::uint64_t offset, std::size_t len) override {
    if (offset > _size || len > _size - offset) return nullptr;  // read_at() reports it
    return _data + offset;
  }

 private:
  std::string _name;
  const std::uint8_t* _data;
  std::uint64_t _size;
};

}  // namespace pyckpt
