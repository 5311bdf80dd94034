#include "core/error.hpp"

#include <cstring>

namespace pyckpt {

namespace {
std::string sys_message(int /*err*/, const std::string& op, const std::string& path,
                        const std::string& detail) {
  std::string msg = op;
  if (!path.empty()) msg += " '" + path + "'";
  if (!detail.empty()) msg += " (" + detail + ")";
  return msg;
}
}  // namespace

SysError::SysError(int err, std::string op, std::string path, std::string detail)
    : std::system_error(err, std::generic_category(), sys_message(err, op, path, detail)),
      _op(std::move(op)),
      _path(std::move(path)),
      _detail(std::move(detail)) {}

void rethrow_with_context(const std::exception_ptr& error, const std::string& context) {
  const std::string suffix = " (" + context + ")";
  // Most derived types first: the copies must keep the original's Python mapping.
  try {
    std::rethrow_exception(error);
  } catch (const SysError& e) {
    const std::string d = e.detail().empty() ? context : e.detail() + ", " + context;
    throw SysError(e.code().value(), e.op(), e.path(), d);
  } catch (const FormatError& e) {
    throw FormatError(e.kind(), e.what() + suffix);
  } catch (const CompressionError& e) {
    throw CompressionError(e.what() + suffix);
  } catch (const CudaError& e) {
    throw CudaError(e.code(), e.what() + suffix);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(e.what() + suffix);
  } catch (const std::logic_error& e) {
    throw std::logic_error(e.what() + suffix);
  } catch (const std::system_error& e) {
    throw std::system_error(e.code(), e.what() + suffix);
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(e.what() + suffix);
  }
}

}  // namespace pyckpt
