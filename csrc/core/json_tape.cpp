#include "core/json_tape.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "core/detail/utf8.hpp"
#include "core/error.hpp"

namespace pyckpt {

namespace {

constexpr std::size_t kMaxIntDigits = 4300;  // Python's int() limit (sys.int_info)

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

int hex_value(char h) {
  if (h >= '0' && h <= '9') return h - '0';
  if (h >= 'a' && h <= 'f') return h - 'a' + 10;
  if (h >= 'A' && h <= 'F') return h - 'A' + 10;
  return -1;
}

// Decodes the code point at s[i] (generalized UTF-8, already validated); advances i.
std::uint32_t next_code_point(std::string_view s, std::size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  std::size_t len = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  len = std::min(len, s.size() - i);
  std::uint32_t cp = len == 1 ? c : len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
  for (std::size_t k = 1; k < len; ++k)
    cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}

// Python's str.isprintable() for a code point beyond ASCII, approximated without the Unicode
// database: control, format, separator (but space), surrogate and private-use code points.
bool printable(std::uint32_t cp) {
  if (cp < 0xA1) return false;  // C1 controls and NO-BREAK SPACE
  if (cp == 0xAD || (cp >= 0x600 && cp <= 0x605) || cp == 0x61C || cp == 0x6DD || cp == 0x70F ||
      cp == 0x1680 || cp == 0x180E || (cp >= 0x2000 && cp <= 0x200F) ||
      (cp >= 0x2028 && cp <= 0x202F) || (cp >= 0x205F && cp <= 0x206F) || cp == 0x3000 ||
      (cp >= 0xD800 && cp <= 0xF8FF) || cp == 0xFEFF || (cp >= 0xFFF9 && cp <= 0xFFFB) ||
      cp == 0xFFFE || cp == 0xFFFF || cp == 0x110BD || (cp >= 0x1BCA0 && cp <= 0x1BCA3) ||
      (cp >= 0x1D173 && cp <= 0x1D17A) || cp == 0xE0001 || (cp >= 0xE0020 && cp <= 0xE007F) ||
      cp >= 0xF0000) {
    return false;
  }
  return true;
}

void hex_escape(std::string& out, char kind, std::uint32_t cp, int digits) {
  static const char* const kHex = "0123456789abcdef";
  out.push_back('\\');
  out.push_back(kind);
  for (int d = digits - 1; d >= 0; --d) out.push_back(kHex[(cp >> (4 * d)) & 0xF]);
}

}  // namespace

// ------------------------------------------------------------------------------------- parser

class JsonTapeParser {
 public:
  JsonTapeParser(JsonTape& t, const std::string& subject, std::size_t max_depth)
      : _t(t), _s(t._text), _subject(subject), _max_depth(max_depth) {}

  void run() {
    _t._nodes.reserve(_s.size() / 16 + 16);
    std::size_t pos = ws(0);
    pos = value(pos);
    while (!_stack.empty()) pos = step(pos);
    pos = ws(pos);
    if (pos != _s.size()) fail("Extra data", pos);
  }

 private:
  struct Frame {
    std::size_t node;
    bool object;
    bool first;
  };

  [[noreturn]] void fail(const char* what, std::size_t byte_pos) const {
    // json.JSONDecodeError's wording; positions count characters, as Python's do.
    std::size_t chars = 0, line = 1, line_start = 0;
    for (std::size_t i = 0; i < byte_pos && i < _s.size(); ++i) {
      const auto c = static_cast<unsigned char>(_s[i]);
      if ((c & 0xC0) == 0x80) continue;
      if (c == '\n') {
        ++line;
        line_start = chars + 1;
      }
      ++chars;
    }
    throw FormatError(FormatKind::Header,
                      detail::concat(_subject, " is not valid JSON (", what, ": line ", line,
                                     " column ", chars - line_start + 1, " (char ", chars, "))"));
  }
  [[noreturn]] void fail_value(const std::string& what) const {
    throw FormatError(FormatKind::Header,
                      detail::concat(_subject, " is not valid JSON (", what, ")"));
  }

  std::size_t ws(std::size_t pos) const {
    while (pos < _s.size() && is_ws(_s[pos])) ++pos;
    return pos;
  }
  char at(std::size_t pos) const { return pos < _s.size() ? _s[pos] : '\0'; }

