// ThreadPool and BufferPool: thin wrappers. Joining threads happens with the GIL released.
#include <pybind11/stl.h>

#include "bindings/bindings.hpp"
#include "core/buffer_pool.hpp"
#include "core/thread_pool.hpp"

namespace pyckpt::bindings {

void bind_pool(py::module_& m) {
  py::class_<ThreadPool>(m, "ThreadPool",
                         R"pbdoc(Fixed pool of native worker threads (started lazily).)pbdoc")
      .def(py::init<std::size_t>(), py::arg("num_threads"))
      .def_property_readonly("size", &ThreadPool::size, R"pbdoc(Number of worker threads.)pbdoc")
      .def("shutdown", &ThreadPool::shutdown, py::call_guard<GilRelease>(),
           R"pbdoc(Finish queued work and join the workers; later use raises RuntimeError.)pbdoc")
      .def("__enter__", [](py::object self) { return self; })
      .def(
          "__exit__",
          [](ThreadPool& self, py::args) {
            GilRelease nogil;
            self.shutdown();
            return false;
          },
          R"pbdoc(Shut the pool down.)pbdoc");

  m.def("set_host_cache_limit", &set_host_cache_limit, py::arg("bytes"),
        R"pbdoc(Bound on the idle pageable host memory (freed pool blocks and thread scratch of
1 MiB or more) the process keeps for reuse; 0 keeps none. Unmaps the oldest beyond it.)pbdoc");
  m.def(
      "host_cache_info",
      [] {
        py::dict d;
        d["bytes"] = host_cache_bytes();
        d["limit"] = host_cache_limit();
        return d;
      },
      R"pbdoc(The host cache: {"bytes": held now, "limit": its bound}.)pbdoc");

  py::class_<BufferPool, std::shared_ptr<BufferPool>>(
      m, "BufferPool",
      R"pbdoc(Bounded pool of 4 KiB-aligned host blocks, reused across calls.)pbdoc")
      .def(py::init([](std::size_t block_bytes, std::size_t max_blocks) {
             return BufferPool::create(block_bytes, max_blocks);
           }),
           py::arg("block_bytes"), py::arg("max_blocks"))
      .def_property_readonly("block_bytes", &BufferPool::block_bytes,
                             R"pbdoc(Block size in bytes (a multiple of 4096).)pbdoc")
      .def(
          "stats", [](const BufferPool& self) { return pool_stats(self); },
          R"pbdoc(Counters as a dict with the PoolStats field names.)pbdoc");
}

py::dict pool_stats(const BufferPool& pool) {
  const PoolStats s = pool.stats();
  py::dict d;
  d["block_bytes"] = s.block_bytes;
  d["max_blocks"] = s.max_blocks;
  d["allocated"] = s.allocated;
  d["in_use"] = s.in_use;
  d["peak_in_use"] = s.peak_in_use;
  d["acquires"] = s.acquires;
  d["pinned"] = s.pinned;
  return d;
}

}  // namespace pyckpt::bindings
