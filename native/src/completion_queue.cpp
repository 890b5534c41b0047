#include "completion_queue.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

namespace datadist {

CompletionQueue::CompletionQueue() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
}

CompletionQueue::~CompletionQueue() { ::close(fd_); }

void CompletionQueue::push(uint64_t request_id, llm_datadist::Status status) {
  bool was_empty;
  {
    std::lock_guard<std::mutex> lock(mu_);
    was_empty = items_.empty();
    items_.push_back({request_id, status});
  }
  if (was_empty) {
    const uint64_t one = 1;
    // A full counter (EAGAIN) already means "readable"; nothing else can fail here.
    ssize_t n = ::write(fd_, &one, sizeof(one));
    (void)n;
  }
}

std::vector<Completion> CompletionQueue::drain() {
  std::vector<Completion> out;
  std::lock_guard<std::mutex> lock(mu_);
  // Clear the counter under the lock: a push after the swap sees an empty
  // queue and writes the eventfd again, so no completion is left unsignalled.
  uint64_t counter;
  ssize_t n = ::read(fd_, &counter, sizeof(counter));
  (void)n;
  out.swap(items_);
  return out;
}

}  // namespace datadist
