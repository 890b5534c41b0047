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
#include "transport/socket_util.h"

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;
using llm_datadist::LLM_TIMEOUT;
using wire::FrameHeader;
using wire::FrameType;

Link::Link(uint64_t peer_id, uint32_t peer_role, bool initiated_here, std::vector<int> fds, LinkHost *host,
           LinkPaths paths)
    : peer_id_(peer_id),
      peer_role_(peer_role),
      initiated_here_(initiated_here),
      host_(host),
      offered_same_host_(paths.offered),
      announce_copies_(paths.announce && paths.peer_memory != nullptr),
      peer_copies_(paths.offered && paths.peer_copies),
      peer_memory_(std::move(paths.peer_memory)),
      answer_fd_(paths.answers),
      peer_opens_device_(paths.peer_opens_device),
      peer_takes_fds_(paths.peer_opens_device && paths.peer_takes_fds),
      ucx_(std::move(paths.ucx)) {
  for (int fd : fds) conns_.push_back(std::make_unique<Connection>(fd));
}

Link::~Link() {
  for (auto &conn : conns_) {
    if (conn->fd >= 0) ::close(conn->fd);
  }
  if (answer_fd_ >= 0) ::close(answer_fd_);
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

bool Link::has_answer_socket() const {
  std::lock_guard<std::mutex> lock(answer_mu_);
  return answer_id_ != 0;
}

bool Link::start() {
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
  if (announce_copies_) {
    // Before any thread runs, so it is the first frame the peer reads.
    OutFrame hello;
    hello.header = wire::make_header(FrameType::kPeerCopies, 0, 0, 0);
    conns_[0]->queue.push_back(std::move(hello));
  }
  if (ucx_) {
    std::weak_ptr<Link> weak = self;
    ucx_->on_error([weak](const std::string &why) {
      if (auto link = weak.lock()) link->fail(llm_datadist::LLM_LINK_FAILED, why);
    });
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
  if (total > kDirectBytes || frame.close_after || frame.device || conn.busy || !conn.queue.empty() || is_down()) {
    conn.queue.push_back(std::move(frame));
    if (!conn.busy) arm_locked(conn);  // else the thread writing goes on to it
    return;
  }
  conn.busy = true;
  lock.unlock();
  std::vector<iovec> iov = frame_bytes(frame);
  const ssize_t n = net::writev_now(conn.fd, iov.data(), iov.size());
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
  if (!conn.busy && !conn.queue.empty()) want |= EPOLLOUT;
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
  {
    std::lock_guard<std::mutex> lock(conn.mu);
    conn.armed = 0;  // it fired: disarmed
    conn.running = true;
    input = !conn.away;
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
          fail(LLM_LINK_FAILED, "connection closed by the peer");
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
      fail(LLM_LINK_FAILED, "connection closed by the peer");
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
      if (is_down() || conn.busy || conn.queue.empty()) return;  // what is left is settled by reap()
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
      n = net::writev_now(conn.fd, iov.data(), iov.size());
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

void Link::write_staged(Connection &conn, OutFrame frame) {
  const bool go_on = finish_staged(conn, frame);
  {
    std::lock_guard<std::mutex> lock(conn.mu);
    conn.busy = false;
    if (go_on && !conn.queue.empty()) arm_locked(conn);
  }
  end_work();
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

bool Link::export_all(const cuda::Device &device, const PlannedFrame &planned, bool fds,
                      std::vector<wire::DeviceExport> &exports) {
  std::vector<cuda::Export> found;
  for (const iovec &v : planned.local) {
    auto addr = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(v.iov_base));
    const uint64_t end = addr + v.iov_len;
    // Every export the range touches: one, or (memory of cuMemCreate)
    // several mapped side by side.
    while (addr < end) {
      const auto holds = [&](const cuda::Export &e) { return addr >= e.base && addr - e.base < e.size; };
      if (found.empty() || !holds(found.back())) {
        auto it = std::find_if(found.begin(), found.end(), holds);
        if (it != found.end()) {
          std::swap(*it, found.back());  // the next element is most likely in the same one
        } else {
          cuda::Export made;
          std::string why;
          if (found.size() == wire::kMaxExports || !device.export_at(addr, fds, made, why)) return false;
          found.push_back(made);
        }
      }
      addr = found.back().base + found.back().size;
    }
  }
  exports.clear();
  for (const cuda::Export &e : found) {
    wire::DeviceExport out{};
    if (e.fd >= 0) {
      const wire::DeviceFd fd{e.fd, 0, e.size, e.serial};
      std::memcpy(out.handle, &fd, sizeof(fd));
      out.kind = wire::kExportFd;
    } else {
      std::memcpy(out.handle, e.handle.reserved, sizeof(out.handle));
      out.kind = wire::kExportIpc;
    }
    out.base = e.base;
    out.ordinal = device.ordinal();
    exports.push_back(out);
  }
  return true;
}

void Link::send_planned(bool write, PlannedFrame &planned, const std::shared_ptr<Request> &request,
                        size_t result_index, Clock::time_point deadline, const std::shared_ptr<const void> &pin,
                        const std::shared_ptr<cuda::Device> &device, bool exports_ok) {
  OutFrame out;
  uint64_t data_len = 0;
  for (const iovec &v : planned.local) data_len += v.iov_len;
  // Same-host: the peer copies the bytes, so the frame names this end's
  // memory instead of carrying it. A frame whose segment table would not
  // fit a body goes over TCP. Device memory of this end goes so only as
  // exports the peer can open; otherwise it goes inline, staged.
  size_t body_bytes = sizeof(wire::Target) + planned.ranges.size() * (sizeof(wire::Range) + sizeof(wire::Segment)) +
                      planned.strides.size() * sizeof(wire::Stride) + planned.bounds.size() * sizeof(wire::Range);
  bool same_host = peer_copies_.load(std::memory_order_acquire) && body_bytes <= wire::kMaxBodyBytes;
  std::vector<wire::DeviceExport> exports;
  if (same_host && device) {
    same_host = exports_ok && peer_opens_device_ && !exports_refused_.load(std::memory_order_acquire) &&
                export_all(*device, planned, peer_takes_fds_, exports) &&
                body_bytes + 2 * sizeof(uint32_t) + exports.size() * sizeof(wire::DeviceExport) <= wire::kMaxBodyBytes;
  }
  // UCX: host memory goes as a frame naming it, with the keys of the
  // tensors it lies in; otherwise (or where its keys cannot be had) inline.
  std::vector<std::shared_ptr<ucx::Mapping>> keys;
  bool ucx = false;
  if (ucx_ && (!device || ucx_->worker()->reaches_device()) && exports_ok) {
    std::string why;
    if (ucx::keys_for(ucx_->worker(), host_->registry(), planned.local, keys, why)) {
      ucx = body_bytes + ucx::key_table_bytes(keys) <= wire::kMaxBodyBytes;
    } else if (!ucx_unmapped_logged_.exchange(true)) {
      log_warning("link to cluster " + std::to_string(peer_id_) + ": an operation goes inline, not by UCX: " + why);
    }
    if (!ucx) keys.clear();
    same_host = ucx;
  }
  std::shared_ptr<PlannedFrame> resend;
  if (ucx) {
    ucx_frames_.fetch_add(1, std::memory_order_relaxed);
    resend = std::make_shared<PlannedFrame>(planned);  // for a peer whose memory is a device's
    planned.target.flags |= wire::kUcxSegments;
  }
  if (device && !ucx) {
    (same_host ? ipc_frames_ : staged_frames_).fetch_add(1, std::memory_order_relaxed);
    if (same_host && std::any_of(exports.begin(), exports.end(),
                                 [](const wire::DeviceExport &e) { return e.kind == wire::kExportFd; })) {
      fd_frames_.fetch_add(1, std::memory_order_relaxed);
    }
    if (same_host) resend = std::make_shared<PlannedFrame>(planned);
  }
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
    exports.clear();
    for (wire::Stride &s : planned.strides) s.segment_stride = 0;
  }
  out.body = wire::encode_request(planned.target, planned.ranges, planned.bounds, segments, planned.strides, exports);
  if (ucx) ucx::encode_keys(keys, out.body);
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
    if (op.resend) op.device = device;
    op.ucx = ucx;
    if (!write && !same_host) {
      op.recv = std::move(planned.local);
      op.recv_bytes = data_len;
      op.device = device;
    }
  }
  out.header.op_id = out.op_id;
  if (write && !same_host) {
    out.data = std::move(planned.local);
    out.device = device;
  }
  const uint64_t group = planned.target.group;
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

namespace {

// Zeros that keep a frame whole after its device copy failed mid-send.
constexpr size_t kPadBytes = 64 * 1024;

}  // namespace

bool Link::finish_staged(Connection &conn, OutFrame &frame) {
  const std::shared_ptr<cuda::Device> device = frame.device;  // outlives the copier and its pool buffers
  const uint64_t total = frame.header.data_len;
  bool header_out = false;
  // The header and body leave with the first chunk, once its copy has run.
  auto sink = [&](const uint8_t *bytes, size_t n) {
    iovec iov[3];
    size_t count = 0;
    if (!header_out) {
      iov[count++] = {&frame.header, sizeof(frame.header)};
      if (!frame.body.empty()) iov[count++] = {frame.body.data(), frame.body.size()};
    }
    iov[count++] = {const_cast<uint8_t *>(bytes), n};
    header_out = true;
    return net::writev_full(conn.fd, iov, count);
  };
  staging::Result result;
  {
    cuda::StreamCopier copier(*device);
    result = staging::stage_out(device->staging_pool(false), copier, frame.data, staging::kDepth, sink);
  }
  if (result.outcome == staging::Outcome::kDone) return after_send(frame, true);
  if (result.outcome == staging::Outcome::kIoFailed) return after_send(frame, false);
  const std::string why = "copying out of device memory failed: " + result.why;
  log_warning("link to cluster " + std::to_string(peer_id_) + ": " + why);
  if (frame.op_id == 0) {
    // The answer to a read: its status left with its header.
    if (header_out) {
      fail(LLM_LINK_FAILED, why + ", after part of a read's data was sent");
      return false;
    }
    OutFrame failed = answer(FrameType::kReadData, frame.header.op_id, llm_datadist::LLM_FAILED,
                             "copying out of device memory on the peer failed: " + result.why);
    std::vector<iovec> iov = frame_bytes(failed);
    return after_send(failed, net::writev_full(conn.fd, iov.data(), iov.size()));
  }
  // A write: it fails here. Once its header is out, the peer gets the frame
  // whole (zeros for the rest), and its answer cannot make it a success.
  fail_here(frame.op_id, llm_datadist::LLM_FAILED, why);
  if (!header_out) {
    mark(frame.op_id, true, true, llm_datadist::LLM_FAILED);
    return true;
  }
  const std::vector<uint8_t> zeros(static_cast<size_t>(std::min<uint64_t>(kPadBytes, total - result.moved)));
  bool ok = true;
  for (uint64_t left = total - result.moved; left > 0 && ok;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, zeros.size()));
    ok = net::write_full(conn.fd, zeros.data(), n);
    left -= n;
  }
  return after_send(frame, ok);
}

bool Link::receive_staged(net::Reader &in, const cuda::Device &device, const std::vector<iovec> &to, uint64_t bytes,
                          bool &io_ok, std::string &why) {
  staging::Result result;
  {
    cuda::StreamCopier copier(device);
    result = staging::stage_in(device.staging_pool(true), copier, to, staging::kDepth,
                               [&](uint8_t *buffer, size_t n) { return in.read(buffer, n); });
  }
  io_ok = result.outcome != staging::Outcome::kIoFailed;
  if (result.outcome != staging::Outcome::kCopyFailed) return true;
  why = result.why;
  io_ok = in.discard(bytes - result.moved);  // the frame's rest, so the next frame is read whole
  return false;
}

int Link::peer_copy_staged(const cuda::Device &device, const std::vector<iovec> &mine,
                           const std::vector<wire::Segment> &theirs, bool from_peer, std::string &why) {
  // The peer's segments, read (or written) as one stream in the order of `mine`.
  size_t index = 0;
  uint64_t offset = 0;
  int error = 0;
  auto copy = [&](uint8_t *buffer, size_t n) {
    std::vector<iovec> local, remote;
    for (size_t done = 0; done < n;) {
      if (index == theirs.size()) {
        error = EINVAL;
        return false;
      }
      const wire::Segment &seg = theirs[index];
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n - done, seg.length - offset));
      if (take > 0) {
        local.push_back({buffer + done, take});
        remote.push_back({reinterpret_cast<void *>(static_cast<uintptr_t>(seg.addr + offset)), take});
      }
      done += take;
      offset += take;
      if (offset == seg.length) {
        ++index;
        offset = 0;
      }
    }
    error = peer_memory_->copy(local.data(), remote.data(), local.size(), from_peer);
    return error == 0;
  };
  staging::Result result;
  {
    cuda::StreamCopier copier(device);
    if (from_peer) {
      result = staging::stage_in(device.staging_pool(true), copier, mine, staging::kDepth, copy);
    } else {
      result = staging::stage_out(device.staging_pool(false), copier, mine, staging::kDepth,
                                  [&](const uint8_t *bytes, size_t n) { return copy(const_cast<uint8_t *>(bytes), n); });
    }
  }
  if (result.outcome == staging::Outcome::kIoFailed) return error;
  if (result.outcome == staging::Outcome::kCopyFailed) {
    why = result.why;
    return -1;
  }
  return 0;
}

