#include "layerstream/check.h"

namespace layerstream::detail {

namespace {
std::string with_location(const char* file, int line, const std::string& message) {
  return concat(message, " [", file, ":", line, "]");
}
}  // namespace

void throw_error(const char* file, int line, const std::string& message) {
  throw Error(with_location(file, line, message));
}

void throw_invalid_argument(const char* file, int line, const std::string& message) {
  throw InvalidArgument(with_location(file, line, message));
}

}  // namespace layerstream::detail
