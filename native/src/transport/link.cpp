#include "transport/link.h"

#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <system_error>

#include "log.h"
#include "thread_name.h"
#include "transport/frame_planner.h"
#include "transport/socket_util.h"

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;
using llm_datadist::LLM_TIMEOUT;
using wire::FrameHeader;
using wire::FrameType;

Link::Link(uint64_t peer_id, uint32_t peer_role, bool initiated_here, std::vector<int> fds, LinkHost *host,
           std::vector<std::shared_ptr<DataPath>> paths, int answers,
           std::vector<std::unique_ptr<tls::Session>> sessions)
    : peer_id_(peer_id),
      peer_role_(peer_role),
      initiated_here_(initiated_here),
      host_(host),
      paths_(std::move(paths)),
      answer_fd_(answers) {
  for (size_t i = 0; i < fds.size(); ++i) {
    conns_.push_back(std::make_unique<Connection>(fds[i], i < sessions.size() ? std::move(sessions[i]) : nullptr));
  }
}

Link::~Link() {
  for (auto &conn : conns_) {
    if (conn->fd >= 0) ::close(conn->fd);
  }
  if (answer_fd_ >= 0) ::close(answer_fd_);
}

const char *Link::transport() const {
  for (const auto &path : paths_) {
    if (path->active()) return path->name();
  }
  return "tcp";
}

bool Link::device_frames_by_reference() const {
  for (const auto &path : paths_) {
    const int says = path->device_by_reference();
    if (says >= 0) return says == 1;
  }
  return false;
}

uint64_t Link::device_frame_bytes() const {
  for (const auto &path : paths_) {
    const int says = path->device_by_reference();
    if (says >= 0) return says == 1 ? path->device_frame_bytes() : wire::kMaxFrameData;
  }
  return wire::kMaxFrameData;
}

bool Link::peer_closed() const {
  for (const auto &conn : conns_) {
    if (conn->fd >= 0 && net::peer_closed(conn->fd)) return true;
  }
  return false;
}

