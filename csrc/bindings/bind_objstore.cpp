// Object-store bindings: BlockWriter (encoded chunks handed to a Python uploader in owned
// blocks that export the buffer protocol, so the client reads them without a copy). Downloaded
// ranges are read through read_requests/verify_segments(sources=...) (bind_io.cpp). The GIL is
// held only to hand a block over; encoding runs without it.
#include <pybind11/stl.h>

#include <cerrno>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "bindings/bindings.hpp"
#include "bindings/core_convert.hpp"
#include "bindings/interrupt.hpp"
#include "bindings/io_convert.hpp"
#include "core/chunk_reader.hpp"
#include "core/encode_pipeline.hpp"
#include "core/error.hpp"
#include "core/memory_storage.hpp"

namespace pyckpt::bindings {

namespace {

/** Encoded bytes handed to Python; exports a read-only buffer that keeps them alive. When
 *  Python lets go of it (the uploader is done), its buffer goes back to the recycler. */
struct Block {
  std::vector<std::uint8_t> bytes;
  std::shared_ptr<BlockRecycler> recycler;

  Block(std::vector<std::uint8_t>&& b, std::shared_ptr<BlockRecycler> r)
      : bytes(std::move(b)), recycler(std::move(r)) {}
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  ~Block() {
    if (recycler) recycler->give(std::move(bytes));
  }
};

/** BlockSink whose blocks go to a Python callable; remembers the callable's exception. */
class BlockWriter {
 public:
  BlockWriter(std::string name, std::size_t block_bytes, py::object on_block,
              std::size_t spare_blocks)
      : _on_block(std::move(on_block)),
        _recycler(spare_blocks > 0 ? std::make_shared<BlockRecycler>(spare_blocks) : nullptr),
        _sink(
            std::move(name), block_bytes,
            [this](std::vector<std::uint8_t>&& bytes) { hand_over(std::move(bytes)); }, _recycler) {
  }

  ~BlockWriter() { _sink.abort(); }

  /** Frees the spare buffers once no more blocks will be made (after commit or abort). */
  void close_recycler() noexcept {
    if (_recycler) _recycler->close();
  }

  BlockSink& sink() { return _sink; }
  std::size_t reused_blocks() const { return _recycler ? _recycler->reused() : 0; }

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
    auto block = std::make_shared<Block>(std::move(bytes), _recycler);
    try {
      _on_block(py::cast(std::move(block)));
    } catch (py::error_already_set& e) {
      _error = e.value();
      throw SysError(EIO, "upload", _sink.name(), py::str(e.value()).cast<std::string>());
    }
  }

  py::object _on_block;
  py::object _error;
  std::shared_ptr<BlockRecycler> _recycler;  // before _sink, which holds it too
  BlockSink _sink;
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
      R"pbdoc(Encodes chunks into blocks of about block_bytes and calls on_block(block) with each (a read-only buffer), in order, the last one in commit(). Up to spare_blocks buffers of blocks the uploader has let go of are reused for later blocks. One thread at a time.)pbdoc")
      .def(py::init<std::string, std::size_t, py::object, std::size_t>(), py::arg("name"),
           py::arg("block_bytes"), py::arg("on_block"), py::arg("spare_blocks") = 0)
      .def(
          "append",
          [](BlockWriter& self, py::handle data) {
            BufferRef b(data, false);
            try {
              GilRelease nogil;
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
              InterruptWatch watch;  // Ctrl-C between chunks; progress of pyckpt.save
              GilRelease nogil;
              written = encode_and_write(self.sink(), reqs, chunk_bytes, pool, blocks);
            } catch (const py::error_already_set&) {
              throw;
            } catch (...) {
              self.rethrow(std::current_exception());
            }
            return written_to_py(written);
          },
          py::arg("items"), py::arg("chunk_bytes"), py::arg("pool"), py::arg("blocks"),
          R"pbdoc(As FileWriter.write_items. SAFETY: each data_ptr must point to nbytes readable bytes kept alive and unmodified until this returns.)pbdoc")
      .def(
          "commit",
          [](BlockWriter& self) {
            try {
              GilRelease nogil;
              self.sink().commit();
              self.close_recycler();
            } catch (const py::error_already_set&) {
              throw;
            } catch (...) {
              self.rethrow(std::current_exception());
            }
          },
          R"pbdoc(Hand over the last block.)pbdoc")
      .def(
          "abort",
          [](BlockWriter& self) {
            self.sink().abort();
            self.close_recycler();
          },
          R"pbdoc(Drop buffered bytes (idempotent; no-op after commit).)pbdoc")
      .def_property_readonly(
          "size", [](BlockWriter& self) { return self.sink().size(); },
          R"pbdoc(Bytes appended so far.)pbdoc")
      .def_property_readonly(
          "committed", [](BlockWriter& self) { return self.sink().committed(); },
          R"pbdoc(True after commit().)pbdoc")
      .def_property_readonly(
          "reused_blocks", [](BlockWriter& self) { return self.reused_blocks(); },
          R"pbdoc(How many blocks were written into a recycled buffer.)pbdoc");
}

}  // namespace pyckpt::bindings
