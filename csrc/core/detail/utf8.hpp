#pragma once
/**
 * @file utf8.hpp
 * @brief UTF-8 encoding of one code point, for the core's two JSON readers (the safetensors
 *        header's, core/detail/json_reader.hpp, and the metadata's, core/json_tape.cpp).
 *
 * Internal to csrc/core. Surrogates are encoded like any other code point below 0x10000
 * (generalized UTF-8): the readers decide whether a lone surrogate escape is an error.
 */
#include <cstdint>
#include <string>

namespace pyckpt::detail {

inline void append_utf8(std::string& out, std::uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace pyckpt::detail