size_t Link::local_socket_count() const {
  size_t count = 0;
  for (const auto &conn : conns_) {
    int domain = 0;
    socklen_t len = sizeof(domain);
    if (::getsockopt(conn->fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && domain == AF_UNIX) ++count;
  }
  return count;
}

Link::Security Link::security() const {
  Security out;
  for (const auto &conn : conns_) {
    if (!conn->tls) continue;
    ++out.encrypted;
    if (out.cipher.empty()) out.cipher = conn->tls->cipher();
    if (conn->tls->ktls_send() && conn->tls->ktls_recv()) ++out.ktls;
  }
  return out;
}

ssize_t Link::send_now(Connection &conn, const iovec *iov, size_t count) {
  return conn.tls ? conn.tls->write_now(iov, count) : net::writev_now(conn.fd, iov, count);
}

bool Link::send_all(Connection &conn, iovec *iov, size_t count) {
  return conn.tls ? conn.tls->write_all(iov, count) : net::writev_full(conn.fd, iov, count);
}

std::string Link::input_end(const Connection &conn, const char *otherwise) {
  if (conn.tls) {
    const std::string why = conn.tls->error();
    if (!why.empty()) {
      return "TLS on the connection failed (" + why + "): the stream was altered or broken; closing the link";
    }
  }
  return otherwise;
}

bool Link::secure(Connection &conn) {
  const tls::Session::Step step = conn.tls->handshake();
  if (step != tls::Session::Step::kFailed) {
    std::lock_guard<std::mutex> lock(conn.mu);
    conn.secured = step == tls::Session::Step::kDone;
    conn.handshake_writes = step == tls::Session::Step::kWantWrite;
    return true;
  }
  fail(LLM_LINK_FAILED, "the TLS handshake with the peer failed (" + conn.tls->error() + "); closing the link");
  return false;
}

bool Link::has_answer_socket() const {
  std::lock_guard<std::mutex> lock(answer_mu_);
  return answer_id_ != 0;
}

bool Link::start() {
  if (!start_connections()) return false;
  for (const auto &path : paths_) path->running();
  return true;
}

std::function<void(std::vector<uint8_t> body)> Link::messenger() {
  std::weak_ptr<Link> weak = weak_from_this();
  return [weak](std::vector<uint8_t> body) {
    auto link = weak.lock();
    if (!link || link->is_down() || link->closing_.load(std::memory_order_acquire)) return;
    OutFrame out;
    out.header = wire::make_header(FrameType::kPathMessage, 0, static_cast<uint32_t>(body.size()), 0);
    out.body = std::move(body);
    // One connection, so that the peer reads them in the order sent.
    link->enqueue(*link->conns_[0], std::move(out));
  };
}

void Link::refuse_moved(uint64_t group) {
  std::lock_guard<std::mutex> lock(mu_);
  moved_refused_.add(group);
}

bool Link::moved_refused(uint64_t group) const {
  std::lock_guard<std::mutex> lock(mu_);
  return moved_refused_.has(group);
}

bool Link::start_connections() {
  auto self = shared_from_this();
  // Under the lock, so reap() finds the connections in the loop or never there.
  std::lock_guard<std::mutex> lock(mu_);
  if (reaping_ || is_down()) return false;
  if (answer_fd_ >= 0) {
    // Before any operation, so no answer can come before the hub watches.
    AnswerHub *hub = host_->answer_hub();
    std::lock_guard<std::mutex> answers(answer_mu_);
    answer_id_ = hub != nullptr ? hub->add(answer_fd_, std::weak_ptr<AnswerReader>(self)) : 0;
    // Unwatched: the peer's sends fail from now on, and it answers on the connections.
    if (answer_id_ == 0) ::shutdown(answer_fd_, SHUT_RDWR);
  }
  std::weak_ptr<Link> weak = self;
  for (const auto &path : paths_) {
    path->start(*this, [weak](const std::string &why) {
      if (auto link = weak.lock()) link->fail(llm_datadist::LLM_LINK_FAILED, why);
    });
    FrameType type;
    if (path->first_frame(type)) {
      // Before any thread runs, so it is the first frame the peer reads.
      OutFrame first;
      first.header = wire::make_header(type, 0, 0, 0);
      conns_[0]->queue.push_back(std::move(first));
    }
  }
  IoLoop &loop = host_->io_loop();
  for (size_t i = 0; i < conns_.size(); ++i) {
    Connection &conn = *conns_[i];
    next_frame(conn);
    conn.io_id = loop.add(conn.fd, std::weak_ptr<IoHandler>(self), i);
    if (conn.io_id == 0) return false;
    std::lock_guard<std::mutex> armed(conn.mu);
    arm_locked(conn);
  }
  return true;
}

Link::Connection &Link::next_connection() {
  return *conns_[next_conn_.fetch_add(1, std::memory_order_relaxed) % conns_.size()];
}

namespace {

// Frames this small may be sent by the thread that makes them.
constexpr size_t kDirectBytes = 64 * 1024;

}  // namespace

std::vector<iovec> Link::frame_bytes(OutFrame &frame) {
  std::vector<iovec> iov;
  iov.reserve(2 + frame.data.size());
  iov.push_back({&frame.header, sizeof(frame.header)});
  if (!frame.body.empty()) iov.push_back({frame.body.data(), frame.body.size()});
  iov.insert(iov.end(), frame.data.begin(), frame.data.end());
  return iov;
}

void Link::enqueue(Connection &conn, OutFrame frame) {
  const size_t total = sizeof(frame.header) + frame.body.size() + frame.header.data_len;
  std::unique_lock<std::mutex> lock(conn.mu);
  if (total > kDirectBytes || frame.close_after || frame.device || conn.busy || !conn.queue.empty() || is_down() ||
      !conn.secured) {
    conn.queue.push_back(std::move(frame));
    if (!conn.busy) arm_locked(conn);  // else the thread writing goes on to it
    return;
  }
  conn.busy = true;
  lock.unlock();
  std::vector<iovec> iov = frame_bytes(frame);
  const ssize_t n = send_now(conn, iov.data(), iov.size());
  if (n >= 0 && static_cast<size_t>(n) < total) {
    // The socket is full: the loop sends the rest, ahead of anything queued since.
    frame.sent = static_cast<size_t>(n);
    lock.lock();
    conn.queue.push_front(std::move(frame));
    conn.busy = false;
    arm_locked(conn);
    return;
  }
  after_send(frame, n >= 0);
  lock.lock();
  conn.busy = false;
  if (!conn.queue.empty()) arm_locked(conn);
}

void Link::arm_locked(Connection &conn) {
  if (conn.running || is_down()) return;
  uint32_t want = 0;
  if (!conn.away) want |= EPOLLIN | EPOLLRDHUP;
  if (!conn.secured) {
    // The handshake first: queued frames wait for it.
    if (conn.handshake_writes) want |= EPOLLOUT;
  } else if (!conn.busy && !conn.queue.empty()) {
    want |= EPOLLOUT;
  }
  // Nothing wanted: left as it is (disarmed since it fired, or about to be).
  if (want == 0 || want == conn.armed) return;
  conn.armed = want;
  if (!host_->io_loop().arm(conn.io_id, want)) {
    conn.armed = 0;
    // Not from here, under this connection's lock: fail() tells the host,
    // which takes locks of its own.
    std::weak_ptr<Link> weak = weak_from_this();
    host_->io_loop().run_blocking([weak] {
      if (auto self = weak.lock()) self->fail(LLM_LINK_FAILED, "the I/O loop refused a connection");
    });
  }
}

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

void Link::on_ready(uint64_t tag, uint32_t events) {
  if (tag >= conns_.size() || !begin_work()) return;
  Connection &conn = *conns_[tag];
  bool input;
  bool taken;
  {
    std::lock_guard<std::mutex> lock(conn.mu);
    conn.armed = 0;  // it fired: disarmed
    // Another I/O thread may still run the handler: this event was armed by
    // a thread off the loop (a blocking receive's end, a frame queued)
    // before that one had let the connection go. Two threads must never
    // read one connection's frames at once: the running one arms it again
    // at its end (armed is 0 now), and what this event saw fires again then.
    taken = conn.running;
    conn.running = true;
    input = !conn.away;
  }
  if (taken) {
    end_work();
    return;
  }
  bool secured;
  {
    std::lock_guard<std::mutex> lock(conn.mu);
    secured = conn.secured;
  }
  if (!secured) {
    const bool ok = secure(conn);
    std::unique_lock<std::mutex> lock(conn.mu);
    if (!ok || !conn.secured) {
      conn.running = false;
      if (ok) arm_locked(conn);  // the handshake's next step; a failed one is not watched again
      lock.unlock();
      end_work();
      return;
    }
    // Frames that came with the handshake's last message may wait inside the session.
    events |= EPOLLIN;
  }
  if (input && (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) != 0) read_input(conn);
  write_queued(conn);
  {
    std::lock_guard<std::mutex> lock(conn.mu);
    conn.running = false;
    arm_locked(conn);
  }
  end_work();
}

void Link::next_frame(Connection &conn) {
  conn.stage = Stage::kHeader;
  conn.part = {&conn.header, sizeof(conn.header)};
  conn.data.clear();
  conn.drop = 0;
  conn.then = nullptr;
  conn.receive = nullptr;
}

void Link::expect_data(Connection &conn, std::vector<iovec> to, uint64_t drop, std::function<bool()> then) {
  conn.data = std::move(to);
  conn.drop = drop;
  conn.then = std::move(then);
}

Link::InputEnd Link::read_input(Connection &conn) {
  using Got = net::Reader::Got;
  bool handled = false;  // a frame was handled in this call
  for (;;) {
    if (is_down()) return InputEnd::kStop;
    // Between frames with nothing buffered, no read is tried that would
    // most often find nothing: the socket, armed again, says when more came.
    if (handled && conn.stage == Stage::kHeader && conn.part.iov_len == sizeof(conn.header) && !conn.in.buffered()) {
      return InputEnd::kWait;
    }
    if (conn.stage != Stage::kData) {
      const Got got = conn.in.readv_now(&conn.part, 1);
      if (got == Got::kAgain) return InputEnd::kWait;
      if (got == Got::kEnd) {
        if (conn.stage == Stage::kBody) {
          fail(LLM_LINK_FAILED, input_end(conn, "connection closed by the peer"));
          return InputEnd::kStop;
        }
        if (conn.tls && !conn.tls->error().empty()) {
          fail(LLM_LINK_FAILED, input_end(conn, ""));
          return InputEnd::kStop;
        }
        // Between frames with nothing open (or while unlinking) this is an
        // ordinary unlink or exit.
        read_answers(AnswerHub::Reader::kLink);  // answers that came before the close count
        if (closing_.load(std::memory_order_acquire)) unlink_answered();
        const bool expected = closing_.load(std::memory_order_acquire) || open_operations() == 0;
        fail(LLM_LINK_FAILED, expected ? "" : "connection lost with operations in flight");
        return InputEnd::kStop;
      }
      if (conn.stage == Stage::kHeader) {
        const std::string problem = wire::check_header(conn.header);
        if (!problem.empty()) {
          fail(LLM_LINK_FAILED, "malformed frame from the peer (" + problem + "); closing the link");
          return InputEnd::kStop;
        }
        conn.body.assign(conn.header.body_len, 0);
        if (!conn.body.empty()) {
          conn.stage = Stage::kBody;
          conn.part = {conn.body.data(), conn.body.size()};
          continue;
        }
      }
      // The frame's header and body are in: it may want its data next, or
      // hand them to the blocking pool.
      const FrameHeader header = conn.header;
      if (!handle_frame(conn, header, conn.body)) return InputEnd::kStop;
      handled = true;
      if (conn.receive) {
        std::function<bool()> receive = std::move(conn.receive);
        next_frame(conn);
        receive_away(conn, std::move(receive));
        return InputEnd::kAway;
      }
      if (conn.data.empty() && conn.drop == 0 && !conn.then) {
        next_frame(conn);
      } else {
        conn.stage = Stage::kData;
      }
      continue;
    }
    Got got = conn.data.empty() ? Got::kDone : conn.in.readv_now(conn.data.data(), conn.data.size());
    if (got == Got::kDone) {
      conn.data.clear();
      got = conn.in.discard_now(conn.drop);
    }
    if (got == Got::kAgain) return InputEnd::kWait;
    if (got == Got::kEnd) {
      fail(LLM_LINK_FAILED, input_end(conn, "connection closed by the peer"));
      return InputEnd::kStop;
    }
    std::function<bool()> then = std::move(conn.then);
    next_frame(conn);
    if (then && !then()) return InputEnd::kStop;
  }
}

void Link::hand_off(Connection &conn, std::function<bool()> receive) { conn.receive = std::move(receive); }

void Link::receive_away(Connection &conn, std::function<bool()> receive) {
  {
    std::lock_guard<std::mutex> lock(conn.mu);
    conn.away = true;
  }
  if (!begin_work()) return;  // being reaped: nothing more is read
  auto self = shared_from_this();
  Connection *c = &conn;
  const bool posted = host_->io_loop().run_blocking([self, c, receive = std::move(receive)] {
    if (receive() && self->read_input(*c) != InputEnd::kAway) {
      std::lock_guard<std::mutex> lock(c->mu);
      c->away = false;
      self->arm_locked(*c);
    }
    self->end_work();
  });
  if (!posted) {
    end_work();
    fail(LLM_LINK_FAILED, "no thread can receive into device memory");
  }
}

bool Link::cancelled_before_send(const OutFrame &frame) {
  if (frame.op_id == 0 || frame.sent != 0) return false;
  std::shared_ptr<Request> request;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = open_.find(frame.op_id);
    if (it != open_.end()) request = it->second.request;
  }
  if (!request || !request->cancel_requested()) return false;
  mark(frame.op_id, true, true, request->cancel_reason(), true);
  return true;
}