bool Link::after_send(OutFrame &frame, bool ok) {
  // Sent or not, the sender is done with the frame's memory; an operation
  // left unanswered gets the reason the link went down when it is reaped.
  if (frame.op_id != 0) mark(frame.op_id, true, false, LLM_SUCCESS);
  if (!ok) {
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
      const bool by_ucx = (req.target.flags & wire::kUcxSegments) != 0;
      if (problem.empty() && by_ucx && !ucx_) problem = "UCX frame on a link without UCX";
      if (problem.empty() && !by_ucx && !peer_memory_) {
        problem = "same-host frame, but this end cannot reach the peer's memory";
      }
      if (!problem.empty()) {
        fail(LLM_LINK_FAILED, "malformed request from the peer (" + problem + "); closing the link");
        return false;
      }
      serve_peer_copy(conn, header, req, type == FrameType::kWriteFrom);
      return !is_down();
    }
    case FrameType::kPeerCopies:
      if (!offered_same_host_ || !body.empty()) {
        fail(LLM_LINK_FAILED, "unexpected same-host announcement from the peer; closing the link");
        return false;
      }
      peer_copies_.store(true, std::memory_order_release);
      return true;
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
  const uint64_t group = req.target.group;
  if (group != 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (refused_groups_.count(group) != 0) {
      target.why = "an earlier request of the same ordered transfer (an earlier layer) was refused";
      return llm_datadist::LLM_FAILED;
    }
  }
  Status st = resolve_request(host_->registry(), req, target);
  if (st != LLM_SUCCESS) refuse_group(group);
  return st;
}

