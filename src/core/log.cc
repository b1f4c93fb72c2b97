#include "layerstream/log.h"

#include <cstdio>
#include <mutex>
#include <set>

namespace layerstream {

namespace {

struct LogState {
  std::mutex mutex;
  LogSink sink;
  std::set<std::string> once_keys;
};

LogState& state() {
  static LogState* s = new LogState();  // never destroyed: logging may happen during static teardown
  return *s;
}

const char* level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARNING";
    case LogLevel::kError: return "ERROR";
  }
  return "?";
}

}  // namespace

void set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().sink = std::move(sink);
}

void log(LogLevel level, const std::string& message) {
  LogSink sink;
  {
    std::lock_guard<std::mutex> lock(state().mutex);
    sink = state().sink;
  }
  // Called outside the lock: a Python sink takes the GIL and may log in turn.
  if (sink) {
    sink(level, message);
  } else {
    std::fprintf(stderr, "layerstream %s: %s\n", level_name(level), message.c_str());
  }
}

bool log_once(const std::string& key, LogLevel level, const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(state().mutex);
    if (!state().once_keys.insert(key).second) return false;
  }
  log(level, message);
  return true;
}

void reset_log_once() {
  std::lock_guard<std::mutex> lock(state().mutex);
  state().once_keys.clear();
}

}  // namespace layerstream
