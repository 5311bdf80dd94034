// FileWriter, the encode+write pipeline, the parallel reader and the verifier. Arguments are
// converted to core structs with the GIL held; the GIL is released for the I/O, compression and
// waiting.
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <optional>

#include "bindings/bindings.hpp"
#include "bindings/core_convert.hpp"
#include "bindings/interrupt.hpp"
#include "bindings/io_convert.hpp"
#include "bindings/records.hpp"
#include "core/chunk_io.hpp"
#include "core/chunk_reader.hpp"
#include "core/encode_pipeline.hpp"
#include "core/error.hpp"
#include "core/memory_storage.hpp"
#include "core/posix_storage.hpp"

namespace pyckpt::bindings {

namespace {

DirectFault fault_from_py(const std::string& s) {
  if (s.empty() || s == "none") return DirectFault::None;
  if (s == "direct_open") return DirectFault::OpenEinval;
  if (s == "direct_write") return DirectFault::FirstWriteEinval;
  throw py::value_error("_test_fault must be '', 'direct_open' or 'direct_write'");
}

void* ptr_from_py(py::handle obj, const char* what) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(u64_from_py(obj, what)));
}

// Accepts any sequence (tuples, or lists decoded from JSON) of exactly n fields.
py::sequence as_tuple(py::handle h, std::size_t n, const char* shape) {
  if (!PySequence_Check(h.ptr()) || PyUnicode_Check(h.ptr()) ||
      PySequence_Size(h.ptr()) != static_cast<Py_ssize_t>(n)) {
    PyErr_Clear();
    throw py::type_error(std::string("expected ") + shape);
  }
  return py::reinterpret_borrow<py::sequence>(h);
}

}  // namespace

std::vector<WriteRequest> items_from_py(py::handle items) {
  std::vector<WriteRequest> out;
  for (py::handle h : py::reinterpret_borrow<py::iterable>(items)) {
    py::sequence t = as_tuple(h, 4, "a WriteItem (name, data_ptr, nbytes, params)");
    WriteRequest r;
    r.name = py::cast<std::string>(t[0]);
    r.data = ptr_from_py(t[1], "data_ptr");
    r.nbytes = u64_from_py(t[2], "nbytes");
    r.params = params_from_py(t[3], "write item params");
    out.push_back(std::move(r));
  }
  return out;
}

std::vector<ReadSegment> segments_from_py(py::handle segments) {
  std::vector<ReadSegment> out;
  for (py::handle sh : py::reinterpret_borrow<py::iterable>(segments)) {
    py::sequence s = as_tuple(sh, 4, "a Segment (path, raw_begin, params, chunks)");
    ReadSegment seg;
    seg.path = path_from_py(s[0]);
    seg.raw_begin = u64_from_py(s[1], "raw_begin");
    seg.params = params_from_py(s[2], "segment params");
    for (py::handle c : py::reinterpret_borrow<py::iterable>(s[3])) {
      seg.chunks.push_back(record_from_py(c));
    }
    out.push_back(std::move(seg));
  }
  return out;
}

std::vector<ReadRequest> requests_from_py(py::handle requests) {
  std::vector<ReadRequest> out;
  for (py::handle h : py::reinterpret_borrow<py::iterable>(requests)) {
    py::sequence t = as_tuple(h, 5, "a ReadRequest (name, segments, lo, hi, dst)");
    ReadRequest r;
    r.name = py::cast<std::string>(t[0]);
    try {
      r.segments = segments_from_py(t[1]);
    } catch (const FormatError&) {
      rethrow_with_context(std::current_exception(), "tensor '" + r.name + "'");
    }
    r.lo = u64_from_py(t[2], "lo");
    r.hi = u64_from_py(t[3], "hi");
    r.dst = ptr_from_py(t[4], "dst");
    out.push_back(std::move(r));
  }
  return out;
}

py::list written_to_py(const std::vector<WrittenItem>& written) {
  py::list out;
  for (const WrittenItem& w : written) {
    py::list chunks;
    for (const ChunkRecord& c : w.chunks) chunks.append(record_to_py(c));
    out.append(record(Rec::WrittenItem, w.offset, w.stored_bytes, chunks));
  }
  return out;
}

