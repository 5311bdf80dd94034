// libpyckpt_fake_cudart.so: a test double of the CUDA runtime for CPU-only CI.
//
// It exports the C entry points pyckpt resolves with dlsym (same names, same signatures as
// cuda_runtime_api.h), so the staging pipeline is loaded through exactly the path used for a
// real runtime (PYCKPT_CUDART=<this library>). "Device memory" is ordinary host memory.
//
// Model: every stream is a worker thread running its queue in order, so copies really are
// asynchronous; events complete when their stream reaches them; cudaStreamWaitEvent makes a
// stream wait for the recording the event had at call time. Optional delays (per copy, or a
// queued "kernel" that fills memory late) make missing waits visible as wrong bytes.
//
// Control and inspection (fake_cudart_*), reachable from Python via ctypes on the same .so:
// failure injection (next n calls, a named entry point, or an asynchronous copy failure that
// surfaces at the next event/stream synchronisation), device count, copy delay, counters.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#define FAKE_API extern "C" __attribute__((visibility("default")))

struct CUstream_st;
struct CUevent_st;

namespace {

constexpr int kSuccess = 0;
constexpr int kErrorInvalidValue = 1;
constexpr int kErrorNoDevice = 100;
constexpr int kErrorInvalidDevice = 101;
constexpr int kErrorInvalidResourceHandle = 400;
constexpr int kErrorNotReady = 600;
constexpr int kErrorHostMemoryAlreadyRegistered = 712;
constexpr int kErrorHostMemoryNotRegistered = 713;

struct Event {
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t recorded = 0;   // generation of the latest cudaEventRecord
  std::uint64_t completed = 0;  // highest generation the stream reached
  int error = kSuccess;         // sticky error of the stream when it reached the event
};

struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> ops;
  bool running = false;  // an op is executing
  bool stop = false;
  int error = kSuccess;  // sticky asynchronous error
  std::thread worker;

  Stream() : worker([this] { loop(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(mu);
      stop = true;
    }
    cv.notify_all();
    worker.join();
  }
  void push(std::function<void()> op) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ops.push_back(std::move(op));
    }
    cv.notify_all();
  }
  int drain() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [this] { return ops.empty() && !running; });
    return error;
  }
  void loop() {
    std::unique_lock<std::mutex> lock(mu);
    for (;;) {
      cv.wait(lock, [this] { return stop || !ops.empty(); });
      if (ops.empty()) return;  // stop requested and nothing left
      std::function<void()> op = std::move(ops.front());
      ops.pop_front();
      running = true;
      lock.unlock();
      op();
      lock.lock();
      running = false;
      cv.notify_all();
    }
  }
};

struct State {
  std::mutex mu;
  // failure injection
  long fail_after = -1;  // calls to let through before failing one (-1: off)
  int fail_code = 0;
  std::string fail_name;  // entry point to fail ("" = none)
  long fail_name_skip = 0;
  int fail_name_code = 0;
  long async_fail_after = -1;  // copies to let through before one fails asynchronously
  int async_fail_code = 0;
  // configuration
  int device_count = 1;
  long copy_delay_us = 0;
  // registrations
  std::map<std::uintptr_t, std::size_t> registered;
  std::size_t registered_bytes = 0;
  long register_calls = 0;
  long unregister_calls = 0;
  // counters
  long calls = 0;
  long copies_d2h = 0, copies_h2d = 0, copies_other = 0;
  long long bytes_d2h = 0, bytes_h2d = 0;
  long unpinned_copies = 0;
  long events_created = 0, events_destroyed = 0, event_records = 0, event_syncs = 0;
  long streams_created = 0, streams_destroyed = 0, stream_waits = 0, stream_syncs = 0;
  std::set<Stream*> streams;
  std::set<Event*> events;
};

State& state() {
  static State* s = new State();  // leaked: worker threads may outlive static destruction
  return *s;
}

Stream& legacy_stream() {
  static Stream* s = new Stream();  // leaked on purpose, like the runtime's own default stream
  return *s;
}

thread_local int t_device = 0;

// Returns an error code when a failure is injected for this call, else kSuccess.
int enter(const char* name) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  ++s.calls;
  if (!s.fail_name.empty() && s.fail_name == name) {
    if (s.fail_name_skip == 0) {
      s.fail_name.clear();
      return s.fail_name_code;
    }
    --s.fail_name_skip;
  }
  if (s.fail_after >= 0) {
    if (s.fail_after == 0) {
      s.fail_after = -1;
      return s.fail_code;
    }
    --s.fail_after;
  }
  return kSuccess;
}

