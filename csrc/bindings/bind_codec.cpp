// Chunk codec and checksum bindings (mostly for tests and tools; the pipelines live in bind_io).
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "bindings/bindings.hpp"
#include "bindings/core_convert.hpp"
#include "bindings/records.hpp"
#include "core/checksum.hpp"
#include "core/codec.hpp"
#include "core/error.hpp"

namespace pyckpt::bindings {

namespace {

ChunkRecord encode_into(py::handle data, const CodecParams& p, py::handle out) {
  BufferRef src(data, false);
  BufferRef dst(out, true);
  const std::size_t need = max_encoded_size(src.size(), p);
  if (dst.size() < need) {
    throw py::value_error("output buffer has " + std::to_string(dst.size()) +
                          " bytes, encoding needs " + std::to_string(need));
  }
  GilRelease nogil;
  return encode_chunk(src.data(), src.size(), p, dst.data());
}

Codec codec_from_name(const std::string& name) {
  if (name == "none") return Codec::None;
  if (name == "zstd") return Codec::Zstd;
  throw py::value_error("codec must be 'none' or 'zstd', got '" + name + "'");
}

Transform transform_from_name(const std::string& name) {
  if (name == "none") return Transform::None;
  if (name == "group") return Transform::ByteGroup;
  if (name == "group_rotl1") return Transform::ByteGroupRotl1;
  throw py::value_error("transform must be 'none', 'group' or 'group_rotl1', got '" + name + "'");
}

const char* codec_name(Codec c) { return c == Codec::Zstd ? "zstd" : "none"; }

const char* transform_name(Transform t) {
  switch (t) {
    case Transform::ByteGroup: return "group";
    case Transform::ByteGroupRotl1: return "group_rotl1";
    default: return "none";
  }
}

// The one place codec parameters are checked: every CodecParams a Python caller holds passed it.
CodecParams make_params(const std::string& codec, int level, std::uint32_t elem_size,
                        const std::string& transform, double raw_threshold) {
  CodecParams p;
  p.codec = codec_from_name(codec);
  p.level = level;
  p.elem_size = elem_size;
  p.transform = transform_from_name(transform);
  p.raw_threshold = raw_threshold;
  validate_params(p);  // std::invalid_argument -> ValueError
  return p;
}

py::tuple params_state(const CodecParams& p) {
  return py::make_tuple(codec_name(p.codec), p.level, p.elem_size, transform_name(p.transform),
                        p.raw_threshold);
}

std::uint32_t plane_count(std::uint32_t elem_size) {
  if (elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8) {
    throw py::value_error("elem_size must be 1, 2, 4 or 8");
  }
  return elem_size;
}

// Borrows the buffers of a sequence of objects (numpy arrays, bytes, ...) while the GIL is
// released; the views are released (GIL held) when this goes out of scope.
struct BorrowedSpans {
  explicit BorrowedSpans(py::handle objects) {
    for (py::handle obj : py::reinterpret_borrow<py::sequence>(objects)) {
      refs.push_back(std::make_unique<BufferRef>(obj, false));
      spans.push_back(ByteSpan{refs.back()->data(), refs.back()->size()});
    }
  }
  std::vector<std::unique_ptr<BufferRef>> refs;
  std::vector<ByteSpan> spans;
};

}  // namespace

void bind_codec(py::module_& m) {
  py::class_<CodecParams>(m, "CodecParams", R"pbdoc(
How a run of chunks is encoded; immutable, validated when made.

Args:
    codec: "none" (store raw bytes) or "zstd".
    level: zstd level, in [ZSTD_minCLevel(), ZSTD_maxCLevel()] (ignored by "none").
    elem_size: element size in bytes for byte grouping: 1, 2, 4 or 8.
    transform: "none", "group" (split elements into byte planes) or "group_rotl1" (rotate each
        element left by one bit first: the exponent of bf16/fp32 lands in one plane).
    raw_threshold: a plane is stored compressed only when that takes fewer than
        raw_threshold * its raw bytes, in (0, 1] (default 0.97).

Raises:
    ValueError: a field out of its range, naming it.
)pbdoc")
      .def(py::init(&make_params), py::arg("codec"), py::arg("level") = 1, py::arg("elem_size") = 1,
           py::arg("transform") = "none", py::arg("raw_threshold") = CodecParams{}.raw_threshold)
      .def_property_readonly("codec", [](const CodecParams& p) { return codec_name(p.codec); })
      .def_property_readonly("level", [](const CodecParams& p) { return p.level; })
      .def_property_readonly("elem_size", [](const CodecParams& p) { return p.elem_size; })
      .def_property_readonly("transform",
                             [](const CodecParams& p) { return transform_name(p.transform); })
      .def_property_readonly("raw_threshold", [](const CodecParams& p) { return p.raw_threshold; })
      .def("__eq__",
           [](const CodecParams& a, py::handle b) {
             if (!py::isinstance<CodecParams>(b)) return false;
             return params_state(a).equal(params_state(b.cast<const CodecParams&>()));
           })
      .def("__hash__", [](const CodecParams& p) { return py::hash(params_state(p)); })
      .def("__repr__",
           [](const CodecParams& p) {
             return py::str(
                        "CodecParams(codec={!r}, level={}, elem_size={}, transform={!r}, "
                        "raw_threshold={})")
                 .format(codec_name(p.codec), p.level, p.elem_size, transform_name(p.transform),
                         p.raw_threshold);
           })
      .def(py::pickle([](const CodecParams& p) { return params_state(p); },
                      [](const py::tuple& t) {
                        if (t.size() != 5) throw py::value_error("bad CodecParams state");
                        return make_params(t[0].cast<std::string>(), t[1].cast<int>(),
                                           t[2].cast<std::uint32_t>(), t[3].cast<std::string>(),
                                           t[4].cast<double>());
                      }));

  m.def(
      "block_digests",
      [](py::handle buffers, std::size_t block, const std::vector<std::uint64_t>& seeds,
         std::size_t threads) {
        BorrowedSpans b(buffers);
        GilRelease nogil;
        return block_digests(b.spans, seeds, block, threads);
      },
      py::arg("buffers"), py::arg("block"), py::arg("seeds"), py::arg("threads") = 1,
      R"pbdoc(Per buffer: XXH64 (seed seeds[i]) of the little-endian u64 array of the XXH64s of its block-byte pieces (the last may be shorter). GIL released, up to threads threads.)pbdoc");

  m.def(
      "sampled_digests",
      [](py::handle buffers, std::size_t block, std::size_t count, std::size_t threads) {
        BorrowedSpans b(buffers);
        GilRelease nogil;
        return sampled_digests(b.spans, block, count, threads);
      },
      py::arg("buffers"), py::arg("block"), py::arg("count"), py::arg("threads") = 1,
      R"pbdoc(Per buffer of n bytes: block_digests (seed n) of its blocks chosen by sampled_blocks, read at most count * block bytes. GIL released, up to threads threads.)pbdoc");

  m.def(
      "sampled_blocks",
      [](std::uint64_t nbytes, std::size_t block, std::size_t count, std::uint64_t first,
         std::uint64_t last) { return sampled_blocks(nbytes, block, count, first, last); },
      py::arg("nbytes"), py::arg("block"), py::arg("count"), py::arg("first"), py::arg("last"),
      R"pbdoc(Indices of the blocks a sampled digest of nbytes reads (all if at most count; else the first, the last and one per stratum between, seeded by first and last, the XXH64s of the first and last blocks).)pbdoc");

  m.def(
      "xxh64",
      [](py::handle data, std::uint64_t seed) {
        BufferRef b(data, false);
        GilRelease nogil;
        return xxh64(b.data(), b.size(), seed);
      },
      py::arg("data"), py::arg("seed") = 0, R"pbdoc(XXH64 of a contiguous buffer.)pbdoc");

  m.def(
      "zstd_frame",
      [](py::handle data, int level) {
        BufferRef b(data, false);
        std::vector<std::uint8_t> out;
        {
          GilRelease nogil;
          out = zstd_frame(b.data(), b.size(), level);
        }
        return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
      },
      py::arg("data"), py::arg("level") = 3,
      R"pbdoc(One standard zstd frame of a contiguous buffer, with its content size.)pbdoc");

  m.def(
      "zstd_unframe",
      [](py::handle data, std::uint64_t max_len) {
        BufferRef b(data, false);
        std::vector<std::uint8_t> out;
        {
          GilRelease nogil;
          out = zstd_unframe(b.data(), b.size(), static_cast<std::size_t>(max_len));
        }
        return py::bytes(reinterpret_cast<const char*>(out.data()), out.size());
      },
      py::arg("data"), py::arg("max_len"),
      R"pbdoc(The content of exactly one zstd frame declaring its content size, at most max_len bytes (checked before decoding): CompressionError / CheckpointFormatError otherwise.)pbdoc");

  m.def(
      "max_encoded_size",
      [](std::uint64_t raw_len, const CodecParams& params) {
        return max_encoded_size(static_cast<std::size_t>(raw_len), params);
      },
      py::arg("raw_len"), py::arg("params"),
      R"pbdoc(Upper bound of a chunk's stored size for these params.)pbdoc");

  m.def(
      "encode_chunk",
      [](py::handle data, const CodecParams& p) {
        BufferRef src(data, false);
        std::unique_ptr<std::uint8_t[]> out(new std::uint8_t[max_encoded_size(src.size(), p) + 1]);
        ChunkRecord rec;
        {
          GilRelease nogil;
          rec = encode_chunk(src.data(), src.size(), p, out.get());
        }
        return record(Rec::EncodedChunk,
                      py::bytes(reinterpret_cast<const char*>(out.get()), rec.stored_len),
                      record_to_py(rec));
      },
      py::arg("data"), py::arg("params"),
      R"pbdoc(Encode one chunk; returns an EncodedChunk (stored bytes, Chunk record).)pbdoc");

  m.def(
      "encode_chunk_into",
      [](py::handle data, const CodecParams& params, py::handle out) {
        return record_to_py(encode_into(data, params, out));
      },
      py::arg("data"), py::arg("params"), py::arg("out"),
      R"pbdoc(Encode one chunk into a writable buffer of max_encoded_size bytes; returns the Chunk record (stored bytes are out[:sum of plane lengths]).)pbdoc");

  m.def(
      "decode_chunk",
      [](py::handle stored, py::handle record, const CodecParams& p, py::handle out) {
        const ChunkRecord rec = record_from_py(record);
        BufferRef src(stored, false);
        BufferRef dst(out, true);
        if (dst.size() != rec.raw_len) {
          throw py::value_error("output buffer has " + std::to_string(dst.size()) +
                                " bytes, the chunk decodes to " + std::to_string(rec.raw_len));
        }
        PYCKPT_EXPECT_FORMAT(src.size() >= rec.stored_len, FormatKind::Truncated,
                             "stored buffer has ", src.size(), " bytes, the record needs ",
                             rec.stored_len);
        GilRelease nogil;
        decode_chunk(src.data(), rec, p, dst.data());
      },
      py::arg("stored"), py::arg("record"), py::arg("params"), py::arg("out"),
      R"pbdoc(Verify the checksum of one chunk (record: a Chunk), then decode it into out (raw_len bytes).)pbdoc");

  m.def(
      "group_bytes",
      [](py::handle data, std::uint32_t elem_size, bool rotl1, py::handle out) {
        const std::uint32_t E = plane_count(elem_size);
        BufferRef src(data, false);
        BufferRef dst(out, true);
        if (src.size() % E != 0 || dst.size() != src.size()) {
          throw py::value_error(
              "group_bytes: len(data) must be a multiple of elem_size and "
              "equal len(out)");
        }
        const std::size_t n = src.size() / E;
        std::uint8_t* planes[8];
        for (std::uint32_t p = 0; p < E; ++p)
          planes[p] = static_cast<std::uint8_t*>(dst.data()) + p * n;
        GilRelease nogil;
        group_bytes(src.data(), n, E, rotl1, planes);
      },
      py::arg("data"), py::arg("elem_size"), py::arg("rotl1"), py::arg("out"),
      R"pbdoc(Byte-group elements into contiguous planes in out (plane p at p * len/elem_size).)pbdoc");

  m.def(
      "ungroup_bytes",
      [](py::handle planes_buf, std::uint32_t elem_size, bool rotl1, py::handle out) {
        const std::uint32_t E = plane_count(elem_size);
        BufferRef src(planes_buf, false);
        BufferRef dst(out, true);
        if (src.size() % E != 0 || dst.size() != src.size()) {
          throw py::value_error(
              "ungroup_bytes: len(planes) must be a multiple of elem_size and "
              "equal len(out)");
        }
        const std::size_t n = src.size() / E;
        const std::uint8_t* planes[8];
        for (std::uint32_t p = 0; p < E; ++p) {
          planes[p] = static_cast<const std::uint8_t*>(src.data()) + p * n;
        }
        GilRelease nogil;
        ungroup_bytes(planes, n, E, rotl1, dst.data());
      },
      py::arg("planes"), py::arg("elem_size"), py::arg("rotl1"), py::arg("out"),
      R"pbdoc(Inverse of group_bytes.)pbdoc");
}

}  // namespace pyckpt::bindings
