#include "core/stager.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <utility>

#include "core/error.hpp"

namespace pyckpt {

namespace {

std::string piece_context(const char* verb, const std::string& name, std::size_t offset,
                          std::size_t n, std::size_t total) {
  return detail::concat(verb, " '", name, "' (bytes ", offset, "..", offset + n, " of ", total,
                        ")");
}

// "'a'" or "'a' and 3 more items": names what a block's event covers, for error messages.
std::string label_of(const std::vector<std::string>& names) {
  if (names.empty()) return "an empty transfer";
  std::string s = "'" + names.front() + "'";
  if (names.size() > 1) s += detail::concat(" and ", names.size() - 1, " more item(s)");
  return s;
}

void check_spec(const CopySpec& s, std::size_t size) {
  PYCKPT_EXPECT(s.host_offset <= size && s.nbytes <= size - s.host_offset, std::invalid_argument,
                "copy of '", s.name, "' (", s.nbytes, " bytes at offset ", s.host_offset,
                ") falls outside the ", size, "-byte host block");
}

}  // namespace

// --- PinnedHostAllocator ---

PinnedHostAllocator::PinnedHostAllocator(std::shared_ptr<const CudaRuntime> runtime)
    : _rt(std::move(runtime)) {
  PYCKPT_EXPECT(_rt != nullptr, std::invalid_argument, "PinnedHostAllocator: null runtime");
  _rt->require("PinnedHostAllocator");
}

void* PinnedHostAllocator::allocate(std::size_t bytes) {
  void* p = allocate_host(bytes);
  try {
    // Portable: the block is page-locked for every context, whichever device stages into it.
    _rt->host_register(p, bytes, cuda::kHostRegisterPortable);
  } catch (...) {
    free_host(p, bytes);
    throw;
  }
  return p;
}

void PinnedHostAllocator::deallocate(void* ptr, std::size_t bytes) noexcept {
  // Unregister before free: the driver must forget the range before the allocator reuses it.
  // If the driver may still hold it, the block is left mapped and never reused: freed, its
  // address range would come back from the host cache or the next mmap, and registering it
  // again would fail ("already registered") in some later save. Losing the block is the lesser
  // harm on this error path. A range the driver reports as not registered (after a device
  // reset, say) is free to reuse.
  try {
    _rt->host_unregister(ptr);
  } catch (const CudaError& e) {
    if (e.code() != cuda::kErrorHostMemoryNotRegistered) return;
  } catch (...) {  // NOLINT: nothing sensible to do in a noexcept release path
    return;
  }
  free_host(ptr, bytes);
}

// --- StagerEvent ---

StagerEvent::StagerEvent(StagerEvent&& other) noexcept
    : _stager(std::move(other._stager)), _event(other._event), _context(std::move(other._context)) {
  other._event = nullptr;
}

StagerEvent& StagerEvent::operator=(StagerEvent&& other) noexcept {
  if (this != &other) {
    reset();
    _stager = std::move(other._stager);
    _event = other._event;
    _context = std::move(other._context);
    other._event = nullptr;
  }
  return *this;
}

StagerEvent::~StagerEvent() { reset(); }

void StagerEvent::reset() noexcept {
  if (_event != nullptr && _stager) _stager->give_event(_event);
  _event = nullptr;
  _stager.reset();
}

void StagerEvent::wait() const {
  if (_event == nullptr) return;
  _stager->_rt->event_synchronize(_event, "staging " + _context);
}

bool StagerEvent::ready() const {
  if (_event == nullptr) return true;
  return _stager->_rt->event_query(_event, "staging " + _context);
}

// --- StagedBlock ---

StagedBlock& StagedBlock::operator=(StagedBlock&& other) noexcept {
  if (this != &other) {
    reset();
    _lease = std::move(other._lease);
    _event = std::move(other._event);
    _pieces = std::move(other._pieces);
    _used = other._used;
    _waited = other._waited;
  }
  return *this;
}

StagedBlock::~StagedBlock() { reset(); }

void StagedBlock::wait() {
  _event.wait();
  _waited = true;
}

bool StagedBlock::ready() const { return _waited || _event.ready(); }

void StagedBlock::reset() noexcept {
  // Never hand a block back to the pool while a copy may still be writing into it.
  if (_lease && _event && !_waited) {
    try {
      _event.wait();
    } catch (...) {  // NOLINT: the error was (or will be) reported by whoever consumed the block
    }
  }
  _event = StagerEvent();
  _lease.reset();
  _pieces.clear();
  _used = 0;
  _waited = false;
}

// --- D2HStream ---

StagedBlock D2HStream::next() {
  if (done()) return StagedBlock();
  Stager& st = *_stager;
  StagedBlock b;
  b._lease = st._pool->acquire();  // blocks while every block is held by a consumer
  const std::size_t cap = b._lease.size();
  std::size_t pos = 0;
  std::vector<std::string> names;
  try {
    CudaDeviceGuard guard(*st._rt, st._device);
    while (_item < _items.size()) {
      const StageItem& it = _items[_item];
      const std::size_t remaining = it.nbytes - _offset;
      std::size_t start = align_up(pos, kPieceAlign);
      if (_offset == 0 && it.nbytes > cap) {
        if (pos > 0) break;  // a large item starts on a fresh block
        start = 0;
      }
      if (start >= cap && remaining > 0) break;
      const std::size_t space = start >= cap ? 0 : cap - start;
      if (_offset == 0 && it.nbytes <= cap && remaining > space) break;  // never split a small one
      const std::size_t n = std::min(remaining, space);
      if (n > 0) st.copy_d2h(b._lease.data() + start, it, _offset, n);
      b._pieces.push_back(StagePiece{_item, _offset, start, n});
      if (names.empty() || names.back() != it.name) names.push_back(it.name);
      pos = start + n;
      _offset += n;
      if (_offset == it.nbytes) {
        ++_item;
        _offset = 0;
      }
    }
    b._used = pos;
    b._event = st.record(label_of(names));
  } catch (...) {
    st.drain_noexcept();  // copies already queued into this block finish before it is released
    throw;
  }
  return b;
}

const std::shared_ptr<BufferPool>& D2HStream::pool() const noexcept { return _stager->pool(); }

// --- Stager ---

std::shared_ptr<Stager> Stager::create(std::shared_ptr<const CudaRuntime> runtime,
                                       std::shared_ptr<BufferPool> pool, int device) {
  PYCKPT_EXPECT(runtime != nullptr, std::invalid_argument, "Stager: null runtime");
  PYCKPT_EXPECT(pool != nullptr, std::invalid_argument, "Stager: null pool");
  PYCKPT_EXPECT(device >= 0, std::invalid_argument, "Stager: invalid device ", device);
  runtime->require("Stager");
  return std::shared_ptr<Stager>(new Stager(std::move(runtime), std::move(pool), device));
}

Stager::Stager(std::shared_ptr<const CudaRuntime> runtime, std::shared_ptr<BufferPool> pool,
               int device)
    : _rt(std::move(runtime)), _pool(std::move(pool)), _device(device) {
  CudaDeviceGuard guard(*_rt, _device);
  // Non-blocking: no implicit synchronisation with the legacy default stream; ordering with the
  // caller's work is explicit, through fences.
  _stream = _rt->stream_create(cuda::kStreamNonBlocking);
}

Stager::~Stager() {
  drain_noexcept();
  _uploads.clear();  // copies finished (or failed): the blocks may go back to the pool
  for (cuda::Event e : _all_events) _rt->event_destroy(e);
  _rt->stream_destroy(_stream);
}

cuda::Event Stager::take_event() {
  {
    std::lock_guard<std::mutex> lock(_mu);
    if (!_free_events.empty()) {
      cuda::Event e = _free_events.back();
      _free_events.pop_back();
      return e;
    }
  }
  cuda::Event e = _rt->event_create(cuda::kEventDisableTiming);
  std::lock_guard<std::mutex> lock(_mu);
  _all_events.push_back(e);
  ++_stats.events_created;
  return e;
}

void Stager::give_event(cuda::Event e) noexcept {
  std::lock_guard<std::mutex> lock(_mu);
  _free_events.push_back(e);
}

void Stager::fence(std::uintptr_t caller_stream) {
  cuda::Event e = take_event();
  try {
    _rt->event_record(e, reinterpret_cast<cuda::Stream>(caller_stream));
    // The wait captures the event's current recording, so the event may be recycled right away.
    _rt->stream_wait_event(_stream, e);
  } catch (...) {
    give_event(e);
    throw;
  }
  give_event(e);
  std::lock_guard<std::mutex> lock(_mu);
  ++_stats.fences;
}

StagerEvent Stager::record(std::string context) {
  cuda::Event e = take_event();
  try {
    _rt->event_record(e, _stream);
  } catch (...) {
    give_event(e);
    throw;
  }
  return StagerEvent(shared_from_this(), e, std::move(context));
}

void Stager::drain_noexcept() noexcept {
  try {
    _rt->stream_synchronize(_stream);
  } catch (...) {  // NOLINT: best effort; the original error is being propagated
  }
}

void Stager::copy_d2h(void* dst, const StageItem& item, std::size_t offset, std::size_t n) {
  _rt->memcpy_async(dst, reinterpret_cast<const void*>(item.device_ptr + offset), n,
                    cuda::kMemcpyDeviceToHost, _stream,
                    piece_context("staging", item.name, offset, n, item.nbytes) + " to host");
  std::lock_guard<std::mutex> lock(_mu);
  ++_stats.d2h_copies;
  _stats.d2h_bytes += n;
}

D2HStream Stager::stream_to_host(std::vector<StageItem> items, std::uintptr_t caller_stream) {
  CudaDeviceGuard guard(*_rt, _device);
  fence(caller_stream);
  return D2HStream(shared_from_this(), std::move(items));
}

StagerEvent Stager::copy_into(const Lease& region, const std::vector<CopySpec>& specs,
                              std::uintptr_t caller_stream) {
  PYCKPT_EXPECT(static_cast<bool>(region), std::invalid_argument,
                "copy_into: the region was released");
  for (const CopySpec& s : specs) check_spec(s, region.size());
  CudaDeviceGuard guard(*_rt, _device);
  fence(caller_stream);
  std::vector<std::string> names;
  try {
    for (const CopySpec& s : specs) {
      names.push_back(s.name);
      if (s.nbytes == 0) continue;
      StageItem item{s.name, s.device_ptr, s.nbytes};
      copy_d2h(region.data() + s.host_offset, item, 0, s.nbytes);
    }
    return record(label_of(names));
  } catch (...) {
    drain_noexcept();
    throw;
  }
}

void Stager::reclaim_completed_uploads() {
  // Uploads complete in queue order (one stream), so stop at the first one still running.
  std::unique_lock<std::mutex> lock(_mu);
  while (!_uploads.empty()) {
    PendingUpload& front = _uploads.front();
    if (!_rt->event_query(front.done, "uploading " + front.name + " to the device")) break;
    _free_events.push_back(front.done);
    _uploads.pop_front();  // the block returns to the pool
  }
}

Lease Stager::acquire_upload_block() {
  for (;;) {
    reclaim_completed_uploads();
    if (Lease l = _pool->try_acquire()) return l;
    PendingUpload oldest;
    {
      std::lock_guard<std::mutex> lock(_mu);
      if (_uploads.empty()) break;  // every block is held elsewhere: wait for the pool
      oldest = std::move(_uploads.front());
      _uploads.pop_front();
    }
    try {
      _rt->event_synchronize(oldest.done, "uploading " + oldest.name + " to the device");
    } catch (...) {
      give_event(oldest.done);
      drain_noexcept();
      throw;  // `oldest.block` returns to the pool here, after the drain
    }
    give_event(oldest.done);
  }
  return _pool->acquire();
}

void Stager::upload(Lease block, const std::vector<CopySpec>& specs) {
  PYCKPT_EXPECT(static_cast<bool>(block), std::invalid_argument, "upload: the block was released");
  for (const CopySpec& s : specs) check_spec(s, block.size());
  CudaDeviceGuard guard(*_rt, _device);
  std::vector<std::string> names;
  cuda::Event e = nullptr;
  try {
    for (const CopySpec& s : specs) {
      names.push_back(s.name);
      if (s.nbytes == 0) continue;
      _rt->memcpy_async(reinterpret_cast<void*>(s.device_ptr), block.data() + s.host_offset,
                        s.nbytes, cuda::kMemcpyHostToDevice, _stream,
                        piece_context("loading", s.name, 0, s.nbytes, s.nbytes) + " to the device");
      std::lock_guard<std::mutex> lock(_mu);
      ++_stats.h2d_copies;
      _stats.h2d_bytes += s.nbytes;
    }
    e = take_event();
    _rt->event_record(e, _stream);
  } catch (...) {
    if (e != nullptr) give_event(e);
    drain_noexcept();  // queued copies still read the block: finish them before releasing it
    throw;
  }
  std::lock_guard<std::mutex> lock(_mu);
  _uploads.push_back(PendingUpload{std::move(block), e, label_of(names)});
}

void Stager::finish_uploads(std::uintptr_t caller_stream) {
  CudaDeviceGuard guard(*_rt, _device);
  cuda::Event e = take_event();
  try {
    _rt->event_record(e, _stream);
    _rt->stream_wait_event(reinterpret_cast<cuda::Stream>(caller_stream), e);
  } catch (...) {
    give_event(e);
    throw;
  }
  give_event(e);
}

void Stager::order_after(std::uintptr_t caller_stream) {
  CudaDeviceGuard guard(*_rt, _device);
  fence(caller_stream);
}

void Stager::synchronize() {
  CudaDeviceGuard guard(*_rt, _device);
  _rt->stream_synchronize(_stream, "waiting for the staging stream");
  std::lock_guard<std::mutex> lock(_mu);
  for (PendingUpload& p : _uploads) _free_events.push_back(p.done);
  _uploads.clear();
}

StagerStats Stager::stats() const {
  std::lock_guard<std::mutex> lock(_mu);
  StagerStats s = _stats;
  s.uploads_pending = _uploads.size();
  return s;
}

}  // namespace pyckpt
