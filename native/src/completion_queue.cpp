#include "completion_queue.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace datadist {

namespace {

// The queue whose drain() runs on this thread: pushes it makes need not
// write the eventfd, the drain takes them right after.
thread_local const CompletionQueue *draining = nullptr;

}  // namespace

CompletionQueue::CompletionQueue() : event_fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)), fd_(-1) {
  if (event_fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  epoll_event event{};
  event.events = EPOLLIN;
  bool ok = fd_ >= 0 && ::epoll_ctl(fd_, EPOLL_CTL_ADD, event_fd_, &event) == 0 &&
            ::epoll_ctl(fd_, EPOLL_CTL_ADD, answers_.fd(), &event) == 0;
  if (!ok) {
    const int error = errno;
    if (fd_ >= 0) ::close(fd_);
    ::close(event_fd_);
    throw std::system_error(error, std::generic_category(), "epoll for completions");
  }
}

CompletionQueue::~CompletionQueue() {
  ::close(fd_);
  ::close(event_fd_);
}

void CompletionQueue::push(uint64_t request_id, llm_datadist::Status status) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool was_empty = items_.empty();
  items_.push_back({request_id, status});
  if (was_empty && draining != this) {
    const uint64_t one = 1;
    // A full counter (EAGAIN) already means "readable"; nothing else can fail here.
    ssize_t n = ::write(event_fd_, &one, sizeof(one));
    (void)n;
    signalled_ = true;
  }
}

std::vector<Completion> CompletionQueue::drain() {
  const CompletionQueue *outer = draining;
  draining = this;
  answers_.drive();
  draining = outer;
  std::vector<Completion> out;
  std::lock_guard<std::mutex> lock(mu_);
  // Clear the counter under the lock: a push after the swap sees an empty
  // queue and writes the eventfd again, so no completion is left unsignalled.
  if (signalled_) {
    uint64_t counter;
    ssize_t n = ::read(event_fd_, &counter, sizeof(counter));
    (void)n;
    signalled_ = false;
  }
  out.swap(items_);
  return out;
}

}  // namespace datadist
