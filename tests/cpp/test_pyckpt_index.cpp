// Unit tests of the pyckpt.json reader: a valid document read into its tables, checksums
// unbound from their place, other versions and key orders read, errors naming the key path, and
// every truncation and byte change of it refused or read without a crash (the sanitizer build
// runs these).
#include <cstdint>
#include <cstdio>
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

// `body` (a document without its last '}') sealed with its metadata checksum member.
std::string seal(const std::string& body) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx",
                static_cast<unsigned long long>(xxh64(body.data(), body.size())));
  return body + ",\"checksum\":\"xxh64:" + hex + "\"}";
}

// One fp32 tensor of 4 elements stored as two raw chunks of 8 bytes in one 16-byte data file,
// an empty bytes item, and planner_data with a tagged tuple (unsealed, without the last '}').
std::string body() {
  return std::string("{\"format\":\"pyckpt\",\"version\":3,\"created_by\":\"test\",") +
         "\"save_id\":\"0123456789ab\",\"dcp_version\":null,\"storage_meta\":{\"modules\":[]}," +
         "\"planner_data\":{\"w\":{\"__tuple__\":[1,\"x\",2.5]}}," +
         "\"files\":{\"0-0.0123456789ab.pyckpt\":16},\"items\":{\"w\":{\"type\":\"tensor\"," +
         "\"dtype\":\"float32\",\"shape\":[4],\"requires_grad\":false," +
         "\"memory_format\":\"contiguous_format\",\"pieces\":[{\"offsets\":[0],\"sizes\":[4]," +
         "\"segments\":[{\"file\":\"0-0.0123456789ab.pyckpt\",\"raw_begin\":0," +
         "\"codec\":[\"none\",0,1,\"none\"],\"chunks\":[[0,8," + std::to_string(bound(111, 0)) +
         ",0,[0,8]],[8,8," + std::to_string(bound(222, 8)) + ",0,[0,8]]]}]}]}," +
         "\"b\":{\"type\":\"bytes\",\"nbytes\":0,\"segments\":[]}}";
}

std::string document() { return seal(body()); }

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
  CHECK((*x.tape)[x.planner].kind == JKind::Object && (*x.tape)[x.planner].n == 1);
}

TEST(reads_other_versions_and_key_orders) {
  const std::string b = body();
  // Version 2: the checksums are read as recorded.
  const PyckptIndex v2 = parse_pyckpt_index(
      seal(std::string(b).replace(b.find("\"version\":3"), 11, "\"version\":2")), "m");
  CHECK(v2.version == 2 && v2.chunks[0].xxh64 == bound(111, 0));
  // Members in another order, whitespace between tokens.
  std::string moved = b;
  moved.replace(moved.find("\"created_by\":\"test\","), 20, "");
  moved += " , \"created_by\" : \"test\"";
  const PyckptIndex x = parse_pyckpt_index(seal(moved), "m");
  CHECK(x.created_by == "test" && x.chunks[1].xxh64 == 222);
}

TEST(errors_name_the_file_and_the_key_path) {
  const std::string b = body();
  const std::pair<std::string, const char*> cases[] = {
      {std::string(b).replace(b.find(":16}"), 4, ":17}"),
       "m: files['0-0.0123456789ab.pyckpt']: records 17 bytes, its chunks end at 16"},
      {std::string(b).replace(b.find("\"created_by\""), 12, "\"format\""),
       "m: metadata repeats the top-level key 'format'"},
      {std::string(b).replace(b.find("[0],\"sizes\""), 3, "[1]"),
       "m: items['w'].pieces[0]: offsets [1] + sizes [4] leave the tensor's shape [4] "
       "(dimension 0)"},
      {std::string(b).replace(b.find("\"float32\""), 9, "\"float33\""),
       "m: items['w'].dtype: unsupported dtype 'float33'"},
      {std::string(b).replace(b.find("\"version\":3"), 11, "\"version\":5"),
       "m: format version 5 is not supported by this pyckpt"},
      {std::string(b).replace(b.find("\"version\":3"), 11, "\"version\":4"),
       "m: a version 4 (sharded) document must begin with"},
  };
  for (const auto& [bad, message] : cases) {
    CHECK_THROWS(parse_pyckpt_index(seal(bad), "m"), FormatError, message);
  }
  std::string damaged = document();
  damaged[10] ^= 1;
  CHECK_THROWS(parse_pyckpt_index(damaged, "m"), FormatError, "metadata checksum mismatch");
}

TEST(every_truncation_and_byte_change_is_refused_or_read) {
  const std::string doc = body();
  for (std::size_t n = 0; n < doc.size(); ++n) {
    CHECK_THROWS(parse_pyckpt_index(seal(doc.substr(0, n)), "m"), FormatError, "");
  }
  const char bytes[] = {'"', '{', '}', '[', ']', ',', ':', '0', '9', '-', '\\', 'x', '\0', '\xff'};
  std::size_t read = 0, total = 0;
  for (std::size_t i = 0; i < doc.size(); ++i) {
    for (const char c : bytes) {
      std::string bad = doc;
      bad[i] = c;
      ++total;
      try {
        (void)parse_pyckpt_index(seal(bad), "m");
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
