#pragma once
/**
 * @file json_tape.hpp
 * @brief JSON text read as Python's `json.loads` reads it, into a flat tape, and Python's `repr`
 *        of its values: what the metadata reader (core/pyckpt_index.hpp) needs to read every
 *        document the format allows and to word its errors as the format specifies.
 *
 * Semantics (CPython's json scanner, strict): whitespace is space, tab, CR and LF; `NaN`,
 * `Infinity` and `-Infinity` are refused (as `json.loads(parse_constant=...)` refusing them);
 * integers of any size up to 4300 digits (Python's int() limit); numbers with a fraction or an
 * exponent are doubles (1e400 is infinity); a `\uXXXX` escape of a lone surrogate is kept (as
 * generalized UTF-8, which Python decodes with "surrogatepass"); a high and a low surrogate
 * escape in a row make one code point. Repeated keys are kept and the object is marked.
 *
 * Memory: 16 bytes per value, plus the decoded text of the strings that hold escapes.
 * Thread-safety: a parsed tape is immutable.
 */
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pyckpt {

/** @brief The kind of a JSON value on the tape. */
enum class JKind : std::uint8_t { Null, True, False, Int, Float, String, Array, Object };

/** @brief One value of the tape: a container is followed by its entries (objects: key, value). */
struct JNode {
  /// Int: the magnitude (BigInt: offset of its text); Float: the double's bits; String: offset
  /// of its bytes in the text (Pooled: in the tape's pool); Array/Object: the index after it.
  std::uint64_t v = 0;
  /// Int: length of its text; String: byte length; Array/Object: entries.
  std::uint32_t n = 0;
  JKind kind = JKind::Null;
  std::uint8_t flags = 0;
  static constexpr std::uint8_t kNegative = 1;  ///< Int: below zero
  static constexpr std::uint8_t kBig = 2;       ///< Int: magnitude beyond 64 bits
  static constexpr std::uint8_t kPooled = 4;    ///< String: decoded text in the pool
  static constexpr std::uint8_t kRepeats = 8;   ///< Object: repeats a key
};

/** @brief A parsed JSON text (it keeps a view of the text: the text must outlive it). */
class JsonTape {
 public:
  /**
   * @brief Parses `text` (valid UTF-8) as `json.loads` does.
   * @param subject the message prefix, e.g. "<file>: metadata".
   * @throws FormatError "<subject> is not valid JSON (<json's message>)" or
   *         "<subject> is nested too deeply" (more than `max_depth` nested containers).
   */
  JsonTape(std::string_view text, const std::string& subject, std::size_t max_depth);

  const JNode& operator[](std::size_t i) const { return _nodes[i]; }
  std::size_t size() const noexcept { return _nodes.size(); }
  /** @return the index after value `i` and its entries. */
  std::size_t next(std::size_t i) const {
    const JNode& n = _nodes[i];
    return n.kind == JKind::Array || n.kind == JKind::Object ? static_cast<std::size_t>(n.v)
                                                             : i + 1;
  }
  /** @return the decoded bytes of string `i` (generalized UTF-8). */
  std::string_view str(std::size_t i) const;
  /** @return true when `i` is the string `s`. */
  bool is(std::size_t i, std::string_view s) const {
    return _nodes[i].kind == JKind::String && str(i) == s;
  }
  /** @return the value of member `key` of object `obj`, or npos. */
  std::size_t member(std::size_t obj, std::string_view key) const;
  /** @return the first key of object `obj` that repeats an earlier one (kRepeats objects). */
  std::string_view repeated_key(std::size_t obj) const;
  /** @return the text of Int `i` (a Python int's decimal digits, "-0" read as "0"). */
  std::string int_text(std::size_t i) const;
  /** @return the double of Float `i`. */
  double float_value(std::size_t i) const;

  /** @return Python's repr() of value `i` (containers in full). */
  std::string repr(std::size_t i) const;
  /**
   * @return how the metadata reader's messages describe value `i`: "an object", "a list",
   * "an object that repeats the key 'k'", or repr() cut to 40 characters.
   */
  std::string describe(std::size_t i) const;

  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

 private:
  friend class JsonTapeParser;
  void repr_into(std::size_t i, std::string& out) const;

  std::string_view _text;
  std::string _pool;  // decoded strings that held escapes
  std::vector<JNode> _nodes;
};

/** @brief Python's repr() of a str given as generalized UTF-8 (printability approximated). */
std::string py_repr_str(std::string_view s);
/** @brief Python's repr() of a float. */
std::string py_repr_float(double d);
/** @brief `text` cut as Python's `text[:37] + "..."` when longer than 40 code points. */
std::string py_shorten(const std::string& text);

}  // namespace pyckpt
