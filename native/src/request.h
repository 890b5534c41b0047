// Request: one asynchronous operation of the engine (a local copy, a push, a
// layer-wise transfer) with one result slot per transfer config.
//
// Ownership: shared by its submitter (the Python CacheTask or a C++ caller)
// and by every piece of work in flight for it.
// Holds: the request completes when its last hold is released. The tracker
// hands it out with one hold owned by the submitter; each piece of work in
// flight takes one more. Every release names the result slot it settles and
// the first failure per slot is kept.
// Threads: every method may be called from any thread.
#ifndef DATADIST_REQUEST_H_
#define DATADIST_REQUEST_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "completion_queue.h"
#include "llm_datadist/llm_error_codes.h"

namespace datadist {

using llm_datadist::Status;

class RequestTracker;

class Request {
 public:
  Request(uint64_t id, size_t num_results, std::shared_ptr<CompletionQueue> completions,
          std::weak_ptr<RequestTracker> tracker);
  ~Request();
  Request(const Request &) = delete;
  Request &operator=(const Request &) = delete;

  uint64_t id() const { return id_; }
  size_t num_results() const { return results_.size(); }

  void hold(size_t n = 1);
  // `skipped` marks work that was not carried out because of a cancellation.
  // `message` says in words why a failure happened (a peer's reason, say);
  // it is kept, cut to kMaxErrorDetail bytes, with the slot's first failure.
  void release(size_t result_index, Status status, bool skipped = false, std::string message = {});

  // Asks every piece of work to stop before its next byte; returns false if
  // the request had already completed. The first reason given is kept.
  bool cancel(Status reason);
  bool cancel_requested() const { return cancel_requested_.load(std::memory_order_acquire); }
  Status cancel_reason() const;
  // True when the user cancelled it and some of its work was skipped.
  bool cancelled() const;

  // done(), outcome() and wait() are looks: on a request not yet done they
  // first read the answers waiting on the engine's answer sockets
  // (answer_hub.h), so polling from any thread completes a request as soon
  // as its answer has come.
  bool done() const;
  // What an awaiting caller needs in one look: 0 while running; once done,
  // the number of results when every one succeeded and nothing was
  // cancelled, else -1.
  int64_t outcome() const;
  // Waits for completion; timeout_ms < 0 waits forever, 0 only looks. True
  // if done.
  bool wait(int64_t timeout_ms) const;
  // When the request completed (its last hold released), in seconds of
  // CLOCK_MONOTONIC (std::chrono::steady_clock on Linux, the clock of
  // Python's time.perf_counter and time.monotonic); negative while it has
  // not. A look, like done().
  double completed_at() const;
  std::vector<Status> results() const;
  // One message per result: the reason given with its first failure, or
  // empty where none was given (or the result is a success).
  std::vector<std::string> messages() const;
  // Asks for a completion-queue entry when the request completes. Returns
  // false, and queues nothing, if it has already completed.
  bool watch();

 private:
  void complete_locked(std::unique_lock<std::mutex> &lock);

  const uint64_t id_;
  std::shared_ptr<CompletionQueue> completions_;
  std::weak_ptr<RequestTracker> tracker_;
  std::atomic<bool> cancel_requested_{false};

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<Status> results_;
  std::vector<std::string> messages_;  // beside results_
  size_t holds_ = 1;
  bool done_ = false;
  double completed_at_ = -1.0;  // set with done_
  bool watched_ = false;
  bool skipped_ = false;
  Status cancel_reason_ = llm_datadist::LLM_SUCCESS;
};

// Status used for work the user cancelled.
constexpr Status kCancelledStatus = llm_datadist::LLM_FAILED;

// Creates requests with unique ids and knows every one still in flight, so
// finalize can stop them all and wait for them to settle.
class RequestTracker : public std::enable_shared_from_this<RequestTracker> {
 public:
  explicit RequestTracker(std::shared_ptr<CompletionQueue> completions);

  std::shared_ptr<Request> create(size_t num_results);
  void cancel_all(Status reason);
  // Waits until no request is in flight; false on timeout.
  bool wait_idle(int64_t timeout_ms);
  size_t in_flight() const;
  const std::shared_ptr<CompletionQueue> &completions() const { return completions_; }

 private:
  friend class Request;
  void forget(uint64_t id);

  std::shared_ptr<CompletionQueue> completions_;
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, std::weak_ptr<Request>> live_;
};

}  // namespace datadist

#endif  // DATADIST_REQUEST_H_