void Link::refuse_group(uint64_t group) {
  if (group == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!refused_groups_.insert(group).second) return;
  refused_order_.push_back(group);
  if (refused_order_.size() > kMaxRefusedGroups) {
    refused_groups_.erase(refused_order_.front());
    refused_order_.pop_front();
  }
}

size_t Link::refused_group_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_groups_.size();
}

void Link::serve_write(Connection &conn, const FrameHeader &header, const wire::Request &req) {
  auto target = std::make_shared<ResolvedTarget>();  // its pins hold the memory until the data are in
  const Status st = resolve_in_group(req, *target);
  const uint64_t op_id = header.op_id;
  const uint64_t group = req.target.group;
  Connection *c = &conn;
  if (st == LLM_SUCCESS && target->device) {
    staged_bytes_served_.fetch_add(header.data_len, std::memory_order_relaxed);
    const uint64_t bytes = header.data_len;
    hand_off(conn, [this, c, target, op_id, group, bytes] {
      bool ok = true;
      std::string why;
      Status status = LLM_SUCCESS;
      if (!receive_staged(c->in, *target->device, target->iov, bytes, ok, why) && ok) {
        status = llm_datadist::LLM_FAILED;
        target->why = "copying into device memory on the peer failed: " + why;
        log_warning("link to cluster " + std::to_string(peer_id_) + ": " + target->why);
        refuse_group(group);
      }
      if (!ok) {
        fail(LLM_LINK_FAILED, "connection closed by the peer");
        return false;
      }
      send_answer(*c, answer(FrameType::kWriteAck, op_id, status, target->why));
      return true;
    });
    return;
  }
  std::vector<iovec> to;
  if (st == LLM_SUCCESS) to = target->iov;
  expect_data(conn, std::move(to), st == LLM_SUCCESS ? 0 : header.data_len, [this, c, target, op_id, st] {
    send_answer(*c, answer(FrameType::kWriteAck, op_id, st, target->why));
    return true;
  });
}

