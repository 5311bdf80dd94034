// Object-store bindings: BlockWriter (encoded chunks handed to a Python uploader in owned
// blocks that export the buffer protocol, so the client reads them without a copy) and reads
// and verification of chunks from ranges a client downloaded (buffers lent to the chunk path
// through ChunkSource::view_at, so they are verified and decoded in place). The GIL is held
// only to hand a block over or to take buffers; encoding, checking and decoding run without it.
#include <pybind11/stl.h>

#include <cerrno>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "bindings/bindings.hpp"
#include "bindings/core_convert.hpp"
#include "bindings/io_convert.hpp"
#include "core/chunk_reader.hpp"
#include "core/encode_pipeline.hpp"
#include "core/error.hpp"
#include "core/memory_storage.hpp"

namespace pyckpt::bindings {

namespace {

/** Encoded bytes handed to Python; exports a read-only buffer that keeps them alive. */
struct Block {
  std::vector<std::uint8_t> bytes;
};

/** BlockSink whose blocks go to a Python callable; remembers the callable's exception. */
class BlockWriter {
 public:
  BlockWriter(std::string name, std::size_t block_bytes, py::object on_block)
      : _on_block(std::move(on_block)),
        _sink(std::move(name), block_bytes,
              [this](std::vector<std::uint8_t>&& bytes) { hand_over(std::move(bytes)); }) {}

  ~BlockWriter() { _sink.abort(); }

  BlockSink& sink() { return _sink; }

  /** Re-raises the uploader's own exception (with the GIL held) if it caused `current`. */
  [[noreturn]] void rethrow(std::exception_ptr current) {
    if (_error) {
      py::object err = std::exchange(_error, py::object());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
      throw py::error_already_set();
    }
    std::rethrow_exception(current);
  }

 private:
  void hand_over(std::vector<std::uint8_t>&& bytes) {
    py::gil_scoped_acquire gil;
    auto block = std::make_shared<Block>();
    block->bytes = std::move(bytes);
    try {
      _on_block(py::cast(std::move(block)));
    } catch (py::error_already_set& e) {
      _error = e.value();
      throw SysError(EIO, "upload", _sink.name(), py::str(e.value()).cast<std::string>());
    }
  }

  py::object _on_block;
  py::object _error;
  BlockSink _sink;
};

/** Keeps the downloaded buffers of one call alive and opens MemorySources over them. */
class Downloads {
 public:
  /** sources: {name: (size, [(offset, buffer), ...])}. Needs the GIL. */
  explicit Downloads(py::handle sources) {
    for (auto kv : py::reinterpret_borrow<py::dict>(sources)) {
      const std::string name = py::cast<std::string>(kv.first);
      py::tuple t = py::reinterpret_borrow<py::tuple>(kv.second);
      Entry e;
      e.size = u64_from_py(t[0], "size");
      for (py::handle r : py::reinterpret_borrow<py::iterable>(t[1])) {
        py::tuple rt = py::reinterpret_borrow<py::tuple>(r);
        _buffers.push_back(std::make_unique<BufferRef>(rt[1], false));
        const BufferRef& b = *_buffers.back();
        e.ranges.push_back(MemoryRange{u64_from_py(rt[0], "offset"),
                                       static_cast<const std::uint8_t*>(b.data()), b.size()});
      }
      _entries.emplace(name, std::move(e));
    }
  }

  /** Drops the buffer views; needs the GIL. */
  ~Downloads() { _buffers.clear(); }

  SourceOpener opener() const {
    return [this](const std::string& name) -> std::unique_ptr<ChunkSource> {
      auto it = _entries.find(name);
      if (it == _entries.end()) throw SysError(ENOENT, "open", name, "object not downloaded");
      return std::make_unique<MemorySource>(name, it->second.size, it->second.ranges);
    };
  }

