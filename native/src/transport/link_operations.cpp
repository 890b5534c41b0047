// A link's open operations: the peer's answers that settle them, their
// deadlines, and the answer frames this end sends.
#include "transport/link.h"

#include <algorithm>
#include <cstring>

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;
using wire::FrameHeader;
using wire::FrameType;

Link::OutFrame Link::answer(FrameType type, uint64_t op_id, Status status, const std::string &why) {
  OutFrame out;
  if (status != LLM_SUCCESS) {
    const size_t n = std::min<size_t>(why.size(), wire::kMaxReasonBytes);
    out.body.assign(why.begin(), why.begin() + static_cast<std::ptrdiff_t>(n));
  }
  out.header = wire::make_header(type, op_id, static_cast<uint32_t>(out.body.size()), 0, status);
  return out;
}

void Link::mark(uint64_t op_id, bool sent, bool answered, Status status, bool skipped, std::string reason) {
  OpenOp done;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(op_id);
    if (it == open_.end()) return;
    OpenOp &op = it->second;
    op.sent = op.sent || sent;
    op.answered = op.answered || answered;
    op.skipped = op.skipped || skipped;
    if (status != LLM_SUCCESS && op.status == LLM_SUCCESS) {
      op.status = status;
      op.reason = std::move(reason);
    }
    if (!(op.sent && op.answered)) return;
    done = std::move(op);
    open_.erase(it);
    if (done.lookup) {
      done.lookup->status = done.status;
      done.lookup->done = true;
    }
  }
  answered_cv_.notify_all();
  settle(done);
}

void Link::fail_here(uint64_t op_id, Status status, std::string why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(op_id);
  if (it == open_.end() || it->second.status != LLM_SUCCESS) return;
  it->second.status = status;
  it->second.failed_here = std::move(why);
}

void Link::settle(OpenOp &op, const std::string &ended) {
  if (!op.request) return;
  std::string message = ended;
  if (!op.reason.empty()) message = "the peer refused: " + op.reason;
  if (!op.failed_here.empty()) message = op.failed_here;
  op.request->release(op.result_index, op.status, op.skipped, std::move(message));
}

std::string Link::ended_message() const {
  const std::string link = "the link to cluster " + std::to_string(peer_id_);
  return down_why_.empty() ? link + " was closed" : link + " failed: " + down_why_;
}

bool Link::take_answer(const FrameHeader &header, std::vector<uint8_t> &body, Connection *conn) {
  const auto type = static_cast<FrameType>(header.type);
  std::vector<iovec> recv;
  std::shared_ptr<cuda::Device> device;
  DataPath *path = nullptr;  // the one that carried a read whose data come
  bool known = false;
  const char *unknown = "";  // why an answer is refused, for the link's last words
  OpenOp resend;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(header.op_id);
    if (it == open_.end()) {
      // Settled already (a second answer), or never opened here.
      unknown = header.op_id != 0 && header.op_id < next_op_ ? "no such operation open: it was settled already"
                                                              : "no such operation open: none was opened by that id";
    } else if (it->second.answered) {
      unknown = "its operation was answered already";
    } else if (it->second.answer_type != type) {
      unknown = "of another type than its operation takes";
    }
    // A write takes a write ack, a read its data, a question its reply.
    if (it != open_.end() && !it->second.answered && it->second.answer_type == type) {
      OpenOp &op = it->second;
      known = true;
      if (op.resend && header.status == llm_datadist::LLM_FEATURE_NOT_ENABLED && header.data_len == 0) {
        // The owner could not open this end's exports: the frame goes again
        // inline, staged, and so does every later one on this link.
        resend = std::move(op);
        open_.erase(it);
      } else if (type == FrameType::kReadData) {
        if (header.status == LLM_SUCCESS && header.data_len != op.recv_bytes) {
          known = false;
          unknown = "its data are not the length read";
        }
        if (header.status == LLM_SUCCESS) {
          recv = op.recv;
          device = op.device;
          path = op.path;
        }
      } else if (type == FrameType::kUnlinkAck) {
        known = op.lookup != nullptr && body.empty();
        if (!known) unknown = "a malformed unlink ack";
      } else if (type == FrameType::kLookupReply) {
        if (!op.lookup || body.size() != sizeof(wire::LookupReply)) {
          known = false;
          unknown = "a malformed lookup reply";
        } else if (header.status == LLM_SUCCESS) {
          std::memcpy(&op.lookup->reply, body.data(), sizeof(wire::LookupReply));
        }
      }
    }
  }
  if (known && header.status != LLM_SUCCESS && header.data_len != 0) unknown = "a failure that carries data";
  if (known && !recv.empty() && conn == nullptr) unknown = "data outside a connection";
  if (*unknown != '\0') {
    fail(LLM_LINK_FAILED, "unexpected answer from the peer (frame type " + std::to_string(header.type) + " for op " +
                              std::to_string(header.op_id) + ": " + unknown + "); closing the link");
    return false;
  }
  if (resend.resend) {
    // The owner cannot serve the frame as its path carried it: the path
    // hears why, and the frame goes again inline. The operation's hold on
    // its request passes to the frame sent again.
    resend.path->refused(std::string(
        body.begin(), body.begin() + static_cast<std::ptrdiff_t>(std::min<size_t>(body.size(), wire::kMaxReasonBytes))));
    send_planned(resend.write, *resend.resend, resend.request, resend.result_index, resend.deadline, resend.pin,
                 resend.device, false);
    return true;
  }
  // An answer means the peer took the whole frame: the op counts as sent
  // too, though its sender may not have marked it yet (a direct send's
  // syscall can still be returning when the answer, and a close, arrive).
  std::string reason;
  if (header.status != LLM_SUCCESS && type != FrameType::kLookupReply) {
    reason.assign(body.begin(), body.begin() + static_cast<std::ptrdiff_t>(std::min<size_t>(body.size(), wire::kMaxReasonBytes)));
  }
  const uint64_t op_id = header.op_id;
  const Status status = header.status;
  if (recv.empty()) {
    mark(op_id, true, true, status, false, std::move(reason));
    return true;
  }
  // The data read come next on the connection, taken by the path that
  // carried the read; the op settles once they are in.
  ConnectionData data(*this, *conn);
  path->take_data(data, std::move(recv), std::move(device), header.data_len, [this, op_id, status](std::string failed) {
    if (!failed.empty()) fail_here(op_id, llm_datadist::LLM_FAILED, std::move(failed));
    mark(op_id, true, true, status);
    return true;
  });
  return true;
}

bool Link::overdue(Clock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto &entry : open_) {
    if (entry.second.deadline <= now) return true;
  }
  return false;
}

bool Link::handshake_overdue(Clock::time_point now) const {
  if (now < handshake_deadline_) return false;
  for (const auto &conn : conns_) {
    std::lock_guard<std::mutex> lock(conn->mu);
    if (!conn->secured) return true;
  }
  return false;
}

Clock::time_point Link::next_deadline() const {
  Clock::time_point next = Clock::time_point::max();
  if (handshake_deadline_ != Clock::time_point::max() && handshake_overdue(Clock::time_point::max())) {
    next = handshake_deadline_;
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto &entry : open_) next = std::min(next, entry.second.deadline);
  return next;
}

size_t Link::open_operations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_.size();
}

}  // namespace datadist