namespace {

// What one turn of an I/O thread writes to a connection before it lets
// the loop serve other connections.
constexpr size_t kBytesPerTurn = 4 << 20;

}  // namespace

void Link::write_queued(Connection &conn) {
  size_t written = 0;
  for (;;) {
    OutFrame frame;
    {
      std::lock_guard<std::mutex> lock(conn.mu);
      if (is_down() || conn.busy || conn.queue.empty() || !conn.secured) return;  // what is left is settled by reap()
      if (written >= kBytesPerTurn) {
        arm_locked(conn);
        return;
      }
      frame = std::move(conn.queue.front());
      conn.queue.pop_front();
      conn.busy = true;
    }
    if (cancelled_before_send(frame)) {
      std::lock_guard<std::mutex> lock(conn.mu);
      conn.busy = false;
      continue;
    }
    if (frame.device) {
      // Device copies and the sends between them may block: the blocking
      // pool sends the frame, the connection staying busy meanwhile.
      if (!begin_work()) return;
      auto self = shared_from_this();
      auto shared = std::make_shared<OutFrame>(std::move(frame));
      Connection *c = &conn;
      if (!host_->io_loop().run_blocking([self, c, shared] { self->write_staged(*c, std::move(*shared)); })) {
        end_work();
        fail(LLM_LINK_FAILED, "no thread can send device memory");
      }
      return;
    }
    const size_t total = sizeof(frame.header) + frame.body.size() + frame.header.data_len;
    std::vector<iovec> iov = frame_bytes(frame);
    net::drop_front(iov, frame.sent);
    ssize_t n = 0;
    while (frame.sent < total) {
      n = send_now(conn, iov.data(), iov.size());
      if (n <= 0) break;
      frame.sent += static_cast<size_t>(n);
      written += static_cast<size_t>(n);
      net::drop_front(iov, static_cast<size_t>(n));
    }
    if (frame.sent < total && n == 0) {
      // The socket is full: the rest goes when it is writable again.
      std::lock_guard<std::mutex> lock(conn.mu);
      conn.queue.push_front(std::move(frame));
      conn.busy = false;
      arm_locked(conn);
      return;
    }
    const bool go_on = after_send(frame, frame.sent == total);
    std::lock_guard<std::mutex> lock(conn.mu);
    conn.busy = false;
    if (!go_on) return;
  }
}

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

