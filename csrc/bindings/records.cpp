#include "bindings/records.hpp"

#include <array>
#include <stdexcept>
#include <string>

namespace pyckpt::bindings {

namespace {

struct RecordSpec {
  const char* name;
  const char* fields;    // space-separated, in tuple order
  std::size_t optional;  // trailing fields that default to None
  const char* doc;
};

// One entry per Rec, in the enum's order.
constexpr std::array<RecordSpec, static_cast<std::size_t>(Rec::kCount)> kRecords{{
    {"Chunk", "file_offset raw_len xxh64 transform planes", 0,
     "A chunk record: stored bytes at file_offset of the data file, decoding to raw_len bytes, "
     "with checksum xxh64; transform 0 none / 1 group / 2 group_rotl1; planes the flat tuple "
     "(mode0, len0, mode1, len1, ...), mode 0 raw / 1 zstd frame (stored_len = sum of the "
     "lens). Records are made in bulk (metadata, write_items) as plain tuples of this layout; "
     "every binding accepts either, or a list decoded from JSON."},
    {"Segment", "path raw_begin params chunks", 0,
     "Chunks of one data file holding a stored item's raw bytes from raw_begin on, back to back: "
     "path (str or os.PathLike; a name of `sources`, or a file), params (CodecParams), chunks "
     "(Chunk records). Made in bulk as plain tuples of this layout, accepted as well."},
    {"WriteItem", "name data_ptr nbytes params", 0,
     "An item for write_items: nbytes at address data_ptr, encoded with params (CodecParams). "
     "SAFETY: data_ptr must point to nbytes readable bytes that stay alive and unmodified until "
     "write_items returns."},
    {"WrittenItem", "offset stored_bytes chunks", 0,
     "A write_items result per item: file offset of its first stored byte, its stored bytes, "
     "its Chunk records (plain tuples)."},
    {"ReadRequest", "name segments lo hi dst", 0,
     "One read into a caller's buffer: raw bytes [lo, hi) of the item `name` (named by errors) "
     "stored in `segments` (Segment), to address dst. SAFETY: dst must point to hi - lo writable "
     "bytes kept alive until the call returns (read_stored: the segments' stored_len bytes)."},
    {"ReadStats", "bytes_read chunks", 0,
     "What read_requests / read_stored / verify_segments did: bytes read and chunks decoded "
     "(read_requests), copied (read_stored) or checked (verify_segments)."},
    {"MemorySource", "size ranges", 0,
     "A source held in memory (`sources` argument): its size and its non-overlapping byte ranges "
     "already in memory (MemoryRange)."},
    {"MemoryRange", "offset data", 0,
     "Bytes of a MemorySource from offset on: any buffer-protocol object, lent (no copy) for the "
     "call."},
    {"EncodedChunk", "stored record", 0,
     "encode_chunk's result: the stored bytes and the Chunk record (a plain tuple)."},
    {"StitchItem", "name shape offsets sizes item source at out_path out_offset lo hi p q cast", 1,
     "One copy job of stitch(): the elements [lo, hi) of tensor `name` (full shape `shape`) that "
     "a source block of shape `sizes` at `offsets` in it holds, elements of `item` bytes. "
     "source: the input file; at: the block's byte offset in it (a safetensors shard) or a "
     "StitchChunk (one encoded chunk); p, q: the block elements it holds, [p, q) (a chunk) or "
     "[0, 2**64 - 1) (a shard); out_path, out_offset: the output file and the tensor's first byte "
     "in it; cast: None or a FloatCast (item is then the source element size)."},
    {"StitchChunk", "chunk params", 0,
     "The source of a StitchItem stored as one encoded chunk: its Chunk record and CodecParams."},
    {"FloatCast", "from_dtype to_dtype", 0,
     "A cast of float elements on the way: safetensors dtype names among F64, F32, F16, BF16 "
     "(to_dtype: not F64)."},
    {"HeaderTensor", "name dtype shape begin end", 0,
     "A tensor of a safetensors header: dtype name, shape (tuple), data bytes [begin, end) "
     "relative to the data section."},
    {"TensorSpec", "name dtype shape", 0,
     "A tensor to declare in a safetensors header: dtype name and shape."},
    {"TensorSpan", "name begin end", 0,
     "Where safetensors_header placed a tensor: data bytes [begin, end) of the data section."},
    {"EmittedHeader", "header layout data_bytes", 0,
     "safetensors_header's result: the header bytes (with the 8-byte length), the tensors' "
     "TensorSpans sorted by name, the size of the data section."},
    {"TileBlock", "offsets sizes origin", 0,
     "A block for check_tiling: its offsets and sizes in the shape, and `origin`, which names "
     "it in errors."},
    {"StageItem", "name device_ptr nbytes", 0,
     "Device bytes for Stager.stream_to_host: nbytes at device_ptr (kept alive by the caller "
     "until the stream is done); name is named by errors."},
    {"CopySpec", "offset device_ptr nbytes name", 0,
     "A copy of Stager.copy_into / upload: nbytes between offset in the host block and "
     "device_ptr; name is named by errors."},
    {"StagePiece", "item item_offset block_offset nbytes", 0,
     "Bytes of a StagedBlock: nbytes of item `item` (an index into the StageItems) from "
     "item_offset on, at block_offset in the block."},
}};

std::array<PyObject*, kRecords.size()> g_types{};  // strong references, kept for the process
std::array<std::size_t, kRecords.size()> g_sizes{};

}  // namespace

void bind_records(py::module_& m) {
  py::object namedtuple = py::module_::import("collections").attr("namedtuple");
  for (std::size_t i = 0; i < kRecords.size(); ++i) {
    const RecordSpec& spec = kRecords[i];
    py::list fields = py::str(spec.fields).attr("split")();
    py::object defaults = py::none();
    if (spec.optional > 0) {
      py::tuple nones(spec.optional);
      for (std::size_t k = 0; k < spec.optional; ++k) nones[k] = py::none();
      defaults = nones;
    }
    py::object cls = namedtuple(spec.name, fields, py::arg("defaults") = defaults,
                                py::arg("module") = "pyckpt._C");
    cls.attr("__doc__") = py::str(spec.doc);
    m.attr(spec.name) = cls;
    g_sizes[i] = fields.size();
    g_types[i] = cls.release().ptr();
  }
}

py::object make_record(Rec r, const py::tuple& values) {
  const auto i = static_cast<std::size_t>(r);
  if (values.size() != g_sizes[i]) {
    throw std::logic_error(std::string(kRecords[i].name) + " takes " + std::to_string(g_sizes[i]) +
                           " fields, got " + std::to_string(values.size()));
  }
  // tuple.__new__(type, values): the C constructor shared by every tuple subclass.
  py::tuple args = py::make_tuple(values);
  PyObject* o =
      PyTuple_Type.tp_new(reinterpret_cast<PyTypeObject*>(g_types[i]), args.ptr(), nullptr);
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

}  // namespace pyckpt::bindings
