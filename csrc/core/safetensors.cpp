#include "core/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <unordered_set>

#include "core/error.hpp"
#include "core/posix_storage.hpp"

namespace pyckpt {

namespace {

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

// ---------------------------------------------------------------------------------------------
// A small streaming JSON reader covering RFC 8259 (objects, arrays, strings with escapes, numbers,
// literals). It exists so that the core has no third-party JSON dependency. It builds no tree:
// objects and arrays are walked with callbacks and the header is decoded straight into compact
// StTensorInfo entries, so memory is the header text plus the result (a tree of generic JSON
// values cost several hundred bytes per tensor). Depth is bounded so hostile input cannot exhaust
// the stack, and every allocation is bounded by the (already capped) input length.
// ---------------------------------------------------------------------------------------------

/** A scalar value; containers met where a scalar is read are skipped and only their kind kept. */
struct JsonValue {
  enum class Kind : std::uint8_t { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool is_uint = false;          // Number: a non-negative integer that fits in 64 bits
  std::uint64_t uint_value = 0;  // valid when is_uint
  std::string str;               // String contents (decoded); Number text
};

constexpr int kMaxDepth = 64;

class JsonReader {
 public:
  JsonReader(std::string_view text, const std::string& origin) : _s(text), _origin(origin) {}

  /** @return the next non-space character (or '\0' at the end), without consuming it. */
  char peek_value() {
    skip_ws();
    return peek();
  }

  /**
   * Walks an object: for each member, reads the key and calls on_member(key), which must consume
   * the value (at depth + 1).
   */
  template <typename OnMember>
  void parse_object(int depth, OnMember&& on_member) {
    if (depth > kMaxDepth) fail("nesting too deep");
    skip_ws();
    expect('{');
    skip_ws();
    if (peek() == '}') {
      ++_pos;
      return;
    }
    for (;;) {
      skip_ws();
      if (peek() != '"') fail("expected a string key");
      std::string key = parse_string();
      skip_ws();
      expect(':');
      skip_ws();
      on_member(std::move(key));
      skip_ws();
      if (peek() == ',') {
        ++_pos;
        continue;
      }
      expect('}');
      return;
    }
  }

  /** Walks an array, calling on_item() for each element; it must consume the element. */
  template <typename OnItem>
  void parse_array(int depth, OnItem&& on_item) {
    if (depth > kMaxDepth) fail("nesting too deep");
    skip_ws();
    expect('[');
    skip_ws();
    if (peek() == ']') {
      ++_pos;
      return;
    }
    for (;;) {
      skip_ws();
      on_item();
      skip_ws();
      if (peek() == ',') {
        ++_pos;
        continue;
      }
      expect(']');
      return;
    }
  }

  /** Reads any value; an object or array is validated and skipped (only its kind is kept). */
  JsonValue parse_scalar(int depth) {
    if (depth > kMaxDepth) fail("nesting too deep");
    skip_ws();
    if (at_end()) fail("unexpected end");
    const char c = _s[_pos];
    JsonValue v;
    if (c == '{') {
      parse_object(depth, [&](std::string) { (void)parse_scalar(depth + 1); });
      v.kind = JsonValue::Kind::Object;
      return v;
    }
    if (c == '[') {
      parse_array(depth, [&] { (void)parse_scalar(depth + 1); });
      v.kind = JsonValue::Kind::Array;
      return v;
    }
    if (c == '"') {
      v.kind = JsonValue::Kind::String;
      v.str = parse_string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {
      parse_number(v);
      return v;
    }
    if (_s.compare(_pos, 4, "true") == 0) {
      _pos += 4;
      v.kind = JsonValue::Kind::Bool;
      return v;
    }
    if (_s.compare(_pos, 5, "false") == 0) {
      _pos += 5;
      v.kind = JsonValue::Kind::Bool;
      return v;
    }
    if (_s.compare(_pos, 4, "null") == 0) {
      _pos += 4;
      return v;
    }
    fail("unexpected character");
  }

  /** Requires that only whitespace follows the document. */
  void finish() {
    skip_ws();
    PYCKPT_EXPECT_FORMAT(_pos == _s.size(), FormatKind::Header, "safetensors header of '", _origin,
                         "' has trailing bytes after the JSON object at offset ", _pos);
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw FormatError(FormatKind::Header,
                      detail::concat("safetensors header of '", _origin,
                                     "' is not valid JSON: ", what, " at offset ", _pos));
  }
  char peek() const { return _pos < _s.size() ? _s[_pos] : '\0'; }
  bool at_end() const { return _pos >= _s.size(); }
  void skip_ws() {
    while (_pos < _s.size()) {
      const char c = _s[_pos];
      if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
        ++_pos;
      } else {
        break;
      }
    }
  }
  void expect(char c) {
    if (at_end() || _s[_pos] != c) fail("unexpected character");
    ++_pos;
  }

