// Bindings of the run-time loaded CUDA runtime, the pinned pool and the stager. Argument
// conversion and GIL release only: the logic lives in core/cuda_runtime.* and core/stager.*.
//
// Block objects export the buffer protocol themselves (so `memoryview(block).obj is block` and a
// torch.frombuffer view keeps the block alive). After release() the memory stays allocated (the
// object keeps the pool alive) but may be reused by the pool, and new views are refused.
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/bindings.hpp"
#include "bindings/records.hpp"
#include "core/buffer_pool.hpp"
#include "core/cuda_runtime.hpp"
#include "core/stager.hpp"

namespace pyckpt::bindings {

namespace {

// A StageItem (name, device_ptr, nbytes) and a CopySpec (offset, device_ptr, nbytes, name), or
// tuples of those layouts.
using ItemTuple = std::tuple<std::string, std::uintptr_t, std::size_t>;
using SpecTuple = std::tuple<std::size_t, std::uintptr_t, std::size_t, std::string>;

// A leased pool block seen from Python.
struct HostBlock {
  Lease lease;
  std::byte* data = nullptr;
  std::size_t size = 0;
  std::shared_ptr<BufferPool> keep;  // memory stays valid for views that outlive release()

  explicit HostBlock(Lease l, std::shared_ptr<BufferPool> pool)
      : lease(std::move(l)), data(lease.data()), size(lease.size()), keep(std::move(pool)) {}
  bool released() const { return !lease; }
};

// A staged device->host block seen from Python.
struct PyStagedBlock {
  StagedBlock block;
  std::byte* data = nullptr;
  std::size_t capacity = 0;
  std::shared_ptr<BufferPool> keep;
};

// Own handle type (not BufferPool itself) so that another module may bind BufferPool freely.
struct PinnedPool {
  std::shared_ptr<BufferPool> pool;
};

std::shared_ptr<PinnedPool> make_pinned_pool(const std::shared_ptr<CudaRuntime>& rt,
                                             std::size_t block_bytes, std::size_t max_blocks) {
  std::shared_ptr<HostAllocator> alloc;
  if (rt) alloc = std::make_shared<PinnedHostAllocator>(rt);
  return std::make_shared<PinnedPool>(
      PinnedPool{BufferPool::create(block_bytes, max_blocks, std::move(alloc))});
}

std::vector<CopySpec> to_specs(const std::vector<SpecTuple>& specs) {
  std::vector<CopySpec> out;
  out.reserve(specs.size());
  for (const auto& [off, ptr, n, name] : specs) out.push_back(CopySpec{off, ptr, n, name});
  return out;
}

py::buffer_info block_buffer(std::byte* data, std::size_t size, bool released) {
  if (released) throw py::value_error("the block was released");
  return py::buffer_info(data, 1, py::format_descriptor<std::uint8_t>::format(), 1,
                         {static_cast<py::ssize_t>(size)}, {static_cast<py::ssize_t>(1)});
}

}  // namespace

void bind_cuda(py::module_& m) {
  py::class_<CudaRuntime, std::shared_ptr<CudaRuntime>>(
      m, "CudaRuntime", "A CUDA runtime loaded at run time (available is False without CUDA).")
      .def_static(
          "load",
          [](std::optional<std::string> path) { return CudaRuntime::load(path.value_or("")); },
          py::arg("path") = py::none(),
          R"pbdoc(Loads the runtime torch already mapped (or `path`); never raises for a missing one.)pbdoc")
      .def_property_readonly("available", &CudaRuntime::available)
      .def_property_readonly("error", &CudaRuntime::error)
      .def_property_readonly("library", &CudaRuntime::library)
      .def_property_readonly("reused_loaded", &CudaRuntime::reused_loaded)
      .def_property_readonly("device_count", &CudaRuntime::device_count);

  py::class_<HostBlock, std::shared_ptr<HostBlock>>(m, "HostBlock", py::buffer_protocol(),
                                                    "A leased 4 KiB-aligned pool block.")
      .def_buffer([](HostBlock& b) { return block_buffer(b.data, b.size, b.released()); })
      .def_property_readonly("nbytes", [](const HostBlock& b) { return b.size; })
      .def_property_readonly(
          "address", [](const HostBlock& b) { return reinterpret_cast<std::uintptr_t>(b.data); })
      .def_property_readonly("released", &HostBlock::released)
      .def(
          "release", [](HostBlock& b) { b.lease.reset(); },
          R"pbdoc(Returns the block to its pool (views made earlier must no longer be used).)pbdoc")
      .def("__enter__", [](std::shared_ptr<HostBlock> b) { return b; })
      .def("__exit__", [](HostBlock& b, py::args) { b.lease.reset(); });

  py::class_<PinnedPool, std::shared_ptr<PinnedPool>>(
      m, "PinnedPool", "Bounded pool of 4 KiB-aligned host blocks, page-locked through a runtime.")
      .def(py::init(&make_pinned_pool), py::arg("runtime"), py::arg("block_bytes"),
           py::arg("max_blocks"))
      .def_property_readonly("block_bytes",
                             [](const PinnedPool& p) { return p.pool->block_bytes(); })
      .def(
          "acquire",
          [](const PinnedPool& p) {
            Lease l;
            {
              GilRelease nogil;
              l = p.pool->acquire();
            }
            return std::make_shared<HostBlock>(std::move(l), p.pool);
          },
          R"pbdoc(Leases a block, waiting (GIL released) while the pool is exhausted.)pbdoc")
      .def(
          "try_acquire",
          [](const PinnedPool& p) -> std::shared_ptr<HostBlock> {
            Lease l = p.pool->try_acquire();
            if (!l) return nullptr;
            return std::make_shared<HostBlock>(std::move(l), p.pool);
          },
          R"pbdoc(Leases a block if one is available now, else returns None.)pbdoc")
      .def("stats", [](const PinnedPool& p) { return pool_stats(*p.pool); });

  py::class_<StagerEvent, std::shared_ptr<StagerEvent>>(m, "StagerEvent",
                                                        "Completion of queued staging copies.")
      .def("wait", &StagerEvent::wait, py::call_guard<GilRelease>(),
           R"pbdoc(Blocks (GIL released) until the copies completed; raises CudaError.)pbdoc")
      .def("ready", &StagerEvent::ready, R"pbdoc(True when the copies completed.)pbdoc");

  py::class_<PyStagedBlock, std::shared_ptr<PyStagedBlock>>(
      m, "StagedBlock", py::buffer_protocol(), "A pool block filled by device-to-host copies.")
      .def_buffer([](PyStagedBlock& b) {
        return block_buffer(b.data, b.capacity, !static_cast<bool>(b.block));
      })
      .def(
          "wait",
          [](PyStagedBlock& b) {
            GilRelease nogil;
            b.block.wait();
          },
          R"pbdoc(Blocks (GIL released) until the block's copies completed; raises CudaError.)pbdoc")
      .def("ready", [](const PyStagedBlock& b) { return b.block.ready(); })
      .def_property_readonly(
          "pieces",
          [](const PyStagedBlock& b) {
            py::list out;
            for (const StagePiece& p : b.block.pieces()) {
              out.append(record(Rec::StagePiece, p.item, p.item_offset, p.block_offset, p.nbytes));
            }
            return out;
          },
          R"pbdoc(The StagePieces (item, item_offset, block_offset, nbytes) the block holds.)pbdoc")
      .def_property_readonly("used", [](const PyStagedBlock& b) { return b.block.used(); })
      .def_property_readonly("capacity", [](const PyStagedBlock& b) { return b.capacity; })
      .def_property_readonly(
          "address",
          [](const PyStagedBlock& b) { return reinterpret_cast<std::uintptr_t>(b.data); })
      .def_property_readonly("released",
                             [](const PyStagedBlock& b) { return !static_cast<bool>(b.block); })
      .def(
          "release",
          [](PyStagedBlock& b) {
            GilRelease nogil;
            b.block.reset();
          },
          R"pbdoc(Returns the block to the pool (waiting for copies still running into it).)pbdoc");

  py::class_<D2HStream, std::shared_ptr<D2HStream>>(m, "D2HStream",
                                                    "Items being staged to host, block by block.")
      .def(
          "next",
          [](D2HStream& s) -> std::shared_ptr<PyStagedBlock> {
            StagedBlock b;
            {
              GilRelease nogil;
              b = s.next();
            }
            if (!b) return nullptr;
            auto out = std::make_shared<PyStagedBlock>();
            out->data = b.data();
            out->capacity = b.capacity();
            out->keep = s.pool();
            out->block = std::move(b);
            return out;
          },
          R"pbdoc(Queues the next block's copies (waiting for a free block); None when done.)pbdoc")
      .def_property_readonly("done", &D2HStream::done);

  py::class_<Stager, std::shared_ptr<Stager>>(
      m, "Stager", "Device<->host staging through pool blocks on a side stream.")
      .def(py::init([](std::shared_ptr<CudaRuntime> rt, const PinnedPool& pool, int device) {
             return Stager::create(std::move(rt), pool.pool, device);
           }),
           py::arg("runtime"), py::arg("pool"), py::arg("device"))
      .def(
          "stream_to_host",
          [](const std::shared_ptr<Stager>& st, const std::vector<ItemTuple>& items,
             std::uintptr_t stream) {
            std::vector<StageItem> v;
            v.reserve(items.size());
            for (const auto& [name, ptr, n] : items) v.push_back(StageItem{name, ptr, n});
            GilRelease nogil;
            return std::make_shared<D2HStream>(st->stream_to_host(std::move(v), stream));
          },
          py::arg("items"), py::arg("stream"),
          R"pbdoc(Starts staging StageItems (name, device_ptr, nbytes), ordered after `stream`.)pbdoc")
      .def(
          "copy_into",
          [](Stager& st, HostBlock& region, const std::vector<SpecTuple>& specs,
             std::uintptr_t stream) {
            std::vector<CopySpec> v = to_specs(specs);
            GilRelease nogil;
            return std::make_shared<StagerEvent>(st.copy_into(region.lease, v, stream));
          },
          py::arg("region"), py::arg("specs"), py::arg("stream"),
          R"pbdoc(Copies CopySpecs (offset, device_ptr, nbytes, name) into `region` after `stream`.)pbdoc")
      .def(
          "acquire_upload_block",
          [](Stager& st) {
            Lease l;
            {
              GilRelease nogil;
              l = st.acquire_upload_block();
            }
            return std::make_shared<HostBlock>(std::move(l), st.pool());
          },
          R"pbdoc(A block to fill for upload(); recycles blocks whose uploads completed.)pbdoc")
      .def(
          "upload",
          [](Stager& st, HostBlock& block, const std::vector<SpecTuple>& specs) {
            std::vector<CopySpec> v = to_specs(specs);
            Lease l = std::move(block.lease);  // the stager keeps it until the copies completed
            GilRelease nogil;
            st.upload(std::move(l), v);
          },
          py::arg("block"), py::arg("specs"),
          R"pbdoc(Queues CopySpecs (offset, device_ptr, nbytes, name) as host-to-device copies; takes the block.)pbdoc")
      .def("order_after", &Stager::order_after, py::arg("stream"), py::call_guard<GilRelease>(),
           R"pbdoc(Orders later side-stream work after the work queued on `stream`.)pbdoc")
      .def("finish_uploads", &Stager::finish_uploads, py::arg("stream"),
           py::call_guard<GilRelease>(),
           R"pbdoc(Orders `stream` after every queued upload (no host wait).)pbdoc")
      .def("synchronize", &Stager::synchronize, py::call_guard<GilRelease>(),
           R"pbdoc(Waits for the side stream and recycles every upload block.)pbdoc")
      .def_property_readonly("side_stream", &Stager::side_stream)
      .def_property_readonly("device", &Stager::device)
      .def("stats", [](const Stager& st) {
        const StagerStats s = st.stats();
        py::dict d;
        d["d2h_copies"] = s.d2h_copies;
        d["d2h_bytes"] = s.d2h_bytes;
        d["h2d_copies"] = s.h2d_copies;
        d["h2d_bytes"] = s.h2d_bytes;
        d["fences"] = s.fences;
        d["events_created"] = s.events_created;
        d["uploads_pending"] = s.uploads_pending;
        return d;
      });
}

}  // namespace pyckpt::bindings
