// DeadlineTimer: one timer (a timerfd) watched by the transport's I/O loop,
// which runs a callback at the earliest time it was asked for.
//
// A timer that nobody asked for a time is disarmed: no thread wakes for it.
// at() keeps the earliest time asked since the last firing; the callback
// runs once per firing, on an I/O thread, and asks for the next time itself
// (at() from within it is allowed). A time asked for once the timer is
// due is served by that firing: its callback, which runs after, looks at
// what is due then and asks for the next time.
//
// Threads: every method may be called from any thread, the callback's
// included; stop() must come before the loop goes.
#ifndef DATADIST_TRANSPORT_DEADLINE_TIMER_H_
#define DATADIST_TRANSPORT_DEADLINE_TIMER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "transport/io_loop.h"

namespace datadist {

class DeadlineTimer : public IoHandler, public std::enable_shared_from_this<DeadlineTimer> {
 public:
  using Clock = std::chrono::steady_clock;

  // Null when the kernel refuses the timer or the loop cannot watch it.
  static std::shared_ptr<DeadlineTimer> create(IoLoop &loop, std::function<void()> fire);
  ~DeadlineTimer() override;
  DeadlineTimer(const DeadlineTimer &) = delete;
  DeadlineTimer &operator=(const DeadlineTimer &) = delete;

  // The callback runs at `when` (at once when it has passed), or earlier if
  // an earlier time is asked for too.
  void at(Clock::time_point when);
  // Stops watching the timer; returns once the callback no longer runs.
  void stop();
  // Firings so far (for tests: none while nobody asked for a time).
  uint64_t firings() const { return firings_.load(std::memory_order_relaxed); }

  void on_ready(uint64_t tag, uint32_t events) override;

 private:
  DeadlineTimer(IoLoop &loop, int fd, std::function<void()> fire);
  // Sets the timerfd to `when` (mu_ held).
  void set_locked(Clock::time_point when);

  IoLoop &loop_;
  const int fd_;
  const std::function<void()> fire_;
  std::mutex mu_;
  bool armed_ = false;  // the timerfd is set (mu_)
  Clock::time_point armed_at_{};  // to this time (mu_)
  uint64_t io_id_ = 0;
  std::atomic<uint64_t> firings_{0};
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_DEADLINE_TIMER_H_
