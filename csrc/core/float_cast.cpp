#include "core/float_cast.hpp"

#include <cstring>
#include <stdexcept>

#include "core/error.hpp"

namespace pyckpt {

namespace {

// The conversions work on bit patterns with integer arithmetic only, so they neither depend on
// the floating-point environment (rounding mode, flush-to-zero) nor raise FP exceptions, and the
// loops below stay branch-light enough for the compiler to vectorise.

inline std::uint16_t to_bf16(std::uint32_t x) noexcept {
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
    return static_cast<std::uint16_t>((x >> 16) | 0x0040u);  // NaN: quiet, sign and payload top
  }
  // Round to nearest even on the 16 dropped bits; a carry out of the mantissa bumps the exponent
  // (the largest finite values round to infinity, as they must).
  return static_cast<std::uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

inline std::uint16_t to_f16(std::uint32_t x) noexcept {
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) {  // NaN: quiet, sign and top payload bits kept
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x03FFu));
  }
  if (a >= 0x477FF000u) {  // >= 65520 (halfway from 65504, the largest fp16, to 2^16): infinity
    return static_cast<std::uint16_t>(sign | 0x7C00u);
  }
  if (a >= 0x38800000u) {               // >= 2^-14: a normal fp16
    std::uint32_t r = a - 0x38000000u;  // exponent bias 127 -> 15
    r += 0x0FFFu + ((r >> 13) & 1u);    // round to nearest even on the 13 dropped bits
    return static_cast<std::uint16_t>(sign | (r >> 13));
  }
  if (a <= 0x33000000u) {  // <= 2^-25, half the smallest subnormal: the tie goes to even zero
    return static_cast<std::uint16_t>(sign);
  }
  // A subnormal fp16: the value in units of 2^-24, rounded to nearest even. The 24-bit
  // significand m is scaled by 2^(e - 126), e in [102, 112], i.e. shifted right by 14..24.
  const std::uint32_t e = a >> 23;
  const std::uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
  const std::uint32_t shift = 126u - e;
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // q == 0x400 is the smallest normal: right
  return static_cast<std::uint16_t>(sign | q);
}

inline std::uint32_t from_f16(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t e = (h >> 10) & 0x1Fu;
  std::uint32_t m = h & 0x03FFu;
  if (e == 0x1Fu) {  // infinity, or NaN made quiet
    return sign | 0x7F800000u | (m << 13) | (m != 0 ? 0x00400000u : 0u);
  }
  if (e != 0) return sign | ((e + 112u) << 23) | (m << 13);
  if (m == 0) return sign;
  // Subnormal: normalise (every fp16 subnormal is a normal fp32).
  e = 1;
  while ((m & 0x0400u) == 0) {
    m <<= 1;
    --e;
  }
  return sign | ((e + 112u) << 23) | ((m & 0x03FFu) << 13);
}

inline std::uint32_t f32_bits(float f) noexcept {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

template <typename In, typename Out, typename Fn>
void convert_loop(const void* src, void* dst, std::uint64_t count, Fn fn) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (std::uint64_t i = 0; i < count; ++i) {
    In x;
    std::memcpy(&x, s + i * sizeof(In), sizeof(In));
    const Out y = fn(x);
    std::memcpy(d + i * sizeof(Out), &y, sizeof(Out));
  }
}

// F64 -> F32 by the hardware conversion (round to nearest even in the default environment, NaN
// quieted with sign and payload top kept), as PyTorch's static_cast does.
inline std::uint32_t from_f64(double v) noexcept { return f32_bits(static_cast<float>(v)); }

}  // namespace

std::size_t float_format_bytes(FloatFormat f) noexcept {
  switch (f) {
    case FloatFormat::F64: return 8;
    case FloatFormat::F32: return 4;
    case FloatFormat::F16:
    case FloatFormat::BF16: return 2;
  }
  return 0;
}

const char* float_format_name(FloatFormat f) noexcept {
  switch (f) {
    case FloatFormat::F64: return "F64";
    case FloatFormat::F32: return "F32";
    case FloatFormat::F16: return "F16";
    case FloatFormat::BF16: return "BF16";
  }
  return "?";
}

std::optional<FloatFormat> float_format_from_name(const std::string& name) noexcept {
  if (name == "F64") return FloatFormat::F64;
  if (name == "F32") return FloatFormat::F32;
  if (name == "F16") return FloatFormat::F16;
  if (name == "BF16") return FloatFormat::BF16;
  return std::nullopt;
}

std::uint16_t f32_bits_to_bf16(std::uint32_t x) noexcept { return to_bf16(x); }
std::uint16_t f32_bits_to_f16(std::uint32_t x) noexcept { return to_f16(x); }
std::uint32_t f16_bits_to_f32(std::uint16_t h) noexcept { return from_f16(h); }

void convert_floats(FloatFormat from, FloatFormat to, const void* src, void* dst,
                    std::uint64_t count) {
  using F = FloatFormat;
  if (from == to) {
    std::memcpy(dst, src, static_cast<std::size_t>(count * float_format_bytes(from)));
    return;
  }
  PYCKPT_EXPECT(to != F::F64, std::invalid_argument, "casting ", float_format_name(from),
                " to F64 is not supported");
  switch (from) {
    case F::F32:
      if (to == F::BF16) {
        convert_loop<std::uint32_t, std::uint16_t>(src, dst, count, to_bf16);
      } else {
        convert_loop<std::uint32_t, std::uint16_t>(src, dst, count, to_f16);
      }
      return;
    case F::BF16:
      if (to == F::F32) {
        convert_loop<std::uint16_t, std::uint32_t>(
            src, dst, count, [](std::uint16_t b) { return static_cast<std::uint32_t>(b) << 16; });
      } else {
        convert_loop<std::uint16_t, std::uint16_t>(src, dst, count, [](std::uint16_t b) {
          return to_f16(static_cast<std::uint32_t>(b) << 16);
        });
      }
      return;
    case F::F16:
      if (to == F::F32) {
        convert_loop<std::uint16_t, std::uint32_t>(src, dst, count, from_f16);
      } else {
        convert_loop<std::uint16_t, std::uint16_t>(
            src, dst, count, [](std::uint16_t h) { return to_bf16(from_f16(h)); });
      }
      return;
    case F::F64:
      if (to == F::F32) {
        convert_loop<double, std::uint32_t>(src, dst, count, from_f64);
      } else if (to == F::BF16) {
        convert_loop<double, std::uint16_t>(src, dst, count,
                                            [](double v) { return to_bf16(from_f64(v)); });
      } else {
        convert_loop<double, std::uint16_t>(src, dst, count,
                                            [](double v) { return to_f16(from_f64(v)); });
      }
      return;
  }
}

}  // namespace pyckpt
