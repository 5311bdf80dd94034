#include "core/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <unordered_set>

#include "core/detail/json_reader.hpp"
#include "core/error.hpp"
#include "core/posix_storage.hpp"

namespace pyckpt {

namespace {

using detail::JsonReader;
using detail::JsonValue;
using detail::valid_utf8;

struct DtypeEntry {
  StDtype dtype;
  const char* name;
  unsigned bits;
};

// Sizes follow the reference implementation's Dtype::bitsize().
constexpr DtypeEntry kDtypes[] = {
    {StDtype::BOOL, "BOOL", 8},
    {StDtype::F4, "F4", 4},
    {StDtype::F6_E2M3, "F6_E2M3", 6},
    {StDtype::F6_E3M2, "F6_E3M2", 6},
    {StDtype::U8, "U8", 8},
    {StDtype::I8, "I8", 8},
    {StDtype::F8_E5M2, "F8_E5M2", 8},
    {StDtype::F8_E4M3, "F8_E4M3", 8},
    {StDtype::F8_E8M0, "F8_E8M0", 8},
    {StDtype::F8_E4M3FNUZ, "F8_E4M3FNUZ", 8},
    {StDtype::F8_E5M2FNUZ, "F8_E5M2FNUZ", 8},
    {StDtype::I16, "I16", 16},
    {StDtype::U16, "U16", 16},
    {StDtype::F16, "F16", 16},
    {StDtype::BF16, "BF16", 16},
    {StDtype::I32, "I32", 32},
    {StDtype::U32, "U32", 32},
    {StDtype::F32, "F32", 32},
    {StDtype::C64, "C64", 64},
    {StDtype::F64, "F64", 64},
    {StDtype::I64, "I64", 64},
    {StDtype::U64, "U64", 64},
};

bool checked_mul(std::uint64_t a, std::uint64_t b, std::uint64_t& out) noexcept {
  if (a != 0 && b > std::numeric_limits<std::uint64_t>::max() / a) return false;
  out = a * b;
  return true;
}

// Bytes of a tensor of `shape` and `bits`-bit elements; false on overflow or a partial byte.
bool tensor_bytes(const std::vector<std::uint64_t>& shape, unsigned bits, std::uint64_t& out) {
  std::uint64_t n = 1;
  for (std::uint64_t d : shape) {
    if (!checked_mul(n, d, n)) return false;
  }
  std::uint64_t total_bits = 0;
  if (!checked_mul(n, bits, total_bits)) return false;
  if (total_bits % 8 != 0) return false;
  out = total_bits / 8;
  return true;
}

std::uint64_t read_uint(const JsonValue& v, const std::string& origin, const std::string& tensor,
                        const char* field) {
  PYCKPT_EXPECT_FORMAT(v.kind == JsonValue::Kind::Number && v.is_uint, FormatKind::Header,
                       "safetensors header of '", origin, "': tensor '", tensor, "' field '", field,
                       "' must hold non-negative integers, got ",
                       v.kind == JsonValue::Kind::Number ? v.str : std::string("a non-number"));
  return v.uint_value;
}

// Reads one tensor entry straight from the reader (positioned at its value). Problems found while
// walking the entry are remembered and reported afterwards in a fixed order (missing fields,
// dtype, shape, offsets, sizes), whatever the order of the keys.
StTensorInfo read_tensor(JsonReader& r, std::string name, const std::string& origin) {
  StTensorInfo info;
  info.name = std::move(name);
  const std::string& n = info.name;
  PYCKPT_EXPECT_FORMAT(r.peek_value() == '{', FormatKind::Header, "safetensors header of '", origin,
                       "': entry '", n, "' is not an object");
  bool has_dtype = false, has_shape = false, has_offsets = false;
  JsonValue dtype;
  bool shape_is_array = false;
  std::string bad_dim;  // first shape entry that is not a non-negative integer
  bool too_many_dims = false;
  bool offsets_is_array = false;
  std::size_t n_offsets = 0;
  JsonValue offsets[2];
  r.parse_object(1, [&](std::string key) {
    if (key == "dtype") {
      has_dtype = true;
      dtype = r.parse_scalar(2);
    } else if (key == "shape") {
      has_shape = true;
      info.shape.clear();
      bad_dim.clear();
      too_many_dims = false;
      shape_is_array = r.peek_value() == '[';
      if (!shape_is_array) {
        (void)r.parse_scalar(2);
        return;
      }
      r.parse_array(2, [&] {
        const JsonValue d = r.parse_scalar(3);
        if (!(d.kind == JsonValue::Kind::Number && d.is_uint)) {
          if (bad_dim.empty()) {
            bad_dim = d.kind == JsonValue::Kind::Number ? d.str : std::string("a non-number");
          }
        } else if (info.shape.size() == kMaxSafetensorsRank) {
          too_many_dims = true;
        } else {
          info.shape.push_back(d.uint_value);
        }
      });
    } else if (key == "data_offsets") {
      has_offsets = true;
      n_offsets = 0;
      offsets_is_array = r.peek_value() == '[';
      if (!offsets_is_array) {
        (void)r.parse_scalar(2);
        return;
      }
      r.parse_array(2, [&] {
        JsonValue v = r.parse_scalar(3);
        if (n_offsets < 2) offsets[n_offsets] = std::move(v);
        ++n_offsets;
      });
    } else {
      (void)r.parse_scalar(2);  // unknown keys are ignored, as the reference implementation does
    }
  });
  PYCKPT_EXPECT_FORMAT(has_dtype && has_shape && has_offsets, FormatKind::Header,
                       "safetensors header of '", origin, "': tensor '", n,
                       "' needs 'dtype', 'shape' and 'data_offsets'");
  PYCKPT_EXPECT_FORMAT(dtype.kind == JsonValue::Kind::String, FormatKind::Header,
                       "safetensors header of '", origin, "': tensor '", n,
                       "' has a non-string dtype");
  const auto dt = st_dtype_from_name(dtype.str);
  PYCKPT_EXPECT_FORMAT(dt.has_value(), FormatKind::Header, "safetensors header of '", origin,
                       "': tensor '", n, "' has unknown dtype '", dtype.str, "'");
  info.dtype = *dt;
  PYCKPT_EXPECT_FORMAT(shape_is_array, FormatKind::Header, "safetensors header of '", origin,
                       "': tensor '", n, "' has a non-array shape");
  PYCKPT_EXPECT_FORMAT(bad_dim.empty(), FormatKind::Header, "safetensors header of '", origin,
                       "': tensor '", n, "' field 'shape' must hold non-negative integers, got ",
                       bad_dim);
  PYCKPT_EXPECT_FORMAT(!too_many_dims, FormatKind::Header, "safetensors header of '", origin,
                       "': tensor '", n, "' has more than ", kMaxSafetensorsRank, " dimensions");
  info.shape.shrink_to_fit();
  PYCKPT_EXPECT_FORMAT(offsets_is_array && n_offsets == 2, FormatKind::Header,
                       "safetensors header of '", origin, "': tensor '", n,
                       "' data_offsets must be [begin, end]");
  info.begin = read_uint(offsets[0], origin, n, "data_offsets");
  info.end = read_uint(offsets[1], origin, n, "data_offsets");
  PYCKPT_EXPECT_FORMAT(info.begin <= info.end, FormatKind::Header, "safetensors header of '",
                       origin, "': tensor '", n, "' has data_offsets [", info.begin, ", ", info.end,
                       "] with begin > end");
  std::uint64_t nbytes = 0;
  PYCKPT_EXPECT_FORMAT(tensor_bytes(info.shape, st_dtype_bits(info.dtype), nbytes),
                       FormatKind::Mismatch, "safetensors header of '", origin, "': tensor '", n,
                       "' shape overflows or is not a whole number of bytes for dtype ",
                       st_dtype_name(info.dtype));
  PYCKPT_EXPECT_FORMAT(info.end - info.begin == nbytes, FormatKind::Mismatch,
                       "safetensors header of '", origin, "': tensor '", n, "' spans ",
                       info.end - info.begin, " bytes but its shape and dtype ",
                       st_dtype_name(info.dtype), " need ", nbytes);
  return info;
}

// Throws for the first name that occurs twice (names sorted through pointers: no copies).
template <typename T, typename Name>
void check_unique(const std::vector<T>& items, Name&& name_of, const std::string& origin,
                  const char* where) {
  std::vector<const std::string*> names;
  names.reserve(items.size());
  for (const T& it : items) names.push_back(&name_of(it));
  std::sort(names.begin(), names.end(),
            [](const std::string* a, const std::string* b) { return *a < *b; });
  for (std::size_t i = 1; i < names.size(); ++i) {
    PYCKPT_EXPECT_FORMAT(*names[i] != *names[i - 1], FormatKind::Header, "safetensors header of '",
                         origin, "'", where, " has the key '", *names[i], "' twice");
  }
}

void json_escape(std::string& out, std::string_view s) {
  out.push_back('"');
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (u < 0x20) {
          static const char* hex = "0123456789abcdef";
          out += "\\u00";
          out.push_back(hex[u >> 4]);
          out.push_back(hex[u & 0xF]);
        } else {
          out.push_back(c);
        }
    }
  }
  out.push_back('"');
}

}  // namespace

