// A link's connections on the I/O loop: the frames each reads and writes,
// in order, and their TLS handshakes.
#include "transport/link.h"

#include <sys/epoll.h>

#include "transport/socket_util.h"

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;
using wire::FrameHeader;

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

void Link::ConnectionData::into(std::vector<iovec> to, uint64_t drop, std::function<bool()> then) {
  expect_data(conn_, std::move(to), drop, std::move(then));
}

void Link::ConnectionData::away(std::function<bool(net::Reader &in)> read) {
  Link *link = &link_;
  Connection *c = &conn_;
  hand_off(conn_, [link, c, read = std::move(read)] {
    if (read(c->in)) return true;
    link->fail(LLM_LINK_FAILED, input_end(*c, "connection closed by the peer"));
    return false;
  });
}

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

}  // namespace datadist
