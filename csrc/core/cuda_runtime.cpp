#include "core/cuda_runtime.hpp"

#include <dlfcn.h>

#include "core/error.hpp"

namespace pyckpt {

namespace {

// Sonames torch wheels ship (CUDA 13, 12, 11), newest first, then the unversioned dev symlink.
constexpr const char* kSonames[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                    "libcudart.so"};

template <typename Fn>
bool sym(void* handle, const char* name, Fn& out, std::string& missing) {
  // POSIX guarantees that a dlsym result converts to a function pointer.
  void* p = dlsym(handle, name);
  if (p == nullptr) {
    if (!missing.empty()) missing += ", ";
    missing += name;
    return false;
  }
  out = reinterpret_cast<Fn>(p);
  return true;
}

std::string dl_error() {
  const char* e = dlerror();
  return e != nullptr ? std::string(e) : std::string("unknown dlopen error");
}

}  // namespace

bool CudaRuntime::resolve(void* handle) {
  std::string missing;
  bool ok = true;
  ok &= sym(handle, "cudaGetDeviceCount", _get_device_count, missing);
  ok &= sym(handle, "cudaGetDevice", _get_device, missing);
  ok &= sym(handle, "cudaSetDevice", _set_device, missing);
  ok &= sym(handle, "cudaGetErrorString", _get_error_string, missing);
  ok &= sym(handle, "cudaHostRegister", _host_register, missing);
  ok &= sym(handle, "cudaHostUnregister", _host_unregister, missing);
  ok &= sym(handle, "cudaMemcpyAsync", _memcpy_async, missing);
  ok &= sym(handle, "cudaStreamCreateWithFlags", _stream_create_with_flags, missing);
  ok &= sym(handle, "cudaStreamDestroy", _stream_destroy, missing);
  ok &= sym(handle, "cudaStreamSynchronize", _stream_synchronize, missing);
  ok &= sym(handle, "cudaStreamWaitEvent", _stream_wait_event, missing);
  ok &= sym(handle, "cudaEventCreateWithFlags", _event_create_with_flags, missing);
  ok &= sym(handle, "cudaEventDestroy", _event_destroy, missing);
  ok &= sym(handle, "cudaEventRecord", _event_record, missing);
  ok &= sym(handle, "cudaEventSynchronize", _event_synchronize, missing);
  ok &= sym(handle, "cudaEventQuery", _event_query, missing);
  if (!ok) _error = "'" + _library + "' lacks CUDA runtime entry points: " + missing;
  return ok;
}

std::shared_ptr<CudaRuntime> CudaRuntime::load(const std::string& path) {
  std::shared_ptr<CudaRuntime> rt(new CudaRuntime());
  void* handle = nullptr;
  if (!path.empty()) {
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      rt->_error = "cannot load CUDA runtime '" + path + "': " + dl_error();
      return rt;
    }
    rt->_library = path;
  } else {
    // Reuse the runtime torch (or anyone) already mapped: one runtime, one primary context.
    for (const char* name : kSonames) {
      handle = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
      if (handle != nullptr) {
        rt->_library = name;
        rt->_reused = true;
        break;
      }
    }
    if (handle == nullptr) {
      std::string tried;
      for (const char* name : kSonames) {
        handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
        if (handle != nullptr) {
          rt->_library = name;
          break;
        }
        tried += std::string(tried.empty() ? "" : "; ") + dl_error();
      }
      if (handle == nullptr) {
        rt->_error = "no CUDA runtime found (" + tried + ")";
        return rt;
      }
    }
  }
  if (!rt->resolve(handle)) return rt;
  int count = 0;
  const cuda::Error rc = rt->_get_device_count(&count);
  if (rc != cuda::kSuccess) {
    rt->_error =
        "cudaGetDeviceCount failed: " + rt->error_string(rc) + " (code " + std::to_string(rc) + ")";
    return rt;
  }
  if (count <= 0) {
    rt->_error = "the CUDA runtime sees no device";
    return rt;
  }
  rt->_device_count = count;
  rt->_available = true;
  return rt;
}

void CudaRuntime::require(const std::string& what) const {
  if (!_available) throw CudaError(-1, what + ": CUDA runtime not available (" + _error + ")");
}

