// Unit tests of the native pyckpt.json reader: a valid document read into its tables, checksums
// unbound from their place, and every truncation and byte change of it refused or read without
// a crash (the sanitizer build runs these).
#include <cstdint>
#include <string>

#include "check.hpp"
#include "core/checksum.hpp"
#include "core/error.hpp"
#include "core/pyckpt_index.hpp"

using namespace pyckpt;

namespace {

std::string le64(std::uint64_t v) {
  std::string s(8, '\0');
  for (int b = 0; b < 8; ++b) s[b] = static_cast<char>(v >> (8 * b));
  return s;
}

// The place-bound checksum of a chunk at raw offset `pos` of the piece of "w" at offset 0.
std::uint64_t bound(std::uint64_t stored_hash, std::uint64_t pos) {
  const std::string head = std::string("w") + '\0' + le64(0);
  const std::uint64_t seed = xxh64(head.data(), head.size());
  const std::string off = le64(pos);
  return stored_hash ^ xxh64(off.data(), off.size(), seed);
}

// One fp32 tensor of 4 elements stored as two raw chunks of 8 bytes in one 16-byte data file,
// an empty bytes item, and planner_data with a tagged tuple.
std::string document() {
  return std::string("{\"format\":\"pyckpt\",\"version\":3,\"created_by\":\"test\",") +
         "\"save_id\":\"0123456789ab\",\"dcp_version\":null,\"storage_meta\":{\"modules\":[]}," +
         "\"planner_data\":{\"w\":{\"__tuple__\":[1,\"x\",2.5]}}," +
         "\"files\":{\"0-0.0123456789ab.pyckpt\":16},\"items\":{\"w\":{\"type\":\"tensor\"," +
         "\"dtype\":\"float32\",\"shape\":[4],\"requires_grad\":false," +
         "\"memory_format\":\"contiguous_format\",\"pieces\":[{\"offsets\":[0],\"sizes\":[4]," +
         "\"segments\":[{\"file\":\"0-0.0123456789ab.pyckpt\",\"raw_begin\":0," +
         "\"codec\":[\"none\",0,1,\"none\"],\"chunks\":[[0,8," + std::to_string(bound(111, 0)) +
         ",0,[0,8]],[8,8," + std::to_string(bound(222, 8)) + ",0,[0,8]]]}]}]}," +
         "\"b\":{\"type\":\"bytes\",\"nbytes\":0,\"segments\":[]}}," +
         "\"checksum\":\"xxh64:0000000000000000\"}";
}

}  // namespace

TEST(reads_a_valid_document) {
  const std::string doc = document();
  const PyckptIndex x = parse_pyckpt_index(doc, "pyckpt.json");
  CHECK(x.version == 3 && x.save_id == "0123456789ab" && !x.has_dcp_version);
  CHECK(x.file_names.size() == 1 && x.file_sizes[0] == 16);
  CHECK(x.items.size() == 2 && x.items[0].fqn == "w" && x.items[0].tensor);
  CHECK(!x.items[1].tensor && x.items[1].nbytes == 0);
  CHECK(x.pieces.size() == 1 && x.pieces[0].nbytes == 16);
  CHECK(x.chunks.size() == 2);
  CHECK(x.chunks[0].xxh64 == 111 && x.chunks[1].xxh64 == 222);  // unbound from their place
  CHECK(doc.substr(x.planner_begin, x.planner_end - x.planner_begin) ==
        "{\"w\":{\"__tuple__\":[1,\"x\",2.5]}}");
}

TEST(refuses_documents_outside_its_subset) {
  std::string doc = document();
  // A gap in the data file, a repeated key, another key order, an older version.
  const std::string cases[] = {
      std::string(doc).replace(doc.find(":16}"), 4, ":17}"),
      std::string(doc).replace(doc.find("\"created_by\""), 12, "\"format\""),
      std::string(doc).replace(doc.find("\"version\":3"), 11, "\"version\":2"),
      std::string(doc).replace(doc.find("[0],\"sizes\""), 3, "[1]"),
  };
  for (const std::string& bad : cases) {
    CHECK_THROWS(parse_pyckpt_index(bad, "m"), FormatError, "outside the native reader's subset");
  }
}

TEST(every_truncation_and_byte_change_is_refused_or_read) {
  const std::string doc = document();
  for (std::size_t n = 0; n < doc.size(); ++n) {
    CHECK_THROWS(parse_pyckpt_index(doc.substr(0, n), "m"), FormatError, "");
  }
  const char bytes[] = {'"', '{', '}', '[', ']', ',', ':', '0', '9', '-', '\\', 'x', '\0', '\xff'};
  std::size_t read = 0, total = 0;
  for (std::size_t i = 0; i < doc.size(); ++i) {
    for (const char c : bytes) {
      std::string bad = doc;
      bad[i] = c;
      ++total;
      try {
        (void)parse_pyckpt_index(bad, "m");
        ++read;
      } catch (const FormatError&) {
      }
    }
  }
  // Some changes keep a valid document (a letter of created_by), most break it; none crashes or
  // throws anything but FormatError.
  CHECK(read > 0 && read < total / 2);
}

PYCKPT_TEST_MAIN
