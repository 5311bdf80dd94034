// Unit tests of the chunk codec: round trips, plane layouts, and rejection of bad records.
#include <algorithm>
#include <string>
#include <vector>

#include "check.hpp"
#include "core/codec.hpp"
#include "core/error.hpp"
#include "test_support.hpp"

using namespace pyckpt;
using namespace pyckpt::test;

namespace {

struct Encoded {
  std::vector<std::uint8_t> stored;
  ChunkRecord rec;
};

Encoded encode(const std::vector<std::uint8_t>& raw, const CodecParams& p) {
  Encoded e;
  e.stored.resize(max_encoded_size(raw.size(), p) + 1);
  e.rec = encode_chunk(raw.data(), raw.size(), p, e.stored.data());
  e.stored.resize(e.rec.stored_len);
  return e;
}

std::vector<std::uint8_t> decode(const Encoded& e, const CodecParams& p) {
  std::vector<std::uint8_t> out(e.rec.raw_len + 1, 0xEE);
  decode_chunk(e.stored.data(), e.rec, p, out.data());
  CHECK(out.back() == 0xEE);  // nothing written past raw_len
  out.pop_back();
  return out;
}

}  // namespace

TEST(round_trip_every_codec_and_size) {
  const CodecParams all[] = {kRaw, kZstd, kBf16, kFp32, kFp64};
  const std::size_t sizes[] = {0, 1, 2, 7, 8, 4095, 4096, 4097, 65536 + 8, 300000};
  for (const CodecParams& p : all) {
    for (std::size_t n : sizes) {
      const std::vector<std::uint8_t> raw = bf16_like(n / 2 + 1, static_cast<std::uint32_t>(n));
      const std::vector<std::uint8_t> data(raw.begin(), raw.begin() + static_cast<long>(n));
      const Encoded e = encode(data, p);
      CHECK(e.rec.raw_len == n);
      CHECK(e.rec.stored_len <= n);
      CHECK(decode(e, p) == data);
      verify_chunk(e.stored.data(), e.rec, p);  // the verify-only path accepts it too
    }
  }
}

TEST(decoded_planes_copy_out_any_byte_range_like_the_full_decode) {
  // Every codec (flat and byte-grouped, rotated or not), ranges that start and end inside an
  // element, and the empty range: copy_out(a, n) equals bytes [a, a + n) of decode_chunk().
  const CodecParams all[] = {kRaw, kZstd, kBf16, kFp32, kFp64};
  for (const CodecParams& p : all) {
    const std::vector<std::uint8_t> data = bf16_like(4096, 11);  // 8192 bytes: divisible by 8
    const Encoded e = encode(data, p);
    const std::vector<std::uint8_t> full = decode(e, p);
    CHECK(full == data);
    const DecodedChunk d = decode_chunk_planes(e.stored.data(), e.rec, p);
    CHECK(d.size() == data.size());
    const std::size_t starts[] = {0, 1, 3, 5, 7, 8, 13, 4095, 8191};
    const std::size_t lens[] = {0, 1, 2, 3, 7, 9, 17, 1000};
    for (std::size_t a : starts) {
      for (std::size_t n : lens) {
        if (a + n > data.size()) continue;
        std::vector<std::uint8_t> out(n + 1, 0xEE);
        d.copy_out(a, n, out.data());
        CHECK(out.back() == 0xEE);  // nothing written past n
        out.pop_back();
        CHECK(std::equal(out.begin(), out.end(), full.begin() + static_cast<long>(a)));
      }
    }
    std::vector<std::uint8_t> all_bytes(data.size());
    d.copy_out(0, data.size(), all_bytes.data());
    CHECK(all_bytes == data);
  }
}

TEST(decoded_planes_verify_the_checksum_first) {
  const std::vector<std::uint8_t> data = bf16_like(4096, 12);
  Encoded e = encode(data, kBf16);
  e.stored[e.stored.size() / 2] ^= 0x40;
  CHECK_THROWS(decode_chunk_planes(e.stored.data(), e.rec, kBf16), FormatError,
               "checksum mismatch");
}

TEST(bf16_compresses_exponent_plane_and_keeps_mantissa_raw) {
  const std::vector<std::uint8_t> data = bf16_like(1 << 16, 7);
  const Encoded e = encode(data, kBf16);
  CHECK(e.rec.transform == Transform::ByteGroupRotl1);
  CHECK(e.rec.planes.size() == 2);
  CHECK(e.rec.planes[0].mode == PlaneMode::Raw);  // mantissa bytes: near random
  CHECK(e.rec.planes[0].stored_len == data.size() / 2);
  CHECK(e.rec.planes[1].mode == PlaneMode::Zstd);  // exponent bytes: low entropy
  CHECK(e.rec.planes[1].stored_len < data.size() / 4);
}

