#include "log.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>

namespace datadist {

namespace {

bool stderr_enabled() {
  static const bool on = [] {
    const char *value = std::getenv("DATADIST_AIO_LOG");
    return value == nullptr || std::strcmp(value, "off") != 0;
  }();
  return on;
}

struct Capture {
  std::mutex mu;
  std::condition_variable cv;
  bool on = false;
  uint64_t epoch = 0;  // bumped when the capture is turned off, to wake waiters
  uint64_t dropped = 0;
  std::deque<std::pair<LogLevel, std::string>> queue;
};

// Leaked on purpose: engine threads may log during static destruction.
Capture &capture() {
  static Capture *c = new Capture;
  return *c;
}

const char *level_name(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    default: return "error";
  }
}

}  // namespace

void log_message(LogLevel level, const std::string &message) {
  Capture &c = capture();
  {
    std::lock_guard<std::mutex> lock(c.mu);
    if (c.on) {
      if (c.queue.size() >= kMaxQueuedLogMessages) {
        c.queue.pop_front();
        ++c.dropped;
      }
      c.queue.emplace_back(level, message);
      c.cv.notify_one();
      return;
    }
  }
  if (level >= LogLevel::kWarning && stderr_enabled()) {
    std::fprintf(stderr, "[datadist_aio] %s: %s\n", level_name(level), message.c_str());
  }
}

void capture_log(bool on) {
  Capture &c = capture();
  std::lock_guard<std::mutex> lock(c.mu);
  if (c.on && !on) ++c.epoch;
  c.on = on;
  c.cv.notify_all();
}

std::vector<std::pair<LogLevel, std::string>> wait_log(int64_t timeout_ms, uint64_t &dropped) {
  Capture &c = capture();
  std::unique_lock<std::mutex> lock(c.mu);
  const uint64_t epoch = c.epoch;
  auto ready = [&] { return !c.queue.empty() || c.epoch != epoch; };
  if (timeout_ms < 0) {
    c.cv.wait(lock, ready);
  } else {
    c.cv.wait_for(lock, std::chrono::milliseconds(timeout_ms), ready);
  }
  std::vector<std::pair<LogLevel, std::string>> out(std::make_move_iterator(c.queue.begin()),
                                                    std::make_move_iterator(c.queue.end()));
  c.queue.clear();
  dropped = c.dropped;
  c.dropped = 0;
  return out;
}

}  // namespace datadist
