#pragma once
/**
 * @file error.hpp
 * @brief Exception types thrown by the pyckpt core, and the checking macros that build them.
 *
 * The core reports every runtime failure by throwing one of these types (never `return -1`,
 * `std::cerr` or `assert`). The Python bindings translate them once, in `module.cpp`:
 *  - SysError         -> OSError(errno, strerror, filename) (so FileNotFoundError etc. apply)
 *  - FormatError      -> pyckpt.CheckpointFormatError (ChecksumError for FormatKind::Checksum)
 *  - CompressionError -> pyckpt.CompressionError
 *  - CudaError        -> pyckpt.CudaError
 *  - std::invalid_argument -> ValueError (pybind11 default)
 */
#include <cerrno>
#include <cstdint>
#include <exception>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>

namespace pyckpt {

/**
 * @brief A failed system call: errno, the operation that failed and the path it concerned.
 */
class SysError : public std::system_error {
 public:
  /**
   * @param err errno value of the failure.
   * @param op the operation, e.g. "open", "pwrite".
   * @param path the file concerned (may be empty).
   * @param detail extra context (e.g. the tensor being written), may be empty.
   */
  SysError(int err, std::string op, std::string path, std::string detail = {});
  /** @return the file concerned, or an empty string. */
  const std::string& path() const noexcept { return _path; }
  /** @return the failed operation's name. */
  const std::string& op() const noexcept { return _op; }
  /** @return extra context, or an empty string. */
  const std::string& detail() const noexcept { return _detail; }

 private:
  std::string _op;
  std::string _path;
  std::string _detail;
};

/** @brief What kind of format violation a FormatError reports. */
enum class FormatKind : std::uint8_t {
  Truncated = 0,  ///< data ends before the recorded length
  Checksum = 1,   ///< stored bytes do not match their checksum
  Header = 2,     ///< malformed header or metadata
  Version = 3,    ///< unknown format version
  Overlap = 4,    ///< overlapping pieces
  Coverage = 5,   ///< pieces leave a hole
  Mismatch = 6,   ///< inconsistent dtype/shape between pieces
  Other = 7,
};

/** @brief The on-disk data violates the format (truncated, corrupted, inconsistent). */
class FormatError : public std::runtime_error {
 public:
  FormatError(FormatKind kind, const std::string& what) : std::runtime_error(what), _kind(kind) {}
  /** @return which violation this is. */
  FormatKind kind() const noexcept { return _kind; }

 private:
  FormatKind _kind;
};

/** @brief zstd reported an error; the message carries ZSTD_getErrorName(). */
class CompressionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/** @brief The CUDA runtime (loaded at run time) returned an error. */
class CudaError : public std::runtime_error {
 public:
  CudaError(int code, const std::string& what) : std::runtime_error(what), _code(code) {}
  /** @return the cudaError_t value. */
  int code() const noexcept { return _code; }

 private:
  int _code;
};

/**
 * @brief Rethrows `error` as the same pyckpt/std exception type with `context` added.
 *
 * SysError keeps errno, operation and path and gets `context` appended to its detail; FormatError
 * keeps its kind; CompressionError, CudaError, std::invalid_argument, std::logic_error and
 * std::runtime_error get " (<context>)" appended to the message. Anything else (e.g.
 * std::bad_alloc) is rethrown unchanged. Used by the parallel pipelines to name the tensor and
 * file a worker failed on, after every task has been drained.
 * @param error a non-null exception pointer.
 * @param context e.g. "tensor 'model.layers.0.weight'".
 */
[[noreturn]] void rethrow_with_context(const std::exception_ptr& error, const std::string& context);

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace pyckpt

/**
 * @brief Throws `exc_type(message)` when `cond` is false; the message is built only on failure.
 * Usage: PYCKPT_EXPECT(n > 0, std::invalid_argument, "n must be positive, got ", n);
 */
#define PYCKPT_EXPECT(cond, exc_type, ...)                              \
  do {                                                                  \
    if (!(cond)) throw exc_type(::pyckpt::detail::concat(__VA_ARGS__)); \
  } while (0)

/**
 * @brief Throws a FormatError of `kind` when `cond` is false.
 */
#define PYCKPT_EXPECT_FORMAT(cond, kind, ...)                                              \
  do {                                                                                     \
    if (!(cond)) throw ::pyckpt::FormatError(kind, ::pyckpt::detail::concat(__VA_ARGS__)); \
  } while (0)

/**
 * @brief Evaluates a POSIX call returning -1 on failure and throws SysError(errno, op, path).
 */
#define PYCKPT_SYSCALL_CHECK(expr, op, path)                         \
  do {                                                               \
    if ((expr) == -1) throw ::pyckpt::SysError(errno, (op), (path)); \
  } while (0)