void Link::serve_read(Connection &conn, const FrameHeader &header, const wire::Request &req) {
  ResolvedTarget target;
  Status st = resolve_in_group(req, target);
  OutFrame out = answer(FrameType::kReadData, header.op_id, st, target.why);
  if (st == LLM_SUCCESS) {
    note_read(req);
    out.header.data_len = req.total_bytes;
    out.data = std::move(target.iov);
    if (target.device) staged_bytes_served_.fetch_add(req.total_bytes, std::memory_order_relaxed);
    out.device = std::move(target.device);
    out.pin = std::make_shared<std::vector<std::shared_ptr<CacheEntry>>>(std::move(target.pins));
  }
  send_answer(conn, std::move(out));
}

void Link::note_read(const wire::Request &req) {
  if ((req.target.flags & wire::kReleaseKey) == 0) return;
  std::vector<uint32_t> tensors;
  for (const wire::Range &r : req.ranges) tensors.push_back(r.tensor);
  host_->registry().note_pulled({req.target.req_id, req.target.model_id, req.target.prefix_id}, tensors);
}

void Link::serve_peer_copy(Connection &conn, const FrameHeader &header, const wire::Request &req, bool write) {
  if (!req.exports.empty()) {
    serve_device_copy(conn, header, req, write);
    return;
  }
  if (!req.ucx_keys.empty()) {
    serve_ucx(conn, header, req, write);
    return;
  }
  ResolvedTarget target;
  Status st = resolve_in_group(req, target);
  // The peer's own ranges, checked before any byte moves: a write reads
  // them, a read writes them.
  if (st == LLM_SUCCESS && !peer_memory_->mapped(req.segments, !write)) {
    target.why = std::string("the initiator's ") + (write ? "source" : "destination") +
                 " memory is not mapped " + (write ? "readable" : "writable") + " in its process";
    log_warning("link to cluster " + std::to_string(peer_id_) + ": refused a same-host operation: " + target.why);
    st = llm_datadist::LLM_PARAM_INVALID;
    refuse_group(req.target.group);
  }
  // An initiator that gave up (its timeout or its cancel closed the link)
  // gets no byte afterwards, however long this process was held up before
  // it came to the request: its closed connection is seen before the copy.
  if (st == LLM_SUCCESS && net::peer_closed(conn.fd)) {
    fail(LLM_LINK_FAILED, "the peer closed the link before its same-host operation was served");
    return;
  }
  if (st == LLM_SUCCESS) {
    std::string why;
    if (target.device) staged_bytes_served_.fetch_add(req.total_bytes, std::memory_order_relaxed);
    const int error = target.device
                          ? peer_copy_staged(*target.device, target.iov, req.segments, write, why)
                          : same_host::copy_pairs(*peer_memory_, host_->copy_pool(), target.iov, req.segments, write);
    if (error == -1) {
      target.why = std::string("copying ") + (write ? "into" : "out of") + " device memory on the peer failed: " + why;
      log_warning("link to cluster " + std::to_string(peer_id_) + ": " + target.why);
      st = llm_datadist::LLM_FAILED;
      refuse_group(req.target.group);
    } else if (error == ESRCH) {
      fail(LLM_LINK_FAILED, "the peer process is gone");
      return;
    }
    if (error > 0) {
      // The peer's memory changed under the copy: its own operation fails.
      target.why = std::string("the same-host copy failed: ") + std::strerror(error);
      log_warning("link to cluster " + std::to_string(peer_id_) + ": " + target.why);
      st = llm_datadist::LLM_PARAM_INVALID;
      refuse_group(req.target.group);
    }
  }
  if (st == LLM_SUCCESS && !write) note_read(req);
  send_answer(conn, answer(write ? FrameType::kWriteAck : FrameType::kReadData, header.op_id, st, target.why));
}