TEST(random_bytes_are_stored_raw) {
  const std::vector<std::uint8_t> data = random_bytes(100000, 3);
  const Encoded e = encode(data, kZstd);
  CHECK(is_plain_chunk(e.rec));
  CHECK(e.stored == data);
}

TEST(ungroup_bytes_matches_a_scalar_interleave_at_every_length) {
  // Lengths around the vector width (16 elements) and long ones, so the SSE2 loop and the scalar
  // tail each write their part, and nothing past the end.
  for (const std::uint32_t e : {2u, 4u}) {
    for (const bool rotl : {false, true}) {
      for (std::size_t n = 0; n < 100; n += (n < 70 ? 1 : 13)) {
        for (const std::size_t big : {std::size_t{0}, std::size_t{100003}}) {
          const std::size_t count = n + big;
          const std::vector<std::uint8_t> planes = random_bytes(e * count, count + e);
          const std::uint8_t* pp[4];
          for (std::uint32_t p = 0; p < e; ++p) pp[p] = planes.data() + p * count;
          std::vector<std::uint8_t> got(e * count + 64, 0xEE);
          ungroup_bytes(pp, count, e, rotl, got.data());
          for (std::size_t i = 0; i < count; ++i) {
            std::uint32_t v = 0;
            for (std::uint32_t p = 0; p < e; ++p) v |= std::uint32_t{pp[p][i]} << (8 * p);
            if (rotl) {
              const std::uint32_t bits = 8 * e;
              v = ((v >> 1) | (v << (bits - 1))) & (e == 4 ? 0xFFFFFFFFu : 0xFFFFu);
            }
            for (std::uint32_t p = 0; p < e; ++p) {
              CHECK(got[e * i + p] == static_cast<std::uint8_t>(v >> (8 * p)));
            }
          }
          for (std::size_t k = e * count; k < got.size(); ++k) CHECK(got[k] == 0xEE);
        }
      }
    }
  }
}

TEST(group_bytes_layout_and_inverse) {
  // Element i = bytes (4i, 4i+1, 4i+2, 4i+3) -> plane p holds byte p of every element.
  std::vector<std::uint8_t> src(4 * 37);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 7 + 1);
  std::vector<std::uint8_t> planes(src.size());
  std::uint8_t* pp[4];
  for (int p = 0; p < 4; ++p) pp[p] = planes.data() + p * 37;
  group_bytes(src.data(), 37, 4, false, pp);
  for (std::size_t i = 0; i < 37; ++i) {
    for (int p = 0; p < 4; ++p) CHECK(pp[p][i] == src[4 * i + static_cast<std::size_t>(p)]);
  }
  std::vector<std::uint8_t> back(src.size());
  const std::uint8_t* cp[4] = {pp[0], pp[1], pp[2], pp[3]};
  ungroup_bytes(cp, 37, 4, false, back.data());
  CHECK(back == src);
  // rotl1: the sign bit of each element moves to bit 0 of plane 0.
  const std::uint8_t neg_one_bf16[2] = {0x80, 0xBF};  // -1.0 = 0xBF80
  std::uint8_t p0 = 0, p1 = 0;
  std::uint8_t* two[2] = {&p0, &p1};
  group_bytes(neg_one_bf16, 1, 2, true, two);
  CHECK(p0 == 0x01);  // 0xBF80 rotl 1 = 0x7F01
  CHECK(p1 == 0x7F);
  CHECK_THROWS(group_bytes(src.data(), 1, 3, false, pp), std::invalid_argument, "elem_size");
}

TEST(checksum_mismatch_is_typed_and_does_not_reveal_the_hash) {
  const std::vector<std::uint8_t> data = bf16_like(4096, 11);
  Encoded e = encode(data, kBf16);
  e.stored[5] ^= 0x40;
  std::vector<std::uint8_t> out(e.rec.raw_len);
  try {
    decode_chunk(e.stored.data(), e.rec, kBf16, out.data());
    CHECK(false);
  } catch (const FormatError& err) {
    CHECK(err.kind() == FormatKind::Checksum);
    const std::string msg = err.what();
    CHECK(msg.find("checksum mismatch") != std::string::npos);
    CHECK(msg.find("0x") == std::string::npos);  // no hash value, computed or recorded
    CHECK(msg.find("computed") == std::string::npos);
  }
}