MemorySources::MemorySources(py::handle sources) {
  if (sources.is_none()) return;
  for (auto kv : py::reinterpret_borrow<py::dict>(sources)) {
    const std::string name = py::cast<std::string>(kv.first);
    py::sequence t = as_tuple(kv.second, 2, "a MemorySource (size, ranges)");
    Entry e;
    e.size = u64_from_py(t[0], "size");
    for (py::handle r : py::reinterpret_borrow<py::iterable>(t[1])) {
      py::sequence rt = as_tuple(r, 2, "a MemoryRange (offset, data)");
      _buffers.push_back(std::make_unique<BufferRef>(rt[1], false));
      const BufferRef& b = *_buffers.back();
      e.ranges.push_back(MemoryRange{u64_from_py(rt[0], "offset"),
                                     static_cast<const std::uint8_t*>(b.data()), b.size()});
    }
    _entries[name] = std::move(e);
  }
}

SourceOpener MemorySources::opener() const {
  return [this](const std::string& name) -> std::unique_ptr<ChunkSource> {
    auto it = _entries.find(name);
    if (it == _entries.end()) return open_posix_source(name);
    return std::make_unique<MemorySource>(name, it->second.size, it->second.ranges);
  };
}

void bind_io(py::module_& m) {
  py::class_<FileWriter>(
      m, "FileWriter",
      R"pbdoc(Writes a data file via a sibling temp file, renamed into place on commit(). One thread at a time.)pbdoc")
      .def(py::init([](py::handle path, const std::string& direct, bool fsync,
                       std::size_t staging_block_bytes, std::size_t staging_blocks,
                       std::optional<std::shared_ptr<BufferPool>> staging,
                       const std::string& test_fault) {
             const std::string p = path_from_py(path);
             const DirectMode mode = direct_mode_from_py(direct);
             const DirectFault fault = fault_from_py(test_fault);
             std::shared_ptr<BufferPool> pool = staging ? *staging : nullptr;
             GilRelease nogil;
             return std::make_unique<FileWriter>(p, mode, fsync, staging_block_bytes,
                                                 staging_blocks, fault, std::move(pool));
           }),
           py::arg("path"), py::arg("direct") = "auto", py::arg("fsync") = true,
           py::arg("staging_block_bytes") = std::size_t{8} << 20, py::arg("staging_blocks") = 3,
           py::kw_only(), py::arg("staging") = py::none(), py::arg("_test_fault") = "")
      .def(
          "append",
          [](FileWriter& self, py::handle data) {
            BufferRef b(data, false);
            GilRelease nogil;
            return self.append(b.data(), b.size());
          },
          py::arg("data"),
          R"pbdoc(Append bytes (copied before returning); returns their file offset.)pbdoc")
      .def(
          "write_items",
          [](FileWriter& self, py::handle items, std::size_t chunk_bytes, ThreadPool& pool,
             BufferPool& blocks) {
            const std::vector<WriteRequest> reqs = items_from_py(items);
            std::vector<WrittenItem> written;
            {
              InterruptWatch watch;  // Ctrl-C between chunks
              GilRelease nogil;
              written = encode_and_write(self, reqs, chunk_bytes, pool, blocks);
            }
            return written_to_py(written);
          },
          py::arg("items"), py::arg("chunk_bytes"), py::arg("pool"), py::arg("blocks"),
          R"pbdoc(Encode WriteItems (name, data_ptr, nbytes, params) in chunks on pool and append them in order; returns a WrittenItem (offset, stored_bytes, chunks) per item. SAFETY: each data_ptr must point to nbytes readable bytes that the caller keeps alive and unmodified until this returns.)pbdoc")
      .def("commit", &FileWriter::commit, py::call_guard<GilRelease>(),
           R"pbdoc(Flush, fsync, rename into place and fsync the directory.)pbdoc")
      .def("abort", &FileWriter::abort, py::call_guard<GilRelease>(),
           R"pbdoc(Discard the temp file (idempotent; no-op after commit).)pbdoc")
      .def_property_readonly("size", &FileWriter::size, R"pbdoc(Bytes appended so far.)pbdoc")
      .def_property_readonly("direct", &FileWriter::direct,
                             R"pbdoc(True while O_DIRECT is in effect.)pbdoc")
      .def_property_readonly("path", &FileWriter::path, R"pbdoc(The final path.)pbdoc")
      .def_property_readonly("temp_path", &FileWriter::temp_path,
                             R"pbdoc(The temp file's path.)pbdoc")
      .def_property_readonly("committed", &FileWriter::committed,
                             R"pbdoc(True after commit().)pbdoc")
      .def("__enter__", [](py::object self) { return self; })
      .def(
          "__exit__",
          [](FileWriter& self, py::args) {
            GilRelease nogil;
            self.abort();  // no-op when committed
            return false;
          },
          R"pbdoc(Abort unless committed.)pbdoc");

  m.def("set_read_piece_bytes", &set_read_piece_bytes, py::arg("bytes"),
        R"pbdoc(Bytes per read call of every native file read (process-wide; default 128 KiB,
at least 4096).)pbdoc");
  m.def("read_piece_bytes", &read_piece_bytes,
        R"pbdoc(Bytes per read call of every native file read.)pbdoc");

  m.def(
      "read_requests",
      [](py::handle requests, ThreadPool& pool, py::handle sources) {
        const std::vector<ReadRequest> reqs = requests_from_py(requests);
        const MemorySources memory(sources);
        ReadStats st;
        {
          InterruptWatch watch;  // Ctrl-C between chunks
          GilRelease nogil;
          st = read_requests(reqs, pool, memory.opener());
        }
        return record(Rec::ReadStats, st.bytes_read, st.chunks_decoded);
      },
      py::arg("requests"), py::arg("pool"), py::arg("sources") = py::none(),
      R"pbdoc(Read, verify and decode the chunks overlapping each ReadRequest's [lo, hi) into dst; returns ReadStats (bytes_read, chunks decoded). `sources` = {name: MemorySource(size, [MemoryRange(offset, data), ...])} serves those segment names from byte ranges already in memory (downloaded objects, chunks received from a peer), verified and decoded in place; other names are files. SAFETY: each dst must point to hi - lo writable bytes kept alive until this returns.)pbdoc");

  m.def(
      "read_stored",
      [](py::handle requests, ThreadPool& pool, py::handle sources) {
        const std::vector<ReadRequest> reqs = requests_from_py(requests);
        const MemorySources memory(sources);
        ReadStats st;
        {
          InterruptWatch watch;  // Ctrl-C between chunks
          GilRelease nogil;
          st = read_stored(reqs, pool, memory.opener());
        }
        return record(Rec::ReadStats, st.bytes_read, st.chunks_decoded);
      },
      py::arg("requests"), py::arg("pool"), py::arg("sources") = py::none(),
      R"pbdoc(Read the stored (still encoded) bytes of every chunk of each ReadRequest's segments back to back into dst, verifying each checksum without decoding; returns ReadStats (bytes_read, chunks copied). `sources` as for read_requests. SAFETY: each dst must point to the sum of the segments' stored_len bytes, kept alive until this returns.)pbdoc");

  m.def(
      "verify_segments",
      [](const std::string& name, py::handle segments, ThreadPool& pool, py::handle sources) {
        std::vector<ReadSegment> segs;
        try {
          segs = segments_from_py(segments);
        } catch (const FormatError&) {
          rethrow_with_context(std::current_exception(), "tensor '" + name + "'");
        }
        const MemorySources memory(sources);
        ReadStats st;
        {
          InterruptWatch watch;  // Ctrl-C between chunks
          GilRelease nogil;
          st = verify_segments(name, segs, pool, memory.opener());
        }
        return record(Rec::ReadStats, st.bytes_read, st.chunks_decoded);
      },
      py::arg("name"), py::arg("segments"), py::arg("pool"), py::arg("sources") = py::none(),
      R"pbdoc(Read and fully check every chunk of an item's segments (sizes, checksums, zstd frames), decoding each once with bounded memory; returns ReadStats (bytes_read, chunks checked). `sources` as for read_requests.)pbdoc");

  m.attr("MAX_CHUNK_BYTES") = kMaxChunkBytes;
}

}  // namespace pyckpt::bindings