namespace {

// The peer's allocations one link keeps open; past it, all are let go
// (each closes once no copy uses it) and opened again on need.
constexpr size_t kMaxOpened = 1024;

}  // namespace

bool Link::open_exports(const std::vector<wire::DeviceExport> &exports, const std::shared_ptr<cuda::Device> &device,
                        std::vector<std::shared_ptr<cuda::PeerAllocation>> &out, std::string &why) {
  // The driver refuses an open in the exporting process; so does this end.
  if (peer_memory_->pid() == ::getpid()) {
    why = "the initiator is this process";
    return false;
  }
  std::lock_guard<std::mutex> lock(opened_mu_);
  std::shared_ptr<cuda::Device> in = device;
  if (!in) {
    if (!host_side_device_) {
      const int ordinal = exports.front().ordinal;
      if (ordinal < 0 || cuda::Device::open(ordinal, host_side_device_) != LLM_SUCCESS) {
        host_side_device_.reset();
        why = "no CUDA driver or no device " + std::to_string(ordinal) + " here";
        return false;
      }
    }
    in = host_side_device_;
  }
  out.clear();
  for (const wire::DeviceExport &e : exports) {
    std::string key(reinterpret_cast<const char *>(e.handle), sizeof(e.handle));
    key += ":" + std::to_string(e.kind) + ":" + std::to_string(in->ordinal());
    auto it = opened_.find(key);
    if (it == opened_.end()) {
      std::shared_ptr<cuda::PeerAllocation> opened;
      if (e.kind == wire::kExportFd) {
        // The initiator's descriptor, taken as the link's sockets were.
        wire::DeviceFd named{};
        std::memcpy(&named, e.handle, sizeof(named));
        const int fd = same_host::take_descriptor(peer_memory_->pid(), static_cast<uint32_t>(named.fd), why);
        if (fd < 0) return false;
        opened = cuda::PeerAllocation::import(in, fd, named.size, why);
      } else {
        opened = cuda::PeerAllocation::open(in, *reinterpret_cast<const cuda::CUipcMemHandle *>(e.handle), why);
      }
      if (!opened) return false;
      if (opened_.size() >= kMaxOpened) opened_.clear();
      it = opened_.emplace(std::move(key), std::move(opened)).first;
    }
    out.push_back(it->second);
  }
  return true;
}