void Link::submit(bool write, std::vector<PlannedFrame> frames, const std::shared_ptr<Request> &request,
                  size_t result_index, Clock::time_point deadline, std::shared_ptr<const void> pin,
                  std::shared_ptr<cuda::Device> device) {
  for (PlannedFrame &planned : frames) {
    request->hold();
    send_planned(write, planned, request, result_index, deadline, pin, device, true);
  }
}

void Link::send_planned(bool write, PlannedFrame &planned, const std::shared_ptr<Request> &request,
                        size_t result_index, Clock::time_point deadline, const std::shared_ptr<const void> &pin,
                        const std::shared_ptr<cuda::Device> &device, bool exports_ok) {
  const uint64_t group = planned.target.group;
  if (exports_ok && !paths_.empty()) {
    // An ordered transfer a path refused here (moving bytes itself) is
    // refused whole, as its owner refuses one it refused.
    if (moved_refused(group)) {
      request->release(result_index, llm_datadist::LLM_FAILED, false,
                       "an earlier request of the same ordered transfer (an earlier layer) was refused");
      return;
    }
    // A path that moves the frame's bytes itself (one-sided) takes it first;
    // the link's reap waits for it as for its own threads.
    if (!request->cancel_requested() && begin_work()) {
      auto self = shared_from_this();
      Settle settle = [self, request, result_index, group, pin](Status status, std::string why) {
        if (status != LLM_SUCCESS) self->refuse_moved(group);
        request->release(result_index, status, false, std::move(why));
        self->end_work();
      };
      for (const auto &path : paths_) {
        if (path->move(write, planned, device.get(), settle)) return;
      }
      end_work();
    }
  }
  OutFrame out;
  uint64_t data_len = 0;
  for (const iovec &v : planned.local) data_len += v.iov_len;
  // The link's paths in order; the first that carries the frame takes it,
  // inline on the connections what none carries. A frame whose segment
  // table would not fit a body goes inline.
  size_t body_bytes = sizeof(wire::Target) + planned.ranges.size() * (sizeof(wire::Range) + sizeof(wire::Segment)) +
                      planned.strides.size() * sizeof(wire::Stride) + planned.bounds.size() * sizeof(wire::Range);
  Carried carried;
  DataPath *by = nullptr;
  for (const auto &path : paths_) {
    const Carry carry = path->carry(planned, device.get(), exports_ok, body_bytes, carried);
    if (carry == Carry::kCarries) by = path.get();
    if (carry != Carry::kNext) break;
    carried = Carried{};
  }
  if (by == nullptr) carried = Carried{};
  const bool same_host = by != nullptr;  // the frame names this end's memory
  // A device frame planned to name exports, which may name more than a
  // frame carries, goes inline after all: as pieces the wire carries, each
  // an operation's frame of its own with its own hold on the request.
  if (!same_host && data_len > wire::kMaxFrameData) {
    std::vector<PlannedFrame> pieces = FramePlanner::split(planned, wire::kMaxFrameData);
    request->hold(pieces.size() - 1);
    for (PlannedFrame &piece : pieces) send_planned(write, piece, request, result_index, deadline, pin, device, false);
    return;
  }
  if (device && !same_host) staged_frames_.fetch_add(1, std::memory_order_relaxed);
  std::shared_ptr<PlannedFrame> resend;
  if (carried.may_resend) resend = std::make_shared<PlannedFrame>(planned);
  planned.target.flags |= carried.flags;
  std::vector<wire::Segment> segments;
  if (same_host) {
    // One segment per range: where its first byte goes (or comes from).
    segments.reserve(planned.ranges.size());
    size_t element = 0;
    for (size_t i = 0; i < planned.ranges.size(); ++i) {
      const iovec &v = planned.local[element];
      segments.push_back({reinterpret_cast<uintptr_t>(v.iov_base), v.iov_len});
      element += planned.strides.empty() ? 1 : planned.strides[i].count;
    }
  } else {
    for (wire::Stride &s : planned.strides) s.segment_stride = 0;
  }
  out.body =
      wire::encode_request(planned.target, planned.ranges, planned.bounds, segments, planned.strides, carried.exports);
  out.body.insert(out.body.end(), carried.trailer.begin(), carried.trailer.end());
  const FrameType type = same_host ? (write ? FrameType::kWriteFrom : FrameType::kReadInto)
                                   : (write ? FrameType::kWrite : FrameType::kRead);
  out.header = wire::make_header(type, 0, static_cast<uint32_t>(out.body.size()), write && !same_host ? data_len : 0);
  out.pin = pin;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reaped_) {
      request->release(result_index, down_reason_, true, ended_message());
      return;
    }
    out.op_id = next_op_++;
    OpenOp &op = open_[out.op_id];
    op.answer_type = write ? FrameType::kWriteAck : FrameType::kReadData;
    op.request = request;
    op.result_index = result_index;
    op.deadline = deadline;
    op.pin = pin;
    op.write = write;
    op.resend = std::move(resend);
    if (op.resend) {
      op.device = device;
      op.path = by;
    }
    if (!write && !same_host) {
      op.recv = std::move(planned.local);
      op.recv_bytes = data_len;
      op.device = device;
    }
  }
  out.header.op_id = out.op_id;
  host_->deadline_at(deadline);
  if (write && !same_host) {
    out.data = std::move(planned.local);
    out.device = device;
  }
  framed_ops_.fetch_add(1, std::memory_order_relaxed);
  framed_bytes_.fetch_add(data_len, std::memory_order_relaxed);
  enqueue(group != 0 ? *conns_[group % conns_.size()] : next_connection(), std::move(out));
}

