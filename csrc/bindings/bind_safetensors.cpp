// Bindings of the safetensors header parser/emitter and the stitcher: argument conversion only.
#include <pybind11/stl.h>

#include <map>
#include <stdexcept>

#include "bindings/bindings.hpp"
#include "bindings/core_convert.hpp"
#include "bindings/interrupt.hpp"
#include "bindings/records.hpp"
#include "core/float_cast.hpp"
#include "core/safetensors.hpp"
#include "core/stitcher.hpp"

namespace pyckpt::bindings {

namespace {

py::dict header_to_py(const StHeader& h) {
  py::dict meta;
  for (const auto& [k, v] : h.metadata) meta[py::str(k)] = py::str(v);
  // One str object per dtype, shared by every tensor of that dtype (headers hold up to 2^20).
  std::map<StDtype, py::str> dtype_names;
  py::list tensors(h.tensors.size());
  for (std::size_t k = 0; k < h.tensors.size(); ++k) {
    const StTensorInfo& t = h.tensors[k];
    py::tuple shape(t.shape.size());
    for (std::size_t i = 0; i < t.shape.size(); ++i) shape[i] = py::int_(t.shape[i]);
    auto dn = dtype_names.find(t.dtype);
    if (dn == dtype_names.end()) dn = dtype_names.emplace(t.dtype, st_dtype_name(t.dtype)).first;
    tensors[k] = record(Rec::HeaderTensor, py::str(t.name), dn->second, shape, t.begin, t.end);
  }
  py::dict out;
  out["header_len"] = h.header_len;
  out["data_start"] = h.data_start;
  out["file_size"] = h.file_size;
  out["metadata"] = meta;
  out["tensors"] = tensors;
  return out;
}

StDtype dtype_arg(const std::string& name) {
  const auto dt = st_dtype_from_name(name);
  if (!dt) throw std::invalid_argument("unknown safetensors dtype '" + name + "'");
  return *dt;
}

// A StitchItem (name, shape, offsets, sizes, item, source, at, out_path, out_offset, lo, hi, p,
// q[, cast]), or any sequence of that layout: `at` is an int (RawFile offset) or a StitchChunk
// (chunk, params); cast is None or a FloatCast (from_dtype, to_dtype).
constexpr std::size_t kItemFields = 13;

FloatFormat float_format_arg(const std::string& name) {
  const auto f = float_format_from_name(name);
  if (!f) {
    throw std::invalid_argument("cannot cast dtype '" + name + "' (F64, F32, F16 or BF16 only)");
  }
  return *f;
}

StitchItem item_from_py(py::handle obj) {
  if (!py::isinstance<py::tuple>(obj) && !py::isinstance<py::list>(obj)) {
    throw py::type_error("stitch item must be a StitchItem (a tuple)");
  }
  auto seq = py::reinterpret_borrow<py::sequence>(obj);
  if (seq.size() != kItemFields && seq.size() != kItemFields + 1) {
    throw py::value_error("stitch item has " + std::to_string(seq.size()) + " fields, expected " +
                          std::to_string(kItemFields) + " or " + std::to_string(kItemFields + 1));
  }
  StitchItem it;
  it.name = py::cast<std::string>(seq[0]);
  it.shape = py::cast<std::vector<std::uint64_t>>(seq[1]);
  it.offsets = py::cast<std::vector<std::uint64_t>>(seq[2]);
  it.sizes = py::cast<std::vector<std::uint64_t>>(seq[3]);
  it.item_bytes = py::cast<std::uint32_t>(seq[4]);
  it.source.path = py::cast<std::string>(seq[5]);
  py::object source = seq[6];
  if (PyLong_Check(source.ptr())) {
    it.source.kind = StitchSource::Kind::RawFile;
    it.source.offset = u64_from_py(source, "source offset");
  } else {
    if (!py::isinstance<py::tuple>(source) || py::len(source) != 2) {
      throw py::type_error("stitch source must be an int offset or a StitchChunk (chunk, params)");
    }
    it.source.kind = StitchSource::Kind::EncodedChunk;
    it.source.chunk = record_from_py(source[py::int_(0)]);
    it.source.params = params_from_py(source[py::int_(1)], "stitch source params");
  }
  it.out_path = py::cast<std::string>(seq[7]);
  it.out_offset = u64_from_py(seq[8], "out_offset");
  it.lo = u64_from_py(seq[9], "lo");
  it.hi = u64_from_py(seq[10], "hi");
  it.block_lo = u64_from_py(seq[11], "block_lo");
  it.block_hi = u64_from_py(seq[12], "block_hi");
  if (seq.size() > kItemFields && !seq[kItemFields].is_none()) {
    const auto cast = py::cast<std::pair<std::string, std::string>>(seq[kItemFields]);
    it.cast.from = float_format_arg(cast.first);
    it.cast.to = float_format_arg(cast.second);
  }
  return it;
}

}  // namespace

void bind_safetensors(py::module_& m) {
  m.attr("MAX_SAFETENSORS_HEADER") = kMaxSafetensorsHeader;
  m.attr("MAX_SAFETENSORS_TENSORS") = kMaxSafetensorsTensors;
  m.attr("MAX_SAFETENSORS_RANK") = kMaxSafetensorsRank;

  m.def(
      "safetensors_dtype_bits",
      [](const std::string& name) { return st_dtype_bits(dtype_arg(name)); }, py::arg("dtype"),
      R"pbdoc(Bits per element of a safetensors dtype name; ValueError if unknown.)pbdoc");

  m.def(
      "read_safetensors_header",
      [](const std::string& path) {
        StHeader h;
        {
          GilRelease release;
          h = parse_safetensors_header(path);
        }
        return header_to_py(h);
      },
      py::arg("path"),
      R"pbdoc(Read and strictly validate a safetensors file's header (pread; data untouched).)pbdoc");

  m.def(
      "parse_safetensors_header",
      [](const py::bytes& json, std::uint64_t file_size, const std::string& origin) {
        const std::string text = json;
        StHeader h;
        {
          GilRelease release;
          h = parse_safetensors_header_bytes(text, file_size, origin);
        }
        return header_to_py(h);
      },
      py::arg("json"), py::arg("file_size"), py::arg("origin") = "<bytes>",
      R"pbdoc(Validate header bytes (without the 8-byte length) against a file size.)pbdoc");

  m.def(
      "safetensors_header",
      [](const std::vector<std::tuple<std::string, std::string, std::vector<std::uint64_t>>>&
             tensors,
         const py::dict& metadata_dict) {
        std::vector<std::pair<std::string, std::string>> metadata;
        for (auto kv : metadata_dict) {
          metadata.emplace_back(py::cast<std::string>(kv.first), py::cast<std::string>(kv.second));
        }
        std::vector<StTensorSpec> specs;
        specs.reserve(tensors.size());
        for (const auto& [name, dtype, shape] : tensors) {
          specs.push_back(StTensorSpec{name, dtype_arg(dtype), shape});
        }
        StEmitted e = emit_safetensors_header(std::move(specs), metadata);
        py::list layout;
        for (std::size_t i = 0; i < e.tensors.size(); ++i) {
          const std::uint64_t end = i + 1 < e.begins.size() ? e.begins[i + 1] : e.data_bytes;
          layout.append(record(Rec::TensorSpan, py::str(e.tensors[i].name), e.begins[i], end));
        }
        return record(Rec::EmittedHeader, py::bytes(e.bytes), layout, e.data_bytes);
      },
      py::arg("tensors"), py::arg("metadata"),
      R"pbdoc(Emit a header for TensorSpecs (name, dtype, shape), sorted by name, with the metadata {key: value} -> EmittedHeader (header bytes, [TensorSpan(name, begin, end)], data_bytes).)pbdoc");

  m.def(
      "check_tiling",
      [](const std::string& name, const std::vector<std::uint64_t>& shape,
         const std::vector<std::tuple<std::vector<std::uint64_t>, std::vector<std::uint64_t>,
                                      std::string>>& blocks) {
        std::vector<TileBlock> tiles;
        tiles.reserve(blocks.size());
        for (const auto& [offsets, sizes, origin] : blocks) {
          tiles.push_back(TileBlock{offsets, sizes, origin});
        }
        GilRelease release;
        check_tiling(name, shape, tiles);
      },
      py::arg("name"), py::arg("shape"), py::arg("blocks"),
      R"pbdoc(Raise CheckpointFormatError unless the TileBlocks (offsets, sizes, origin) tile the shape.)pbdoc");

  m.def(
      "stitch",
      [](const py::sequence& items, std::size_t threads, std::size_t task_bytes,
         const std::string& input_mode, bool fsync, bool partial) {
        std::vector<StitchItem> work;
        work.reserve(items.size());
        for (py::handle item : items) work.push_back(item_from_py(item));
        StitchOptions opts;
        opts.threads = threads;
        opts.task_bytes = task_bytes;
        if (input_mode == "pread") {
          opts.input = InputMode::Pread;
        } else if (input_mode == "mmap") {
          opts.input = InputMode::Mmap;
        } else {
          throw std::invalid_argument("input_mode must be 'pread' or 'mmap', got '" + input_mode +
                                      "'");
        }
        opts.fsync = fsync;
        opts.partial = partial;
        StitchStats s;
        {
          InterruptWatch watch;  // Ctrl-C between tasks; the thread's ProgressCounter
          GilRelease release;
          s = stitch(work, opts);
        }
        py::dict out;
        out["bytes"] = s.bytes;
        out["tasks"] = s.tasks;
        out["runs"] = s.runs;
        return out;
      },
      py::arg("items"), py::arg("threads"), py::arg("task_bytes"), py::arg("input_mode"),
      py::arg("fsync"), py::kw_only(), py::arg("partial") = false,
      R"pbdoc(Copy shard blocks or decoded chunks into pre-sized outputs (partial=True: the encoded-chunk items of a tensor may cover only part of its range, the rest coming in other calls); output bytes are added to the thread's ProgressCounter (set_progress_counter); items are StitchItems (name, shape, offsets, sizes, item, source, at: offset | StitchChunk(chunk, params), out_path, out_offset, lo, hi, p, q[, cast: None | FloatCast(from_dtype, to_dtype)]).)pbdoc");

  m.def(
      "convert_floats",
      [](py::handle src, const std::string& from, const std::string& to, py::handle out) {
        const FloatFormat f = float_format_arg(from);
        const FloatFormat t = float_format_arg(to);
        BufferRef in(src, false);
        BufferRef dst(out, true);
        const std::size_t fb = float_format_bytes(f);
        if (in.size() % fb != 0) {
          throw std::invalid_argument("convert_floats: " + std::to_string(in.size()) +
                                      " input bytes are not whole " + from + " elements");
        }
        const std::uint64_t count = in.size() / fb;
        if (dst.size() != count * float_format_bytes(t)) {
          throw std::invalid_argument("convert_floats: output holds " + std::to_string(dst.size()) +
                                      " bytes, expected " +
                                      std::to_string(count * float_format_bytes(t)));
        }
        GilRelease release;
        convert_floats(f, t, in.data(), dst.data(), count);
      },
      py::arg("src"), py::arg("from_dtype"), py::arg("to_dtype"), py::arg("out"),
      R"pbdoc(Convert F64/F32/F16/BF16 elements of src into out (round to nearest even, as torch).)pbdoc");
}

}  // namespace pyckpt::bindings
