#include "core/error.hpp"

#include <cstring>

namespace pyckpt {

namespace {
std::string sys_message(int err, const std::string& op, const std::string& path,
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

}  // namespace pyckpt