std::optional<StDtype> st_dtype_from_name(std::string_view name) noexcept {
  for (const auto& e : kDtypes) {
    if (name == e.name) return e.dtype;
  }
  return std::nullopt;
}

const char* st_dtype_name(StDtype dtype) noexcept {
  for (const auto& e : kDtypes) {
    if (e.dtype == dtype) return e.name;
  }
  return "?";
}

unsigned st_dtype_bits(StDtype dtype) noexcept {
  for (const auto& e : kDtypes) {
    if (e.dtype == dtype) return e.bits;
  }
  return 0;
}

StHeader parse_safetensors_header_bytes(std::string_view json, std::uint64_t file_size,
                                        const std::string& origin) {
  StHeader h;
  h.header_len = json.size();
  h.data_start = 8 + h.header_len;
  h.file_size = file_size;
  PYCKPT_EXPECT_FORMAT(h.header_len <= kMaxSafetensorsHeader, FormatKind::Header,
                       "safetensors header of '", origin, "' is ", h.header_len,
                       " bytes, above the ", kMaxSafetensorsHeader, "-byte limit");
  PYCKPT_EXPECT_FORMAT(file_size >= h.data_start, FormatKind::Truncated, "safetensors file '",
                       origin, "' is ", file_size, " bytes, shorter than its ", h.header_len,
                       "-byte header");
  PYCKPT_EXPECT_FORMAT(valid_utf8(json), FormatKind::Header, "safetensors header of '", origin,
                       "' is not valid UTF-8");
  JsonReader r(json, detail::concat("safetensors header of '", origin, "'"));
  PYCKPT_EXPECT_FORMAT(r.peek_value() == '{', FormatKind::Header, "safetensors header of '", origin,
                       "' does not start with '{'");
  bool have_metadata = false;
  r.parse_object(0, [&](std::string key) {
    if (key == "__metadata__") {
      PYCKPT_EXPECT_FORMAT(!have_metadata, FormatKind::Header, "safetensors header of '", origin,
                           "' has the key '__metadata__' twice");
      have_metadata = true;
      PYCKPT_EXPECT_FORMAT(r.peek_value() == '{', FormatKind::Header, "safetensors header of '",
                           origin, "': __metadata__ is not an object");
      r.parse_object(1, [&](std::string mk) {
        PYCKPT_EXPECT_FORMAT(r.peek_value() == '"', FormatKind::Header, "safetensors header of '",
                             origin, "': __metadata__ value of '", mk, "' is not a string");
        std::string mv = r.parse_string();
        h.metadata.emplace_back(std::move(mk), std::move(mv));
      });
      return;
    }
    PYCKPT_EXPECT_FORMAT(h.tensors.size() < kMaxSafetensorsTensors, FormatKind::Header,
                         "safetensors header of '", origin, "' declares more than ",
                         kMaxSafetensorsTensors, " tensors");
    h.tensors.push_back(read_tensor(r, std::move(key), origin));
  });
  r.finish();
  h.tensors.shrink_to_fit();
  check_unique(
      h.metadata, [](const auto& kv) -> const std::string& { return kv.first; }, origin,
      ": __metadata__");
  check_unique(
      h.tensors, [](const StTensorInfo& t) -> const std::string& { return t.name; }, origin, "");

  std::sort(h.tensors.begin(), h.tensors.end(), [](const StTensorInfo& a, const StTensorInfo& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  const std::uint64_t data_size = file_size - h.data_start;
  std::uint64_t cursor = 0;
  const StTensorInfo* prev = nullptr;
  for (const auto& t : h.tensors) {
    PYCKPT_EXPECT_FORMAT(t.end <= data_size, FormatKind::Truncated, "safetensors file '", origin,
                         "': tensor '", t.name, "' data_offsets [", t.begin, ", ", t.end,
                         "] exceed the ", data_size, "-byte data section");
    if (t.begin < cursor) {
      throw FormatError(
          FormatKind::Overlap,
          detail::concat("safetensors file '", origin, "': tensor '", t.name, "' [", t.begin, ", ",
                         t.end, ") overlaps tensor '", prev ? prev->name : std::string("?"), "' [",
                         prev ? prev->begin : 0, ", ", cursor, ")"));
    }
    PYCKPT_EXPECT_FORMAT(t.begin == cursor, FormatKind::Header, "safetensors file '", origin,
                         "': bytes [", cursor, ", ", t.begin, ") before tensor '", t.name,
                         "' belong to no tensor");
    cursor = t.end;
    prev = &t;
  }
  PYCKPT_EXPECT_FORMAT(cursor == data_size, FormatKind::Header, "safetensors file '", origin,
                       "': the tensors end at data offset ", cursor, " but the data section holds ",
                       data_size, " bytes");
  return h;
}

StHeader parse_safetensors_header(const std::string& path) {
  PosixFile file(path, OpenFor::Read);  // regular files only; no symlink, no FIFO wait
  const std::uint64_t file_size = file.size();
  PYCKPT_EXPECT_FORMAT(file_size >= 8, FormatKind::Truncated, "safetensors file '", path, "' is ",
                       file_size, " bytes, too short for the 8-byte header length");

  unsigned char len_bytes[8];
  file.read_at(0, 8, len_bytes);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  // Both bounds are checked before allocating, so an absurd length costs nothing.
  PYCKPT_EXPECT_FORMAT(n <= kMaxSafetensorsHeader, FormatKind::Header, "safetensors file '", path,
                       "' declares a ", n, "-byte header, above the ", kMaxSafetensorsHeader,
                       "-byte limit");
  PYCKPT_EXPECT_FORMAT(n <= file_size - 8, FormatKind::Truncated, "safetensors file '", path,
                       "' declares a ", n, "-byte header but holds only ", file_size - 8,
                       " bytes after the length");
  std::string json(static_cast<std::size_t>(n), '\0');
  file.read_at(8, json.size(), json.data());
  return parse_safetensors_header_bytes(json, file_size, path);
}

StEmitted emit_safetensors_header(
    std::vector<StTensorSpec> tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::sort(tensors.begin(), tensors.end(),
            [](const StTensorSpec& a, const StTensorSpec& b) { return a.name < b.name; });
  StEmitted out;
  std::string json = "{";
  bool first = true;
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    for (std::size_t i = 0; i < metadata.size(); ++i) {
      if (i) json.push_back(',');
      json_escape(json, metadata[i].first);
      json.push_back(':');
      json_escape(json, metadata[i].second);
    }
    json.push_back('}');
    first = false;
  }
  std::uint64_t offset = 0;
  out.begins.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    PYCKPT_EXPECT(t.name != "__metadata__", std::invalid_argument,
                  "a tensor cannot be named __metadata__");
    PYCKPT_EXPECT(i == 0 || tensors[i - 1].name != t.name, std::invalid_argument,
                  "duplicate tensor name '", t.name, "'");
    std::uint64_t nbytes = 0;
    PYCKPT_EXPECT(tensor_bytes(t.shape, st_dtype_bits(t.dtype), nbytes), std::invalid_argument,
                  "tensor '", t.name, "' size overflows or is not a whole number of bytes");
    PYCKPT_EXPECT(offset <= std::numeric_limits<std::uint64_t>::max() - nbytes,
                  std::invalid_argument, "total size overflows");
    if (!first) json.push_back(',');
    first = false;
    json_escape(json, t.name);
    json += ":{\"dtype\":\"";
    json += st_dtype_name(t.dtype);
    json += "\",\"shape\":[";
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (d) json.push_back(',');
      json += std::to_string(t.shape[d]);
    }
    json += "],\"data_offsets\":[";
    json += std::to_string(offset);
    json.push_back(',');
    json += std::to_string(offset + nbytes);
    json += "]}";
    out.begins.push_back(offset);
    offset += nbytes;
  }
  json.push_back('}');
  // Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
  json.append((8 - json.size() % 8) % 8, ' ');
  const std::uint64_t n = json.size();
  out.bytes.resize(8);
  for (int i = 0; i < 8; ++i) out.bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  out.bytes += json;
  out.tensors = std::move(tensors);
  out.data_bytes = offset;
  return out;
}

}  // namespace pyckpt