std::shared_ptr<Link::LookupState> Link::send_question(FrameType type, const std::vector<uint8_t> &body,
                                                      Clock::time_point deadline) {
  auto state = std::make_shared<LookupState>();
  OutFrame out;
  out.body = body;
  out.header = wire::make_header(type, 0, static_cast<uint32_t>(out.body.size()), 0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (reaped_ || is_down()) {
      state->status = down_reason_;
      state->done = true;
      return state;
    }
    out.op_id = next_op_++;
    OpenOp &op = open_[out.op_id];
    op.deadline = deadline;
    op.lookup = state;
    op.answer_type = type == FrameType::kLookup ? FrameType::kLookupReply : FrameType::kUnlinkAck;
  }
  out.header.op_id = out.op_id;
  host_->deadline_at(deadline);
  enqueue(next_connection(), std::move(out));
  return state;
}

bool Link::probe(Clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (is_down() || (probe_ && !probe_->done)) return false;
  }
  // A cache id no registry hands out: the owner answers "not found".
  wire::Target target{};
  target.kind = wire::kById;
  target.cache_id = -1;
  auto state = send_question(FrameType::kLookup, wire::encode_request(target, {}), deadline);
  std::lock_guard<std::mutex> lock(mu_);
  probe_ = state;
  return !state->done;
}

