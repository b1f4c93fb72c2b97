// Logging for the core: one process-wide sink, replaceable by the Python layer (which forwards to the
// `logging` module). The default sink writes to stderr. All functions are thread-safe.
//
// `log_once(key, ...)` exists for conditions a user must hear about exactly once per process, such as a
// refused pin that makes the engine fall back to pageable memory.
#pragma once

#include <functional>
#include <string>

namespace layerstream {

enum class LogLevel { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };

using LogSink = std::function<void(LogLevel, const std::string&)>;

// Replaces the sink; an empty function restores the default (stderr).
void set_log_sink(LogSink sink);
void log(LogLevel level, const std::string& message);
// Logs `message` the first time `key` is seen in this process; returns true when it logged.
bool log_once(const std::string& key, LogLevel level, const std::string& message);
// Forgets every key seen by log_once (tests use it).
void reset_log_once();

}  // namespace layerstream