 private:
  struct Entry {
    std::uint64_t size = 0;
    std::vector<MemoryRange> ranges;
  };
  std::vector<std::unique_ptr<BufferRef>> _buffers;
  std::map<std::string, Entry> _entries;
};

}  // namespace

void bind_objstore(py::module_& m) {
  py::class_<Block, std::shared_ptr<Block>>(
      m, "Block", py::buffer_protocol(),
      R"pbdoc(Encoded bytes handed to an uploader; a read-only buffer (no copy).)pbdoc")
      .def_buffer([](Block& b) {
        return py::buffer_info(b.bytes.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {b.bytes.size()}, {1}, /*readonly=*/true);
      })
      .def("__len__", [](const Block& b) { return b.bytes.size(); });

  py::class_<BlockWriter>(
      m, "BlockWriter",
      R"pbdoc(Encodes chunks into blocks of about block_bytes and calls on_block(block) with each (a read-only buffer), in order, the last one in commit(). One thread at a time.)pbdoc")
      .def(py::init<std::string, std::size_t, py::object>(), py::arg("name"),
           py::arg("block_bytes"), py::arg("on_block"))
      .def(
          "append",
          [](BlockWriter& self, py::handle data) {
            BufferRef b(data, false);
            try {
              py::gil_scoped_release nogil;
              return self.sink().append(b.data(), b.size());
            } catch (const py::error_already_set&) {
              throw;
            } catch (...) {
              self.rethrow(std::current_exception());
            }
          },
          py::arg("data"), R"pbdoc(Append bytes (copied); returns their object offset.)pbdoc")
      .def(
          "write_items",
          [](BlockWriter& self, py::handle items, std::size_t chunk_bytes, ThreadPool& pool,
             BufferPool& blocks) {
            const std::vector<WriteRequest> reqs = items_from_py(items);
            std::vector<WrittenItem> written;
            try {
              py::gil_scoped_release nogil;
              written = encode_and_write(self.sink(), reqs, chunk_bytes, pool, blocks);
            } catch (const py::error_already_set&) {
              throw;
            } catch (...) {
              self.rethrow(std::current_exception());
            }
            py::list out;
            for (const WrittenItem& w : written) {
              py::list chunks;
              for (const ChunkRecord& c : w.chunks) chunks.append(record_to_py(c));
              out.append(py::make_tuple(w.offset, w.stored_bytes, chunks));
            }
            return out;
          },
          py::arg("items"), py::arg("chunk_bytes"), py::arg("pool"), py::arg("blocks"),
          R"pbdoc(As FileWriter.write_items. SAFETY: each data_ptr must point to nbytes readable bytes kept alive and unmodified until this returns.)pbdoc")
      .def(
          "commit",
          [](BlockWriter& self) {
            try {
              py::gil_scoped_release nogil;
              self.sink().commit();
            } catch (const py::error_already_set&) {
              throw;
            } catch (...) {
              self.rethrow(std::current_exception());
            }
          },
          R"pbdoc(Hand over the last block.)pbdoc")
      .def(
          "abort", [](BlockWriter& self) { self.sink().abort(); },
          R"pbdoc(Drop buffered bytes (idempotent; no-op after commit).)pbdoc")
      .def_property_readonly(
          "size", [](BlockWriter& self) { return self.sink().size(); },
          R"pbdoc(Bytes appended so far.)pbdoc")
      .def_property_readonly(
          "committed", [](BlockWriter& self) { return self.sink().committed(); },
          R"pbdoc(True after commit().)pbdoc");

  m.def(
      "read_requests_from",
      [](py::handle requests, ThreadPool& pool, py::handle sources) {
        const std::vector<ReadRequest> reqs = requests_from_py(requests);
        Downloads dl(sources);
        ReadStats st;
        {
          py::gil_scoped_release nogil;
          st = read_requests(reqs, pool, dl.opener());
        }
        return py::make_tuple(st.bytes_read, st.chunks_decoded);
      },
      py::arg("requests"), py::arg("pool"), py::arg("sources"),
      R"pbdoc(As read_requests, with segment paths naming objects of sources = {name: (size, [(offset, buffer), ...])}: downloaded, non-overlapping ranges holding every chunk needed, verified and decoded in place. SAFETY: as read_requests.)pbdoc");

  m.def(
      "verify_segments_from",
      [](const std::string& name, py::handle segments, ThreadPool& pool, py::handle sources) {
        std::vector<ReadSegment> segs;
        try {
          segs = segments_from_py(segments);
        } catch (const FormatError&) {
          rethrow_with_context(std::current_exception(), "tensor '" + name + "'");
        }
        Downloads dl(sources);
        ReadStats st;
        {
          py::gil_scoped_release nogil;
          st = verify_segments(name, segs, pool, dl.opener());
        }
        return py::make_tuple(st.bytes_read, st.chunks_decoded);
      },
      py::arg("name"), py::arg("segments"), py::arg("pool"), py::arg("sources"),
      R"pbdoc(As verify_segments, over downloaded ranges (see read_requests_from).)pbdoc");
}

}  // namespace pyckpt::bindings