Status Link::ask(FrameType type, const std::vector<uint8_t> &body, int timeout_ms, wire::LookupReply *reply) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto state = send_question(type, body, deadline);
  std::unique_lock<std::mutex> lock(mu_);
  if (!answered_cv_.wait_until(lock, deadline, [&] { return state->done; })) return LLM_TIMEOUT;
  if (reply != nullptr) *reply = state->reply;
  return state->status;
}

Status Link::lookup(const wire::Target &target, wire::LookupReply &reply, int timeout_ms) {
  return ask(FrameType::kLookup, wire::encode_request(target, {}), timeout_ms, &reply);
}

Status Link::request_unlink(int timeout_ms) {
  closing_.store(true, std::memory_order_release);
  return ask(FrameType::kUnlink, {}, timeout_ms, nullptr);
}

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

void Link::unlink_answered() {
  std::vector<uint64_t> asked;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto &entry : open_) {
      if (entry.second.lookup && entry.second.answer_type == FrameType::kUnlinkAck) asked.push_back(entry.first);
    }
  }
  for (uint64_t op_id : asked) mark(op_id, true, true, LLM_SUCCESS);
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

bool Link::after_send(OutFrame &frame, bool ok) {
  // Sent or not, the sender is done with the frame's memory; an operation
  // left unanswered gets the reason the link went down when it is reaped.
  if (frame.op_id != 0) mark(frame.op_id, true, false, LLM_SUCCESS);
  if (!ok) {
    // While this end unlinks, the peer closes once it has dropped its end:
    // a frame that meets the close (a path's message) answers the question
    // as the close itself does.
    if (closing_.load(std::memory_order_acquire)) {
      unlink_answered();
      fail(LLM_LINK_FAILED, "");
      return false;
    }
    fail(LLM_LINK_FAILED, "send to peer failed: " + net::errno_text());
    return false;
  }
  if (frame.close_after) {
    fail(LLM_LINK_FAILED, "");
    return false;
  }
  return true;
}