  void parse_number(JsonValue& v) {
    v.kind = JsonValue::Kind::Number;
    const std::size_t start = _pos;
    bool negative = false;
    if (peek() == '-') {
      negative = true;
      ++_pos;
    }
    if (at_end() || !(peek() >= '0' && peek() <= '9')) fail("malformed number");
    bool overflow = false;
    std::uint64_t value = 0;
    if (peek() == '0') {
      ++_pos;
    } else {
      while (!at_end() && peek() >= '0' && peek() <= '9') {
        const auto digit = static_cast<std::uint64_t>(peek() - '0');
        if (value > (std::numeric_limits<std::uint64_t>::max() - digit) / 10) overflow = true;
        value = value * 10 + digit;
        ++_pos;
      }
    }
    bool integral = true;
    if (peek() == '.') {
      integral = false;
      ++_pos;
      if (at_end() || !(peek() >= '0' && peek() <= '9')) fail("malformed number");
      while (!at_end() && peek() >= '0' && peek() <= '9') ++_pos;
    }
    if (peek() == 'e' || peek() == 'E') {
      integral = false;
      ++_pos;
      if (peek() == '+' || peek() == '-') ++_pos;
      if (at_end() || !(peek() >= '0' && peek() <= '9')) fail("malformed number");
      while (!at_end() && peek() >= '0' && peek() <= '9') ++_pos;
    }
    v.str.assign(_s.substr(start, _pos - start));
    v.is_uint = integral && !overflow && (!negative || value == 0);
    v.uint_value = v.is_uint ? value : 0;
  }

  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  std::uint32_t parse_hex4() {
    if (_s.size() - _pos < 4) fail("truncated \\u escape");
    std::uint32_t cp = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = _s[_pos++];
      cp <<= 4;
      if (h >= '0' && h <= '9') {
        cp |= static_cast<std::uint32_t>(h - '0');
      } else if (h >= 'a' && h <= 'f') {
        cp |= static_cast<std::uint32_t>(h - 'a' + 10);
      } else if (h >= 'A' && h <= 'F') {
        cp |= static_cast<std::uint32_t>(h - 'A' + 10);
      } else {
        fail("bad hex digit in \\u escape");
      }
    }
    return cp;
  }

 public:
  std::string parse_string() {
    expect('"');
    std::string out;
    for (;;) {
      if (at_end()) fail("unterminated string");
      const char c = _s[_pos++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (at_end()) fail("unterminated escape");
      const char e = _s[_pos++];
      switch (e) {
        case '"': out.push_back('"'); break;
        case '\\': out.push_back('\\'); break;
        case '/': out.push_back('/'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'n': out.push_back('\n'); break;
        case 'r': out.push_back('\r'); break;
        case 't': out.push_back('\t'); break;
        case 'u': {
          std::uint32_t cp = parse_hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (_s.compare(_pos, 2, "\\u") != 0) fail("unpaired surrogate");
            _pos += 2;
            const std::uint32_t lo = parse_hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("unpaired surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("unknown escape");
      }
    }
  }

 private:
  std::string_view _s;
  const std::string& _origin;
  std::size_t _pos = 0;
};

// Rejects overlong encodings, surrogates and code points above U+10FFFF, like std::str::from_utf8.
bool valid_utf8(std::string_view s) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const std::size_t n = s.size();
  std::size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t len = 0;
    std::uint32_t cp = 0;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (std::size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

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
  JsonReader r(json, origin);
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
