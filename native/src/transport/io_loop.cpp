#include "transport/io_loop.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <system_error>

#include "thread_name.h"

namespace datadist {

namespace {

// Events one thread takes per wait: few, so a handler that writes for a
// while does not hold ready descriptors back from idle threads.
constexpr int kEventsPerWait = 4;

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

IoLoop::IoLoop(size_t threads)
    : count_(std::clamp<size_t>(threads == 0 ? default_threads() : threads, 1, kMaxThreads)),
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
  std::unique_ptr<WorkerPool> blocking;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    blocking = std::move(blocking_);
  }
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = ::write(stop_fd_, &one, sizeof(one));
  for (auto &thread : threads_) thread.join();
  if (blocking) blocking->shutdown();
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
  std::lock_guard<std::mutex> lock(mu_);
  auto it = watched_.find(id);
  if (it == watched_.end()) return;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->second.fd, nullptr);
  watched_.erase(it);
}

bool IoLoop::run_blocking(std::function<void()> job) {
  WorkerPool *pool;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    if (!blocking_) {
      try {
        blocking_ = std::make_unique<WorkerPool>(kBlockingThreads, "dd-io-block");
      } catch (const std::system_error &) {
        return false;
      }
    }
    pool = blocking_.get();
  }
  // The pool lives until the destructor, which no thread of its own runs.
  return pool->submit(std::move(job));
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
      }
      if (handler) handler->on_ready(tag, events[i].events);
    }
  }
}

}  // namespace datadist