  // One step of the innermost open container, from `pos` (after its '{'/'[' or a value).
  std::size_t step(std::size_t pos) {
    Frame& f = _stack.back();
    pos = ws(pos);
    const char close = f.object ? '}' : ']';
    if (f.first) {
      f.first = false;
      if (at(pos) == close) return end_container(pos);
    } else {
      if (at(pos) == close) return end_container(pos);
      if (at(pos) != ',' || pos >= _s.size()) fail("Expecting ',' delimiter", pos);
      pos = ws(pos + 1);
    }
    ++_t._nodes[f.node].n;
    if (f.object) {
      if (at(pos) != '"' || pos >= _s.size()) {
        fail("Expecting property name enclosed in double quotes", pos);
      }
      pos = ws(string(pos));
      if (at(pos) != ':' || pos >= _s.size()) fail("Expecting ':' delimiter", pos);
      pos = ws(pos + 1);
    }
    return value(pos);
  }

  std::size_t end_container(std::size_t pos) {
    const Frame f = _stack.back();
    _stack.pop_back();
    JNode& n = _t._nodes[f.node];
    n.v = _t._nodes.size();
    if (f.object && n.n > 1) check_repeats(f.node);
    return pos + 1;
  }

  void check_repeats(std::size_t obj) {
    const JNode& o = _t._nodes[obj];
    bool repeats = false;
    if (o.n <= 16) {
      std::string_view keys[16];
      std::size_t k = 0;
      for (std::size_t i = obj + 1; i < o.v; i = _t.next(i + 1)) {
        keys[k] = _t.str(i);
        for (std::size_t j = 0; j < k && !repeats; ++j) repeats = keys[j] == keys[k];
        ++k;
      }
    } else {
      std::unordered_set<std::string_view> seen;
      seen.reserve(o.n);
      for (std::size_t i = obj + 1; i < o.v && !repeats; i = _t.next(i + 1)) {
        repeats = !seen.insert(_t.str(i)).second;
      }
    }
    if (repeats) _t._nodes[obj].flags |= JNode::kRepeats;
  }

  std::size_t push(JKind kind, std::uint64_t v, std::uint32_t n, std::uint8_t flags = 0) {
    JNode node;
    node.kind = kind;
    node.v = v;
    node.n = n;
    node.flags = flags;
    _t._nodes.push_back(node);
    return _t._nodes.size() - 1;
  }

  std::size_t value(std::size_t pos) {
    const char c = at(pos);
    if (pos >= _s.size()) fail("Expecting value", pos);
    switch (c) {
      case '"': return string(pos);
      case '{':
      case '[': {
        if (_stack.size() >= _max_depth) {
          throw FormatError(FormatKind::Header, detail::concat(_subject, " is nested too deeply"));
        }
        const std::size_t node = push(c == '{' ? JKind::Object : JKind::Array, 0, 0);
        _stack.push_back(Frame{node, c == '{', true});
        return pos + 1;
      }
      case 'n':
        if (_s.compare(pos, 4, "null") != 0) break;
        push(JKind::Null, 0, 0);
        return pos + 4;
      case 't':
        if (_s.compare(pos, 4, "true") != 0) break;
        push(JKind::True, 0, 0);
        return pos + 4;
      case 'f':
        if (_s.compare(pos, 5, "false") != 0) break;
        push(JKind::False, 0, 0);
        return pos + 5;
      case 'N':
        if (_s.compare(pos, 3, "NaN") == 0) fail_value("NaN is not a JSON value");
        break;
      case 'I':
        if (_s.compare(pos, 8, "Infinity") == 0) fail_value("Infinity is not a JSON value");
        break;
      case '-':
        if (_s.compare(pos, 9, "-Infinity") == 0) fail_value("-Infinity is not a JSON value");
        return number(pos);
      default:
        if (is_digit(c)) return number(pos);
        break;
    }
    fail("Expecting value", pos);
  }

  std::size_t number(std::size_t start) {
    std::size_t pos = start;
    const bool negative = at(pos) == '-';
    if (negative) ++pos;
    if (at(pos) >= '1' && at(pos) <= '9') {
      while (is_digit(at(pos))) ++pos;
    } else if (at(pos) == '0') {
      ++pos;
    } else {
      fail("Expecting value", start);
    }
    const std::size_t int_end = pos;
    bool is_float = false;
    if (at(pos) == '.' && is_digit(at(pos + 1))) {
      is_float = true;
      pos += 2;
      while (is_digit(at(pos))) ++pos;
    }
    if (at(pos) == 'e' || at(pos) == 'E') {
      std::size_t e = pos + 1;
      if (at(e) == '+' || at(e) == '-') ++e;
      if (is_digit(at(e))) {
        is_float = true;
        while (is_digit(at(e))) ++e;
        pos = e;
      }
    }
    const std::string_view text = _s.substr(start, pos - start);
    if (is_float) {
      const std::string copy(text);
      const double d = std::strtod(copy.c_str(), nullptr);  // correctly rounded; inf beyond
      std::uint64_t bits;
      std::memcpy(&bits, &d, sizeof bits);
      push(JKind::Float, bits, static_cast<std::uint32_t>(text.size()));
      return pos;
    }
    const std::size_t digits = int_end - start - (negative ? 1 : 0);
    if (digits > kMaxIntDigits) {
      fail_value(detail::concat("Exceeds the limit (", kMaxIntDigits,
                                " digits) for integer string conversion: value has ", digits,
                                " digits; use sys.set_int_max_str_digits() to increase the limit"));
    }
    std::uint64_t mag = 0;
    bool big = false;
    for (std::size_t i = start + (negative ? 1 : 0); i < int_end; ++i) {
      const auto d = static_cast<std::uint64_t>(_s[i] - '0');
      if (mag > (std::numeric_limits<std::uint64_t>::max() - d) / 10) big = true;
      mag = mag * 10 + d;
    }
    std::uint8_t flags = (negative && (big || mag != 0)) ? JNode::kNegative : 0;
    if (big) flags |= JNode::kBig;
    push(JKind::Int, big ? start : mag, static_cast<std::uint32_t>(text.size()), flags);
    return pos;
  }

