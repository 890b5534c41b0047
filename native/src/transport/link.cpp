// A link's making and start, the frames submit() plans and sends (or a
// path moves itself), and what the link says of itself.
#include "transport/link.h"

#include <sys/socket.h>
#include <unistd.h>

#include "transport/frame_planner.h"
#include "transport/paths/paths.h"
#include "transport/socket_util.h"

namespace datadist {

namespace {

// `paths`, then the inline path, which carries every frame they do not.
std::vector<std::shared_ptr<DataPath>> with_inline(std::vector<std::shared_ptr<DataPath>> paths) {
  paths.push_back(inline_path());
  return paths;
}

}  // namespace

using llm_datadist::LLM_SUCCESS;
using wire::FrameType;

Link::Link(uint64_t peer_id, uint32_t peer_role, bool initiated_here, std::vector<int> fds, LinkHost *host,
           std::vector<std::shared_ptr<DataPath>> paths, int answers,
           std::vector<std::unique_ptr<tls::Session>> sessions)
    : peer_id_(peer_id),
      peer_role_(peer_role),
      initiated_here_(initiated_here),
      host_(host),
      paths_(with_inline(std::move(paths))),
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
  return paths_.back()->name();  // not reached: the inline path, last, is always active
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
    // One connection, so that the peer reads them in the order sent.
    link->enqueue(*link->conns_[0], path_message(std::move(body)));
  };
}

Link::OutFrame Link::path_message(std::vector<uint8_t> body) {
  OutFrame out;
  out.header = wire::make_header(FrameType::kPathMessage, 0, static_cast<uint32_t>(body.size()), 0);
  out.body = std::move(body);
  return out;
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
    std::vector<uint8_t> body;
    if (path->first_message(body)) {
      // Before any thread runs, so it is the first frame the peer reads.
      conns_[0]->queue.push_back(path_message(std::move(body)));
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

void Link::submit(bool write, std::vector<PlannedFrame> frames, const std::shared_ptr<Request> &request,
                  size_t result_index, Clock::time_point deadline, std::shared_ptr<const void> pin,
                  std::shared_ptr<cuda::Device> device) {
  uint64_t operation_bytes = 0;
  for (const PlannedFrame &planned : frames) {
    for (const iovec &v : planned.local) operation_bytes += v.iov_len;
  }
  for (PlannedFrame &planned : frames) {
    planned.operation_bytes = operation_bytes;
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
        if (path->move(write, planned, device, settle)) return;
      }
      end_work();
    }
  }
  OutFrame out;
  uint64_t data_len = 0;
  for (const iovec &v : planned.local) data_len += v.iov_len;
  // The link's paths in order; the first that carries the frame takes it.
  // The last, inline on the connections, carries any; one that should and
  // cannot (a frame whose segment table would not fit a body) leaves it to
  // that one.
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
  if (by == nullptr) {
    carried = Carried{};
    by = paths_.back().get();
    by->carry(planned, device.get(), exports_ok, body_bytes, carried);
  }
  const bool by_reference = !carried.bytes_follow;  // the frame names this end's memory
  // A device frame planned to name exports, which may name more than a
  // frame carries, goes inline after all: as pieces the wire carries, each
  // an operation's frame of its own with its own hold on the request.
  if (!by_reference && data_len > wire::kMaxFrameData) {
    std::vector<PlannedFrame> pieces = FramePlanner::split(planned, wire::kMaxFrameData);
    request->hold(pieces.size() - 1);
    for (PlannedFrame &piece : pieces) send_planned(write, piece, request, result_index, deadline, pin, device, false);
    return;
  }
  std::shared_ptr<PlannedFrame> resend;
  if (carried.may_resend) resend = std::make_shared<PlannedFrame>(planned);
  std::vector<wire::Segment> segments;
  if (by_reference) {
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
  out.body = wire::encode_request(planned.target, planned.ranges, planned.bounds, segments, planned.strides,
                                  carried.trailer_path, carried.trailer);
  const FrameType type = by_reference ? (write ? FrameType::kWriteFrom : FrameType::kReadInto)
                                   : (write ? FrameType::kWrite : FrameType::kRead);
  out.header = wire::make_header(type, 0, static_cast<uint32_t>(out.body.size()), write && !by_reference ? data_len : 0);
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
    op.path = by;
    if (op.resend) op.device = device;
    if (!write && !by_reference) {
      op.recv = std::move(planned.local);
      op.recv_bytes = data_len;
      op.device = device;
    }
  }
  out.header.op_id = out.op_id;
  host_->deadline_at(deadline);
  if (write && !by_reference) {
    out.data = std::move(planned.local);
    out.device = device;
    out.path = by;
  }
  framed_ops_.fetch_add(1, std::memory_order_relaxed);
  framed_bytes_.fetch_add(data_len, std::memory_order_relaxed);
  enqueue(group != 0 ? *conns_[group % conns_.size()] : next_connection(), std::move(out));
}

void Link::path_counters(std::map<std::string, uint64_t> &out) const {
  const auto get = [](const std::atomic<uint64_t> &n) { return n.load(std::memory_order_relaxed); };
  // Which way each operation's bytes moved: this end's operations sent as
  // frames (their owner moved the bytes), the peer's this end served as
  // owner; the paths count those they moved themselves (one_sided_*), and
  // the inline path those it staged.
  out["framed_ops"] += get(framed_ops_);
  out["framed_bytes"] += get(framed_bytes_);
  out["owner_served_ops"] += get(served_ops_);
  out["owner_served_bytes"] += get(served_bytes_);
  for (const auto &path : paths_) path->counters(out);
}

}  // namespace datadist
