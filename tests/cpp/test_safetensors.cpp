// Unit tests of the safetensors header parser: valid headers, limits, overflow, and layout rules.
#include <string>
#include <vector>

#include "check.hpp"
#include "core/error.hpp"
#include "core/safetensors.hpp"

using namespace pyckpt;

namespace {

std::string entry(const std::string& name, const char* dtype, const std::string& shape,
                  std::uint64_t b, std::uint64_t e) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":[" + std::to_string(b) + "," + std::to_string(e) + "]}";
}

FormatKind kind_of(const std::string& json, std::uint64_t file_size) {
  try {
    parse_safetensors_header_bytes(json, file_size, "x.safetensors");
  } catch (const FormatError& e) {
    return e.kind();
  }
  return FormatKind::Other;  // did not throw: callers compare against a real kind
}

}  // namespace

TEST(parses_a_valid_header_sorted_by_offset) {
  const std::string json =
      "{\"__metadata__\":{\"format\":\"pt\"}," + entry("b", "BF16", "[2,3]", 4, 16) + "," +
      entry("a", "F32", "[1]", 0, 4) + "," + entry("s", "F4", "[2]", 16, 17) + "}";
  const StHeader h = parse_safetensors_header_bytes(json, 8 + json.size() + 17, "x");
  CHECK(h.tensors.size() == 3);
  CHECK(h.tensors[0].name == "a" && h.tensors[1].name == "b" && h.tensors[2].name == "s");
  CHECK(h.tensors[1].dtype == StDtype::BF16);
  CHECK((h.tensors[1].shape == std::vector<std::uint64_t>{2, 3}));
  CHECK(h.metadata.size() == 1 && h.metadata[0].second == "pt");
  CHECK(h.data_start == 8 + json.size());
}

TEST(escaped_names_and_unknown_entry_keys) {
  const std::string json =
      "{\"w\\u00e9\\n\":{\"extra\":[1,{\"x\":null}],\"dtype\":\"U8\",\"shape\":[2],"
      "\"data_offsets\":[0,2]}}";
  const StHeader h = parse_safetensors_header_bytes(json, 8 + json.size() + 2, "x");
  CHECK(h.tensors.size() == 1);
  CHECK(h.tensors[0].name == "w\xc3\xa9\n");
}

TEST(rejects_overflowing_sizes_and_offsets) {
  const std::uint64_t d = std::uint64_t{1} << 60;
  // prod(shape) * 2 bytes overflows 64 bits.
  const std::string big = "{" + entry("t", "BF16", "[" + std::to_string(d) + ",16]", 0, 0) + "}";
  CHECK(kind_of(big, 8 + big.size()) == FormatKind::Mismatch);
  // 2^64 does not fit: not a valid size at all.
  const std::string wrap = "{" + entry("t", "U8", "[18446744073709551616]", 0, 0) + "}";
  CHECK(kind_of(wrap, 8 + wrap.size()) == FormatKind::Header);
  // end beyond the data section.
  const std::string past = "{" + entry("t", "U8", "[8]", d, d + 8) + "}";
  CHECK(kind_of(past, 8 + past.size() + 8) == FormatKind::Truncated);
  const std::string inv = "{" + entry("t", "U8", "[0]", 5, 4) + "}";
  CHECK(kind_of(inv, 8 + inv.size() + 5) == FormatKind::Header);
}

TEST(rejects_layout_violations) {
  const std::string overlap =
      "{" + entry("a", "U8", "[4]", 0, 4) + "," + entry("b", "U8", "[4]", 2, 6) + "}";
  CHECK(kind_of(overlap, 8 + overlap.size() + 6) == FormatKind::Overlap);
  const std::string hole =
      "{" + entry("a", "U8", "[4]", 0, 4) + "," + entry("b", "U8", "[4]", 5, 9) + "}";
  CHECK(kind_of(hole, 8 + hole.size() + 9) == FormatKind::Header);
  const std::string dup =
      "{" + entry("a", "U8", "[4]", 0, 4) + "," + entry("a", "U8", "[4]", 4, 8) + "}";
  CHECK_THROWS(parse_safetensors_header_bytes(dup, 8 + dup.size() + 8, "x"), FormatError, "twice");
  const std::string trailing = "{" + entry("a", "U8", "[4]", 0, 4) + "} x";
  CHECK(kind_of(trailing, 8 + trailing.size() + 4) == FormatKind::Header);
  CHECK(kind_of("{\"a\":", 100) == FormatKind::Header);
  CHECK(kind_of(std::string(200, '['), 300) == FormatKind::Header);  // not an object
  std::string deep = "{\"a\":{\"x\":";
  for (int i = 0; i < 100; ++i) deep += "[";
  CHECK(kind_of(deep, deep.size() + 8) == FormatKind::Header);
  CHECK(kind_of("{\"a\":{\"dtype\":\"X9\",\"shape\":[],\"data_offsets\":[0,0]}}", 200) ==
        FormatKind::Header);
  CHECK(kind_of(std::string("{\"\xff\":1}"), 100) == FormatKind::Header);  // invalid UTF-8
}

TEST(emitted_headers_parse_back) {
  const StEmitted e = emit_safetensors_header(
      {StTensorSpec{"z", StDtype::F16, {3, 5}}, StTensorSpec{"a", StDtype::I64, {}}}, {{"k", "v"}});
  CHECK(e.bytes.size() % 8 == 0);
  const std::string json = e.bytes.substr(8);
  const StHeader h = parse_safetensors_header_bytes(json, e.bytes.size() + e.data_bytes, "x");
  CHECK(h.tensors.size() == 2);
  CHECK(h.tensors[0].name == "a" && h.tensors[0].end == 8);
  CHECK(h.tensors[1].name == "z" && h.tensors[1].end - h.tensors[1].begin == 30);
}

PYCKPT_TEST_MAIN
