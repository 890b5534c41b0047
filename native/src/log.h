// Engine messages a user must be able to see (a malformed frame, a link
// going down).
//
// By default they go to stderr, prefixed "[datadist_aio]"; the environment
// variable DATADIST_AIO_LOG=off silences them. The Python package instead
// calls capture_log(true): from then on messages are queued here (bounded;
// the oldest are dropped and counted when it is full) and a Python thread
// takes them with wait_log() and hands them to Python's logging. Engine
// threads therefore never touch the Python interpreter.
// Threads: every function may be called from any thread.
#ifndef DATADIST_LOG_H_
#define DATADIST_LOG_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace datadist {

enum class LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };

void log_message(LogLevel level, const std::string &message);
inline void log_warning(const std::string &message) { log_message(LogLevel::kWarning, message); }

// Queue messages for wait_log() (true) or print them to stderr (false).
// Turning the capture off wakes a waiter with what is still queued.
void capture_log(bool on);

constexpr size_t kMaxQueuedLogMessages = 1024;

// Waits up to timeout_ms (< 0: forever) until a message is queued or the
// capture ends; takes every queued message. `dropped` counts the messages
// lost to a full queue since the last call.
std::vector<std::pair<LogLevel, std::string>> wait_log(int64_t timeout_ms, uint64_t &dropped);

}  // namespace datadist

#endif  // DATADIST_LOG_H_
