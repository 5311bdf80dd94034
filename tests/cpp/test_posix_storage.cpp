// Unit tests of the POSIX file helpers: preadv_full() scattering a file range into many buffers.
#include <sys/uio.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/error.hpp"
#include "core/posix_storage.hpp"
#include "test_support.hpp"

using namespace pyckpt;
using namespace pyckpt::test;

namespace {

/** A temporary file holding `bytes`, removed on destruction. */
struct TempFile {
  std::string path;
  int fd = -1;
  explicit TempFile(const std::vector<std::uint8_t>& bytes) {
    char name[] = "/tmp/pyckpt-test-posix-XXXXXX";
    fd = ::mkstemp(name);
    CHECK(fd >= 0);
    path = name;
    CHECK(pwrite_full(fd, bytes.data(), bytes.size(), 0) == 0);
  }
  ~TempFile() {
    ::close(fd);
    ::unlink(path.c_str());
  }
};

}  // namespace

TEST(preadv_full_scatters_more_runs_than_one_call_takes) {
  // 3000 runs of 1..13 bytes with gaps between their destinations: more buffers than one
  // preadv() accepts, so the batching and the advance over filled buffers are exercised.
  const std::vector<std::uint8_t> file = random_bytes(40000, 5);
  TempFile f(file);
  std::vector<std::uint8_t> dst(80000, 0xEE);
  std::vector<struct iovec> iov;
  std::vector<std::size_t> at;
  std::size_t pos = 0;
  std::size_t total = 0;
  for (std::size_t i = 0; i < 3000; ++i) {
    const std::size_t len = 1 + i % 13;
    iov.push_back({dst.data() + pos, len});
    at.push_back(pos);
    pos += len + 3;  // a 3-byte gap that must stay untouched
    total += len;
  }
  preadv_full(f.fd, iov.data(), static_cast<int>(iov.size()), 100, f.path);
  std::size_t src = 100;
  for (std::size_t i = 0; i < at.size(); ++i) {
    const std::size_t len = 1 + i % 13;
    for (std::size_t k = 0; k < len; ++k) CHECK(dst[at[i] + k] == file[src + k]);
    for (std::size_t k = 0; k < 3; ++k) CHECK(dst[at[i] + len + k] == 0xEE);
    src += len;
  }
  CHECK(src == 100 + total);
}

TEST(preadv_full_splits_reads_into_pieces_across_and_within_buffers) {
  // Reads go out in calls of at most 128 KiB: buffers smaller than that are grouped, a larger
  // one is read in parts, and one ending exactly at a piece's end starts no empty call.
  const std::vector<std::uint8_t> file = random_bytes(3 << 20, 7);
  TempFile f(file);
  const std::vector<std::size_t> lens{100 << 10, 50 << 10,        300 << 10, 10, 128 << 10,
                                      1,         (128 << 10) - 1, 700 << 10, 3};
  std::vector<std::uint8_t> dst(4 << 20, 0xEE);
  std::vector<struct iovec> iov;
  std::vector<std::size_t> at;
  std::size_t pos = 0;
  for (const std::size_t len : lens) {
    iov.push_back({dst.data() + pos, len});
    at.push_back(pos);
    pos += len + 5;  // a gap that must stay untouched
  }
  preadv_full(f.fd, iov.data(), static_cast<int>(iov.size()), 4097, f.path);
  std::size_t src = 4097;
  for (std::size_t i = 0; i < lens.size(); ++i) {
    CHECK(std::memcmp(dst.data() + at[i], file.data() + src, lens[i]) == 0);
    for (std::size_t k = 0; k < 5; ++k) CHECK(dst[at[i] + lens[i] + k] == 0xEE);
    src += lens[i];
  }
  // One buffer of several pieces, not a multiple of the piece size.
  std::vector<std::uint8_t> one((1 << 20) + 12345, 0);
  pread_full(f.fd, one.data(), one.size(), 99, f.path);
  CHECK(std::memcmp(one.data(), file.data() + 99, one.size()) == 0);
}

TEST(preadv_full_past_the_end_is_truncated_naming_the_file) {
  const std::vector<std::uint8_t> file = random_bytes(1000, 6);
  TempFile f(file);
  std::vector<std::uint8_t> a(600);
  std::vector<std::uint8_t> b(600);
  std::vector<struct iovec> iov{{a.data(), a.size()}, {b.data(), b.size()}};
  CHECK_THROWS(preadv_full(f.fd, iov.data(), 2, 0, f.path), FormatError,
               "file '" + f.path + "' is truncated: bytes [0, 1200)");
}

PYCKPT_TEST_MAIN