bool Link::handle_frame(Connection &conn, const FrameHeader &header, std::vector<uint8_t> &body) {
  const auto type = static_cast<FrameType>(header.type);
  switch (type) {
    case FrameType::kWrite:
    case FrameType::kRead:
    case FrameType::kLookup: {
      wire::Request req;
      std::string problem = wire::decode_request(body, req);
      if (problem.empty() && type == FrameType::kWrite && header.data_len != req.total_bytes) {
        problem = "data length does not match the ranges";
      }
      if (!problem.empty()) {
        fail(LLM_LINK_FAILED, "malformed request from the peer (" + problem + "); closing the link");
        return false;
      }
      if (type == FrameType::kWrite) {
        serve_write(conn, header, req);
      } else if (type == FrameType::kRead) {
        serve_read(conn, header, req);
      } else {
        serve_lookup(conn, header, req);
      }
      return !is_down();
    }
    case FrameType::kWriteFrom:
    case FrameType::kReadInto: {
      wire::Request req;
      std::string problem = wire::decode_request(body, req, true);
      std::shared_ptr<DataPath> path;
      if (problem.empty()) path = path_serving(req);
      if (problem.empty() && !path) {
        problem = (req.target.flags & wire::kUcxSegments) != 0
                      ? "UCX frame on a link without UCX"
                      : "same-host frame, but this end cannot reach the peer's memory";
      }
      if (!problem.empty()) {
        fail(LLM_LINK_FAILED, "malformed request from the peer (" + problem + "); closing the link");
        return false;
      }
      serve_by_path(conn, header, std::move(req), type == FrameType::kWriteFrom, path);
      return !is_down();
    }
    case FrameType::kPeerCopies:
    case FrameType::kPathMessage: {
      bool ok = false;
      for (const auto &path : paths_) {
        if (path->takes(type, body, ok)) break;
      }
      if (!ok) {
        fail(LLM_LINK_FAILED, type == FrameType::kPeerCopies
                                  ? "unexpected same-host announcement from the peer; closing the link"
                                  : "a path message from the peer that no path of the link takes; closing the link");
        return false;
      }
      return true;
    }
    case FrameType::kWriteAck:
    case FrameType::kReadData:
    case FrameType::kLookupReply:
    case FrameType::kUnlinkAck:
      return take_answer(header, body, &conn);
    case FrameType::kUnlink: {
      // Forget the link first, so the peer's unlink returns with both ends gone.
      host_->detach(shared_from_this());
      OutFrame ack;
      ack.header = wire::make_header(FrameType::kUnlinkAck, header.op_id, 0, 0);
      ack.close_after = true;
      enqueue(conn, std::move(ack));
      return true;
    }
    default:
      fail(LLM_LINK_FAILED, "unexpected frame type " + std::to_string(header.type) + "; closing the link");
      return false;
  }
}

Status Link::resolve_in_group(const wire::Request &req, ResolvedTarget &target) {
  served_ops_.fetch_add(1, std::memory_order_relaxed);
  served_bytes_.fetch_add(req.total_bytes, std::memory_order_relaxed);
  const uint64_t group = req.target.group;
  if (group != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (refused_groups_.has(group)) {
      target.why = "an earlier request of the same ordered transfer (an earlier layer) was refused";
      return llm_datadist::LLM_FAILED;
    }
  }
  Status st = resolve_request(host_->registry(), req, target);
  if (st != LLM_SUCCESS) refuse_group(group);
  return st;
}

void Link::refuse_group(uint64_t group) {
  std::lock_guard<std::mutex> lock(mu_);
  refused_groups_.add(group);
}

Status Link::refuse_served(uint64_t group, Status status, std::string &out, std::string why, const char *context) {
  out = std::move(why);
  log_warning("link to cluster " + std::to_string(peer_id_) + ": " + context + out);
  refuse_group(group);
  return status;
}

bool Link::initiator_gone(const Connection &conn) {
  if (!net::peer_closed(conn.fd)) return false;
  fail(LLM_LINK_FAILED, "the peer closed the link before its same-host operation was served");
  return true;
}

size_t Link::refused_group_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_groups_.size();
}

std::shared_ptr<DataPath> Link::path_serving(const wire::Request &req) const {
  for (const auto &path : paths_) {
    if (path->serves(req)) return path;
  }
  return nullptr;
}