  // A string at `pos` (its opening quote); returns the position after its closing quote.
  std::size_t string(std::size_t pos) {
    const std::size_t begin = pos + 1;
    std::size_t i = begin;
    while (i < _s.size()) {  // the common case: no escape
      const auto u = static_cast<unsigned char>(_s[i]);
      if (u == '"' || u == '\\' || u < 0x20) break;
      ++i;
    }
    if (i < _s.size() && _s[i] == '"') {
      push(JKind::String, begin, static_cast<std::uint32_t>(i - begin));
      return i + 1;
    }
    std::string out(_s.substr(begin, i - begin));
    for (;;) {
      if (i >= _s.size()) fail("Unterminated string starting at", pos);
      const char c = _s[i];
      if (c == '"') break;
      if (static_cast<unsigned char>(c) < 0x20) fail("Invalid control character at", i);
      if (c != '\\') {
        out.push_back(c);
        ++i;
        continue;
      }
      if (i + 1 >= _s.size()) fail("Unterminated string starting at", pos);
      const char e = _s[i + 1];
      if (e != 'u') {
        const char* plain = "\"\\/\b\f\n\r\t";
        const char* names = "\"\\/bfnrt";
        const char* hit = std::strchr(names, e);
        if (hit == nullptr || e == '\0') fail("Invalid \\escape", i);
        out.push_back(plain[hit - names]);
        i += 2;
        continue;
      }
      std::int64_t cp = hex4(i + 2, i + 1);
      std::size_t next = i + 6;
      if (cp >= 0xD800 && cp <= 0xDBFF && next + 6 < _s.size() && at(next) == '\\' &&
          at(next + 1) == 'u') {
        const std::int64_t lo = hex4(next + 2, next + 1);
        if (lo >= 0xDC00 && lo <= 0xDFFF) {
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          next += 6;
        }
      }
      detail::append_utf8(out, static_cast<std::uint32_t>(cp));
      i = next;
    }
    const std::size_t at_pool = _t._pool.size();
    _t._pool += out;
    push(JKind::String, at_pool, static_cast<std::uint32_t>(out.size()), JNode::kPooled);
    return i + 1;
  }

  // The 4 hex digits at `pos` of a \u escape whose 'u' is at `u`.
  std::int64_t hex4(std::size_t pos, std::size_t u) const {
    if (pos + 4 >= _s.size()) fail("Invalid \\uXXXX escape", u);
    std::int64_t cp = 0;
    for (std::size_t k = 0; k < 4; ++k) {
      const int h = hex_value(_s[pos + k]);
      if (h < 0) fail("Invalid \\uXXXX escape", u);
      cp = (cp << 4) | h;
    }
    return cp;
  }

