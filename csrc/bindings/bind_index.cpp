// Bindings of the metadata reader (core/pyckpt_index.hpp): the parse runs without the GIL;
// materialize() turns its flat tables into the Python objects of pyckpt._format's index.
#include <Python.h>
#include <pybind11/stl.h>

#include <string>
#include <unordered_map>

#include "bindings/bindings.hpp"
#include "bindings/gil.hpp"
#include "core/json_tape.hpp"
#include "core/pyckpt_index.hpp"

namespace pyckpt::bindings {

namespace {

py::object steal(PyObject* o) {
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

py::object u64(std::uint64_t v) { return steal(PyLong_FromUnsignedLongLong(v)); }

// A str from the reader's generalized UTF-8 (lone surrogates of \u escapes, as json.loads).
py::object text(std::string_view s) {
  return steal(PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogatepass"));
}

// The Python value of JSON value `i` as json.loads(object_hook=...) builds it, a tagged tuple
// {"__tuple__": [...]} (the reader checked it holds that key alone) becoming a tuple.
py::object value(const JsonTape& t, std::size_t i) {
  const JNode& n = t[i];
  switch (n.kind) {
    case JKind::Null: return py::none();
    case JKind::True: return py::bool_(true);
    case JKind::False: return py::bool_(false);
    case JKind::Int: {
      if (n.flags & JNode::kBig)
        return steal(PyLong_FromString(t.int_text(i).c_str(), nullptr, 10));
      if (n.flags & JNode::kNegative) {
        return steal(PyNumber_Negative(u64(n.v).ptr()));
      }
      return u64(n.v);
    }
    case JKind::Float: return steal(PyFloat_FromDouble(t.float_value(i)));
    case JKind::String: return text(t.str(i));
    case JKind::Array: {
      py::object list = steal(PyList_New(static_cast<Py_ssize_t>(n.n)));
      Py_ssize_t k = 0;
      for (std::size_t e = i + 1; e < t.next(i); e = t.next(e)) {
        PyList_SET_ITEM(list.ptr(), k++, value(t, e).release().ptr());
      }
      return list;
    }
    case JKind::Object: {
      const std::size_t inner = t.member(i, "__tuple__");
      if (inner != JsonTape::npos) return steal(PySequence_Tuple(value(t, inner).ptr()));
      py::dict d;
      for (std::size_t e = i + 1; e < t.next(i); e = t.next(e + 1)) {
        if (PyDict_SetItem(d.ptr(), text(t.str(e)).ptr(), value(t, e + 1).ptr()) != 0) {
          throw py::error_already_set();
        }
      }
      return std::move(d);
    }
  }
  return py::none();
}

/** A document read by the reader, with its planner_data already a Python value. */
struct NativeIndex {
  PyckptIndex x;
  py::object planner_data;
};

py::object dims_tuple(const std::vector<std::uint64_t>& dims, std::size_t at, std::size_t n) {
  py::object t = steal(PyTuple_New(static_cast<Py_ssize_t>(n)));
  for (std::size_t i = 0; i < n; ++i) {
    PyTuple_SET_ITEM(t.ptr(), static_cast<Py_ssize_t>(i), u64(dims[at + i]).release().ptr());
  }
  return t;
}

py::object call(const py::object& f, std::initializer_list<PyObject*> args) {
  return steal(PyObject_Vectorcall(f.ptr(), args.begin(), args.size(), nullptr));
}

/**
 * Makes instances of a slots dataclass without running its __init__ (a frozen dataclass sets
 * each field through object.__setattr__ there, a good part of the cost per piece): the object
 * is allocated by object.__new__ and each slot set by the generic setter, in `fields` order
 * (dataclasses.fields(cls), passed by the caller, who checks that the class has no
 * __post_init__).
 */
class Maker {
 public:
  Maker(py::object cls, const py::tuple& fields) : _cls(std::move(cls)) {
    for (const auto& f : fields) _fields.push_back(py::reinterpret_borrow<py::object>(f));
    if (!PyType_Check(_cls.ptr())) throw std::invalid_argument("materialize needs classes");
  }

  py::object operator()(std::initializer_list<PyObject*> values) const {
    if (values.size() != _fields.size()) {
      throw std::invalid_argument("materialize: a class's fields do not match its values");
    }
    auto* type = reinterpret_cast<PyTypeObject*>(_cls.ptr());
    py::object empty = steal(PyTuple_New(0));
    py::object o = steal(PyBaseObject_Type.tp_new(type, empty.ptr(), nullptr));
    std::size_t i = 0;
    for (PyObject* v : values) {
      if (PyObject_GenericSetAttr(o.ptr(), _fields[i++].ptr(), v) != 0) {
        throw py::error_already_set();
      }
    }
    return o;
  }

 private:
  py::object _cls;
  std::vector<py::object> _fields;
};

/** Builds the Python values of one index; shares repeated strings and plane tuples. */
class Builder {
 public:
  Builder(const PyckptIndex& x, const py::list& paths, Maker piece, const py::object& codec_cls)
      : _x(x), _paths(paths), _piece(std::move(piece)) {
    for (const IdxCodec& c : x.codecs) {
      _codecs.push_back(codec_cls(c.codec, c.level, c.elem_size, c.transform));
    }
  }

  py::object str(const std::string& s) {
    auto it = _strings.find(s);
    if (it == _strings.end()) it = _strings.emplace(s, text(s)).first;
    return it->second;
  }

  py::object segments(std::size_t begin, std::size_t end) {
    py::object list = steal(PyList_New(static_cast<Py_ssize_t>(end - begin)));
    for (std::size_t s = begin; s < end; ++s) {
      const IdxSegment& seg = _x.segments[s];
      py::object chunks =
          steal(PyList_New(static_cast<Py_ssize_t>(seg.chunks_end - seg.chunks_begin)));
      for (std::size_t c = seg.chunks_begin; c < seg.chunks_end; ++c) {
        PyList_SET_ITEM(chunks.ptr(), static_cast<Py_ssize_t>(c - seg.chunks_begin),
                        chunk(_x.chunks[c]).release().ptr());
      }
      py::object t = steal(PyTuple_New(4));
      PyObject* path = PyList_GET_ITEM(_paths.ptr(), static_cast<Py_ssize_t>(seg.file));
      Py_INCREF(path);
      PyTuple_SET_ITEM(t.ptr(), 0, path);
      PyTuple_SET_ITEM(t.ptr(), 1, u64(seg.raw_begin).release().ptr());
      PyTuple_SET_ITEM(t.ptr(), 2, py::object(_codecs[seg.codec]).release().ptr());
      PyTuple_SET_ITEM(t.ptr(), 3, chunks.release().ptr());
      PyList_SET_ITEM(list.ptr(), static_cast<Py_ssize_t>(s - begin), t.release().ptr());
    }
    return list;
  }

  py::object piece(const IdxItem& t, const IdxPiece& p) {
    py::object offsets = dims_tuple(_x.dims, p.dims_at, t.ndim);
    py::object sizes = dims_tuple(_x.dims, p.dims_at + t.ndim, t.ndim);
    py::object nbytes = u64(p.nbytes);
    py::object segs = segments(p.segments_begin, p.segments_end);
    return _piece({offsets.ptr(), sizes.ptr(), nbytes.ptr(), segs.ptr()});
  }

 private:
  // (file_offset, raw_len, xxh64, transform, (mode, length, ...)); raw lengths and all-raw plane
  // tuples are shared, as the Python validator shares them.
  py::object chunk(const IdxChunk& c) {
    const std::size_t n = 2 * std::size_t{c.nplanes};
    bool raw = true;
    for (std::size_t i = 0; i < n; i += 2) raw = raw && _x.planes[c.planes_at + i] == 0;
    py::object planes;
    if (raw) {
      const std::string key(reinterpret_cast<const char*>(_x.planes.data() + c.planes_at),
                            n * sizeof(std::uint64_t));
      auto it = _raw_planes.find(key);
      if (it == _raw_planes.end()) {
        it = _raw_planes.emplace(key, dims_tuple(_x.planes, c.planes_at, n)).first;
      }
      planes = it->second;
    } else {
      planes = dims_tuple(_x.planes, c.planes_at, n);
    }
    py::object t = steal(PyTuple_New(5));
    PyTuple_SET_ITEM(t.ptr(), 0, u64(c.file_offset).release().ptr());
    auto len = _ints.find(c.raw_len);  // most chunks have the same raw length
    if (len == _ints.end()) len = _ints.emplace(c.raw_len, u64(c.raw_len)).first;
    PyTuple_SET_ITEM(t.ptr(), 1, py::object(len->second).release().ptr());
    PyTuple_SET_ITEM(t.ptr(), 2, u64(c.xxh64).release().ptr());
    PyTuple_SET_ITEM(t.ptr(), 3, u64(c.transform).release().ptr());
    PyTuple_SET_ITEM(t.ptr(), 4, planes.release().ptr());
    return t;
  }

  const PyckptIndex& _x;
  const py::list& _paths;
  Maker _piece;
  std::vector<py::object> _codecs;
  std::unordered_map<std::string, py::object> _strings;
  std::unordered_map<std::string, py::object> _raw_planes;
  std::unordered_map<std::uint64_t, py::object> _ints;
};

}  // namespace

void bind_index(py::module_& m) {
  py::class_<NativeIndex>(m, "PyckptIndex", "A pyckpt.json read by parse_pyckpt_index.")
      .def_property_readonly("version", [](const NativeIndex& n) { return n.x.version; })
      .def_property_readonly("created_by",
                             [](const NativeIndex& n) { return text(n.x.created_by); })
      .def_property_readonly("save_id", [](const NativeIndex& n) { return text(n.x.save_id); })
      .def_property_readonly("dcp_version",
                             [](const NativeIndex& n) -> py::object {
                               if (!n.x.has_dcp_version) return py::none();
                               return text(n.x.dcp_version);
                             })
      .def_property_readonly("modules",
                             [](const NativeIndex& n) {
                               py::list out;
                               for (const std::string& s : n.x.modules) out.append(text(s));
                               return out;
                             })
      .def_readonly("planner_data", &NativeIndex::planner_data,
                    "planner_data as json.loads builds it, tagged tuples made tuples")
      .def_property_readonly(
          "files",
          [](const NativeIndex& n) {
            py::list out;
            for (std::size_t i = 0; i < n.x.file_names.size(); ++i) {
              out.append(py::make_tuple(text(n.x.file_names[i]), n.x.file_sizes[i]));
            }
            return out;
          },
          "[(data file name, size)] in the document's order")
      .def(
          "materialize",
          [](const NativeIndex& n, const py::list& paths, const py::tuple& tensor_cls,
             const py::tuple& piece_cls, const py::object& bytes_cls, const py::object& codec_cls) {
            const PyckptIndex& x = n.x;
            if (paths.size() != x.file_names.size()) {
              throw std::invalid_argument("materialize needs one path per data file");
            }
            const Maker tensor(tensor_cls[0], tensor_cls[1]);
            Builder b(x, paths, Maker(piece_cls[0], piece_cls[1]), codec_cls);
            py::dict tensors, bytes_items;
            for (const IdxItem& item : x.items) {
              py::object fqn = text(item.fqn);
              if (!item.tensor) {
                py::object nbytes = u64(item.nbytes);
                py::object segs = b.segments(item.segments_begin, item.segments_end);
                bytes_items[fqn] = call(bytes_cls, {fqn.ptr(), nbytes.ptr(), segs.ptr()});
                continue;
              }
              py::object pieces =
                  steal(PyList_New(static_cast<Py_ssize_t>(item.pieces_end - item.pieces_begin)));
              for (std::size_t p = item.pieces_begin; p < item.pieces_end; ++p) {
                PyList_SET_ITEM(pieces.ptr(), static_cast<Py_ssize_t>(p - item.pieces_begin),
                                b.piece(item, x.pieces[p]).release().ptr());
              }
              py::object dtype = b.str(item.dtype);
              py::object shape = dims_tuple(x.dims, item.shape_at, item.ndim);
              py::object grad = py::bool_(item.requires_grad);
              py::object mf = b.str(item.memory_format);
              tensors[fqn] =
                  tensor({fqn.ptr(), dtype.ptr(), shape.ptr(), pieces.ptr(), grad.ptr(), mf.ptr()});
            }
            return py::make_tuple(tensors, bytes_items);
          },
          py::arg("paths"), py::arg("tensor_cls"), py::arg("piece_cls"), py::arg("bytes_cls"),
          py::arg("codec_cls"),
          "(tensors, bytes_items): dicts of tensors (fqn, dtype, shape, pieces, requires_grad, "
          "memory_format) and bytes_cls(fqn, nbytes, segments) in the document's order; a piece "
          "is (offsets, sizes, nbytes, segments), a segment (paths[file], raw_begin, "
          "codec_cls(codec, level, elem_size, transform), [chunk records]). tensor_cls and "
          "piece_cls are (slots dataclass, its field names): their instances are made without "
          "__init__, each field set in that order.");

  m.def(
      "parse_pyckpt_index",
      [](const py::buffer& doc, const std::string& origin, std::size_t disjoint_pieces,
         std::int64_t rank, const py::object& limits) {
        const py::buffer_info info = doc.request();
        if (info.ndim != 1 || info.itemsize != 1) {
          throw std::invalid_argument("parse_pyckpt_index needs a contiguous bytes-like object");
        }
        PyckptIndexOptions options;
        options.disjoint_pieces = disjoint_pieces;
        options.only_rank = rank;
        if (!limits.is_none()) {  // tests: smaller count limits
          PyckptIndexLimits& l = options.limits;
          for (const auto& [key, v] : limits.cast<py::dict>()) {
            const std::string name = py::str(key);
            const auto value = v.cast<std::uint64_t>();
            if (name == "MAX_ITEMS")
              l.max_items = value;
            else if (name == "MAX_FILES")
              l.max_files = value;
            else if (name == "MAX_PIECES")
              l.max_pieces = value;
            else if (name == "MAX_SEGMENTS")
              l.max_segments = value;
            else if (name == "MAX_CHUNKS")
              l.max_chunks = value;
            else
              throw std::invalid_argument("parse_pyckpt_index: no limit " + name);
          }
        }
        const std::string_view bytes(static_cast<const char*>(info.ptr),
                                     static_cast<std::size_t>(info.size));
        NativeIndex out;
        try {
          GilRelease nogil;
          out.x = parse_pyckpt_index(bytes, origin, options);
        } catch (const UnsupportedDtype& e) {
          PyErr_SetString(py::module_::import("pyckpt.errors").attr("UnsupportedDtypeError").ptr(),
                          e.what());
          throw py::error_already_set();
        }
        out.planner_data = value(*out.x.tape, out.x.planner);
        out.x.tape.reset();  // it views `doc`, which the caller may release
        return out;
      },
      py::arg("doc"), py::arg("origin"), py::kw_only(), py::arg("disjoint_pieces") = 0,
      py::arg("rank") = -1, py::arg("limits") = py::none(),
      "Verifies, parses and validates pyckpt.json (the one metadata reader, "
      "core/pyckpt_index.hpp). "
      "disjoint_pieces > 0 reads a rank-local part of rank `rank` (pieces need not tile a tensor, "
      "at most that many per tensor, none overlapping; only the rank's data files); `limits` "
      "lowers count limits (MAX_ITEMS, MAX_FILES, MAX_PIECES, MAX_SEGMENTS, MAX_CHUNKS) for "
      "tests. Raises CheckpointFormatError naming `origin` and the key path, or "
      "UnsupportedDtypeError.");

  m.def(
      "pyckpt_index_tables",
      [] {
        const PyckptIndexLimits l = pyckpt_index_limits();
        py::dict limits;
        limits["MAX_ITEMS"] = l.max_items;
        limits["MAX_FILES"] = l.max_files;
        limits["MAX_PIECES"] = l.max_pieces;
        limits["MAX_SEGMENTS"] = l.max_segments;
        limits["MAX_CHUNKS"] = l.max_chunks;
        limits["MAX_CHUNK_BYTES"] = l.max_chunk_bytes;
        limits["MAX_NDIM"] = l.max_ndim;
        limits["MAX_NUMEL"] = l.max_numel;
        limits["MAX_ITEM_BYTES"] = l.max_item_bytes;
        limits["_MAX_FILE_BYTES"] = l.max_file_bytes;
        limits["MAX_PLANNER_DEPTH"] = l.max_planner_depth;
        limits["_MAX_IRREGULAR_PIECES"] = l.max_irregular_pieces;
        limits["_ZSTD_MAX_RATIO"] = l.zstd_max_ratio;
        limits["_ZSTD_LEVELS"] = py::make_tuple(l.zstd_min_level, l.zstd_max_level);
        py::dict dtypes;
        for (const PyckptDtype& d : pyckpt_dtypes()) {
          dtypes[py::str(d.name)] = py::make_tuple(d.size, d.planes, d.transform);
        }
        return py::make_tuple(limits, dtypes);
      },
      "(limits, {dtype: (size, planes, transform)}) the native reader enforces (for tests).");
}

}  // namespace pyckpt::bindings