void Link::serve_ucx(Connection &conn, const FrameHeader &header, const wire::Request &req, bool write) {
  const FrameType type = write ? FrameType::kWriteAck : FrameType::kReadData;
  ResolvedTarget target;
  Status st = resolve_in_group(req, target);
  if (st != LLM_SUCCESS) {
    send_answer(conn, answer(type, header.op_id, st, target.why));
    return;
  }
  // This end's memory as UCX's mappings. Where it cannot be had (device
  // memory this UCX does not reach), the initiator sends the frame again
  // inline: nothing has moved.
  std::vector<std::shared_ptr<ucx::Mapping>> mine;
  std::vector<datadist_ucx_mem *> mems(target.iov.size(), nullptr);
  std::string unmapped;
  if (target.device && !target.entry) {
    unmapped = "device memory named by address";
  } else if (target.entry && !ucx::local_maps(ucx_->worker(), *target.entry, target.iov, mine, mems, unmapped)) {
    // unmapped says why
  } else if (target.device && !target.device->make_current(unmapped)) {
    // the CUDA transports copy on this thread too
  }
  if (!unmapped.empty()) {
    send_answer(conn, answer(type, header.op_id, llm_datadist::LLM_FEATURE_NOT_ENABLED,
                             "this end's UCX cannot move its memory: " + unmapped));
    return;
  }
  // One get or put per key: this end's ranges (checked above) against the
  // initiator's, which the key bounds.
  std::vector<std::vector<datadist_ucx_range>> by_key(req.ucx_keys.size());
  for (size_t i = 0; i < req.segments.size(); ++i) {
    by_key[req.segment_key[i]].push_back({static_cast<uint64_t>(reinterpret_cast<uintptr_t>(target.iov[i].iov_base)),
                                          req.segments[i].addr, req.segments[i].length, mems[i]});
  }
  struct Served {
    std::shared_ptr<Link> link;
    Connection *conn;
    uint64_t op_id;
    bool write;
    wire::Request req;
    std::shared_ptr<const void> pin;  // this end's cache, alive until UCX is done with it
    std::vector<std::shared_ptr<ucx::Mapping>> mine;  // and its mappings
    std::mutex mu;
    size_t left = 0;
    int status = 0;
    std::string why;
  };
  auto served = std::make_shared<Served>();
  served->link = shared_from_this();
  served->conn = &conn;
  served->op_id = header.op_id;
  served->write = write;
  served->req = req;
  served->pin = target.entry;
  served->mine = std::move(mine);
  // Settles the frame once every get (or every put and the flush) is done.
  auto finish = [served](int status, const std::string &why) {
    bool last;
    {
      std::lock_guard<std::mutex> lock(served->mu);
      if (status != 0 && served->status == 0) {
        served->status = status;
        served->why = why;
      }
      last = --served->left == 0;
    }
    if (!last) return;
    Link &link = *served->link;
    if (!link.begin_work()) return;
    Status result = LLM_SUCCESS;
    std::string words;
    if (served->status != 0) {
      words = std::string("UCX could not ") + (served->write ? "read the initiator's memory: " : "write the initiator's memory: ") +
              (served->why.empty() ? link.ucx_->worker()->describe(served->status) : served->why);
      log_warning("link to cluster " + std::to_string(link.peer_id_) + ": " + words);
      result = llm_datadist::LLM_FAILED;
      link.refuse_group(served->req.target.group);
    } else {
      link.ucx_bytes_served_.fetch_add(served->req.total_bytes, std::memory_order_relaxed);
      if (!served->write) link.note_read(served->req);
    }
    link.send_answer(*served->conn,
                     answer(served->write ? FrameType::kWriteAck : FrameType::kReadData, served->op_id, result, words));
    link.end_work();
  };
  size_t posts = 0;
  for (const auto &ranges : by_key) posts += ranges.empty() ? 0 : 1;
  served->left = posts + (write ? 0 : 1) + 1;  // the gets or puts, the flush, and this thread's hold
  std::string why;
  bool posted = true;
  for (size_t k = 0; k < by_key.size() && posted; ++k) {
    if (by_key[k].empty()) continue;
    posted = write ? ucx_->get(req.ucx_key_bytes[k], by_key[k], finish, why)
                   : ucx_->put(req.ucx_key_bytes[k], by_key[k], finish, why);
    if (!posted) {
      // This post and those never tried end here.
      size_t never = 0;
      for (size_t j = k; j < by_key.size(); ++j) never += by_key[j].empty() ? 0 : 1;
      for (size_t j = 0; j < never; ++j) finish(-1, why);
      if (!write) finish(-1, why);
    }
  }
  if (posted && !write && !ucx_->flush(finish, why)) finish(-1, why);
  finish(0, {});
}

