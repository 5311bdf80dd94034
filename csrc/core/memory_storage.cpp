// In-memory storage backends. See memory_storage.hpp for the contracts.
#include "core/memory_storage.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>

#include "core/error.hpp"

namespace pyckpt {

std::vector<std::uint8_t> BlockRecycler::take(std::size_t capacity) {
  {
    std::lock_guard<std::mutex> lock(_mu);
    while (!_spare.empty()) {
      std::vector<std::uint8_t> v = std::move(_spare.back());
      _spare.pop_back();
      if (v.capacity() >= capacity) {
        ++_reused;
        v.clear();
        return v;
      }
    }
  }
  std::vector<std::uint8_t> v;
  v.reserve(capacity);
  return v;
}

void BlockRecycler::give(std::vector<std::uint8_t>&& block) noexcept {
  std::vector<std::uint8_t> drop;  // freed outside the lock
  std::lock_guard<std::mutex> lock(_mu);
  if (_spare.size() < _max_spare) {
    try {
      _spare.push_back(std::move(block));
      return;
    } catch (const std::bad_alloc&) {  // the spare list could not grow: free the block
    }
  }
  drop.swap(block);
}

void BlockRecycler::close() noexcept {
  std::vector<std::vector<std::uint8_t>> drop;  // freed outside the lock
  std::lock_guard<std::mutex> lock(_mu);
  _max_spare = 0;
  drop.swap(_spare);
}

std::size_t BlockRecycler::reused() const {
  std::lock_guard<std::mutex> lock(_mu);
  return _reused;
}

BlockSink::BlockSink(std::string name, std::size_t block_bytes, OnBlock on_block,
                     std::shared_ptr<BlockRecycler> recycler)
    : _name(std::move(name)),
      _block_bytes(block_bytes),
      _on_block(std::move(on_block)),
      _recycler(std::move(recycler)) {
  if (_block_bytes == 0) throw std::invalid_argument("BlockSink: block_bytes must be >= 1");
  if (!_on_block) throw std::invalid_argument("BlockSink: no block callback");
}

std::uint64_t BlockSink::append(const void* data, std::size_t n) {
  if (_state != State::Open) {
    throw std::logic_error("BlockSink '" + _name + "': append after commit, abort or failure");
  }
  const std::uint64_t at = _size;
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (n > 0) {
    if (_block.capacity() == 0) {
      if (_recycler) {
        _block = _recycler->take(_block_bytes);
      } else {
        _block.reserve(_block_bytes);
      }
    }
    const std::size_t take = std::min(n, _block_bytes - _block.size());
    _block.insert(_block.end(), p, p + take);
    p += take;
    n -= take;
    _size += take;
    if (_block.size() == _block_bytes) flush();
  }
  return at;
}

void BlockSink::flush() {
  std::vector<std::uint8_t> out;
  out.swap(_block);
  try {
    _on_block(std::move(out));
  } catch (...) {
    _state = State::Failed;
    throw;
  }
}

void BlockSink::commit() {
  if (_state != State::Open) {
    throw std::logic_error("BlockSink '" + _name + "': commit after commit, abort or failure");
  }
  if (!_block.empty()) flush();
  _state = State::Committed;
}

void BlockSink::abort() noexcept {
  if (_state == State::Committed) return;
  _state = State::Failed;
  std::vector<std::uint8_t>().swap(_block);
}

MemorySource::MemorySource(std::string name, std::uint64_t size, std::vector<MemoryRange> ranges)
    : _name(std::move(name)), _size(size), _ranges(std::move(ranges)) {
  std::sort(_ranges.begin(), _ranges.end(),
            [](const MemoryRange& a, const MemoryRange& b) { return a.offset < b.offset; });
}

const MemoryRange* MemorySource::find(std::uint64_t offset, std::size_t len) const noexcept {
  // The last range starting at or before offset (the ranges do not overlap).
  auto it =
      std::upper_bound(_ranges.begin(), _ranges.end(), offset,
                       [](std::uint64_t off, const MemoryRange& r) { return off < r.offset; });
  if (it == _ranges.begin()) return nullptr;
  --it;
  if (offset - it->offset <= it->len && len <= it->len - (offset - it->offset)) return &*it;
  return nullptr;
}

void MemorySource::read_at(std::uint64_t offset, std::size_t len, void* dst) {
  const std::uint8_t* p = view_at(offset, len);
  if (p == nullptr) {
    if (offset > _size || len > _size - offset) {
      throw FormatError(FormatKind::Truncated, "'" + _name + "': " + std::to_string(len) +
                                                   " bytes at offset " + std::to_string(offset) +
                                                   " run past its end (" + std::to_string(_size) +
                                                   " bytes)");
    }
    throw SysError(EIO, "read", _name,
                   "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + len) +
                       ") were not downloaded");
  }
  if (len > 0) std::memcpy(dst, p, len);
}

const std::uint8_t* MemorySource::view_at(std::uint64_t offset, std::size_t len) {
  if (offset > _size || len > _size - offset) return nullptr;
  const MemoryRange* r = find(offset, len);
  return r == nullptr ? nullptr : r->data + (offset - r->offset);
}

}  // namespace pyckpt
