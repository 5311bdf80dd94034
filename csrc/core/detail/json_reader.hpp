#pragma once
// A small streaming JSON reader (RFC 8259) and a strict UTF-8 check, shared by the parsers of
// safetensors headers (core/safetensors.cpp) and of pyckpt metadata (core/pyckpt_index.cpp).

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "core/detail/utf8.hpp"
#include "core/error.hpp"

namespace pyckpt::detail {

// ---------------------------------------------------------------------------------------------
// A small streaming JSON reader covering RFC 8259 (objects, arrays, strings with escapes, numbers,
// literals). It exists so that the core has no third-party JSON dependency. It builds no tree:
// objects and arrays are walked with callbacks and each caller decodes the document straight into
// its own compact entries, so memory is the text plus the result (a tree of generic JSON values
// cost several hundred bytes per tensor). Depth is bounded so hostile input cannot exhaust
// the stack, and every allocation is bounded by the (already capped) input length.
// ---------------------------------------------------------------------------------------------

/** A scalar value; containers met where a scalar is read are skipped and only their kind kept. */
struct JsonValue {
  enum class Kind : std::uint8_t { Null, Bool, Number, String, Array, Object };
  Kind kind = Kind::Null;
  bool is_uint = false;          // Number: a non-negative integer that fits in 64 bits
  std::uint64_t uint_value = 0;  // valid when is_uint
  std::string str;               // String contents (decoded); Number text unless is_uint
};

constexpr int kMaxDepth = 64;

class JsonReader {
 public:
  /** @param subject what the text is, for messages (e.g. "safetensors header of 'x'"). */
  JsonReader(std::string_view text, std::string subject) : _s(text), _subject(std::move(subject)) {}

  /** @return the offset of the next character to read. */
  std::size_t pos() const noexcept { return _pos; }

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
    PYCKPT_EXPECT_FORMAT(_pos == _s.size(), FormatKind::Header, _subject,
                         " has trailing bytes after the JSON object at offset ", _pos);
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw FormatError(FormatKind::Header,
                      concat(_subject, " is not valid JSON: ", what, " at offset ", _pos));
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
    v.is_uint = integral && !overflow && (!negative || value == 0);
    v.uint_value = v.is_uint ? value : 0;
    if (!v.is_uint) v.str.assign(_s.substr(start, _pos - start));  // only kept where needed
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
      // The run up to the next quote, backslash or control character is copied at once.
      const std::size_t run = _pos;
      while (_pos < _s.size()) {
        const auto u = static_cast<unsigned char>(_s[_pos]);
        if (u == '"' || u == '\\' || u < 0x20) break;
        ++_pos;
      }
      out.append(_s.data() + run, _pos - run);
      if (at_end()) fail("unterminated string");
      const char c = _s[_pos++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
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
  std::string _subject;
  std::size_t _pos = 0;
};

// Rejects overlong encodings, surrogates and code points above U+10FFFF, like std::str::from_utf8.
inline bool valid_utf8(std::string_view s) noexcept {
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

}  // namespace pyckpt::detail