void Link::serve_device_copy(Connection &conn, const FrameHeader &header, const wire::Request &req, bool write) {
  ResolvedTarget target;
  Status st = resolve_in_group(req, target);
  std::vector<std::shared_ptr<cuda::PeerAllocation>> opened;
  if (st == LLM_SUCCESS) {
    std::string why;
    if (!open_exports(req.exports, target.device, opened, why)) {
      // Not a refusal: the initiator sends the frame again inline.
      target.why = "cannot open the initiator's device memory here: " + why;
      log_warning("link to cluster " + std::to_string(peer_id_) + ": " + target.why);
      st = llm_datadist::LLM_FEATURE_NOT_ENABLED;
    }
  }
  // Every segment inside the allocation it names, by the size of what was
  // opened (not what the initiator says), or running on into exports whose
  // bases follow that size without a gap, before any byte moves.
  std::vector<cuda::Copy> copies;
  uint64_t fd_bytes = 0;
  const auto following = [&](uint64_t base) -> int64_t {
    for (size_t e = 0; e < req.exports.size(); ++e) {
      if (req.exports[e].base == base) return static_cast<int64_t>(e);
    }
    return -1;
  };
  for (size_t i = 0; st == LLM_SUCCESS && i < req.segments.size(); ++i) {
    const wire::Segment &seg = req.segments[i];
    uint32_t e = req.segment_export[i];
    uint64_t offset = seg.addr - req.exports[e].base;
    auto mine = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(target.iov[i].iov_base));
    const bool mine_device = target.device != nullptr;
    uint64_t left = seg.length;
    while (left > 0) {
      const cuda::PeerAllocation &peer = *opened[e];
      const int64_t next = offset < peer.size() && left > peer.size() - offset
                               ? following(req.exports[e].base + peer.size())
                               : -1;
      if (offset >= peer.size() || (left > peer.size() - offset && next < 0)) {
        target.why = "device segment " + std::to_string(i) + " [" + std::to_string(seg.addr) + ", +" +
                     std::to_string(seg.length) + ") runs outside its exported allocation of " +
                     std::to_string(peer.size()) + " bytes at " + std::to_string(req.exports[e].base);
        log_warning("link to cluster " + std::to_string(peer_id_) + ": refused a device operation: " + target.why);
        st = llm_datadist::LLM_PARAM_INVALID;
        refuse_group(req.target.group);
        break;
      }
      const uint64_t n = std::min(left, peer.size() - offset);
      const uint64_t theirs = peer.base() + offset;
      copies.push_back(write ? cuda::Copy{mine, theirs, n, mine_device, true}
                             : cuda::Copy{theirs, mine, n, true, mine_device});
      if (peer.imported()) fd_bytes += n;
      mine += n;
      left -= n;
      if (left > 0) {
        e = static_cast<uint32_t>(next);
        offset = 0;
      }
    }
  }
  if (st == LLM_SUCCESS && net::peer_closed(conn.fd)) {
    fail(LLM_LINK_FAILED, "the peer closed the link before its same-host operation was served");
    return;
  }
  if (st == LLM_SUCCESS) {
    std::string why;
    const cuda::Device &device = target.device ? *target.device : *opened.front()->device();
    if (!device.copy(copies, why)) {
      target.why = std::string("copying ") + (write ? "into" : "out of") + (target.device ? " device" : " host") +
                   " memory on the peer failed (through CUDA IPC): " + why;
      log_warning("link to cluster " + std::to_string(peer_id_) + ": " + target.why);
      st = llm_datadist::LLM_FAILED;
      refuse_group(req.target.group);
    } else {
      ipc_bytes_served_.fetch_add(req.total_bytes, std::memory_order_relaxed);
      fd_bytes_served_.fetch_add(fd_bytes, std::memory_order_relaxed);
    }
  }
  if (st == LLM_SUCCESS && !write) note_read(req);
  send_answer(conn, answer(write ? FrameType::kWriteAck : FrameType::kReadData, header.op_id, st, target.why));
}