std::string CudaRuntime::error_string(cuda::Error code) const {
  const char* s = _get_error_string != nullptr ? _get_error_string(code) : nullptr;
  return s != nullptr ? std::string(s) : std::string("unknown CUDA error");
}

void CudaRuntime::check(cuda::Error code, const char* call, const std::string& context) const {
  if (code == cuda::kSuccess) return;
  std::string msg =
      std::string(call) + " failed: " + error_string(code) + " (code " + std::to_string(code) + ")";
  if (!context.empty()) msg += " while " + context;
  throw CudaError(code, msg);
}

int CudaRuntime::get_device() const {
  require("cudaGetDevice");
  int d = 0;
  check(_get_device(&d), "cudaGetDevice");
  return d;
}

void CudaRuntime::set_device(int device) const {
  require("cudaSetDevice");
  check(_set_device(device), "cudaSetDevice", "selecting device " + std::to_string(device));
}

void CudaRuntime::host_register(void* ptr, std::size_t bytes, unsigned flags) const {
  require("cudaHostRegister");
  check(_host_register(ptr, bytes, flags), "cudaHostRegister",
        "pinning a " + std::to_string(bytes) + "-byte host block");
}

void CudaRuntime::host_unregister(void* ptr) const {
  require("cudaHostUnregister");
  check(_host_unregister(ptr), "cudaHostUnregister");
}

void CudaRuntime::memcpy_async(void* dst, const void* src, std::size_t bytes, cuda::MemcpyKind kind,
                               cuda::Stream stream, const std::string& context) const {
  require("cudaMemcpyAsync");
  check(_memcpy_async(dst, src, bytes, static_cast<int>(kind), stream), "cudaMemcpyAsync", context);
}

cuda::Stream CudaRuntime::stream_create(unsigned flags) const {
  require("cudaStreamCreateWithFlags");
  cuda::Stream s = nullptr;
  check(_stream_create_with_flags(&s, flags), "cudaStreamCreateWithFlags");
  return s;
}

void CudaRuntime::stream_destroy(cuda::Stream stream) const noexcept {
  if (_stream_destroy != nullptr) (void)_stream_destroy(stream);
}

void CudaRuntime::stream_synchronize(cuda::Stream stream, const std::string& context) const {
  require("cudaStreamSynchronize");
  check(_stream_synchronize(stream), "cudaStreamSynchronize", context);
}

void CudaRuntime::stream_wait_event(cuda::Stream stream, cuda::Event event) const {
  require("cudaStreamWaitEvent");
  check(_stream_wait_event(stream, event, 0), "cudaStreamWaitEvent");
}

cuda::Event CudaRuntime::event_create(unsigned flags) const {
  require("cudaEventCreateWithFlags");
  cuda::Event e = nullptr;
  check(_event_create_with_flags(&e, flags), "cudaEventCreateWithFlags");
  return e;
}

void CudaRuntime::event_destroy(cuda::Event event) const noexcept {
  if (_event_destroy != nullptr) (void)_event_destroy(event);
}

void CudaRuntime::event_record(cuda::Event event, cuda::Stream stream) const {
  require("cudaEventRecord");
  check(_event_record(event, stream), "cudaEventRecord");
}

void CudaRuntime::event_synchronize(cuda::Event event, const std::string& context) const {
  require("cudaEventSynchronize");
  check(_event_synchronize(event), "cudaEventSynchronize", context);
}

bool CudaRuntime::event_query(cuda::Event event, const std::string& context) const {
  require("cudaEventQuery");
  const cuda::Error rc = _event_query(event);
  if (rc == cuda::kErrorNotReady) return false;
  check(rc, "cudaEventQuery", context);
  return true;
}

CudaDeviceGuard::CudaDeviceGuard(const CudaRuntime& rt, int device)
    : _rt(rt), _previous(rt.get_device()), _switched(false) {
  if (_previous != device) {
    rt.set_device(device);
    _switched = true;
  }
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (_switched) {
    try {
      _rt.set_device(_previous);
    } catch (...) {  // NOLINT: a destructor must not throw; the next CUDA call reports errors.
    }
  }
}

}  // namespace pyckpt
