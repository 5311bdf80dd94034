#include "bindings/core_convert.hpp"

#include "core/error.hpp"

namespace pyckpt::bindings {

BufferRef::BufferRef(py::handle obj, bool writable) {
  // PyBUF_SIMPLE implies a C-contiguous export, so (buf, len) describes every byte.
  const int flags = writable ? PyBUF_WRITABLE : PyBUF_SIMPLE;
  if (PyObject_GetBuffer(obj.ptr(), &_view, flags) != 0) throw py::error_already_set();
}

BufferRef::~BufferRef() { PyBuffer_Release(&_view); }

std::uint64_t u64_from_py(py::handle obj, const char* what) {
  if (!PyLong_Check(obj.ptr())) {
    throw py::type_error(std::string(what) + " must be an int, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  const unsigned long long v = PyLong_AsUnsignedLongLong(obj.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(std::string(what) + " must be an int in [0, 2**64)");
  }
  return static_cast<std::uint64_t>(v);
}

namespace {

py::sequence as_sequence(py::handle obj, std::size_t min_len, std::size_t max_len,
                         const char* what) {
  if (!PySequence_Check(obj.ptr()) || PyUnicode_Check(obj.ptr()) || PyBytes_Check(obj.ptr())) {
    throw py::type_error(std::string(what) + " must be a tuple or list");
  }
  auto seq = py::reinterpret_borrow<py::sequence>(obj);
  const std::size_t n = seq.size();
  if (n < min_len || n > max_len) {
    throw py::value_error(std::string(what) + " has " + std::to_string(n) + " fields, expected " +
                          std::to_string(min_len) +
                          (min_len == max_len ? "" : " to " + std::to_string(max_len)));
  }
  return seq;
}

}  // namespace

const CodecParams& params_from_py(py::handle obj, const char* what) {
  if (!py::isinstance<CodecParams>(obj)) {
    throw py::type_error(std::string(what) + " must be a pyckpt._C.CodecParams, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  }
  return obj.cast<const CodecParams&>();
}

ChunkRecord record_from_py(py::handle obj) {
  // Records usually come from checkpoint metadata, so a malformed one is a format error.
  try {
    py::sequence seq = as_sequence(obj, 5, 5, "chunk record");
    ChunkRecord r;
    r.file_offset = u64_from_py(seq[0], "file_offset");
    r.raw_len = u64_from_py(seq[1], "raw_len");
    r.checksum = u64_from_py(seq[2], "checksum");
    const std::uint64_t t = u64_from_py(seq[3], "transform");
    if (t > 2) throw py::value_error("transform id must be 0, 1 or 2, got " + std::to_string(t));
    r.transform = static_cast<Transform>(t);
    py::sequence planes = as_sequence(seq[4], 2, 16, "planes (mode0, len0, ...)");
    if (planes.size() % 2 != 0) throw py::value_error("planes must hold (mode, len) pairs");
    for (std::size_t i = 0; i < planes.size(); i += 2) {
      const std::uint64_t mode = u64_from_py(planes[i], "plane mode");
      if (mode > 1) throw py::value_error("plane mode must be 0 or 1, got " + std::to_string(mode));
      const std::uint64_t len = u64_from_py(planes[i + 1], "plane length");
      r.planes.push_back(PlaneRecord{static_cast<PlaneMode>(mode), len});
      r.stored_len += len;
    }
    return r;
  } catch (py::error_already_set&) {
    throw;
  } catch (const py::builtin_exception& e) {  // value/type/cast errors from the parsing above
    throw FormatError(FormatKind::Header, std::string("malformed chunk record: ") + e.what());
  }
}

py::tuple record_to_py(const ChunkRecord& rec) {
  py::tuple planes(2 * rec.planes.size());
  for (std::size_t i = 0; i < rec.planes.size(); ++i) {
    planes[2 * i] = py::int_(static_cast<int>(rec.planes[i].mode));
    planes[2 * i + 1] = py::int_(rec.planes[i].stored_len);
  }
  return py::make_tuple(rec.file_offset, rec.raw_len, rec.checksum, static_cast<int>(rec.transform),
                        planes);
}

DirectMode direct_mode_from_py(const std::string& s) {
  if (s == "auto") return DirectMode::Auto;
  if (s == "on") return DirectMode::On;
  if (s == "off") return DirectMode::Off;
  throw py::value_error("direct must be 'auto', 'on' or 'off', got '" + s + "'");
}

std::string path_from_py(py::handle obj) {
  py::object p = py::module_::import("os").attr("fspath")(obj);
  if (PyBytes_Check(p.ptr())) return py::cast<std::string>(p);
  return py::cast<std::string>(py::module_::import("os").attr("fsencode")(p));
}

}  // namespace pyckpt::bindings
