#pragma once
/**
 * @file float_cast.hpp
 * @brief Element-wise conversion between IEEE floating formats (F64, F32, F16, BF16), rounding
 *        to nearest, ties to even, as PyTorch's `Tensor.to(dtype)` does.
 *
 * Used by the stitcher to cast tensors on their way into an export (fp32 master weights to bf16,
 * fp16 / bf16 / fp32 among each other). Every finite and infinite input converts to exactly the
 * bits `torch.Tensor.to` gives: subnormals are kept (no flush to zero), values past the largest
 * finite target round to infinity, ties round to the even neighbour. F64 sources are rounded to
 * F32 first and then to the target, as PyTorch does (its conversions go through float).
 *
 * NaN stays NaN, quiet, with its sign and the top bits of its payload (what the x86 F16C and
 * AVX512-BF16 conversion instructions produce). PyTorch's own NaN bit patterns differ between its
 * scalar and vectorised kernels and between CPUs (e.g. 0xFFFF or 0x7FC0 for fp32 -> bf16), so
 * NaN bits are not part of the contract; NaN-ness and sign are.
 *
 * Thread-safety: pure functions; reentrant.
 */
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

namespace pyckpt {

/** @brief The floating formats convert_floats() reads and writes. */
enum class FloatFormat : std::uint8_t { F64 = 0, F32 = 1, F16 = 2, BF16 = 3 };

/** @return bytes per element of `f` (8, 4, 2, 2). */
std::size_t float_format_bytes(FloatFormat f) noexcept;

/** @return the safetensors spelling of `f` ("F64", "F32", "F16", "BF16"). */
const char* float_format_name(FloatFormat f) noexcept;

/** @return the format spelled `name` in safetensors ("F64", "F32", "F16", "BF16"), or nullopt. */
std::optional<FloatFormat> float_format_from_name(const std::string& name) noexcept;

/**
 * @brief A conversion applied to every element on its way into the output.
 *
 * `from == to` means no conversion (the default).
 */
struct FloatCast {
  FloatFormat from = FloatFormat::F32;  ///< source format
  FloatFormat to = FloatFormat::F32;    ///< target format
  /** @return true when elements change format. */
  bool enabled() const noexcept { return from != to; }
  /** @return true when both casts convert the same way (disabled casts are all equal). */
  bool operator==(const FloatCast& o) const noexcept {
    return enabled() == o.enabled() && (!enabled() || (from == o.from && to == o.to));
  }
  bool operator!=(const FloatCast& o) const noexcept { return !(*this == o); }
};

/**
 * @brief Converts `count` elements from `from` at `src` into `to` at `dst`.
 * @param from source format.
 * @param to target format: F32, F16 or BF16 (F64 only when `from` is F64: a plain copy).
 * @param src count x float_format_bytes(from) bytes, native byte order (little-endian on every
 *        platform pyckpt supports), any alignment.
 * @param dst count x float_format_bytes(to) bytes, any alignment; must not overlap `src`.
 * @param count elements.
 * @throws std::invalid_argument for a widening to F64 from another format (no caller needs it).
 */
void convert_floats(FloatFormat from, FloatFormat to, const void* src, void* dst,
                    std::uint64_t count);

/** @name Scalar conversions (bit patterns in, bit patterns out), exposed for tests. */
///@{
/** @return `x` (fp32 bits) rounded to bf16 bits. */
std::uint16_t f32_bits_to_bf16(std::uint32_t x) noexcept;
/** @return `x` (fp32 bits) rounded to fp16 bits. */
std::uint16_t f32_bits_to_f16(std::uint32_t x) noexcept;
/** @return `h` (fp16 bits) widened exactly to fp32 bits (NaN quieted). */
std::uint32_t f16_bits_to_f32(std::uint16_t h) noexcept;
///@}

}  // namespace pyckpt
