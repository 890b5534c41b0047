// A link's answer socket: answers without data go there when it takes them,
// and are read by the thread that waits for them (answer_hub.h).
#include "transport/link.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using wire::FrameHeader;
using wire::FrameType;

void Link::send_answer(Connection &conn, OutFrame frame) {
  const size_t length = sizeof(frame.header) + frame.body.size();
  if (answer_fd_ >= 0 && frame.data.empty() && frame.header.data_len == 0 && !frame.close_after &&
      frame.body.size() <= wire::kMaxReasonBytes) {
    uint8_t message[sizeof(FrameHeader) + wire::kMaxReasonBytes];
    std::memcpy(message, &frame.header, sizeof(frame.header));
    if (!frame.body.empty()) std::memcpy(message + sizeof(frame.header), frame.body.data(), frame.body.size());
    ssize_t n;
    do {
      n = ::send(answer_fd_, message, length, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n == static_cast<ssize_t>(length)) return;
    // Full (the peer's reader lags) or closed: the connection carries it.
  }
  enqueue(conn, std::move(frame));
}

void Link::read_answers(AnswerHub::Reader by) {
  std::lock_guard<std::mutex> lock(answer_mu_);
  read_answers_locked(by);
}

void Link::read_answers_locked(AnswerHub::Reader by) {
  alignas(FrameHeader) uint8_t message[sizeof(FrameHeader) + wire::kMaxReasonBytes];
  while (answer_id_ != 0) {
    const ssize_t n = ::recv(answer_fd_, message, sizeof(message), MSG_DONTWAIT | MSG_TRUNC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {
      close_answers_locked();  // the peer closed its end (or an error): nothing more comes here
      break;
    }
    const auto length = static_cast<size_t>(n);
    FrameHeader header{};
    std::string problem;
    if (length < sizeof(header) || length > sizeof(message)) {
      problem = "an answer of " + std::to_string(length) + " bytes";
    } else {
      std::memcpy(&header, message, sizeof(header));
      problem = wire::check_header(header);
      const auto type = static_cast<FrameType>(header.type);
      if (problem.empty() && type != FrameType::kWriteAck && type != FrameType::kReadData) {
        problem = "frame type " + std::to_string(header.type) + " on the answer socket";
      } else if (problem.empty() && (header.data_len != 0 || header.body_len != length - sizeof(header))) {
        problem = "an answer whose lengths do not match its message";
      }
    }
    if (!problem.empty()) {
      fail(LLM_LINK_FAILED, "malformed answer from the peer (" + problem + "); closing the link");
      close_answers_locked();
      break;
    }
    std::vector<uint8_t> body(message + sizeof(header), message + length);
    host_->answer_hub()->count(by, 1);  // before it completes anything a caller may look at
    if (!take_answer(header, body, nullptr)) {
      close_answers_locked();
      break;
    }
  }
}

void Link::close_answers_locked() {
  if (answer_id_ == 0) return;
  host_->answer_hub()->remove(answer_id_, answer_fd_);
  answer_id_ = 0;
  ::shutdown(answer_fd_, SHUT_RDWR);
}

}  // namespace datadist