DevicePathStats Link::device_path_stats() const {
  DevicePathStats s;
  s.ipc_frames = ipc_frames_.load(std::memory_order_relaxed);
  s.ipc_fallbacks = ipc_fallbacks_.load(std::memory_order_relaxed);
  s.staged_frames = staged_frames_.load(std::memory_order_relaxed);
  s.ipc_bytes_served = ipc_bytes_served_.load(std::memory_order_relaxed);
  s.staged_bytes_served = staged_bytes_served_.load(std::memory_order_relaxed);
  s.fd_frames = fd_frames_.load(std::memory_order_relaxed);
  s.fd_bytes_served = fd_bytes_served_.load(std::memory_order_relaxed);
  s.ucx_frames = ucx_frames_.load(std::memory_order_relaxed);
  s.ucx_fallbacks = ucx_fallbacks_.load(std::memory_order_relaxed);
  s.ucx_bytes_served = ucx_bytes_served_.load(std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(opened_mu_);
  for (const auto &entry : opened_) s.fd_imports += entry.second->imported() ? 1 : 0;
  return s;
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
      unknown = "no such operation open";
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
  if (resend.resend && resend.ucx) {
    // The peer's memory is a device's, which UCX does not reach there.
    ucx_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    send_planned(resend.write, *resend.resend, resend.request, resend.result_index, resend.deadline, resend.pin,
                 resend.device, false);
    return true;
  }
  if (resend.resend) {
    exports_refused_.store(true, std::memory_order_release);
    ipc_fallbacks_.fetch_add(1, std::memory_order_relaxed);
    const std::string why(body.begin(), body.begin() + static_cast<std::ptrdiff_t>(std::min<size_t>(body.size(), wire::kMaxReasonBytes)));
    log_warning("link to cluster " + std::to_string(peer_id_) + ": device memory goes staged: " + why);
    // The operation's hold on its request passes to the frame sent again.
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
      if (!receive_staged(c->in, *device, recv, bytes, io_ok, why) && io_ok) {
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
  // Answers that came before the end settle their operations as answered.
  {
    std::lock_guard<std::mutex> lock(answer_mu_);
    read_answers_locked(AnswerHub::Reader::kLink);
    close_answers_locked();
  }
  {
    // The peer's opened allocations close once no copy uses them.
    std::lock_guard<std::mutex> lock(opened_mu_);
    opened_.clear();
    host_side_device_.reset();
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

size_t Link::open_operations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return open_.size();
}

}  // namespace datadist
