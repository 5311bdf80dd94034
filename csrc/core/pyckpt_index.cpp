#include "core/pyckpt_index.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <utility>

#include "core/checksum.hpp"
#include "core/chunk_io.hpp"
#include "core/error.hpp"
#include "core/json_tape.hpp"
#include "core/stitcher.hpp"

namespace pyckpt {

namespace {

__extension__ typedef unsigned __int128 u128;

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
constexpr std::uint64_t kMaxGridCells = std::uint64_t{1} << 24;
constexpr std::uint64_t kZstdMaxRatio = std::uint64_t{1} << 16;
constexpr std::int64_t kZstdMinLevel = -(std::int64_t{1} << 17);
constexpr std::int64_t kZstdMaxLevel = 22;
constexpr int kPlaceBoundVersion = 3;  // chunk checksums bound to their place from this version
// Containers nested deeper than this make the JSON "nested too deeply" (Python's parser stops
// near its recursion limit, 1000).
constexpr std::size_t kMaxJsonDepth = 512;

// The metadata checksum member that ends a version 2+ file: ,"checksum":"xxh64:<16 hex>"}
constexpr std::string_view kSealHead = ",\"checksum\":\"xxh64:";
constexpr std::size_t kSealLen = kSealHead.size() + 16 + 2;

const char* const kMemoryFormats[] = {"contiguous_format", "channels_last", "channels_last_3d",
                                      "preserve_format"};
const char* const kTopKeys[] = {"format",      "version",      "created_by",   "save_id",
                                "dcp_version", "storage_meta", "planner_data", "files",
                                "items",       "checksum"};
const char* const kTensorKeys[] = {"type",          "dtype",         "shape",
                                   "requires_grad", "memory_format", "pieces"};
const char* const kBytesKeys[] = {"type", "nbytes", "segments"};
const char* const kPieceKeys[] = {"offsets", "sizes", "segments"};
const char* const kSegmentKeys[] = {"file", "raw_begin", "codec", "chunks"};
const char* const kStorageMetaKeys[] = {"modules"};
const char* const kTupleKeys[] = {"__tuple__"};

// Transform codes of chunk records (docs/FORMAT.md): none 0, group 1, group_rotl1 2.
std::uint32_t transform_code(std::string_view t) {
  return t == "group" ? 1 : t == "group_rotl1" ? 2 : 0;
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

// Python's UTF-8 decoder: the reason and start of the first error, or nullptr when `s` is valid.
const char* utf8_error(std::string_view s, std::size_t& start) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  for (std::size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    start = i;
    std::size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return "invalid start byte";
    }
    for (std::size_t k = 1; k < len; ++k) {
      if (i + k >= n) return "unexpected end of data";
      const unsigned char b = p[i + k];
      if (k == 1 ? (b < lo || b > hi) : (b & 0xC0) != 0x80) return "invalid continuation byte";
    }
    i += len;
  }
  return nullptr;
}

std::string dims_text(const std::uint64_t* d, std::size_t n) {
  std::string out = "[";
  for (std::size_t i = 0; i < n; ++i) {
    if (i) out += ", ";
    out += std::to_string(d[i]);
  }
  return out + "]";
}

std::string u128_text(u128 v) {
  if (v == 0) return "0";
  std::string out;
  while (v) {
    out.push_back(static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::string member_path(const std::string& path, std::string_view key) {
  return path.empty() ? std::string(key) : detail::concat(path, ".", key);
}

class Reader {
 public:
  Reader(std::string_view doc, const std::string& origin, const PyckptIndexOptions& options)
      : _doc(doc), _meta(origin), _o(options) {}

  PyckptIndex run() {
    const bool sealed = check_seal();
    std::size_t bad = 0;
    if (const char* why = utf8_error(_doc, bad)) {
      fail("", detail::concat("metadata is not UTF-8 (", why, " at byte ", bad, ")"));
    }
    if (_doc.empty() || _doc[0] != '{') {
      fail("", "metadata must start with '{' (no byte order mark, no whitespace)");
    }
    _x.tape = std::make_unique<JsonTape>(_doc, _meta + ": metadata", kMaxJsonDepth);
    _t = _x.tape.get();
    const JsonTape& t = *_t;
    if (t[0].flags & JNode::kRepeats) {
      fail("", "metadata repeats the top-level key " + py_repr_str(t.repeated_key(0)));
    }
    const std::size_t format = t.member(0, "format");
    if (format == JsonTape::npos || !t.is(format, "pyckpt")) {
      fail("", "not a pyckpt metadata file ('format' is not 'pyckpt')");
    }
    const std::size_t version = t.member(0, "version");
    if (version == JsonTape::npos) fail("version", "must be an integer, got None");
    if (t[version].kind != JKind::Int)
      fail("version", "must be an integer, got " + t.describe(version));
    if (in_range(version, 4, 4)) {  // read by pyckpt/_format_shards_read.py, by its prefix
      fail("",
           "a version 4 (sharded) document must begin with {\"format\":\"pyckpt\","
           "\"version\":4, (docs/FORMAT.md, \"Version 4\")");
    }
    if (!in_range(version, 1, 3)) {
      fail("", "format version " + t.int_text(version) +
                   " is not supported by this pyckpt (reads versions 1, 2, 3, 4); upgrade pyckpt "
                   "to read it");
    }
    _x.version = static_cast<int>(t[version].v);
    if (_x.version >= 2 && !sealed) {
      fail("",
           detail::concat("the metadata checksum is missing or malformed (a version ", _x.version,
                          " file ends with ,\"checksum\":\"xxh64:<16 hex digits>\"}): the file "
                          "is damaged"));
    }
    document();
    return std::move(_x);
  }

 private:
  // ------------------------------------------------------------------------------ helpers

  [[noreturn]] void fail(const std::string& path, const std::string& what) const {
    throw FormatError(FormatKind::Header, path.empty()
                                              ? detail::concat(_meta, ": ", what)
                                              : detail::concat(_meta, ": ", path, ": ", what));
  }
  [[noreturn]] void too_many(std::uint64_t limit, const char* what) const {
    fail("", detail::concat("more than ", limit, " ", what, ": this pyckpt refuses such metadata"));
  }

  bool check_seal() const {
    if (_doc.size() <= kSealLen) return false;
    const std::string_view tail = _doc.substr(_doc.size() - kSealLen);
    if (tail.substr(0, kSealHead.size()) != kSealHead || tail.substr(kSealLen - 2) != "\"}" ||
        !lower_hex(tail.substr(kSealHead.size(), 16), 16)) {
      return false;
    }
    std::uint64_t recorded = 0;
    for (char c : tail.substr(kSealHead.size(), 16)) {
      recorded = recorded * 16 + static_cast<std::uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
    }
    const std::uint64_t actual = xxh64(_doc.data(), _doc.size() - kSealLen);
    if (actual != recorded) {
      char buf[128];
      std::snprintf(buf, sizeof buf,
                    "metadata checksum mismatch (recorded xxh64:%016llx, computed xxh64:%016llx)"
                    ": the file is damaged",
                    static_cast<unsigned long long>(recorded),
                    static_cast<unsigned long long>(actual));
      fail("", buf);
    }
    return true;
  }

  // `i` is an integer in [lo, hi].
  bool in_range(std::size_t i, std::int64_t lo, std::uint64_t hi) const {
    const JNode& n = (*_t)[i];
    if (n.kind != JKind::Int || (n.flags & JNode::kBig)) return false;
    if (n.flags & JNode::kNegative) {
      return lo < 0 && n.v <= static_cast<std::uint64_t>(-(lo + 1)) + 1;
    }
    return (lo <= 0 || n.v >= static_cast<std::uint64_t>(lo)) && n.v <= hi;
  }
  bool is_uint(std::size_t i, std::uint64_t value) const {
    const JNode& n = (*_t)[i];
    return n.kind == JKind::Int && !(n.flags & (JNode::kBig | JNode::kNegative)) && n.v == value;
  }

  template <typename Path>
  std::uint64_t int_(std::size_t i, const Path& path, std::int64_t lo, std::uint64_t hi) const {
    if ((*_t)[i].kind != JKind::Int) fail(path(), "must be an integer, got " + _t->describe(i));
    if (!in_range(i, lo, hi)) {
      fail(path(), detail::concat(_t->int_text(i), " is outside [", lo, ", ", hi, "]"));
    }
    return (*_t)[i].v;
  }

  template <typename Path>
  std::string_view str_(std::size_t i, const Path& path) const {
    if ((*_t)[i].kind != JKind::String) fail(path(), "must be a string, got " + _t->describe(i));
    return _t->str(i);
  }

  template <typename Path>
  void object(std::size_t i, const Path& path) const {
    const JNode& n = (*_t)[i];
    if (n.kind != JKind::Object) fail(path(), "must be an object, got " + _t->describe(i));
    if (n.flags & JNode::kRepeats)
      fail(path(), "repeats the key " + py_repr_str(_t->repeated_key(i)));
  }

  // Object `i` with exactly the keys `keys`; `out[k]` = the value of keys[k].
  template <std::size_t N, typename Path>
  void bind(std::size_t i, const Path& path, const char* const (&keys)[N], std::size_t (&out)[N],
            std::size_t n = N) const {
    object(i, path);
    const JsonTape& t = *_t;
    std::fill(out, out + N, JsonTape::npos);
    bool unknown = false;
    std::size_t k = 0;
    for (std::size_t m = i + 1; m < t.next(i); m = t.next(m + 1), ++k) {
      const std::string_view key = t.str(m);
      std::size_t at = k < n && key == keys[k] ? k : n;  // the writer's order first
      for (std::size_t j = 0; at == n && j < n; ++j) {
        if (key == keys[j]) at = j;
      }
      if (at == n) {
        unknown = true;
      } else {
        out[at] = m + 1;
      }
    }
    const char* missing = nullptr;
    for (std::size_t j = 0; j < n; ++j) {
      if (out[j] == JsonTape::npos && (missing == nullptr || std::strcmp(keys[j], missing) < 0)) {
        missing = keys[j];
      }
    }
    if (missing != nullptr) fail(member_path(path(), missing), "missing");
    if (unknown) {
      std::string_view first;
      bool have = false;
      for (std::size_t m = i + 1; m < t.next(i); m = t.next(m + 1)) {
        const std::string_view key = t.str(m);
        if (std::none_of(keys, keys + n, [&](const char* k2) { return key == k2; }) &&
            (!have || key < first)) {
          first = key;
          have = true;
        }
      }
      fail(member_path(path(), first), "unknown key");
    }
  }

  template <typename Path>
  std::size_t list(std::size_t i, const Path& path,
                   std::uint64_t limit = std::numeric_limits<std::uint64_t>::max()) const {
    const JNode& n = (*_t)[i];
    if (n.kind != JKind::Array) fail(path(), "must be a list, got " + _t->describe(i));
    if (n.n > limit) fail(path(), detail::concat("has ", n.n, " entries, more than ", limit));
    return n.n;
  }

  // A list of dimensions (shape, offsets, sizes) appended to _x.dims; `ndim` npos: any rank.
  template <typename Path>
  std::size_t dims(std::size_t i, const Path& path, std::size_t ndim) {
    const std::size_t count = list(i, path, kMaxNdim);
    if (ndim != JsonTape::npos && count != ndim) {
      fail(path(), detail::concat("has ", count, " entries, the tensor has ", ndim, " dimensions"));
    }
    std::size_t d = 0;
    for (std::size_t e = i + 1; e < _t->next(i); e = _t->next(e), ++d) {
      if (!in_range(e, 0, _o.limits.max_numel)) {
        fail(detail::concat(path(), "[", d, "]"),
             detail::concat("must be an integer in [0, ", _o.limits.max_numel, "], got ",
                            _t->describe(e)));
      }
      _x.dims.push_back((*_t)[e].v);
    }
    return count;
  }

  // ----------------------------------------------------------------------------- document

  void document() {
    const JsonTape& t = *_t;
    std::size_t v[10];
    const auto top = [] { return std::string(); };
    bind(0, top, kTopKeys, v, _x.version >= 2 ? 10 : 9);
    _x.created_by = std::string(str_(v[2], [] { return std::string("created_by"); }));
    _x.save_id = std::string(str_(v[3], [] { return std::string("save_id"); }));
    if (!lower_hex(_x.save_id, 12)) {
      fail("save_id", py_repr_str(_x.save_id) + " is not 12 lowercase hex digits");
    }
    if (t[v[4]].kind != JKind::Null) {
      _x.dcp_version = std::string(str_(v[4], [] { return std::string("dcp_version"); }));
      _x.has_dcp_version = true;
    }
    std::size_t sm[1];
    bind(v[5], [] { return std::string("storage_meta"); }, kStorageMetaKeys, sm);
    list(sm[0], [] { return std::string("storage_meta.modules"); });
    std::size_t m = 0;
    for (std::size_t e = sm[0] + 1; e < t.next(sm[0]); e = t.next(e), ++m) {
      _x.modules.emplace_back(
          str_(e, [&] { return detail::concat("storage_meta.modules[", m, "]"); }));
    }
    _x.planner = v[6];
    _path.assign(1, "planner_data");
    planner(v[6], 0);
    files(v[7]);
    items(v[8]);
    check_packing();
  }

  // planner_data: any JSON value nested at most kMaxPlannerDepth deep, in which an object with
  // the key "__tuple__" holds only that key, with a list value. `_path` is its key path.
  void planner(std::size_t i, int depth) {
    const JsonTape& t = *_t;
    const JNode& n = t[i];
    const auto path = [&] {
      std::string out;
      for (const std::string& p : _path) out += p;
      return out;
    };
    if (depth > kMaxPlannerDepth) {
      fail(path(), detail::concat("nested deeper than ", kMaxPlannerDepth, " levels"));
    }
    if (n.kind == JKind::Object) {
      if (n.flags & JNode::kRepeats) fail(path(), "unexpected " + t.describe(i));
      const std::size_t inner = t.member(i, "__tuple__");
      if (inner != JsonTape::npos) {
        std::size_t one[1];
        bind(i, path, kTupleKeys, one);
        if (t[inner].kind != JKind::Array) {
          list(inner, [&] { return path() + ".__tuple__"; });
        }
        std::size_t k = 0;
        for (std::size_t e = inner + 1; e < t.next(inner); e = t.next(e), ++k) {
          _path.push_back(detail::concat(".__tuple__[", k, "]"));
          planner(e, depth + 1);
          _path.pop_back();
        }
        return;
      }
      for (std::size_t e = i + 1; e < t.next(i); e = t.next(e + 1)) {
        _path.push_back("[" + py_repr_str(t.str(e)) + "]");
        planner(e + 1, depth + 1);
        _path.pop_back();
      }
    } else if (n.kind == JKind::Array) {
      std::size_t k = 0;
      for (std::size_t e = i + 1; e < t.next(i); e = t.next(e), ++k) {
        _path.push_back(detail::concat("[", k, "]"));
        planner(e, depth + 1);
        _path.pop_back();
      }
    }
  }

  void files(std::size_t i) {
    const JsonTape& t = *_t;
    object(i, [] { return std::string("files"); });
    if (t[i].n > _o.limits.max_files) {
      fail("files", detail::concat("has ", t[i].n, " entries, more than ", _o.limits.max_files));
    }
    for (std::size_t k = i + 1; k < t.next(i); k = t.next(k + 1)) {
      const std::string_view name = t.str(k);
      const auto fp = [&] { return "files[" + py_repr_str(name) + "]"; };
      if (!data_file_name(name)) {
        fail(fp(), "illegal data file name (expected <rank>-<k>.<save_id>.pyckpt)");
      }
      const std::uint64_t size = int_(k + 1, fp, 0, kMaxFileBytes);
      if (_o.only_rank >= 0 && name.substr(0, name.find('-')) != std::to_string(_o.only_rank)) {
        fail(fp(), detail::concat("is not a data file of rank ", _o.only_rank,
                                  "; rank-local metadata names only its rank's files"));
      }
      _file_index.emplace(name, static_cast<std::uint32_t>(_x.file_names.size()));
      _x.file_names.emplace_back(name);
      _x.file_sizes.push_back(size);
    }
    _ranges.resize(_x.file_names.size());
  }

  void items(std::size_t i) {
    const JsonTape& t = *_t;
    object(i, [] { return std::string("items"); });
    if (t[i].n > _o.limits.max_items) {
      fail("items", detail::concat("has ", t[i].n, " entries, more than ", _o.limits.max_items));
    }
    for (std::size_t k = i + 1; k < t.next(i); k = t.next(k + 1)) {
      IdxItem item;
      item.fqn = std::string(t.str(k));
      const std::string ip = "items[" + py_repr_str(item.fqn) + "]";
      const auto ipf = [&] { return ip; };
      const std::size_t raw = k + 1;
      object(raw, ipf);
      const std::size_t type = t.member(raw, "type");
      if (type != JsonTape::npos && t.is(type, "tensor")) {
        std::size_t v[6];
        bind(raw, ipf, kTensorKeys, v);
        tensor(item, ip, v);
      } else if (type != JsonTape::npos && t.is(type, "bytes")) {
        std::size_t v[3];
        bind(raw, ipf, kBytesKeys, v);
        item.tensor = false;
        item.nbytes = int_(v[1], [&] { return ip + ".nbytes"; }, 0, kMaxItemBytes);
        item.segments_begin = _x.segments.size();
        segments(v[2], item.nbytes, ipf, "uint8", place_seed(item.fqn, nullptr, 0));
        item.segments_end = _x.segments.size();
      } else if (type == JsonTape::npos) {
        fail(ip + ".type", "missing");
      } else {
        fail(ip + ".type", "unknown item type " + t.describe(type));
      }
      _x.items.push_back(std::move(item));
    }
  }

  void tensor(IdxItem& item, const std::string& ip, const std::size_t (&v)[6]) {
    const JsonTape& t = *_t;
    item.dtype = std::string(str_(v[1], [&] { return ip + ".dtype"; }));
    const auto& table = pyckpt_dtypes();
    const auto dt = std::find_if(table.begin(), table.end(),
                                 [&](const PyckptDtype& d) { return item.dtype == d.name; });
    if (dt == table.end()) {
      throw UnsupportedDtype(
          detail::concat(_meta, ": ", ip, ".dtype: unsupported dtype ", py_repr_str(item.dtype)));
    }
    const std::uint64_t esize = dt->size;
    item.shape_at = _x.dims.size();
    item.ndim =
        static_cast<std::uint32_t>(dims(v[2], [&] { return ip + ".shape"; }, JsonTape::npos));
    const std::uint64_t* shape = _x.dims.data() + item.shape_at;
    u128 numel = 1;
    for (std::uint32_t d = 0; d < item.ndim; ++d) {
      numel = shape[d] == 0 ? 0 : numel > (u128{1} << 64) ? numel : numel * shape[d];
      if (shape[d] == 0) break;
    }
    if (numel > _o.limits.max_numel || numel * esize > _o.limits.max_item_bytes) {
      fail(ip + ".shape",
           detail::concat(dims_text(shape, item.ndim), " holds more than ", _o.limits.max_numel,
                          " elements or ", _o.limits.max_item_bytes, " bytes"));
    }
    if (t[v[3]].kind != JKind::True && t[v[3]].kind != JKind::False) {
      fail(ip + ".requires_grad", "must be true or false, got " + t.describe(v[3]));
    }
    item.requires_grad = t[v[3]].kind == JKind::True;
    if (t[v[4]].kind != JKind::String ||
        std::none_of(std::begin(kMemoryFormats), std::end(kMemoryFormats),
                     [&](const char* m) { return t.str(v[4]) == m; })) {
      fail(ip + ".memory_format",
           "must be one of ['contiguous_format', 'channels_last', 'channels_last_3d', "
           "'preserve_format'], got " +
               t.describe(v[4]));
    }
    item.memory_format = std::string(t.str(v[4]));
    const std::size_t count = list(v[5], [&] { return ip + ".pieces"; });
    _pieces += count;
    if (_pieces > _o.limits.max_pieces) too_many(_o.limits.max_pieces, "pieces");
    item.pieces_begin = _x.pieces.size();
    std::size_t n = 0;
    for (std::size_t e = v[5] + 1; e < t.next(v[5]); e = t.next(e), ++n) {
      piece(item, ip, n, e, esize);
    }
    item.pieces_end = _x.pieces.size();
    if (_o.disjoint_pieces) {
      check_disjoint(item, ip);
    } else {
      check_tiling(item, ip, static_cast<std::uint64_t>(numel));
    }
  }

  void piece(const IdxItem& item, const std::string& ip, std::size_t n, std::size_t raw,
             std::uint64_t esize) {
    const auto pp = [&] { return detail::concat(ip, ".pieces[", n, "]"); };
    std::size_t v[3];
    bind(raw, pp, kPieceKeys, v);
    IdxPiece p;
    p.dims_at = _x.dims.size();
    dims(v[0], [&] { return pp() + ".offsets"; }, item.ndim);
    dims(v[1], [&] { return pp() + ".sizes"; }, item.ndim);
    const std::uint64_t* shape = _x.dims.data() + item.shape_at;
    const std::uint64_t* offsets = _x.dims.data() + p.dims_at;
    const std::uint64_t* sizes = offsets + item.ndim;
    std::uint64_t nbytes = esize;
    for (std::uint32_t d = 0; d < item.ndim; ++d) {
      if (offsets[d] > shape[d] || sizes[d] > shape[d] - offsets[d]) {
        fail(pp(), detail::concat("offsets ", dims_text(offsets, item.ndim), " + sizes ",
                                  dims_text(sizes, item.ndim), " leave the tensor's shape ",
                                  dims_text(shape, item.ndim), " (dimension ", d, ")"));
      }
      nbytes *= sizes[d];  // bounded by the tensor's bytes, checked against the limit
    }
    p.nbytes = nbytes;
    p.segments_begin = _x.segments.size();
    segments(v[2], nbytes, pp, item.dtype, place_seed(item.fqn, offsets, item.ndim));
    p.segments_end = _x.segments.size();
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

  // The segments of a piece or bytes item (`where`: its key path) holding `nbytes` raw bytes.
  template <typename Path>
  void segments(std::size_t i, std::uint64_t nbytes, const Path& where, const std::string& dtype,
                std::uint64_t seed) {
    const JsonTape& t = *_t;
    const std::size_t count = list(i, [&] { return where() + ".segments"; });
    _segments += count;
    if (_segments > _o.limits.max_segments) too_many(_o.limits.max_segments, "segments");
    std::uint64_t expect = 0;
    std::size_t s = 0;
    for (std::size_t e = i + 1; e < t.next(i); e = t.next(e), ++s) {
      const auto sp = [&] { return detail::concat(where(), ".segments[", s, "]"); };
      std::size_t v[4];
      bind(e, sp, kSegmentKeys, v);
      IdxSegment seg;
      const auto file =
          t[v[0]].kind == JKind::String ? _file_index.find(t.str(v[0])) : _file_index.end();
      if (file == _file_index.end()) {
        fail(sp() + ".file", t.describe(v[0]) + " is not a data file listed in 'files'");
      }
      seg.file = file->second;
      seg.raw_begin = int_(v[1], [&] { return sp() + ".raw_begin"; }, 0, kMaxItemBytes);
      if (seg.raw_begin != expect) {
        fail(sp() + ".raw_begin", detail::concat("segments leave a gap or overlap: ", seg.raw_begin,
                                                 ", expected ", expect));
      }
      seg.codec = codec(v[2], [&] { return sp() + ".codec"; }, dtype);
      const std::size_t chunks = list(v[3], [&] { return sp() + ".chunks"; });
      _chunks += chunks;
      if (_chunks > _o.limits.max_chunks) too_many(_o.limits.max_chunks, "chunk records");
      seg.chunks_begin = _x.chunks.size();
      expect += chunk_records(v[3], seg, seed, sp);
      seg.chunks_end = _x.chunks.size();
      _x.segments.push_back(seg);
    }
    if (expect != nbytes) {
      fail(where() + ".segments", detail::concat("hold ", expect, " raw bytes, expected ", nbytes));
    }
  }

  template <typename Path>
  std::uint32_t codec(std::size_t i, const Path& path, const std::string& dtype) {
    const JsonTape& t = *_t;
    if (list(i, path) != 4) fail(path(), "must be [codec, level, elem_size, transform]");
    const std::size_t c0 = i + 1, c1 = t.next(c0), c2 = t.next(c1), c3 = t.next(c2);
    IdxCodec c;
    c.dtype = dtype;
    if (t.is(c0, "none")) {
      if (!is_uint(c1, 0) || !is_uint(c2, 1) || !t.is(c3, "none")) {
        fail(path(), "codec 'none' is stored as [\"none\", 0, 1, \"none\"], got " + t.repr(i));
      }
      c.codec = c.transform = "none";
    } else if (t.is(c0, "zstd")) {
      c.codec = "zstd";
      int_(
          c1, [&] { return path() + "[1]"; }, kZstdMinLevel,
          static_cast<std::uint64_t>(kZstdMaxLevel));
      const JNode& lv = t[c1];
      c.level = (lv.flags & JNode::kNegative) ? -static_cast<std::int64_t>(lv.v)
                                              : static_cast<std::int64_t>(lv.v);
      if (t[c3].kind != JKind::String ||
          (!t.is(c3, "none") && !t.is(c3, "group") && !t.is(c3, "group_rotl1"))) {
        fail(path() + "[3]", "unknown transform " + t.describe(c3));
      }
      c.transform = std::string(t.str(c3));
      std::uint64_t want_e = 1;
      bool fits = true;
      if (c.transform != "none") {
        const auto& table = pyckpt_dtypes();
        const auto it = std::find_if(table.begin(), table.end(),
                                     [&](const PyckptDtype& d) { return dtype == d.name; });
        fits = it != table.end() && it->planes > 1 && c.transform == it->transform;
        want_e = fits ? it->planes : 0;
      }
      if (!fits || !is_uint(c2, want_e)) {
        fail(path(), "elem_size " + t.describe(c2) + " and transform " + py_repr_str(c.transform) +
                         " do not fit dtype " + dtype);
      }
      c.elem_size = static_cast<std::uint32_t>(want_e);
    } else {
      fail(path() + "[0]", "unknown codec " + t.describe(c0));
    }
    // One entry per distinct (dtype, fields).
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

  // The chunk records of `seg` (list `i`); returns their raw bytes.
  template <typename Path>
  std::uint64_t chunk_records(std::size_t i, const IdxSegment& seg, std::uint64_t seed,
                              const Path& sp) {
    const JsonTape& t = *_t;
    const IdxCodec& c = _x.codecs[seg.codec];
    const bool zstd = c.codec == "zstd";
    const std::uint32_t E = c.elem_size;
    const std::uint32_t group_code = zstd && E > 1 ? transform_code(c.transform) : 0;
    const std::uint64_t size = _x.file_sizes[seg.file];
    const bool bound = _x.version >= kPlaceBoundVersion;
    auto& ranges = _ranges[seg.file];
    std::uint64_t total = 0;
    std::uint64_t pos = seg.raw_begin;
    std::size_t j = 0;
    for (std::size_t e = i + 1; e < t.next(i); e = t.next(e), ++j) {
      const auto cp = [&] { return detail::concat(sp(), ".chunks[", j, "]"); };
      const auto field = [&](int k) { return detail::concat(cp(), "[", k, "]"); };
      const JNode& rec = t[e];
      const std::size_t f0 = e + 1, f1 = f0 + 1, f2 = f1 + 1, f3 = f2 + 1, f4 = f3 + 1;
      // The fields are scalars in the common case; otherwise walk them.
      std::size_t f[5] = {f0, f1, f2, f3, f4};
      if (rec.kind == JKind::Array && rec.n == 5) {
        for (int k = 1; k < 5; ++k) f[k] = t.next(f[k - 1]);
      }
      if (rec.kind != JKind::Array || rec.n != 5 || t[f[4]].kind != JKind::Array) {
        fail(cp(), "must be [file_offset, raw_len, xxh64, transform, [plane modes and lengths]]");
      }
      IdxChunk ch;
      if (!in_range(f[0], 0, kMaxFileBytes)) fail(field(0), "bad file offset " + t.describe(f[0]));
      ch.file_offset = t[f[0]].v;
      if (!in_range(f[1], 1, _o.limits.max_chunk_bytes)) {
        fail(field(1), detail::concat("raw_len must be an integer in [1, ",
                                      _o.limits.max_chunk_bytes, "], got ", t.describe(f[1])));
      }
      ch.raw_len = t[f[1]].v;
      if (!in_range(f[2], 0, std::numeric_limits<std::uint64_t>::max())) {
        fail(field(2), "xxh64 must be an integer in [0, 2**64), got " + t.describe(f[2]));
      }
      ch.xxh64 = t[f[2]].v;
      const bool grouped = group_code != 0 && ch.raw_len % E == 0;
      const std::uint32_t want = grouped ? group_code : 0;
      if (!is_uint(f[3], want)) {
        fail(field(3),
             detail::concat("transform code ", t.describe(f[3]),
                            " disagrees with the codec params ['", c.codec, "', ", c.level, ", ",
                            c.elem_size, ", '", c.transform, "'] (expected ", want, ")"));
      }
      ch.transform = want;
      ch.nplanes = grouped ? E : 1;
      if (t[f[4]].n != 2 * ch.nplanes) {
        fail(field(4), detail::concat("must list ", ch.nplanes, " (mode, length) plane pairs"));
      }
      const std::uint64_t n = ch.raw_len / ch.nplanes;
      std::uint64_t stored = 0;
      ch.planes_at = _x.planes.size();
      std::size_t pe = f[4] + 1;
      for (std::uint32_t p = 0; p < ch.nplanes; ++p) {
        const std::size_t mode = pe, length = t.next(mode);
        pe = t.next(length);
        if (t[mode].kind != JKind::Int || t[length].kind != JKind::Int) {
          fail(field(4), "plane modes and lengths must be integers");
        }
        const std::uint64_t len = t[length].v;
        const bool len_ok = in_range(length, 0, std::numeric_limits<std::uint64_t>::max());
        bool ok = false;
        if (is_uint(mode, 0)) {
          ok = len_ok && len == n;
        } else if (is_uint(mode, 1)) {
          ok = zstd && len_ok && len > 0 && len < n && n <= len * kZstdMaxRatio;
        }
        if (!ok) {
          fail(field(4),
               detail::concat("plane ", p, " (mode ", t.int_text(mode), ", ", t.int_text(length),
                              " bytes) cannot hold ", n, " raw bytes"));
        }
        _x.planes.push_back(t[mode].v);
        _x.planes.push_back(len);
        stored += len;
      }
      if (ch.file_offset + stored > size) {
        fail(cp(), detail::concat("stored bytes [", ch.file_offset, ", ", ch.file_offset + stored,
                                  ") lie past the end of ", _x.file_names[seg.file], " (", size,
                                  " bytes)"));
      }
      ranges.emplace_back(ch.file_offset, ch.file_offset + stored);
      if (bound) ch.xxh64 ^= place_key(seed, pos);
      pos += ch.raw_len;
      total += ch.raw_len;
      _x.chunks.push_back(ch);
    }
    return total;
  }

  // ------------------------------------------------------------------ whole-tensor checks

  // The pieces must tile the tensor: no gap, no overlap (empty pieces are allowed).
  void check_tiling(const IdxItem& item, const std::string& ip, std::uint64_t numel) {
    if (numel == 0) return;  // every piece is inside the shape, hence empty
    const std::uint32_t nd = item.ndim;
    const std::uint64_t* shape = _x.dims.data() + item.shape_at;
    const auto offs = [&](std::size_t b) { return _x.dims.data() + _x.pieces[b].dims_at; };
    const auto sizes = [&](std::size_t b) { return offs(b) + nd; };
    std::vector<std::size_t> boxes;  // non-empty pieces (indexes into _x.pieces)
    u128 covered = 0;
    for (std::size_t p = item.pieces_begin; p < item.pieces_end; ++p) {
      u128 volume = 1;
      for (std::uint32_t d = 0; d < nd; ++d) volume *= sizes(p)[d];
      if (volume == 0) continue;
      boxes.push_back(p);
      covered += volume;
    }
    if (covered != numel) {
      fail(ip + ".pieces",
           detail::concat("cover ", u128_text(covered), " element(s) of the tensor's ", numel,
                          " (shape ", dims_text(shape, nd),
                          "): ", covered < numel ? "a piece is missing" : "pieces overlap"));
    }
    if (boxes.size() == 1) return;
    const auto name = [&](std::size_t p) {
      return detail::concat(ip, ".pieces[", p - item.pieces_begin, "]");
    };
    std::vector<std::uint32_t> varying;
    for (std::uint32_t d = 0; d < nd; ++d) {
      if (std::any_of(boxes.begin(), boxes.end(),
                      [&](std::size_t b) { return offs(b)[d] != 0 || sizes(b)[d] != shape[d]; })) {
        varying.push_back(d);
      }
    }
    if (varying.size() == 1) {  // slices along one dimension: sort and compare neighbours
      const std::uint32_t d = varying[0];
      std::vector<std::size_t> order(boxes);
      std::stable_sort(order.begin(), order.end(),
                       [&](std::size_t a, std::size_t b) { return offs(a)[d] < offs(b)[d]; });
      for (std::size_t k = 1; k < order.size(); ++k) {
        const std::size_t a = order[k - 1], b = order[k];
        if (offs(b)[d] < offs(a)[d] + sizes(a)[d]) fail(name(b), "overlaps " + name(a));
      }
      return;
    }
    // Cut every varying dimension at every piece boundary; each piece covers a box of grid
    // cells, and the pieces tile the tensor iff every cell is covered exactly once. The
    // counters are 8-bit: with the element total already equal, a count that wraps past 255
    // still leaves some other cell at 0.
    std::vector<std::vector<std::uint64_t>> cuts(varying.size());
    u128 cells = 1;
    for (std::size_t k = 0; k < varying.size(); ++k) {
      const std::uint32_t d = varying[k];
      auto& c = cuts[k];
      c.push_back(0);
      c.push_back(shape[d]);
      for (std::size_t b : boxes) {
        c.push_back(offs(b)[d]);
        c.push_back(offs(b)[d] + sizes(b)[d]);
      }
      std::sort(c.begin(), c.end());
      c.erase(std::unique(c.begin(), c.end()), c.end());
      cells *= c.size() - 1;
      if (cells > (u128{1} << 64)) cells = u128{1} << 64;
    }
    if (cells > std::min<std::uint64_t>(kMaxGridCells, 16 * boxes.size() + 4096)) {
      check_irregular_tiling(item, ip, boxes);
      return;
    }
    const auto ncells = static_cast<std::size_t>(cells);
    std::vector<std::uint8_t> grid(ncells, 0);
    std::vector<std::size_t> lo(varying.size()), hi(varying.size()), stride(varying.size());
    for (std::size_t k = varying.size(); k-- > 0;) {
      stride[k] = k + 1 == varying.size() ? 1 : stride[k + 1] * (cuts[k + 1].size() - 1);
    }
    for (std::size_t b : boxes) {
      for (std::size_t k = 0; k < varying.size(); ++k) {
        const auto& c = cuts[k];
        const std::uint32_t d = varying[k];
        lo[k] =
            static_cast<std::size_t>(std::lower_bound(c.begin(), c.end(), offs(b)[d]) - c.begin());
        hi[k] = static_cast<std::size_t>(
            std::lower_bound(c.begin(), c.end(), offs(b)[d] + sizes(b)[d]) - c.begin());
      }
      std::vector<std::size_t> at(lo);
      for (;;) {
        std::size_t cell = 0;
        for (std::size_t k = 0; k < at.size(); ++k) cell += at[k] * stride[k];
        ++grid[cell];
        std::size_t k = at.size();
        while (k-- > 0) {
          if (++at[k] < hi[k]) break;
          at[k] = lo[k];
        }
        if (k == static_cast<std::size_t>(-1)) break;
      }
    }
    for (std::size_t cell = 0; cell < ncells; ++cell) {
      if (grid[cell] == 1) continue;
      std::vector<std::uint64_t> element(nd, 0);
      std::size_t rest = cell;
      for (std::size_t k = 0; k < varying.size(); ++k) {
        element[varying[k]] = cuts[k][rest / stride[k]];
        rest %= stride[k];
      }
      fail(ip + ".pieces", "element " + dims_text(element.data(), nd) + " is covered " +
                               (grid[cell] == 0 ? "by no piece" : "more than once"));
    }
  }

  void check_irregular_tiling(const IdxItem& item, const std::string& ip,
                              const std::vector<std::size_t>& boxes) {
    if (boxes.size() > kMaxIrregularPieces) {
      fail(ip + ".pieces", detail::concat(boxes.size(),
                                          " pieces that are not a product of "
                                          "per-dimension cuts (at most ",
                                          kMaxIrregularPieces, " supported)"));
    }
    const std::uint32_t nd = item.ndim;
    const auto at = [&](std::size_t i) { return _x.dims.begin() + static_cast<std::ptrdiff_t>(i); };
    std::vector<std::uint64_t> shape(at(item.shape_at), at(item.shape_at + nd));
    std::vector<TileBlock> blocks;
    blocks.reserve(boxes.size());
    for (std::size_t b : boxes) {
      const std::size_t o = _x.pieces[b].dims_at;
      blocks.push_back(TileBlock{{at(o), at(o + nd)},
                                 {at(o + nd), at(o + 2 * nd)},
                                 detail::concat("pieces[", b - item.pieces_begin, "]")});
    }
    try {
      pyckpt::check_tiling(ip, shape, blocks);
    } catch (const FormatError& e) {
      fail(ip + ".pieces", e.what());
    }
  }

  // A rank-local part: at most disjoint_pieces non-empty pieces, no two overlapping.
  void check_disjoint(const IdxItem& item, const std::string& ip) {
    const std::uint32_t nd = item.ndim;
    std::vector<std::size_t> boxes;
    for (std::size_t p = item.pieces_begin; p < item.pieces_end; ++p) {
      if (_x.pieces[p].nbytes) boxes.push_back(p);
    }
    if (boxes.size() > _o.disjoint_pieces) {
      fail(ip + ".pieces", detail::concat(boxes.size(), " pieces, more than the ",
                                          _o.disjoint_pieces, " a rank-local part may hold"));
    }
    for (std::size_t k = 0; k < boxes.size(); ++k) {
      const std::uint64_t* b = _x.dims.data() + _x.pieces[boxes[k]].dims_at;
      for (std::size_t m = 0; m < k; ++m) {
        const std::uint64_t* a = _x.dims.data() + _x.pieces[boxes[m]].dims_at;
        bool overlap = true;
        for (std::uint32_t d = 0; d < nd && overlap; ++d) {
          overlap = a[d] < b[d] + b[nd + d] && b[d] < a[d] + a[nd + d];
        }
        if (overlap) {
          fail(detail::concat(ip, ".pieces[", boxes[k] - item.pieces_begin, "]"),
               detail::concat("overlaps ", ip, ".pieces[", boxes[m] - item.pieces_begin, "]"));
        }
      }
    }
  }

  // Every data file is its chunks back to back: no overlap, no gap, nothing after.
  void check_packing() {
    for (std::size_t f = 0; f < _ranges.size(); ++f) {
      auto& r = _ranges[f];
      const std::uint64_t size = _x.file_sizes[f];
      const std::string fp = "files[" + py_repr_str(_x.file_names[f]) + "]";
      if (r.empty()) {
        if (size) fail(fp, detail::concat(size, " bytes but no chunk is stored in it"));
        continue;
      }
      std::stable_sort(r.begin(), r.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      std::uint64_t prev = 0;
      for (const auto& [begin, end] : r) {
        if (begin != prev) {
          const std::string& name = _x.file_names[f];
          if (begin < prev) {
            fail(chunk_path(f, begin),
                 detail::concat("stored bytes at offset ", begin, " of ", name,
                                " overlap another chunk's (which end at ", prev, ")"));
          }
          fail(chunk_path(f, begin),
               detail::concat("bytes [", prev, ", ", begin, ") of ", name, " belong to no chunk"));
        }
        prev = end;
      }
      if (prev != size) {
        fail(fp, detail::concat("records ", size, " bytes, its chunks end at ", prev));
      }
    }
  }

  // The key path of the (last listed) chunk stored at `off` of file `f`: bytes items first,
  // then the tensors' pieces.
  std::string chunk_path(std::size_t f, std::uint64_t off) const {
    std::string found = "files[" + py_repr_str(_x.file_names[f]) + "]";
    const auto scan = [&](const std::string& where, std::size_t begin, std::size_t end) {
      for (std::size_t s = begin; s < end; ++s) {
        const IdxSegment& seg = _x.segments[s];
        if (seg.file != f) continue;
        for (std::size_t c = seg.chunks_begin; c < seg.chunks_end; ++c) {
          if (_x.chunks[c].file_offset == off) {
            found = detail::concat(where, ".segments[", s - begin, "].chunks[",
                                   c - seg.chunks_begin, "]");
          }
        }
      }
    };
    for (const IdxItem& item : _x.items) {
      if (!item.tensor)
        scan("items[" + py_repr_str(item.fqn) + "]", item.segments_begin, item.segments_end);
    }
    for (const IdxItem& item : _x.items) {
      if (!item.tensor) continue;
      for (std::size_t p = item.pieces_begin; p < item.pieces_end; ++p) {
        scan(detail::concat("items[", py_repr_str(item.fqn), "].pieces[", p - item.pieces_begin,
                            "]"),
             _x.pieces[p].segments_begin, _x.pieces[p].segments_end);
      }
    }
    return found;
  }

  std::string_view _doc;
  const std::string& _meta;
  const PyckptIndexOptions& _o;
  PyckptIndex _x;
  const JsonTape* _t = nullptr;
  std::vector<std::string> _path;  // of the planner_data value being checked
  std::unordered_map<std::string_view, std::uint32_t> _file_index;
  std::unordered_map<std::string, std::uint32_t> _codec_index;
  std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> _ranges;  // per file
  std::string _seed_buf;
  std::string _codec_key;
  std::uint64_t _pieces = 0, _segments = 0, _chunks = 0;
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

PyckptIndex parse_pyckpt_index(std::string_view doc, const std::string& origin,
                               const PyckptIndexOptions& options) {
  return Reader(doc, origin, options).run();
}

}  // namespace pyckpt
