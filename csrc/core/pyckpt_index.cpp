#include "core/pyckpt_index.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "core/checksum.hpp"
#include "core/chunk_io.hpp"
#include "core/detail/json_reader.hpp"
#include "core/error.hpp"
#include "core/stitcher.hpp"

namespace pyckpt {

namespace {

using detail::JsonReader;
using detail::JsonValue;

// docs/FORMAT.md, "Limits" (the same constants as pyckpt/_format_spec.py; a test compares them).
constexpr std::uint64_t kMaxItems = std::uint64_t{1} << 22;
constexpr std::uint64_t kMaxFiles = std::uint64_t{1} << 20;
constexpr std::uint64_t kMaxPieces = std::uint64_t{1} << 24;
constexpr std::uint64_t kMaxSegments = std::uint64_t{1} << 24;
constexpr std::uint64_t kMaxChunks = std::uint64_t{1} << 24;
constexpr std::uint64_t kMaxNdim = 64;
constexpr std::uint64_t kMaxNumel = std::uint64_t{1} << 60;
constexpr std::uint64_t kMaxItemBytes = std::uint64_t{1} << 62;
constexpr std::uint64_t kMaxFileBytes = (std::uint64_t{1} << 63) - 1;
constexpr int kMaxPlannerDepth = 64;
constexpr std::uint64_t kMaxIrregularPieces = std::uint64_t{1} << 14;
constexpr std::uint64_t kZstdMaxRatio = std::uint64_t{1} << 16;
constexpr std::int64_t kZstdMinLevel = -(std::int64_t{1} << 17);
constexpr std::int64_t kZstdMaxLevel = 22;
constexpr int kVersion = 3;  // the one version read here (older ones: the Python validator)
// Number tokens in planner_data longer than this are left to the Python validator (Python's
// int() refuses integers of more than 4300 digits).
constexpr std::size_t kMaxNumberText = 40;

const char* const kMemoryFormats[] = {"contiguous_format", "channels_last", "channels_last_3d",
                                      "preserve_format"};

// Transform codes of chunk records (docs/FORMAT.md): none 0, group 1, group_rotl1 2.
std::uint32_t transform_code(const std::string& t) {
  return t == "group" ? 1 : t == "group_rotl1" ? 2 : 0;
}

bool mul_ok(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return false;
  out = a * b;
  return true;
}

// <rank>-<k>.<save_id>.pyckpt: ranks and file numbers of 1-10 digits without leading zeros, a
// save id of 12 lowercase hex digits (pyckpt._format_spec._DATA_FILE_RE).
bool decimal_field(std::string_view s) {
  if (s.empty() || s.size() > 10) return false;
  if (s.size() > 1 && s[0] == '0') return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool lower_hex(std::string_view s, std::size_t n) {
  return s.size() == n && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

bool data_file_name(std::string_view s) {
  constexpr std::string_view kSuffix = ".pyckpt";
  if (s.size() < kSuffix.size() || s.substr(s.size() - kSuffix.size()) != kSuffix) return false;
  s.remove_suffix(kSuffix.size());
  const auto dash = s.find('-');
  if (dash == std::string_view::npos) return false;
  const auto dot = s.find('.', dash);
  if (dot == std::string_view::npos) return false;
  return decimal_field(s.substr(0, dash)) && decimal_field(s.substr(dash + 1, dot - dash - 1)) &&
         lower_hex(s.substr(dot + 1), 12);
}

class Parser {
 public:
  Parser(std::string_view doc, const std::string& origin)
      : _doc(doc), _origin(origin), _r(doc, origin) {}

  PyckptIndex run() {
    if (!detail::valid_utf8(_doc)) refuse("not UTF-8");
    if (_doc.empty() || _doc[0] != '{') refuse("does not start with '{'");
    static const char* const kTop[] = {"format",      "version",      "created_by",   "save_id",
                                       "dcp_version", "storage_meta", "planner_data", "files",
                                       "items",       "checksum"};
    members(0, kTop, [&](std::size_t k) {
      switch (k) {
        case 0:
          if (string() != "pyckpt") refuse("not a pyckpt document");
          break;
        case 1:
          if (uint(1, kVersion, kVersion) != kVersion) refuse("version");
          _x.version = kVersion;
          break;
        case 2: _x.created_by = string(); break;
        case 3:
          _x.save_id = string();
          if (!lower_hex(_x.save_id, 12)) refuse("save_id");
          break;
        case 4:
          if (_r.peek_value() == 'n') {
            null(1);
          } else {
            _x.has_dcp_version = true;
            _x.dcp_version = string();
          }
          break;
        case 5: {
          static const char* const kMeta[] = {"modules"};
          members(1, kMeta, [&](std::size_t) {
            expect_next('[');
            _r.parse_array(2, [&] { _x.modules.push_back(string()); });
          });
          break;
        }
        case 6:
          _x.planner_begin = skip_ws_pos();
          planner(1);
          _x.planner_end = _r.pos();
          break;
        case 7: files(); break;
        case 8: items(); break;
        case 9: (void)string(); break;  // the seal, verified by the caller
        default: break;
      }
    });
    _r.finish();
    check_packing();
    return std::move(_x);
  }

 private:
  [[noreturn]] void refuse(const char* what) const {
    throw FormatError(FormatKind::Header,
                      detail::concat(_origin, ": outside the native reader's subset (", what,
                                     ") near offset ", _r.pos()));
  }

  std::size_t skip_ws_pos() {
    (void)_r.peek_value();
    return _r.pos();
  }

  void expect_next(char c) {
    if (_r.peek_value() != c) refuse("unexpected value type");
  }

  // Walks an object whose keys must be exactly `keys`, in that order; on_value(k) reads member k.
  template <std::size_t N, typename F>
  void members(int depth, const char* const (&keys)[N], F&& on_value) {
    expect_next('{');
    std::size_t k = 0;
    _r.parse_object(depth, [&](std::string key) {
      if (k >= N || key != keys[k]) refuse("keys differ from the writer's");
      on_value(k++);
    });
    if (k != N) refuse("missing key");
  }

  std::string string() {
    expect_next('"');
    return _r.parse_string();
  }

  void null(int depth) {
    const JsonValue v = _r.parse_scalar(depth);
    if (v.kind != JsonValue::Kind::Null) refuse("expected null");
  }

  bool boolean(int depth) {
    const char c = _r.peek_value();
    const JsonValue v = _r.parse_scalar(depth);
    if (v.kind != JsonValue::Kind::Bool) refuse("expected true or false");
    return c == 't';
  }

  std::uint64_t uint(int depth, std::uint64_t lo, std::uint64_t hi) {
    const char c = _r.peek_value();
    if (c != '-' && !(c >= '0' && c <= '9')) refuse("expected an integer");
    const JsonValue v = _r.parse_scalar(depth);
    if (!v.is_uint || v.uint_value < lo || v.uint_value > hi) refuse("integer out of range");
    return v.uint_value;
  }

  std::int64_t int64(int depth, std::int64_t lo, std::int64_t hi) {
    const char c = _r.peek_value();
    if (c != '-' && !(c >= '0' && c <= '9')) refuse("expected an integer");
    const JsonValue v = _r.parse_scalar(depth);
    std::int64_t value = 0;
    if (v.is_uint) {
      if (v.uint_value > static_cast<std::uint64_t>(hi < 0 ? 0 : hi))
        refuse("integer out of range");
      value = static_cast<std::int64_t>(v.uint_value);
    } else {
      // A negative integer: "-" and 1-18 digits (no fraction or exponent).
      const std::string& t = v.str;
      if (t.size() < 2 || t.size() > 19 || t[0] != '-' ||
          !std::all_of(t.begin() + 1, t.end(), [](char d) { return d >= '0' && d <= '9'; })) {
        refuse("expected an integer");
      }
      for (std::size_t i = 1; i < t.size(); ++i) value = value * 10 + (t[i] - '0');
      value = -value;
    }
    if (value < lo || value > hi) refuse("integer out of range");
    return value;
  }

  // planner_data: any JSON value without repeated keys, nested at most kMaxPlannerDepth deep
  // (counting every object and array: the Python validator counts a {"__tuple__": [...]} as one
  // level, so this is the stricter bound), every object with a "__tuple__" key exactly that key
  // holding a list.
  void planner(int depth) {
    if (depth > kMaxPlannerDepth) refuse("planner_data nested too deeply");
    const char c = _r.peek_value();
    if (c == '{') {
      std::unordered_set<std::string> keys;
      bool tuple = false;
      _r.parse_object(depth, [&](std::string key) {
        if (key == "__tuple__") {
          tuple = true;
          expect_next('[');
        }
        if (!keys.insert(std::move(key)).second) refuse("repeated key in planner_data");
        planner(depth + 1);
      });
      if (tuple && keys.size() != 1) refuse("__tuple__ with other keys");
    } else if (c == '[') {
      _r.parse_array(depth, [&] { planner(depth + 1); });
    } else {
      const JsonValue v = _r.parse_scalar(depth);
      if (v.kind == JsonValue::Kind::Number && v.str.size() > kMaxNumberText) {
        refuse("long number in planner_data");
      }
    }
  }

  void files() {
    expect_next('{');
    _r.parse_object(1, [&](std::string name) {
      if (!data_file_name(name)) refuse("data file name");
      if (_x.file_names.size() >= kMaxFiles) refuse("too many files");
      const auto index = static_cast<std::uint32_t>(_x.file_names.size());
      if (!_file_index.emplace(name, index).second) refuse("repeated file");
      _x.file_sizes.push_back(uint(2, 0, kMaxFileBytes));
      _x.file_names.push_back(std::move(name));
    });
    _ranges.resize(_x.file_names.size());
  }

  void items() {
    expect_next('{');
    std::unordered_set<std::string> seen;
    _r.parse_object(1, [&](std::string fqn) {
      if (_x.items.size() >= kMaxItems) refuse("too many items");
      if (!seen.insert(fqn).second) refuse("repeated item");
      IdxItem item;
      item.fqn = std::move(fqn);
      expect_next('{');
      std::size_t k = 0;
      _r.parse_object(2, [&](std::string key) {
        if (k == 0) {
          if (key != "type") refuse("item keys");
          const std::string type = string();
          if (type != "tensor" && type != "bytes") refuse("item type");
          item.tensor = type == "tensor";
        } else if (item.tensor) {
          static const char* const kTensor[] = {"dtype", "shape", "requires_grad", "memory_format",
                                                "pieces"};
          if (k > 5 || key != kTensor[k - 1]) refuse("tensor keys");
          tensor_member(item, k);
        } else {
          static const char* const kBytes[] = {"nbytes", "segments"};
          if (k > 2 || key != kBytes[k - 1]) refuse("bytes item keys");
          if (k == 1) {
            item.nbytes = uint(3, 0, kMaxItemBytes);
          } else {
            item.segments_begin = _x.segments.size();
            segments("uint8", item.nbytes, place_seed(item.fqn, nullptr, 0), 3);
            item.segments_end = _x.segments.size();
          }
        }
        ++k;
      });
      if (k != (item.tensor ? 6u : 3u)) refuse("missing item key");
      _x.items.push_back(std::move(item));
    });
  }

  void tensor_member(IdxItem& t, std::size_t k) {
    switch (k) {
      case 1: {
        t.dtype = string();
        const auto& table = pyckpt_dtypes();
        const auto it = std::find_if(table.begin(), table.end(),
                                     [&](const PyckptDtype& d) { return t.dtype == d.name; });
        if (it == table.end()) refuse("dtype");
        _esize = it->size;
        break;
      }
      case 2: {
        t.shape_at = _x.dims.size();
        expect_next('[');
        _r.parse_array(3, [&] {
          if (_x.dims.size() - t.shape_at >= kMaxNdim) refuse("too many dimensions");
          _x.dims.push_back(uint(4, 0, kMaxNumel));
        });
        t.ndim = static_cast<std::uint32_t>(_x.dims.size() - t.shape_at);
        _numel = 1;
        for (std::size_t d = 0; d < t.ndim; ++d) {
          if (!mul_ok(_numel, _x.dims[t.shape_at + d], _numel)) refuse("shape overflows");
        }
        std::uint64_t bytes = 0;
        if (_numel > kMaxNumel || !mul_ok(_numel, _esize, bytes) || bytes > kMaxItemBytes) {
          refuse("shape too large");
        }
        break;
      }
      case 3: t.requires_grad = boolean(3); break;
      case 4: {
        t.memory_format = string();
        if (std::none_of(std::begin(kMemoryFormats), std::end(kMemoryFormats),
                         [&](const char* m) { return t.memory_format == m; })) {
          refuse("memory_format");
        }
        break;
      }
      case 5: {
        t.pieces_begin = _x.pieces.size();
        expect_next('[');
        _r.parse_array(3, [&] { piece(t); });
        t.pieces_end = _x.pieces.size();
        check_tiling(t);
        break;
      }
      default: break;
    }
  }

  void piece(const IdxItem& t) {
    if (_x.pieces.size() >= kMaxPieces) refuse("too many pieces");
    IdxPiece p;
    p.dims_at = _x.dims.size();
    static const char* const kPiece[] = {"offsets", "sizes", "segments"};
    members(4, kPiece, [&](std::size_t k) {
      if (k < 2) {
        const std::size_t at = _x.dims.size();
        expect_next('[');
        _r.parse_array(5, [&] {
          if (_x.dims.size() - at >= t.ndim) refuse("piece rank");
          _x.dims.push_back(uint(6, 0, kMaxNumel));
        });
        if (_x.dims.size() - at != t.ndim) refuse("piece rank");
        return;
      }
      std::uint64_t nbytes = _esize;
      for (std::uint32_t d = 0; d < t.ndim; ++d) {
        const std::uint64_t full = _x.dims[t.shape_at + d];
        const std::uint64_t o = _x.dims[p.dims_at + d];
        const std::uint64_t s = _x.dims[p.dims_at + t.ndim + d];
        if (o > full || s > full - o) refuse("piece leaves the tensor");
        nbytes *= s;  // bounded by the tensor's bytes, checked against kMaxItemBytes
      }
      p.nbytes = nbytes;
      p.segments_begin = _x.segments.size();
      segments(t.dtype, nbytes, place_seed(t.fqn, _x.dims.data() + p.dims_at, t.ndim), 5);
      p.segments_end = _x.segments.size();
    });
    _x.pieces.push_back(p);
  }

  // XXH64 of the item's name, a zero byte and each offset as 64-bit little endian
  // (pyckpt._format_spec.chunk_place_seed).
  std::uint64_t place_seed(const std::string& fqn, const std::uint64_t* offsets, std::size_t n) {
    _seed_buf.assign(fqn.begin(), fqn.end());
    _seed_buf.push_back('\0');
    for (std::size_t i = 0; i < n; ++i) {
      unsigned char le[8];
      for (int b = 0; b < 8; ++b) le[b] = static_cast<unsigned char>(offsets[i] >> (8 * b));
      _seed_buf.append(reinterpret_cast<const char*>(le), 8);
    }
    return xxh64(_seed_buf.data(), _seed_buf.size());
  }

  static std::uint64_t place_key(std::uint64_t seed, std::uint64_t raw_offset) {
    unsigned char le[8];
    for (int b = 0; b < 8; ++b) le[b] = static_cast<unsigned char>(raw_offset >> (8 * b));
    return xxh64(le, 8, seed);
  }

  void segments(const std::string& dtype, std::uint64_t nbytes, std::uint64_t seed, int depth) {
    expect_next('[');
    std::uint64_t expect = 0;
    _r.parse_array(depth, [&] {
      if (_x.segments.size() >= kMaxSegments) refuse("too many segments");
      IdxSegment seg;
      static const char* const kSegment[] = {"file", "raw_begin", "codec", "chunks"};
      members(depth + 1, kSegment, [&](std::size_t k) {
        switch (k) {
          case 0: {
            const auto it = _file_index.find(string());
            if (it == _file_index.end()) refuse("segment file not listed");
            seg.file = it->second;
            break;
          }
          case 1:
            seg.raw_begin = uint(depth + 2, 0, kMaxItemBytes);
            if (seg.raw_begin != expect) refuse("segments leave a gap or overlap");
            break;
          case 2: seg.codec = codec(dtype, depth + 2); break;
          case 3:
            seg.chunks_begin = _x.chunks.size();
            expect += chunks(seg, seed, depth + 2);
            seg.chunks_end = _x.chunks.size();
            break;
          default: break;
        }
      });
      _x.segments.push_back(seg);
    });
    if (expect != nbytes) refuse("segments do not hold the item's bytes");
  }

  std::uint32_t codec(const std::string& dtype, int depth) {
    expect_next('[');
    IdxCodec c;
    c.dtype = dtype;
    std::size_t k = 0;
    _r.parse_array(depth, [&] {
      switch (k++) {
        case 0: c.codec = string(); break;
        case 1: c.level = int64(depth + 1, kZstdMinLevel, kZstdMaxLevel); break;
        case 2: c.elem_size = static_cast<std::uint32_t>(uint(depth + 1, 1, 8)); break;
        case 3: c.transform = string(); break;
        default: refuse("codec has more than 4 fields");
      }
    });
    if (k != 4) refuse("codec fields");
    if (c.codec == "none") {
      if (c.level != 0 || c.elem_size != 1 || c.transform != "none") refuse("codec none");
    } else if (c.codec == "zstd") {
      if (c.transform == "none") {
        if (c.elem_size != 1) refuse("codec elem_size");
      } else {
        const auto& table = pyckpt_dtypes();
        const auto it = std::find_if(table.begin(), table.end(),
                                     [&](const PyckptDtype& d) { return dtype == d.name; });
        if (it == table.end() || it->planes == 1 || c.elem_size != it->planes ||
            c.transform != it->transform) {
          refuse("codec does not fit the dtype");
        }
      }
    } else {
      refuse("codec");
    }
    // One entry per distinct (dtype, fields): a key built without a stream (once per segment).
    std::string& key = _codec_key;
    key.assign(dtype).push_back('\0');
    key.append(c.codec).push_back('\0');
    key.append(std::to_string(c.level)).push_back('\0');
    key.append(std::to_string(c.elem_size)).push_back('\0');
    key.append(c.transform);
    const auto found = _codec_index.find(key);
    if (found != _codec_index.end()) return found->second;
    const auto index = static_cast<std::uint32_t>(_x.codecs.size());
    _x.codecs.push_back(std::move(c));
    _codec_index.emplace(key, index);
    return index;
  }

  // Reads and checks the chunk records of `seg` (pyckpt._format_schema._Validator.chunks_of);
  // returns their raw bytes.
  std::uint64_t chunks(const IdxSegment& seg, std::uint64_t seed, int depth) {
    const IdxCodec& c = _x.codecs[seg.codec];
    const bool zstd = c.codec == "zstd";
    const std::uint32_t E = c.elem_size;
    const std::uint32_t group_code = zstd && E > 1 ? transform_code(c.transform) : 0;
    const std::uint64_t size = _x.file_sizes[seg.file];
    auto& ranges = _ranges[seg.file];
    std::uint64_t total = 0;
    std::uint64_t pos = seg.raw_begin;
    expect_next('[');
    _r.parse_array(depth, [&] {
      if (_x.chunks.size() >= kMaxChunks) refuse("too many chunk records");
      IdxChunk ch;
      std::size_t k = 0;
      std::uint64_t n = 0, stored = 0;
      expect_next('[');
      _r.parse_array(depth + 1, [&] {
        switch (k++) {
          case 0: ch.file_offset = uint(depth + 2, 0, kMaxFileBytes); break;
          case 1: ch.raw_len = uint(depth + 2, 1, kMaxChunkBytes); break;
          case 2: ch.xxh64 = uint(depth + 2, 0, std::numeric_limits<std::uint64_t>::max()); break;
          case 3: {
            const bool grouped = group_code != 0 && ch.raw_len % E == 0;
            ch.transform = static_cast<std::uint32_t>(uint(depth + 2, 0, 2));
            if (ch.transform != (grouped ? group_code : 0)) refuse("chunk transform code");
            ch.nplanes = grouped ? E : 1;
            n = ch.raw_len / ch.nplanes;
            break;
          }
          case 4: {
            ch.planes_at = _x.planes.size();
            expect_next('[');
            _r.parse_array(depth + 2, [&] {
              const std::size_t i = _x.planes.size() - ch.planes_at;
              if (i >= 2 * ch.nplanes) refuse("chunk planes");
              _x.planes.push_back(uint(depth + 3, 0, std::numeric_limits<std::uint64_t>::max()));
              if (i % 2 == 1) {
                const std::uint64_t mode = _x.planes[ch.planes_at + i - 1];
                const std::uint64_t length = _x.planes.back();
                const bool ok = mode == 0 ? length == n
                                          : mode == 1 && zstd && length > 0 && length < n &&
                                                n <= length * kZstdMaxRatio;
                if (!ok) refuse("chunk plane");
                stored += length;
              }
            });
            if (_x.planes.size() - ch.planes_at != 2 * ch.nplanes) refuse("chunk planes");
            break;
          }
          default: refuse("chunk record has more than 5 fields");
        }
      });
      if (k != 5) refuse("chunk record fields");
      if (ch.file_offset + stored > size) refuse("chunk past the end of its file");
      ranges.emplace_back(ch.file_offset, ch.file_offset + stored);
      ch.xxh64 ^= place_key(seed, pos);
      pos += ch.raw_len;
      total += ch.raw_len;
      _x.chunks.push_back(ch);
    });
    return total;
  }

  // The pieces must tile the tensor: no gap, no overlap (empty pieces are allowed).
  void check_tiling(const IdxItem& t) {
    if (_numel == 0) return;  // every piece is inside the shape, hence empty
    const std::size_t count = t.pieces_end - t.pieces_begin;
    if (count == 1) {
      if (_x.pieces[t.pieces_begin].nbytes != _numel * _esize) refuse("pieces do not cover");
      return;
    }
    if (count > kMaxIrregularPieces) refuse("many pieces");  // the Python validator decides
    std::vector<std::uint64_t> shape(
        _x.dims.begin() + static_cast<std::ptrdiff_t>(t.shape_at),
        _x.dims.begin() + static_cast<std::ptrdiff_t>(t.shape_at + t.ndim));
    std::vector<TileBlock> blocks;
    blocks.reserve(count);
    for (std::size_t i = t.pieces_begin; i < t.pieces_end; ++i) {
      const auto at = static_cast<std::ptrdiff_t>(_x.pieces[i].dims_at);
      const auto nd = static_cast<std::ptrdiff_t>(t.ndim);
      blocks.push_back(TileBlock{{_x.dims.begin() + at, _x.dims.begin() + at + nd},
                                 {_x.dims.begin() + at + nd, _x.dims.begin() + at + 2 * nd},
                                 std::string()});
    }
    try {
      pyckpt::check_tiling(t.fqn, shape, blocks);
    } catch (const FormatError&) {
      refuse("pieces do not tile the tensor");
    }
  }

  // Every data file is its chunks back to back: no overlap, no gap, nothing after.
  void check_packing() {
    for (std::size_t f = 0; f < _ranges.size(); ++f) {
      auto& r = _ranges[f];
      std::sort(r.begin(), r.end());
      std::uint64_t prev = 0;
      for (const auto& [begin, end] : r) {
        if (begin != prev) refuse("data file not packed");
        prev = end;
      }
      if (prev != _x.file_sizes[f]) refuse("data file size");
    }
  }

  std::string_view _doc;
  const std::string& _origin;
  JsonReader _r;
  PyckptIndex _x;
  std::unordered_map<std::string, std::uint32_t> _file_index;
  std::unordered_map<std::string, std::uint32_t> _codec_index;
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> _ranges;  // per file
  std::string _seed_buf;
  std::string _codec_key;
  std::uint32_t _esize = 1;  // of the tensor being read
  std::uint64_t _numel = 1;
};

}  // namespace

PyckptIndexLimits pyckpt_index_limits() noexcept {
  return PyckptIndexLimits{kMaxItems,
                           kMaxFiles,
                           kMaxPieces,
                           kMaxSegments,
                           kMaxChunks,
                           kMaxChunkBytes,
                           kMaxNdim,
                           kMaxNumel,
                           kMaxItemBytes,
                           kMaxFileBytes,
                           static_cast<std::uint64_t>(kMaxPlannerDepth),
                           kMaxIrregularPieces,
                           kZstdMaxRatio,
                           kZstdMinLevel,
                           kZstdMaxLevel};
}

const std::vector<PyckptDtype>& pyckpt_dtypes() {
  static const std::vector<PyckptDtype> table = {
      {"float64", 8, 8, "group"},       {"float32", 4, 4, "group_rotl1"},
      {"float16", 2, 2, "group"},       {"bfloat16", 2, 2, "group_rotl1"},
      {"float8_e4m3fn", 1, 1, "none"},  {"float8_e4m3fnuz", 1, 1, "none"},
      {"float8_e5m2", 1, 1, "none"},    {"float8_e5m2fnuz", 1, 1, "none"},
      {"float8_e8m0fnu", 1, 1, "none"}, {"float4_e2m1fn_x2", 1, 1, "none"},
      {"complex128", 16, 8, "group"},   {"complex64", 8, 4, "group_rotl1"},
      {"complex32", 4, 2, "group"},     {"int64", 8, 8, "group"},
      {"int32", 4, 4, "group"},         {"int16", 2, 2, "group"},
      {"int8", 1, 1, "none"},           {"uint64", 8, 8, "group"},
      {"uint32", 4, 4, "group"},        {"uint16", 2, 2, "group"},
      {"uint8", 1, 1, "none"},          {"bool", 1, 1, "none"},
  };
  return table;
}

PyckptIndex parse_pyckpt_index(std::string_view doc, const std::string& origin) {
  return Parser(doc, origin).run();
}

}  // namespace pyckpt
