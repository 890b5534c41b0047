#include "transport/io_loop.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <cerrno>
#include <system_error>

#include "thread_name.h"

namespace datadist {

namespace {

// Events one thread takes per wait: few, so a handler that writes for a
// while does not hold ready descriptors back from idle threads.
constexpr int kEventsPerWait = 4;

// The registration whose handler this thread runs now (0: none).
thread_local uint64_t t_dispatching = 0;
thread_local const void *t_loop = nullptr;

int checked_epoll() {
  const int fd = ::epoll_create1(EPOLL_CLOEXEC);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "epoll_create1");
  return fd;
}

}  // namespace

size_t IoLoop::default_threads() {
  const size_t cores = std::thread::hardware_concurrency();
  return std::clamp<size_t>(cores, 1, kMaxThreads);
}

IoLoop::IoLoop(size_t threads, std::chrono::milliseconds blocking_idle)
    : count_(std::clamp<size_t>(threads == 0 ? default_threads() : threads, 1, kMaxThreads)),
      blocking_idle_(blocking_idle),
      epoll_fd_(checked_epoll()),
      stop_fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  epoll_event event{};
  event.events = EPOLLIN;  // level-triggered: every thread sees it
  event.data.u64 = 0;
  if (stop_fd_ < 0 || ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, stop_fd_, &event) != 0) {
    const int error = errno;
    if (stop_fd_ >= 0) ::close(stop_fd_);
    ::close(epoll_fd_);
    throw std::system_error(error, std::generic_category(), "eventfd");
  }
}

IoLoop::~IoLoop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  blocking_cv_.notify_all();
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(stop_fd_, &one, sizeof(one));
  for (auto &thread : threads_) thread.join();
  // Blocking threads run the jobs already queued, then end.
  std::unique_lock<std::mutex> lock(mu_);
  while (!blocking_.empty() || !ended_.empty()) {
    join_ended_locked();
    if (!blocking_.empty()) blocking_cv_.wait_for(lock, std::chrono::milliseconds(10));
  }
  lock.unlock();
  ::close(stop_fd_);
  ::close(epoll_fd_);
}

size_t IoLoop::running_threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return threads_.size();
}

uint64_t IoLoop::add(int fd, std::weak_ptr<IoHandler> handler, uint64_t tag) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return 0;
  try {
    while (threads_.size() < count_) {
      threads_.emplace_back([this] {
        name_this_thread("dd-io");
        run();
      });
    }
  } catch (const std::system_error &) {
    if (threads_.empty()) return 0;  // fewer threads serve as well, if slower
  }
  const uint64_t id = next_id_++;
  epoll_event event{};
  event.events = EPOLLONESHOT;  // disarmed until armed
  event.data.u64 = id;
  if (::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &event) != 0) return 0;
  watched_.emplace(id, Watched{fd, std::move(handler), tag});
  return id;
}

bool IoLoop::arm(uint64_t id, uint32_t events) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = watched_.find(id);
  if (it == watched_.end()) return false;
  epoll_event event{};
  event.events = events | EPOLLONESHOT;
  event.data.u64 = id;
  return ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, it->second.fd, &event) == 0;
}

void IoLoop::remove(uint64_t id) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = watched_.find(id);
  if (it == watched_.end()) return;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->second.fd, nullptr);
  const int mine = t_loop == this && t_dispatching == id ? 1 : 0;  // called from its own handler
  dispatched_cv_.wait(lock, [&] {
    it = watched_.find(id);
    return it == watched_.end() || it->second.dispatching <= mine;
  });
  if (it != watched_.end()) watched_.erase(it);
}

bool IoLoop::run_blocking(std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return false;
  join_ended_locked();
  if (idle_ > jobs_.size()) {
    jobs_.push_back(std::move(job));
    blocking_cv_.notify_one();
    return true;
  }
  try {
    blocking_.emplace_back();
    auto self = std::prev(blocking_.end());
    *self = std::thread([this, self] {
      name_this_thread("dd-io-block");
      run_blocking_thread(self);
    });
  } catch (const std::system_error &) {
    blocking_.pop_back();
    return false;
  }
  jobs_.push_back(std::move(job));
  return true;
}

size_t IoLoop::blocking_threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return blocking_.size();
}

size_t IoLoop::idle_blocking_threads() const {
  std::lock_guard<std::mutex> lock(mu_);
  return idle_;
}

void IoLoop::join_ended_locked() {
  for (auto &thread : ended_) thread.join();
  ended_.clear();
}

void IoLoop::run_blocking_thread(std::list<std::thread>::iterator self) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (!jobs_.empty()) {
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      job = nullptr;  // what it holds goes before the lock is taken
      lock.lock();
      continue;
    }
    if (stopping_) break;
    ++idle_;
    const bool woken = blocking_cv_.wait_for(lock, blocking_idle_, [this] { return stopping_ || !jobs_.empty(); });
    --idle_;
    if (!woken) break;  // idle too long
  }
  // Joined by the next caller, or the destructor.
  ended_.push_back(std::move(*self));
  blocking_.erase(self);
  blocking_cv_.notify_all();
}

void IoLoop::run() {
  epoll_event events[kEventsPerWait];
  for (;;) {
    const int n = ::epoll_wait(epoll_fd_, events, kEventsPerWait, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // the set is gone: the loop is being destroyed
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == 0) return;  // stopping
      std::shared_ptr<IoHandler> handler;
      uint64_t tag = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = watched_.find(id);
        if (it == watched_.end()) continue;
        handler = it->second.handler.lock();
        tag = it->second.tag;
        ++it->second.dispatching;
      }
      t_dispatching = id;
      t_loop = this;
      if (handler) handler->on_ready(tag, events[i].events);
      handler.reset();  // before remove() may return: the owner may then go
      t_dispatching = 0;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = watched_.find(id);
        if (it != watched_.end()) --it->second.dispatching;
      }
      dispatched_cv_.notify_all();
    }
  }
}

}  // namespace datadist
