#include "transport/deadline_timer.h"

#include <sys/epoll.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <ctime>

namespace datadist {

std::shared_ptr<DeadlineTimer> DeadlineTimer::create(IoLoop &loop, std::function<void()> fire) {
  const int fd = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (fd < 0) return nullptr;
  std::shared_ptr<DeadlineTimer> timer(new DeadlineTimer(loop, fd, std::move(fire)));
  timer->io_id_ = loop.add(fd, std::weak_ptr<IoHandler>(timer), 0);
  if (timer->io_id_ == 0 || !loop.arm(timer->io_id_, EPOLLIN)) return nullptr;
  return timer;
}

DeadlineTimer::DeadlineTimer(IoLoop &loop, int fd, std::function<void()> fire)
    : loop_(loop), fd_(fd), fire_(std::move(fire)) {}

DeadlineTimer::~DeadlineTimer() {
  stop();
  ::close(fd_);
}

void DeadlineTimer::stop() {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = io_id_;
    io_id_ = 0;
  }
  if (id != 0) loop_.remove(id);
}

void DeadlineTimer::set_locked(Clock::time_point when) {
  // steady_clock is CLOCK_MONOTONIC; a time that has passed (or the epoch,
  // which would disarm) fires at once.
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count();
  if (ns <= 0) ns = 1;
  itimerspec spec{};
  spec.it_value.tv_sec = static_cast<time_t>(ns / 1000000000);
  spec.it_value.tv_nsec = static_cast<long>(ns % 1000000000);
  ::timerfd_settime(fd_, TFD_TIMER_ABSTIME, &spec, nullptr);
  armed_ = true;
  armed_at_ = when;
}

void DeadlineTimer::at(Clock::time_point when) {
  std::lock_guard<std::mutex> lock(mu_);
  if (armed_ && armed_at_ <= when) return;
  set_locked(when);
}

void DeadlineTimer::on_ready(uint64_t, uint32_t) {
  uint64_t expirations = 0;
  [[maybe_unused]] const ssize_t n = ::read(fd_, &expirations, sizeof(expirations));
  uint64_t id;
  {
    // It fired for the time it was set to: a time asked for since is
    // served by the callback below.
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = false;
    id = io_id_;
  }
  firings_.fetch_add(1, std::memory_order_relaxed);
  fire_();
  if (id != 0) loop_.arm(id, EPOLLIN);
}

}  // namespace datadist