TEST(rejects_unknown_codes_and_impossible_plane_counts) {
  const std::vector<std::uint8_t> data = bf16_like(2048, 5);
  const Encoded good = encode(data, kBf16);
  std::vector<std::uint8_t> out(good.rec.raw_len);
  auto bad = [&](auto mutate, const CodecParams& p, const char* needle) {
    ChunkRecord r = good.rec;
    mutate(r);
    CHECK_THROWS(validate_record(r, p), FormatError, needle);
    CHECK_THROWS(decode_chunk(good.stored.data(), r, p, out.data()), FormatError, needle);
    CHECK_THROWS(verify_chunk(good.stored.data(), r, p), FormatError, needle);
  };
  bad([](ChunkRecord& r) { r.transform = static_cast<Transform>(7); }, kBf16, "unknown transform");
  bad([](ChunkRecord& r) { r.planes[1].mode = static_cast<PlaneMode>(3); }, kBf16, "unknown mode");
  bad([](ChunkRecord& r) { r.planes.push_back(PlaneRecord{PlaneMode::Raw, 0}); }, kBf16, "planes");
  bad([](ChunkRecord& r) { r.planes.clear(); }, kBf16, "1 to 8 planes");
  bad([](ChunkRecord& r) { r.stored_len += 1; }, kBf16, "sum to");
  bad([](ChunkRecord& r) { r.raw_len += 1; }, kBf16, "multiple of elem_size");
  bad([](ChunkRecord&) {}, kFp32, "planes");  // elem_size 4 needs 4 planes
  bad([](ChunkRecord&) {}, kRaw, "codec 'none'");
  bad([](ChunkRecord& r) { r.transform = Transform::None; }, kBf16, "must have 1 plane");
  bad([](ChunkRecord& r) { r.raw_len = r.stored_len - 2; }, kBf16, "decoded bytes");
  bad([](ChunkRecord&) {}, kZstd, "elem_size 2, 4 or 8");
  bad([](ChunkRecord& r) { r.planes[0].stored_len = UINT64_MAX; }, kBf16, "overflow");
}

TEST(metadata_frames_round_trip_and_are_bounded_before_decoding) {
  std::string text;
  for (int i = 0; i < 4000; ++i) text += "[1,2,3],";
  const auto frame = zstd_frame(text.data(), text.size(), 3);
  CHECK(frame.size() < text.size() / 10);
  const auto back = zstd_unframe(frame.data(), frame.size(), text.size());
  CHECK(std::string(back.begin(), back.end()) == text);
  CHECK_THROWS(zstd_unframe(frame.data(), frame.size(), text.size() - 1), FormatError, "more than");
  auto longer = frame;
  longer.push_back(0);
  CHECK_THROWS(zstd_unframe(longer.data(), longer.size(), text.size()), FormatError,
               "hold a zstd frame");
  CHECK_THROWS(zstd_unframe(text.data(), text.size(), text.size()), CompressionError,
               "not a valid zstd frame");
  CHECK_THROWS(zstd_unframe(frame.data(), frame.size() - 2, text.size()), CompressionError, "zstd");
}

TEST(zstd_frame_size_must_match_the_record) {
  // 64 KiB of zeros: one tiny zstd frame that declares 65536 decoded bytes.
  const std::vector<std::uint8_t> zeros(65536, 0);
  const Encoded e = encode(zeros, kZstd);
  CHECK(e.rec.planes.size() == 1 && e.rec.planes[0].mode == PlaneMode::Zstd);
  // A record promising fewer bytes than the frame holds (a bomb): rejected from the frame
  // header, before decoding anything, as a format error (not a zstd failure).
  ChunkRecord smaller = e.rec;
  smaller.raw_len = 4096;
  std::vector<std::uint8_t> out(65536);
  CHECK_THROWS(decode_chunk(e.stored.data(), smaller, kZstd, out.data()), FormatError,
               "declares 65536");
  CHECK_THROWS(verify_chunk(e.stored.data(), smaller, kZstd), FormatError, "declares 65536");
  ChunkRecord larger = e.rec;
  larger.raw_len = 65536 * 2;
  CHECK_THROWS(decode_chunk(e.stored.data(), larger, kZstd, out.data()), FormatError,
               "declares 65536");
  // Bytes that are not a zstd frame at all (checksum made to match).
  std::vector<std::uint8_t> junk = random_bytes(e.stored.size(), 9);
  ChunkRecord jr = e.rec;
  jr.checksum = 0;
  {
    // Recompute the checksum of the junk through a raw encode of the same bytes.
    const Encoded raw = encode(junk, kRaw);
    jr.checksum = raw.rec.checksum;
  }
  CHECK_THROWS(decode_chunk(junk.data(), jr, kZstd, out.data()), CompressionError, "zstd");
  CHECK_THROWS(verify_chunk(junk.data(), jr, kZstd), CompressionError, "zstd");
}

TEST(validate_params_rejects_bad_fields) {
  CHECK_THROWS(validate_params(CodecParams{Codec::Zstd, 1, 3, Transform::None}),
               std::invalid_argument, "elem_size");
  CHECK_THROWS(validate_params(CodecParams{Codec::Zstd, 1000, 1, Transform::None}),
               std::invalid_argument, "level");
  CHECK_THROWS(validate_params(CodecParams{Codec::Zstd, 1, 1, Transform::None, 0.0}),
               std::invalid_argument, "raw_threshold");
}

PYCKPT_TEST_MAIN
