// Error types and the check macros used everywhere in layerstream.
//
// Every runtime condition that can fail is checked with one of the macros below; they throw, they never
// abort or exit. Two error kinds exist because the Python layer maps them differently:
//   * InvalidArgument -> ValueError: the caller passed something wrong (size 0, unknown layer, ...).
//   * Error           -> RuntimeError: the engine or the platform could not do what was asked.
// Messages say what went wrong and, where there is one, what to do about it. The file and line of the
// check are appended so that a report from a user points at the code.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace layerstream {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The device refused an allocation (the Python bindings raise torch.OutOfMemoryError for it).
class OutOfDeviceMemory : public Error {
 public:
  using Error::Error;
};

namespace detail {

// Streams every argument into one string; used to build messages lazily (only on failure).
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

[[noreturn]] void throw_error(const char* file, int line, const std::string& message);
[[noreturn]] void throw_invalid_argument(const char* file, int line, const std::string& message);

}  // namespace detail
}  // namespace layerstream

// LS_CHECK(cond, msg...): throws layerstream::Error when cond is false.
#define LS_CHECK(cond, ...)                                                                 \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      ::layerstream::detail::throw_error(__FILE__, __LINE__,                                \
                                         ::layerstream::detail::concat(__VA_ARGS__));       \
    }                                                                                       \
  } while (0)

// LS_CHECK_ARG(cond, msg...): throws layerstream::InvalidArgument when cond is false.
#define LS_CHECK_ARG(cond, ...)                                                             \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      ::layerstream::detail::throw_invalid_argument(__FILE__, __LINE__,                     \
                                                    ::layerstream::detail::concat(__VA_ARGS__)); \
    }                                                                                       \
  } while (0)

// LS_FAIL(msg...): unconditional layerstream::Error.
#define LS_FAIL(...) \
  ::layerstream::detail::throw_error(__FILE__, __LINE__, ::layerstream::detail::concat(__VA_ARGS__))
