// CompletionQueue: hands finished request ids from engine threads to one
// consumer (the asyncio loop) through one pollable fd.
//
// The fd is an epoll set holding an eventfd, written when the queue goes
// from empty to non-empty (so a burst of completions costs one wake-up and
// one drain), and the answer hub's set: drain() first reads the answers
// waiting on same-host links' answer sockets (which complete requests on
// the draining thread, with no engine thread woken), then takes the queue.
//
// Thread rules: push() from any thread; drain() from any thread, usually the
// loop thread.
#ifndef DATADIST_COMPLETION_QUEUE_H_
#define DATADIST_COMPLETION_QUEUE_H_

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "answer_hub.h"
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

  // Readable (level-triggered) while completions or answers may be waiting.
  int fd() const { return fd_; }

  void push(uint64_t request_id, llm_datadist::Status status);

  // Reads waiting answers, then takes every waiting completion and clears
  // the eventfd.
  std::vector<Completion> drain();

  AnswerHub &answers() { return answers_; }

 private:
  AnswerHub answers_;
  int event_fd_;
  int fd_;
  std::mutex mu_;
  std::vector<Completion> items_;
  bool signalled_ = false;  // the eventfd was written and not read since
};

}  // namespace datadist

#endif  // DATADIST_COMPLETION_QUEUE_H_