Stream* resolve_stream(CUstream_st* handle, bool* ok) {
  *ok = true;
  const auto v = reinterpret_cast<std::uintptr_t>(handle);
  if (v == 0 || v == 1 || v == 2) return &legacy_stream();  // default / legacy / per-thread
  auto* s = reinterpret_cast<Stream*>(handle);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.streams.count(s) == 0) {
    *ok = false;
    return nullptr;
  }
  return s;
}

Event* resolve_event(CUevent_st* handle) {
  auto* e = reinterpret_cast<Event*>(handle);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  return st.events.count(e) != 0 ? e : nullptr;
}

bool is_registered_locked(const State& s, const void* p, std::size_t n) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = s.registered.upper_bound(a);
  if (it == s.registered.begin()) return false;
  --it;
  return a >= it->first && a + n <= it->first + it->second;
}

}  // namespace

// ---------------------------------------------------------------- CUDA runtime entry points ---

FAKE_API const char* cudaGetErrorString(int code) {
  switch (code) {
    case kSuccess: return "no error";
    case kErrorInvalidValue: return "invalid argument";
    case 2: return "out of memory";
    case kErrorNoDevice: return "no CUDA-capable device is detected";
    case kErrorInvalidDevice: return "invalid device ordinal";
    case kErrorInvalidResourceHandle: return "invalid resource handle";
    case kErrorNotReady: return "device not ready";
    case 35: return "CUDA driver version is insufficient for CUDA runtime version";
    case 700: return "an illegal memory access was encountered";
    case kErrorHostMemoryAlreadyRegistered:
      return "part or all of the requested memory range is already mapped";
    case kErrorHostMemoryNotRegistered:
      return "pointer does not correspond to a registered memory region";
    case 719: return "unspecified launch failure";
    default: return "unrecognized error code";
  }
}

FAKE_API int cudaGetDeviceCount(int* count) {
  if (int rc = enter("cudaGetDeviceCount")) return rc;
  if (count == nullptr) return kErrorInvalidValue;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  *count = s.device_count;
  return s.device_count > 0 ? kSuccess : kErrorNoDevice;
}

FAKE_API int cudaGetDevice(int* device) {
  if (int rc = enter("cudaGetDevice")) return rc;
  if (device == nullptr) return kErrorInvalidValue;
  *device = t_device;
  return kSuccess;
}

FAKE_API int cudaSetDevice(int device) {
  if (int rc = enter("cudaSetDevice")) return rc;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (device < 0 || device >= s.device_count) return kErrorInvalidDevice;
  t_device = device;
  return kSuccess;
}

FAKE_API int cudaHostRegister(void* ptr, std::size_t size, unsigned int /*flags*/) {
  if (int rc = enter("cudaHostRegister")) return rc;
  if (ptr == nullptr || size == 0) return kErrorInvalidValue;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto a = reinterpret_cast<std::uintptr_t>(ptr);
  for (const auto& [start, len] : s.registered) {
    if (a < start + len && start < a + size) return kErrorHostMemoryAlreadyRegistered;
  }
  s.registered[a] = size;
  s.registered_bytes += size;
  ++s.register_calls;
  return kSuccess;
}

FAKE_API int cudaHostUnregister(void* ptr) {
  if (int rc = enter("cudaHostUnregister")) return rc;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.registered.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == s.registered.end()) return kErrorHostMemoryNotRegistered;
  s.registered_bytes -= it->second;
  s.registered.erase(it);
  ++s.unregister_calls;
  return kSuccess;
}

FAKE_API int cudaStreamCreateWithFlags(CUstream_st** out, unsigned int /*flags*/) {
  if (int rc = enter("cudaStreamCreateWithFlags")) return rc;
  if (out == nullptr) return kErrorInvalidValue;
  auto* s = new Stream();
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.streams.insert(s);
  ++st.streams_created;
  *out = reinterpret_cast<CUstream_st*>(s);
  return kSuccess;
}

FAKE_API int cudaStreamDestroy(CUstream_st* handle) {
  if (int rc = enter("cudaStreamDestroy")) return rc;
  auto* s = reinterpret_cast<Stream*>(handle);
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    if (st.streams.erase(s) == 0) return kErrorInvalidResourceHandle;
    ++st.streams_destroyed;
  }
  delete s;  // finishes queued work, joins the worker
  return kSuccess;
}

FAKE_API int cudaStreamSynchronize(CUstream_st* handle) {
  if (int rc = enter("cudaStreamSynchronize")) return rc;
  bool ok = false;
  Stream* s = resolve_stream(handle, &ok);
  if (!ok) return kErrorInvalidResourceHandle;
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    ++st.stream_syncs;
  }
  return s->drain();
}

