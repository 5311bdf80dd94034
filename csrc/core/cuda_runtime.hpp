#pragma once
/**
 * @file cuda_runtime.hpp
 * @brief The CUDA runtime, loaded at run time with dlopen; no CUDA headers or toolkit at build.
 *
 * pyckpt never links against libcudart. CudaRuntime::load() first looks for a runtime that is
 * already mapped into the process (`dlopen(..., RTLD_NOLOAD)` on the sonames torch ships), so
 * pyckpt and torch share one runtime and one primary context; only when none is mapped does it
 * load one itself. An explicit path (set from Python through `PYCKPT_CUDART`) goes through the
 * same resolution of entry points: that is how tests load the test double of the runtime.
 *
 * The handful of types and constants used are declared by hand below and match the CUDA headers
 * (`driver_types.h`, `cuda_runtime_api.h`) exactly; they are ABI-stable across CUDA 11-13.
 *
 * Any failure (library missing, an entry point missing, no device) leaves `available() == false`
 * with a reason in `error()`; nothing throws at load time, and every pyckpt path that does not
 * touch device memory keeps working.
 *
 * Thread-safety: a loaded CudaRuntime is immutable; every method may be called from any thread.
 * @note The library handle is never dlclose()d: unloading a CUDA runtime while the driver still
 *       holds state for it is unsafe, and the handle is cheap.
 */
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace pyckpt {

/** @brief Hand-written declarations matching the CUDA runtime headers (no cuda.h). */
namespace cuda {
/** @brief `cudaError_t` (an enum of int size in driver_types.h). */
using Error = int;
/** @brief `cudaStream_t`: opaque pointer `struct CUstream_st*`. */
using Stream = struct CUstream_st*;
/** @brief `cudaEvent_t`: opaque pointer `struct CUevent_st*`. */
using Event = struct CUevent_st*;

/** @brief `cudaMemcpyKind` values. */
enum MemcpyKind : int {
  kMemcpyHostToHost = 0,
  kMemcpyHostToDevice = 1,
  kMemcpyDeviceToHost = 2,
  kMemcpyDeviceToDevice = 3,
  kMemcpyDefault = 4,
};

constexpr Error kSuccess = 0;                         ///< cudaSuccess
constexpr Error kErrorNotReady = 600;                 ///< cudaErrorNotReady (event/stream query)
constexpr Error kErrorHostMemoryNotRegistered = 713;  ///< cudaErrorHostMemoryNotRegistered
constexpr unsigned kHostRegisterDefault = 0;          ///< cudaHostRegisterDefault
constexpr unsigned kHostRegisterPortable = 1;         ///< cudaHostRegisterPortable
constexpr unsigned kStreamNonBlocking = 1;            ///< cudaStreamNonBlocking
constexpr unsigned kEventDisableTiming = 2;           ///< cudaEventDisableTiming
}  // namespace cuda

/**
 * @brief Entry points of one loaded CUDA runtime, wrapped so that every failure throws CudaError.
 *
 * Obtain one with CudaRuntime::load(); share it (stagers and pinned allocators hold a
 * shared_ptr so the runtime outlives every stream, event and registration made through it).
 */
class CudaRuntime {
 public:
  /**
   * @brief Loads a CUDA runtime and resolves its entry points. Never throws for a missing or
   *        unusable library: the result then reports `available() == false`.
   * @param path library to load; empty means "the runtime torch already loaded, else the first
   *        of libcudart.so.13/.12/.11.0/libcudart.so that dlopen finds".
   * @return a runtime (possibly unavailable).
   * @throws std::bad_alloc only.
   */
  static std::shared_ptr<CudaRuntime> load(const std::string& path = {});

  CudaRuntime(const CudaRuntime&) = delete;
  CudaRuntime& operator=(const CudaRuntime&) = delete;

  /** @return true when every entry point resolved and at least one device is visible. */
  bool available() const noexcept { return _available; }
  /** @return why the runtime is unavailable (empty when available). */
  const std::string& error() const noexcept { return _error; }
  /** @return the library that was opened (soname or path), empty if none. */
  const std::string& library() const noexcept { return _library; }
  /** @return true when the library was already mapped by someone else (RTLD_NOLOAD hit). */
  bool reused_loaded() const noexcept { return _reused; }
  /** @return the number of visible devices (0 when unavailable). */
  int device_count() const noexcept { return _device_count; }

  /**
   * @brief Throws CudaError(-1, ...) naming `what` and error() when the runtime is unavailable.
   * @throws CudaError.
   */
  void require(const std::string& what) const;

  /** @brief Human-readable message for `code` (cudaGetErrorString). */
  std::string error_string(cuda::Error code) const;

  /**
   * @brief Throws CudaError when `code` is not cudaSuccess.
   * @param code the value a CUDA call returned.
   * @param call the entry point's name, e.g. "cudaMemcpyAsync".
   * @param context what pyckpt was doing (e.g. the tensor's name), may be empty.
   * @throws CudaError carrying `code`.
   */
  void check(cuda::Error code, const char* call, const std::string& context = {}) const;

  /** @return the calling thread's current device. @throws CudaError. */
  int get_device() const;
  /** @brief Makes `device` current on the calling thread. @throws CudaError. */
  void set_device(int device) const;
  /**
   * @brief Page-locks `[ptr, ptr + bytes)` (cudaHostRegister).
   * @note `ptr` must stay allocated until host_unregister(ptr).
   * @throws CudaError.
   */
  void host_register(void* ptr, std::size_t bytes, unsigned flags) const;
  /** @brief Undoes host_register (cudaHostUnregister). @throws CudaError. */
  void host_unregister(void* ptr) const;
  /**
   * @brief Queues an asynchronous copy on `stream` (cudaMemcpyAsync).
   * @note SAFETY: both ranges must stay valid until the copy completes (track it with an event).
   * @throws CudaError (with `context` in the message).
   */
  void memcpy_async(void* dst, const void* src, std::size_t bytes, cuda::MemcpyKind kind,
                    cuda::Stream stream, const std::string& context = {}) const;
  /** @return a new stream created with `flags` (cudaStreamCreateWithFlags). @throws CudaError. */
  cuda::Stream stream_create(unsigned flags) const;
  /** @brief Destroys `stream`; errors are ignored (used in destructors). */
  void stream_destroy(cuda::Stream stream) const noexcept;
  /** @brief Blocks until `stream` is idle. @throws CudaError. */
  void stream_synchronize(cuda::Stream stream, const std::string& context = {}) const;
  /** @brief Makes future work on `stream` wait for `event` (no host sync). @throws CudaError. */
  void stream_wait_event(cuda::Stream stream, cuda::Event event) const;
  /** @return a new event created with `flags`. @throws CudaError. */
  cuda::Event event_create(unsigned flags) const;
  /** @brief Destroys `event`; errors are ignored (used in destructors). */
  void event_destroy(cuda::Event event) const noexcept;
  /** @brief Records `event` on `stream`. @throws CudaError. */
  void event_record(cuda::Event event, cuda::Stream stream) const;
  /** @brief Blocks until `event` completed. @throws CudaError (with `context`). */
  void event_synchronize(cuda::Event event, const std::string& context = {}) const;
  /** @return true when `event` completed, false when still pending. @throws CudaError. */
  bool event_query(cuda::Event event, const std::string& context = {}) const;

 private:
  CudaRuntime() = default;
  bool resolve(void* handle);

  // Entry points, typed as in cuda_runtime_api.h.
  cuda::Error (*_get_device_count)(int*) = nullptr;
  cuda::Error (*_get_device)(int*) = nullptr;
  cuda::Error (*_set_device)(int) = nullptr;
  const char* (*_get_error_string)(cuda::Error) = nullptr;
  cuda::Error (*_host_register)(void*, std::size_t, unsigned) = nullptr;
  cuda::Error (*_host_unregister)(void*) = nullptr;
  cuda::Error (*_memcpy_async)(void*, const void*, std::size_t, int, cuda::Stream) = nullptr;
  cuda::Error (*_stream_create_with_flags)(cuda::Stream*, unsigned) = nullptr;
  cuda::Error (*_stream_destroy)(cuda::Stream) = nullptr;
  cuda::Error (*_stream_synchronize)(cuda::Stream) = nullptr;
  cuda::Error (*_stream_wait_event)(cuda::Stream, cuda::Event, unsigned) = nullptr;
  cuda::Error (*_event_create_with_flags)(cuda::Event*, unsigned) = nullptr;
  cuda::Error (*_event_destroy)(cuda::Event) = nullptr;
  cuda::Error (*_event_record)(cuda::Event, cuda::Stream) = nullptr;
  cuda::Error (*_event_synchronize)(cuda::Event) = nullptr;
  cuda::Error (*_event_query)(cuda::Event) = nullptr;

  bool _available = false;
  bool _reused = false;
  int _device_count = 0;
  std::string _error;
  std::string _library;
};

/**
 * @brief Makes `device` current for the lifetime of the guard and restores the previous one.
 * @throws CudaError from the constructor; the destructor ignores errors.
 */
class CudaDeviceGuard {
 public:
  /** @param rt an available runtime. @param device the device to make current. */
  CudaDeviceGuard(const CudaRuntime& rt, int device);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  const CudaRuntime& _rt;
  int _previous;
  bool _switched;
};

}  // namespace pyckpt
