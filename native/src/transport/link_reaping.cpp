// A link's end: the threads working for it counted, its failure, and the
// reap that waits them out and settles every operation still open.
#include "transport/link.h"

#include <sys/socket.h>

#include "log.h"

namespace datadist {

using llm_datadist::LLM_SUCCESS;

bool Link::begin_work() {
  std::lock_guard<std::mutex> lock(mu_);
  if (reaping_) return false;
  ++working_;
  return true;
}

void Link::end_work() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--working_ == 0) work_done_cv_.notify_all();
}

void Link::fail(Status reason, const std::string &why) {
  if (down_.exchange(true, std::memory_order_acq_rel)) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    down_reason_ = reason;
    down_why_ = why;
  }
  if (!why.empty()) log_warning("link to cluster " + std::to_string(peer_id_) + ": " + why);
  for (auto &conn : conns_) ::shutdown(conn->fd, SHUT_RDWR);
  host_->link_down(shared_from_this());
}

void Link::reap() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reaping_) return;  // reaped already, or being reaped
    reaping_ = true;
  }
  for (auto &conn : conns_) {
    if (conn->io_id != 0) host_->io_loop().remove(conn->io_id);
  }
  {
    // No I/O thread or blocking job touches the link's frames from here.
    std::unique_lock<std::mutex> lock(mu_);
    work_done_cv_.wait(lock, [this] { return working_ == 0; });
  }
  // Each path lets go of what it holds of the peer (UCX: its gets and puts
  // have ended) before the link's operations settle.
  for (const auto &path : paths_) path->reap();
  // Answers that came before the end settle their operations as answered.
  {
    std::lock_guard<std::mutex> lock(answer_mu_);
    read_answers_locked(AnswerHub::Reader::kLink);
    close_answers_locked();
  }
  for (auto &conn : conns_) {
    std::deque<OutFrame> dropped;
    {
      std::lock_guard<std::mutex> lock(conn->mu);
      dropped.swap(conn->queue);
    }
    // What a frame cut short was to run once its bytes were in (a served
    // frame, which holds the link) never runs now: it goes here, with the
    // link's hold on itself.
    next_frame(*conn);
  }
  std::vector<OpenOp> open;
  Status reason;
  std::string ended;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reaped_ = true;
    reason = down_reason_;
    ended = ended_message();
    for (auto &entry : open_) {
      if (entry.second.lookup) {
        entry.second.lookup->status = reason;
        entry.second.lookup->done = true;
      }
      open.push_back(std::move(entry.second));
    }
    open_.clear();
  }
  answered_cv_.notify_all();
  for (OpenOp &op : open) {
    const bool ends_here = op.status == LLM_SUCCESS;
    if (ends_here) op.status = reason;
    op.skipped = op.skipped || !op.sent;
    settle(op, ends_here ? ended : std::string());
  }
}

}  // namespace datadist
