#pragma once
/**
 * @file safetensors.hpp
 * @brief Strict safetensors header parsing and emission (no external JSON library).
 *
 * A safetensors file is `u64 little-endian N` + `N` bytes of UTF-8 JSON + a data section. The JSON
 * is one object: an optional `"__metadata__"` object of string values, and one entry per tensor
 * `{"dtype": "<DT>", "shape": [d0, ...], "data_offsets": [begin, end]}` whose offsets are relative
 * to the data section (which starts at byte 8 + N).
 *
 * parse_safetensors_header() enforces, and reports every violation as a FormatError naming the
 * file and, where there is one, the tensor:
 *  - N <= kMaxSafetensorsHeader and 8 + N <= file size (checked before anything is allocated);
 *  - at most kMaxSafetensorsTensors tensors, each of at most kMaxSafetensorsRank dimensions;
 *  - the header is valid UTF-8, starts with '{', is one JSON object followed only by whitespace,
 *    nests at most 64 levels and has no duplicate key;
 *  - every dtype is a known safetensors dtype, every shape entry and offset a non-negative integer,
 *    `begin <= end`, and `end - begin == prod(shape) * bits / 8` (a whole number of bytes) with no
 *    arithmetic overflow;
 *  - sorted by offset, tensors neither overlap nor leave holes, and the last one ends exactly at
 *    the end of the file (the format forbids unindexed bytes).
 * Unknown keys inside a tensor entry are ignored (as the reference implementation does).
 *
 * Memory: the header is parsed in one streaming pass without a JSON tree; the result holds one
 * compact StTensorInfo per tensor (name, dtype, shape, offsets), so peak memory is about the
 * header's length plus ~100 bytes per tensor.
 *
 * Thread-safety: all functions are reentrant.
 */
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pyckpt {

/** @brief Upper bound on a header's length, the reference implementation's limit (100 MB). */
constexpr std::uint64_t kMaxSafetensorsHeader = 100'000'000;

/** @brief Upper bound on the number of tensors one header may declare (2^20). */
constexpr std::size_t kMaxSafetensorsTensors = std::size_t{1} << 20;

/** @brief Upper bound on the number of dimensions of one tensor. */
constexpr std::size_t kMaxSafetensorsRank = 64;

/** @brief Every dtype of the safetensors format, in the reference implementation's order. */
enum class StDtype : std::uint8_t {
  BOOL,
  F4,
  F6_E2M3,
  F6_E3M2,
  U8,
  I8,
  F8_E5M2,
  F8_E4M3,
  F8_E8M0,
  F8_E4M3FNUZ,
  F8_E5M2FNUZ,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  C64,
  F64,
  I64,
  U64,
};

/**
 * @brief Looks up a dtype by its header spelling (e.g. "BF16", "F8_E4M3").
 * @return the dtype, or std::nullopt for an unknown name.
 */
std::optional<StDtype> st_dtype_from_name(std::string_view name) noexcept;

/** @return the header spelling of `dtype`. */
const char* st_dtype_name(StDtype dtype) noexcept;

/** @return the size of one element in bits (4 for F4, 6 for F6_*, 8..64 otherwise). */
unsigned st_dtype_bits(StDtype dtype) noexcept;

/** @brief One tensor entry of a header. */
struct StTensorInfo {
  std::string name;                  ///< key in the header
  StDtype dtype = StDtype::U8;       ///< element type
  std::vector<std::uint64_t> shape;  ///< dimensions (empty for a scalar)
  std::uint64_t begin = 0;           ///< first byte, relative to the data section
  std::uint64_t end = 0;             ///< one past the last byte, relative to the data section
};

/** @brief A parsed and validated header. */
struct StHeader {
  std::uint64_t header_len = 0;  ///< N, the JSON length (including padding)
  std::uint64_t data_start = 0;  ///< absolute offset of the data section, 8 + N
  std::uint64_t file_size = 0;   ///< total file size the header was validated against
  std::vector<std::pair<std::string, std::string>> metadata;  ///< `__metadata__`, in file order
  std::vector<StTensorInfo> tensors;                          ///< sorted by `begin` (then by name)
};

/**
 * @brief Reads and validates the header of the safetensors file at `path`.
 *
 * Reads only the 8-byte length and the header itself (pread), never the data section.
 * @param path the file.
 * @return the validated header.
 * @throws SysError when the file cannot be opened or read (ENOENT -> FileNotFoundError).
 * @throws FormatError (Header, Truncated, Overlap or Mismatch) on any violation listed in the
 *         file comment; the message names the file and the tensor.
 */
StHeader parse_safetensors_header(const std::string& path);

/**
 * @brief Validates a header already in memory.
 * @param json the `N` header bytes (without the 8-byte length prefix).
 * @param file_size the size of the whole file the header belongs to (8 + N + data bytes).
 * @param origin a name for error messages (usually the path).
 * @return the validated header.
 * @throws FormatError as parse_safetensors_header().
 */
StHeader parse_safetensors_header_bytes(std::string_view json, std::uint64_t file_size,
                                        const std::string& origin);

/** @brief A tensor to be described by an emitted header. */
struct StTensorSpec {
  std::string name;                  ///< key (any UTF-8 string except "__metadata__")
  StDtype dtype = StDtype::U8;       ///< element type
  std::vector<std::uint64_t> shape;  ///< dimensions
};

/** @brief An emitted header and where each tensor's bytes go. */
struct StEmitted {
  std::string bytes;  ///< 8-byte length prefix + JSON padded with spaces to a multiple of 8
  std::vector<StTensorSpec> tensors;  ///< the input tensors, sorted by name
  std::vector<std::uint64_t> begins;  ///< data-section offset of each sorted tensor
  std::uint64_t data_bytes = 0;       ///< size of the data section
};

/**
 * @brief Builds a standard safetensors header: `__metadata__` first, then the tensors sorted by
 *        name and laid out back to back in that order from data offset 0.
 * @param tensors the tensors (names must be unique).
 * @param metadata string key/value pairs for `__metadata__` (emitted in the given order; an empty
 *        list omits `__metadata__`).
 * @return the header bytes and layout. The file is `bytes` followed by `data_bytes` bytes.
 * @throws std::invalid_argument on a duplicate or reserved name, a shape whose byte size is not
 *         whole, or a size that overflows 64 bits.
 */
StEmitted emit_safetensors_header(std::vector<StTensorSpec> tensors,
                                  const std::vector<std::pair<std::string, std::string>>& metadata);

}  // namespace pyckpt