  JsonTape& _t;
  std::string_view _s;
  const std::string& _subject;
  std::size_t _max_depth;
  std::vector<Frame> _stack;
};

JsonTape::JsonTape(std::string_view text, const std::string& subject, std::size_t max_depth)
    : _text(text) {
  JsonTapeParser(*this, subject, max_depth).run();
}

// ------------------------------------------------------------------------------------ accessors

std::string_view JsonTape::str(std::size_t i) const {
  const JNode& n = _nodes[i];
  const std::string_view base = (n.flags & JNode::kPooled) ? std::string_view(_pool) : _text;
  return base.substr(static_cast<std::size_t>(n.v), n.n);
}

std::size_t JsonTape::member(std::size_t obj, std::string_view key) const {
  const std::size_t end = next(obj);
  for (std::size_t k = obj + 1; k < end; k = next(k + 1)) {
    if (str(k) == key) return k + 1;
  }
  return npos;
}

std::string_view JsonTape::repeated_key(std::size_t obj) const {
  const std::size_t end = next(obj);
  std::unordered_set<std::string_view> seen;
  for (std::size_t k = obj + 1; k < end; k = next(k + 1)) {
    if (!seen.insert(str(k)).second) return str(k);
  }
  return {};
}

std::string JsonTape::int_text(std::size_t i) const {
  const JNode& n = _nodes[i];
  if (n.flags & JNode::kBig) return std::string(_text.substr(static_cast<std::size_t>(n.v), n.n));
  return (n.flags & JNode::kNegative ? "-" : "") + std::to_string(n.v);
}

double JsonTape::float_value(std::size_t i) const {
  double d;
  std::memcpy(&d, &_nodes[i].v, sizeof d);
  return d;
}

// ----------------------------------------------------------------------------------------- repr

std::string py_repr_str(std::string_view s) {
  const bool single =
      s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos;
  const char quote = single ? '"' : '\'';
  std::string out(1, quote);
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t at = i;
    const std::uint32_t cp = next_code_point(s, i);
    if (cp == static_cast<std::uint32_t>(quote) || cp == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(cp));
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp < 0x20 || cp == 0x7F) {
      hex_escape(out, 'x', cp, 2);
    } else if (cp < 0x7F || printable(cp)) {
      out.append(s.substr(at, i - at));
    } else if (cp <= 0xFF) {
      hex_escape(out, 'x', cp, 2);
    } else if (cp <= 0xFFFF) {
      hex_escape(out, 'u', cp, 4);
    } else {
      hex_escape(out, 'U', cp, 8);
    }
  }
  out.push_back(quote);
  return out;
}

std::string py_repr_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  // Shortest round-trip digits in scientific form: [-]d[.ddd]e[+-]xx.
  const auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  const bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  const std::size_t e = sci.find('e');
  const int exp = std::atoi(sci.c_str() + e + 1);
  std::string digits;
  for (std::size_t i = 0; i < e; ++i) {
    if (sci[i] != '.') digits.push_back(sci[i]);
  }
  std::string out = neg ? "-" : "";
  if (exp >= -5 + 1 && exp < 16) {  // Python's repr: positional for 1e-4 <= |d| < 1e16
    const int point = exp + 1;      // digits before the decimal point
    if (point <= 0) {
      out += "0." + std::string(static_cast<std::size_t>(-point), '0') + digits;
    } else if (static_cast<std::size_t>(point) >= digits.size()) {
      out += digits + std::string(static_cast<std::size_t>(point) - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, static_cast<std::size_t>(point)) + "." +
             digits.substr(static_cast<std::size_t>(point));
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  const int a = exp < 0 ? -exp : exp;
  out += detail::concat("e", exp < 0 ? '-' : '+', a < 10 ? "0" : "", a);
  return out;
}

std::string py_shorten(const std::string& text) {
  std::size_t chars = 0, cut = 0;
  for (std::size_t i = 0; i < text.size();) {
    if (chars == 37) cut = i;
    (void)next_code_point(text, i);
    ++chars;
  }
  return chars <= 40 ? text : text.substr(0, cut) + "...";
}

void JsonTape::repr_into(std::size_t i, std::string& out) const {
  const JNode& n = _nodes[i];
  switch (n.kind) {
    case JKind::Null: out += "None"; return;
    case JKind::True: out += "True"; return;
    case JKind::False: out += "False"; return;
    case JKind::Int: out += int_text(i); return;
    case JKind::Float: out += py_repr_float(float_value(i)); return;
    case JKind::String: out += py_repr_str(str(i)); return;
    case JKind::Array: {
      out.push_back('[');
      for (std::size_t k = i + 1, first = 1; k < n.v; k = next(k), first = 0) {
        if (!first) out += ", ";
        repr_into(k, out);
      }
      out.push_back(']');
      return;
    }
    case JKind::Object: {
      if (n.flags & JNode::kRepeats) {
        out += "<an object that repeats the key " + py_repr_str(repeated_key(i)) + ">";
        return;
      }
      out.push_back('{');
      for (std::size_t k = i + 1, first = 1; k < n.v; k = next(k + 1), first = 0) {
        if (!first) out += ", ";
        repr_into(k, out);
        out += ": ";
        repr_into(k + 1, out);
      }
      out.push_back('}');
      return;
    }
  }
}

std::string JsonTape::repr(std::size_t i) const {
  std::string out;
  repr_into(i, out);
  return out;
}

std::string JsonTape::describe(std::size_t i) const {
  const JNode& n = _nodes[i];
  if (n.kind == JKind::Object) {
    if (n.flags & JNode::kRepeats) {
      return "an object that repeats the key " + py_repr_str(repeated_key(i));
    }
    return "an object";
  }
  if (n.kind == JKind::Array) return "a list";
  return py_shorten(repr(i));
}

}  // namespace pyckpt
