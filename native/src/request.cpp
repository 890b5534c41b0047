#include "request.h"

#include <time.h>

#include <chrono>

#include "error_detail.h"

namespace datadist {

using llm_datadist::LLM_SUCCESS;

Request::Request(uint64_t id, size_t num_results, std::shared_ptr<CompletionQueue> completions,
                 std::weak_ptr<RequestTracker> tracker)
    : id_(id),
      completions_(std::move(completions)),
      tracker_(std::move(tracker)),
      results_(num_results == 0 ? 1 : num_results, LLM_SUCCESS),
      messages_(results_.size()) {}

Request::~Request() {
  if (holds_ != 0) {
    if (auto tracker = tracker_.lock()) tracker->forget(id_);
  }
}

void Request::hold(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  holds_ += n;
}

void Request::release(size_t result_index, Status status, bool skipped, std::string message) {
  if (message.size() > kMaxErrorDetail) message.resize(kMaxErrorDetail);
  std::unique_lock<std::mutex> lock(mu_);
  if (result_index < results_.size() && status != LLM_SUCCESS && results_[result_index] == LLM_SUCCESS) {
    results_[result_index] = status;
    messages_[result_index] = std::move(message);
  }
  skipped_ = skipped_ || skipped;
  if (--holds_ == 0) complete_locked(lock);
}

namespace {

double monotonic_seconds() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<double>(now.tv_sec) + static_cast<double>(now.tv_nsec) * 1e-9;
}

}  // namespace

void Request::complete_locked(std::unique_lock<std::mutex> &lock) {
  const double completed_at = monotonic_seconds();
  // Leave the tracker first: whoever sees the request done also sees it no
  // longer in flight.
  lock.unlock();
  if (auto tracker = tracker_.lock()) tracker->forget(id_);
  lock.lock();
  done_ = true;
  completed_at_ = completed_at;
  const bool notify = watched_;
  Status first = LLM_SUCCESS;
  for (Status s : results_) {
    if (s != LLM_SUCCESS) {
      first = s;
      break;
    }
  }
  lock.unlock();
  cv_.notify_all();
  if (notify) completions_->push(id_, first);
}

bool Request::cancel(Status reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return false;
  if (!cancel_requested_.load(std::memory_order_relaxed)) {
    cancel_reason_ = reason;
    cancel_requested_.store(true, std::memory_order_release);
  }
  return true;
}

Status Request::cancel_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cancel_reason_;
}

bool Request::cancelled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return skipped_ && cancel_reason_ == kCancelledStatus;
}

bool Request::done() const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (done_) return true;
  }
  // Whoever asks reads the answers waiting for it (answer_hub.h): a task
  // polled from a thread that runs no loop completes at its next look.
  completions_->answers().drive(AnswerHub::Reader::kLook);
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

double Request::completed_at() const {
  if (!done()) return -1.0;
  std::lock_guard<std::mutex> lock(mu_);
  return completed_at_;
}

int64_t Request::outcome() const {
  if (!done()) return 0;
  std::lock_guard<std::mutex> lock(mu_);
  if (skipped_ && cancel_reason_ == kCancelledStatus) return -1;
  for (Status s : results_) {
    if (s != LLM_SUCCESS) return -1;
  }
  return static_cast<int64_t>(results_.size());
}

bool Request::wait(int64_t timeout_ms) const {
  if (done()) return true;
  if (timeout_ms == 0) return false;
  // The hub's thread reads answers while this one blocks.
  AnswerHub::Blocking blocking(completions_->answers());
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout_ms < 0) {
    cv_.wait(lock, [this] { return done_; });
    return true;
  }
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [this] { return done_; });
}

std::vector<Status> Request::results() const {
  std::lock_guard<std::mutex> lock(mu_);
  return results_;
}

std::vector<std::string> Request::messages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return messages_;
}

bool Request::watch() {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return false;
  watched_ = true;
  return true;
}

RequestTracker::RequestTracker(std::shared_ptr<CompletionQueue> completions)
    : completions_(std::move(completions)) {}

std::shared_ptr<Request> RequestTracker::create(size_t num_results) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t id = next_id_++;
  auto request = std::make_shared<Request>(id, num_results, completions_, weak_from_this());
  live_.emplace(id, request);
  return request;
}

void RequestTracker::forget(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  live_.erase(id);
  if (live_.empty()) idle_cv_.notify_all();
}

void RequestTracker::cancel_all(Status reason) {
  std::vector<std::shared_ptr<Request>> live;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto &entry : live_) {
      if (auto request = entry.second.lock()) live.push_back(std::move(request));
    }
  }
  for (auto &request : live) request->cancel(reason);
}

bool RequestTracker::wait_idle(int64_t timeout_ms) {
  AnswerHub::Blocking blocking(completions_->answers());
  std::unique_lock<std::mutex> lock(mu_);
  auto idle = [this] {
    for (auto &entry : live_) {
      if (!entry.second.expired()) return false;
    }
    return true;
  };
  if (timeout_ms < 0) {
    idle_cv_.wait(lock, idle);
    return true;
  }
  return idle_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), idle);
}

size_t RequestTracker::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.size();
}

}  // namespace datadist