FAKE_API int cudaEventCreateWithFlags(CUevent_st** out, unsigned int /*flags*/) {
  if (int rc = enter("cudaEventCreateWithFlags")) return rc;
  if (out == nullptr) return kErrorInvalidValue;
  auto* e = new Event();
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  st.events.insert(e);
  ++st.events_created;
  *out = reinterpret_cast<CUevent_st*>(e);
  return kSuccess;
}

FAKE_API int cudaEventDestroy(CUevent_st* handle) {
  if (int rc = enter("cudaEventDestroy")) return rc;
  auto* e = reinterpret_cast<Event*>(handle);
  State& st = state();
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.events.erase(e) == 0) return kErrorInvalidResourceHandle;
  ++st.events_destroyed;
  // Like CUDA, destroying a pending event is allowed; a queued completion may still touch it,
  // so the object is leaked rather than freed (tests create few events).
  return kSuccess;
}

FAKE_API int cudaEventRecord(CUevent_st* handle, CUstream_st* stream) {
  if (int rc = enter("cudaEventRecord")) return rc;
  Event* e = resolve_event(handle);
  if (e == nullptr) return kErrorInvalidResourceHandle;
  bool ok = false;
  Stream* s = resolve_stream(stream, &ok);
  if (!ok) return kErrorInvalidResourceHandle;
  std::uint64_t gen;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    gen = ++e->recorded;
  }
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    ++st.event_records;
  }
  s->push([e, s, gen] {
    int err;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      err = s->error;
    }
    std::lock_guard<std::mutex> lock(e->mu);
    e->completed = std::max(e->completed, gen);
    e->error = err;
    e->cv.notify_all();
  });
  return kSuccess;
}

FAKE_API int cudaEventQuery(CUevent_st* handle) {
  if (int rc = enter("cudaEventQuery")) return rc;
  Event* e = resolve_event(handle);
  if (e == nullptr) return kErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lock(e->mu);
  if (e->completed < e->recorded) return kErrorNotReady;
  return e->error;
}

FAKE_API int cudaEventSynchronize(CUevent_st* handle) {
  if (int rc = enter("cudaEventSynchronize")) return rc;
  Event* e = resolve_event(handle);
  if (e == nullptr) return kErrorInvalidResourceHandle;
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    ++st.event_syncs;
  }
  std::unique_lock<std::mutex> lock(e->mu);
  const std::uint64_t target = e->recorded;
  e->cv.wait(lock, [e, target] { return e->completed >= target; });
  return e->error;
}

FAKE_API int cudaStreamWaitEvent(CUstream_st* stream, CUevent_st* handle, unsigned int /*flags*/) {
  if (int rc = enter("cudaStreamWaitEvent")) return rc;
  Event* e = resolve_event(handle);
  if (e == nullptr) return kErrorInvalidResourceHandle;
  bool ok = false;
  Stream* s = resolve_stream(stream, &ok);
  if (!ok) return kErrorInvalidResourceHandle;
  std::uint64_t target;
  {
    std::lock_guard<std::mutex> lock(e->mu);
    target = e->recorded;  // the recording current at call time, as in CUDA
  }
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    ++st.stream_waits;
  }
  s->push([e, target] {
    std::unique_lock<std::mutex> lock(e->mu);
    e->cv.wait(lock, [e, target] { return e->completed >= target; });
  });
  return kSuccess;
}

FAKE_API int cudaMemcpyAsync(void* dst, const void* src, std::size_t count, int kind,
                             CUstream_st* stream) {
  if (int rc = enter("cudaMemcpyAsync")) return rc;
  if ((dst == nullptr || src == nullptr) && count > 0) return kErrorInvalidValue;
  if (kind < 0 || kind > 4) return kErrorInvalidValue;
  bool ok = false;
  Stream* s = resolve_stream(stream, &ok);
  if (!ok) return kErrorInvalidResourceHandle;
  long delay_us;
  bool fail_async = false;
  int async_code = 0;
  {
    State& st = state();
    std::lock_guard<std::mutex> lock(st.mu);
    if (kind == 2) {
      ++st.copies_d2h;
      st.bytes_d2h += static_cast<long long>(count);
      if (!is_registered_locked(st, dst, count)) ++st.unpinned_copies;
    } else if (kind == 1) {
      ++st.copies_h2d;
      st.bytes_h2d += static_cast<long long>(count);
      if (!is_registered_locked(st, src, count)) ++st.unpinned_copies;
    } else {
      ++st.copies_other;
    }
    delay_us = st.copy_delay_us;
    if (st.async_fail_after >= 0) {
      if (st.async_fail_after == 0) {
        st.async_fail_after = -1;
        fail_async = true;
        async_code = st.async_fail_code;
      } else {
        --st.async_fail_after;
      }
    }
  }
  s->push([=] {
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    {
      std::lock_guard<std::mutex> lock(s->mu);
      if (fail_async) s->error = async_code;
      if (s->error != kSuccess) return;  // a failed stream copies nothing more
    }
    std::memcpy(dst, src, count);
  });
  return kSuccess;
}