void Link::serve_by_path(Connection &conn, const FrameHeader &header, wire::Request req, bool write,
                         const std::shared_ptr<DataPath> &path) {
  auto frame = std::make_shared<ServedFrame>();
  frame->req = std::move(req);
  frame->write = write;
  const Status st = resolve_in_group(frame->req, frame->target);
  if (st != LLM_SUCCESS) {
    send_answer(conn, answer(write ? FrameType::kWriteAck : FrameType::kReadData, header.op_id, st, frame->target.why));
    return;
  }
  if (path->checks_initiator_first() && initiator_gone(conn)) return;
  const bool counted = path->reap_waits();  // else: counted only while answered
  if (counted && !begin_work()) return;  // being reaped: the peer's operation ends with the link
  std::shared_ptr<Link> self = shared_from_this();
  frame->keep = self;
  const uint64_t op_id = header.op_id;
  Connection *c = &conn;
  ServedFrame *served = frame.get();
  frame->done = [self, c, op_id, served, counted](Moved moved) {
    if (!counted && !self->begin_work()) return;  // reaped meanwhile: no answer
    self->end_served(*c, op_id, *served, std::move(moved));
    self->end_work();
  };
  path->serve(std::move(frame));
}

void Link::end_served(Connection &conn, uint64_t op_id, const ServedFrame &frame, Moved moved) {
  if (moved.peer_gone) {
    fail(LLM_LINK_FAILED, "the peer process is gone");
    return;
  }
  Status st = moved.status;
  std::string words;
  if (st != LLM_SUCCESS && moved.again_inline) {
    words = std::move(moved.why);  // not a refusal of the transfer
  } else if (st != LLM_SUCCESS) {
    st = refuse_served(frame.req.target.group, st, words, std::move(moved.why), moved.context);
  } else if (!frame.write) {
    note_read(frame.req);
  }
  send_answer(conn, answer(frame.write ? FrameType::kWriteAck : FrameType::kReadData, op_id, st, words));
}

void Link::path_counters(std::map<std::string, uint64_t> &out) const {
  const auto get = [](const std::atomic<uint64_t> &n) { return n.load(std::memory_order_relaxed); };
  // Inline frames on device memory: initiator side, those sent (staged);
  // owner side, the bytes staged and the waits for a stream.
  // Which way each operation's bytes moved: this end's operations sent as
  // frames (their owner moved the bytes), the peer's this end served as
  // owner; the paths count those they moved themselves (one_sided_*).
  out["framed_ops"] += get(framed_ops_);
  out["framed_bytes"] += get(framed_bytes_);
  out["owner_served_ops"] += get(served_ops_);
  out["owner_served_bytes"] += get(served_bytes_);
  out["staged_frames"] += get(staged_frames_);
  out["staged_bytes_served"] += get(staged_bytes_served_);
  out["device_stream_waits"] += get(device_stream_waits_);
  for (const auto &path : paths_) path->counters(out);
}

void Link::serve_lookup(Connection &conn, const FrameHeader &header, const wire::Request &req) {
  ResolvedTarget target;
  Status st = find_target(host_->registry(), req.target, target);
  wire::LookupReply reply{};
  if (st == LLM_SUCCESS) {
    const CacheEntry &entry = *target.entry;
    reply.cache_id = entry.id;
    reply.num_tensors = static_cast<uint32_t>(entry.addrs.size());
    reply.remote_accessible = entry.remote_accessible ? 1 : 0;
    reply.slot_size = entry.geometry.slot_size;
    reply.num_slots = entry.geometry.num_slots;
    reply.bound_slot = target.bound_slot;
  }
  OutFrame out;
  out.body.resize(sizeof(reply));
  std::memcpy(out.body.data(), &reply, sizeof(reply));
  out.header = wire::make_header(FrameType::kLookupReply, header.op_id, sizeof(reply), 0, st);
  enqueue(conn, std::move(out));
}

bool Link::take_answer(const FrameHeader &header, std::vector<uint8_t> &body, Connection *conn) {
  const auto type = static_cast<FrameType>(header.type);
  std::vector<iovec> recv;
  std::shared_ptr<cuda::Device> device;
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
  // The data read come next on the connection; the op settles once they are in.
  auto settle_read = [this, op_id, status] {
    mark(op_id, true, true, status);
    return true;
  };
  if (device) {
    const uint64_t bytes = header.data_len;
    Connection *c = conn;
    hand_off(*conn, [this, c, device, recv, bytes, op_id, settle_read] {
      bool io_ok = true;
      std::string why;
      if (!receive_staged(c->in, *device, recv, bytes, false, io_ok, why) && io_ok) {
        fail_here(op_id, llm_datadist::LLM_FAILED, "copying the data read into device memory failed: " + why);
      }
      if (!io_ok) {
        fail(LLM_LINK_FAILED, "connection closed by the peer");
        return false;
      }
      return settle_read();
    });
    return true;
  }
  expect_data(*conn, std::move(recv), 0, settle_read);
  return true;
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
