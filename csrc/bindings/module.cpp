// pyckpt._C: the private native module. Registers the exception translators (the one place where
// core exceptions become Python exceptions) and every bind_<area>.cpp.
#include <zstd.h>

#include "bindings/bindings.hpp"
#include "bindings/interrupt.hpp"
#include "bindings/records.hpp"
#include "core/cancel.hpp"
#include "core/error.hpp"

namespace py = pybind11;

namespace {

constexpr unsigned kMinZstdVersion = 10400;  // 1.4.0, matches cmake/pyckpt_zstd.cmake

// Python exception classes live in pyckpt/errors.py (they need multiple bases, e.g.
// CheckpointFormatError(PyckptError, ValueError)); fetched once at import.
struct PyErrors {
  py::object format_error, checksum_error, compression_error, cuda_error;
};

PyErrors& py_errors() {
  static PyErrors* errs = new PyErrors();  // leaked on purpose: no Python calls at static exit
  return *errs;
}

void raise_os_error(const pyckpt::SysError& e) {
  const int err = e.code().value();
  // OSError(errno, strerror, filename) picks the subclass (FileNotFoundError, ...) from errno.
  std::string msg = e.code().message() + " [" + e.op() + "]";
  if (!e.detail().empty()) msg += " (" + e.detail() + ")";
  py::object exc = py::reinterpret_steal<py::object>(PyObject_CallFunction(
      PyExc_OSError, "isN", err, msg.c_str(),
      e.path().empty() ? py::none().release().ptr() : py::str(e.path()).release().ptr()));
  if (!exc) throw py::error_already_set();
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyckpt native core (private; use the pyckpt package)";
  m.attr("__version__") = PYCKPT_VERSION;

  const unsigned zv = ZSTD_versionNumber();
  if (zv < kMinZstdVersion) {
    throw py::import_error("pyckpt needs libzstd >= 1.4.0 at run time, found " +
                           std::string(ZSTD_versionString()));
  }
  m.attr("zstd_version") = ZSTD_versionString();

  py::module_ errors = py::module_::import("pyckpt.errors");
  auto& errs = py_errors();
  errs.format_error = errors.attr("CheckpointFormatError");
  errs.checksum_error = errors.attr("ChecksumError");
  errs.compression_error = errors.attr("CompressionError");
  errs.cuda_error = errors.attr("CudaError");

  pyckpt::bindings::init_interrupts();

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pyckpt::SysError& e) {
      raise_os_error(e);
    } catch (const pyckpt::FormatError& e) {
      auto& x = py_errors();
      const auto& cls =
          e.kind() == pyckpt::FormatKind::Checksum ? x.checksum_error : x.format_error;
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const pyckpt::CompressionError& e) {
      PyErr_SetString(py_errors().compression_error.ptr(), e.what());
    } catch (const pyckpt::CudaError& e) {
      PyErr_SetString(py_errors().cuda_error.ptr(), e.what());
    } catch (const pyckpt::Cancelled&) {
      pyckpt::bindings::raise_cancelled();  // KeyboardInterrupt (Ctrl-C) during native work
    }
  });

  pyckpt::bindings::bind_records(m);  // first: the other bindings make its types
  pyckpt::bindings::bind_pool(m);
  pyckpt::bindings::bind_codec(m);
  pyckpt::bindings::bind_io(m);
  pyckpt::bindings::bind_objstore(m);
  pyckpt::bindings::bind_safetensors(m);
  pyckpt::bindings::bind_index(m);
  pyckpt::bindings::bind_cuda(m);
  pyckpt::bindings::bind_interrupt(m);
}