// ---------------------------------------------------------------- control and inspection ---

/** Fail the call that comes after `n_calls` more successful entry-point calls, once. */
FAKE_API void fake_cudart_fail_after(int n_calls, int error_code) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.fail_after = n_calls;
  s.fail_code = error_code;
}

/** Fail the (skip+1)-th next call of entry point `name`, once. */
FAKE_API void fake_cudart_fail_on(const char* name, int skip, int error_code) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.fail_name = name != nullptr ? name : "";
  s.fail_name_skip = skip;
  s.fail_name_code = error_code;
}

/** The copy queued after `n_copies` more copies fails on its stream (sticky, asynchronous). */
FAKE_API void fake_cudart_fail_async_copy_after(int n_copies, int error_code) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.async_fail_after = n_copies;
  s.async_fail_code = error_code;
}

/** Clears failure injection, delays and counters (not registrations, streams or events). */
FAKE_API void fake_cudart_reset() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.fail_after = -1;
  s.fail_name.clear();
  s.async_fail_after = -1;
  s.device_count = 1;
  s.copy_delay_us = 0;
  s.register_calls = s.unregister_calls = 0;
  s.calls = 0;
  s.copies_d2h = s.copies_h2d = s.copies_other = 0;
  s.bytes_d2h = s.bytes_h2d = 0;
  s.unpinned_copies = 0;
  s.events_created = s.events_destroyed = s.event_records = s.event_syncs = 0;
  s.streams_created = s.streams_destroyed = s.stream_waits = s.stream_syncs = 0;
}

/** Clears the sticky asynchronous error of a stream (0 = the legacy stream). */
FAKE_API int fake_cudart_clear_stream_error(CUstream_st* stream) {
  bool ok = false;
  Stream* s = resolve_stream(stream, &ok);
  if (!ok) return kErrorInvalidResourceHandle;
  std::lock_guard<std::mutex> lock(s->mu);
  s->error = kSuccess;
  return kSuccess;
}

FAKE_API void fake_cudart_set_device_count(int n) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.device_count = n;
}

/** Every queued copy sleeps this long on its stream before copying. */
FAKE_API void fake_cudart_set_copy_delay_us(long us) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.copy_delay_us = us;
}

/** Queues a fake "kernel" on `stream`: sleep `delay_us`, then memset(ptr, value, n). */
FAKE_API int fake_cudart_enqueue_fill(CUstream_st* stream, void* ptr, int value, std::size_t n,
                                      long delay_us) {
  bool ok = false;
  Stream* s = resolve_stream(stream, &ok);
  if (!ok) return kErrorInvalidResourceHandle;
  s->push([=] {
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    std::memset(ptr, value, n);
  });
  return kSuccess;
}

/** Names a counter; returns -1 for an unknown name. */
FAKE_API long long fake_cudart_counter(const char* name) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const std::string n = name != nullptr ? name : "";
  if (n == "registered_bytes") return static_cast<long long>(s.registered_bytes);
  if (n == "registered_blocks") return static_cast<long long>(s.registered.size());
  if (n == "register_calls") return s.register_calls;
  if (n == "unregister_calls") return s.unregister_calls;
  if (n == "calls") return s.calls;
  if (n == "copies_d2h") return s.copies_d2h;
  if (n == "copies_h2d") return s.copies_h2d;
  if (n == "copies_other") return s.copies_other;
  if (n == "bytes_d2h") return s.bytes_d2h;
  if (n == "bytes_h2d") return s.bytes_h2d;
  if (n == "unpinned_copies") return s.unpinned_copies;
  if (n == "events_created") return s.events_created;
  if (n == "events_destroyed") return s.events_destroyed;
  if (n == "events_live") return static_cast<long long>(s.events.size());
  if (n == "event_records") return s.event_records;
  if (n == "event_syncs") return s.event_syncs;
  if (n == "streams_created") return s.streams_created;
  if (n == "streams_destroyed") return s.streams_destroyed;
  if (n == "streams_live") return static_cast<long long>(s.streams.size());
  if (n == "stream_waits") return s.stream_waits;
  if (n == "stream_syncs") return s.stream_syncs;
  return -1;
}
