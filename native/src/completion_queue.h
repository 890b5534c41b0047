// CompletionQueue: hands finished request ids from engine threads to one
// consumer (the asyncio loop) through an eventfd.
//
// Thread rules: push() from any thread; drain() from any thread, usually the
// loop thread. The eventfd is written only when the queue goes from empty to
// non-empty, so a burst of completions costs one wake-up and one drain.
#ifndef DATADIST_COMPLETION_QUEUE_H_
#define DATADIST_COMPLETION_QUEUE_H_

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "llm_datadist/llm_error_codes.h"

namespace datadist {

struct Completion {
  uint64_t request_id;
  llm_datadist::Status status;
};

class CompletionQueue {
 public:
  CompletionQueue();
  ~CompletionQueue();
  CompletionQueue(const CompletionQueue &) = delete;
  CompletionQueue &operator=(const CompletionQueue &) = delete;

  // Readable (level-triggered) while completions may be waiting.
  int fd() const { return fd_; }

  void push(uint64_t request_id, llm_datadist::Status status);

  // Takes every waiting completion and clears the eventfd.
  std::vector<Completion> drain();

 private:
  int fd_;
  std::mutex mu_;
  std::vector<Completion> items_;
};

}  // namespace datadist

#endif  // DATADIST_COMPLETION_QUEUE_H_
