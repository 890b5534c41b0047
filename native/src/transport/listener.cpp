#include "transport/listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <system_error>

#include "log.h"
#include "thread_name.h"
#include "transport/socket_util.h"

namespace datadist {

using llm_datadist::LLM_AUTH_FAILED;
using llm_datadist::LLM_LINK_FAILED;
using wire::FrameHeader;
using wire::FrameType;

namespace {

constexpr auto kFirstPause = std::chrono::milliseconds(10);
constexpr auto kLongestPause = std::chrono::milliseconds(1000);
// Accepts per wake-up, so that a flood of connections cannot starve the
// handshakes already under way.
constexpr int kAcceptBurst = 64;

std::string peer_address(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (::getpeername(fd, reinterpret_cast<sockaddr *>(&addr), &len) == 0 && addr.ss_family == AF_INET) {
    const auto *in = reinterpret_cast<const sockaddr_in *>(&addr);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

bool is_shortage(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

}  // namespace

Listener::Listener(ListenerOptions options, OnLink on_link) : options_(std::move(options)), on_link_(std::move(on_link)) {}

Listener::~Listener() { stop(); }

bool Listener::start(const std::string &ip, uint16_t port, std::string &error) {
  listen_fd_ = net::listen_tcp(ip, port, port_, error);
  if (listen_fd_ < 0) return false;
  ::fcntl(listen_fd_, F_SETFL, ::fcntl(listen_fd_, F_GETFL) | O_NONBLOCK);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ >= 0) {
    try {
      thread_ = std::thread([this] {
        name_this_thread("dd-listen");
        run();
      });
      return true;
    } catch (const std::system_error &e) {
      error = std::string("cannot start the listener thread: ") + e.what();
    }
  } else {
    error = net::errno_text();
  }
  close_everything();
  return false;
}

void Listener::stop() {
  stopping_.store(true, std::memory_order_release);
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  close_everything();
}

void Listener::close_everything() {
  for (auto &entry : waiting_) ::close(entry.second.fd);
  waiting_.clear();
  for (auto &entry : forming_) {
    for (int fd : entry.second.link.fds) {
      if (fd >= 0) ::close(fd);
    }
  }
  forming_.clear();
  waiting_count_ = 0;
  forming_count_ = 0;
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  listen_fd_ = wake_fd_ = -1;
}

ListenerStats Listener::stats() const {
  ListenerStats s;
  s.waiting = waiting_count_.load();
  s.forming = forming_count_.load();
  s.accepted = accepted_.load();
  s.evicted = evicted_.load();
  s.expired = expired_.load();
  s.accept_pauses = accept_pauses_.load();
  return s;
}

void Listener::run() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> seqs;  // the waiting connection of each pollfd past the first two
  while (!stopping_.load(std::memory_order_acquire)) {
    Clock::time_point now = Clock::now();
    expire(now);
    fds.clear();
    seqs.clear();
    fds.push_back({wake_fd_, POLLIN, 0});
    const bool accepting = now >= paused_until_;
    fds.push_back({accepting ? listen_fd_ : -1, POLLIN, 0});
    Clock::time_point wake_at = accepting ? Clock::time_point::max() : paused_until_;
    for (auto &entry : waiting_) {
      fds.push_back({entry.second.fd, POLLIN, 0});
      seqs.push_back(entry.first);
      wake_at = std::min(wake_at, entry.second.deadline);
    }
    for (auto &entry : forming_) wake_at = std::min(wake_at, entry.second.deadline);
    int timeout = -1;
    if (wake_at != Clock::time_point::max()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(wake_at - now).count() + 1;
      timeout = static_cast<int>(std::clamp<int64_t>(left, 0, 60000));
    }
    const int n = ::poll(fds.data(), fds.size(), timeout);
    if (n < 0 && errno != EINTR) {
      log_warning("the listener's poll failed: " + net::errno_text());
      std::this_thread::sleep_for(kFirstPause);
      continue;
    }
    if (n <= 0) continue;
    if (fds[0].revents != 0) {
      uint64_t value;
      [[maybe_unused]] ssize_t r = ::read(wake_fd_, &value, sizeof(value));
      continue;  // only stop() writes it
    }
    now = Clock::now();
    for (size_t i = 2; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      auto it = waiting_.find(seqs[i - 2]);
      if (it == waiting_.end()) continue;
      Next next;
      try {
        next = progress(it->second, now);
      } catch (const std::bad_alloc &) {
        log_warning("out of memory in a handshake; closing that connection");
        ::close(it->second.fd);
        next = Next::kDone;
      }
      if (next == Next::kDone) waiting_.erase(it);
    }
    waiting_count_ = waiting_.size();
    if (fds[1].fd >= 0 && fds[1].revents != 0) accept_ready(now);
  }
}

void Listener::accept_ready(Clock::time_point now) {
  for (int i = 0; i < kAcceptBurst; ++i) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) {
      pause_ = std::chrono::milliseconds(0);
      admit_connection(fd, now);
      continue;
    }
    const int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) return;
    if (err == EINTR || err == ECONNABORTED || err == EPROTO || err == EPERM) continue;
    // Short of descriptors or memory (or an error accepting cannot fix by
    // retrying at once): wait, longer each time, and accept again. The
    // pending connection stays in the kernel's queue meanwhile.
    pause_ = pause_.count() == 0 ? kFirstPause : std::min(pause_ * 2, kLongestPause);
    paused_until_ = now + pause_;
    if (accept_pauses_.fetch_add(1) == 0 || pause_ == kLongestPause) {
      log_warning(std::string("accepting links paused: ") + std::strerror(err) +
                  (is_shortage(err) ? "" : " (unexpected)"));
    }
    return;
  }
}

void Listener::admit_connection(int fd, Clock::time_point now) {
  ++accepted_;
  if (waiting_.size() >= options_.max_waiting) {
    // The oldest waiting connection makes room: a flood of idle sockets
    // cannot keep new ones out, and each lives at most its deadline anyway.
    auto oldest = waiting_.begin();
    ::close(oldest->second.fd);
    waiting_.erase(oldest);
    ++evicted_;
  }
  net::tune_data_socket(fd, options_.user_timeout_ms);
  try {
    Waiting &w = waiting_[next_seq_++];
    w.fd = fd;
    w.deadline = now + std::chrono::milliseconds(options_.handshake_timeout_ms);
  } catch (const std::bad_alloc &) {
    ::close(fd);
  }
  waiting_count_ = waiting_.size();
}

void Listener::expire(Clock::time_point now) {
  // Every connection has the same timeout, so the oldest expire first.
  while (!waiting_.empty() && waiting_.begin()->second.deadline <= now) {
    ::close(waiting_.begin()->second.fd);
    waiting_.erase(waiting_.begin());
    ++expired_;
  }
  waiting_count_ = waiting_.size();
  for (auto it = forming_.begin(); it != forming_.end();) {
    if (it->second.deadline > now) {
      ++it;
      continue;
    }
    for (int fd : it->second.link.fds) {
      if (fd >= 0) ::close(fd);
    }
    it = forming_.erase(it);
    ++expired_;
  }
  forming_count_ = forming_.size();
}

Listener::Next Listener::progress(Waiting &w, Clock::time_point now) {
  for (;;) {
    const size_t want = sizeof(FrameHeader) + (w.have_header ? w.header.body_len : 0);
    const size_t had = w.in.size();
    w.in.resize(want);
    const ssize_t n = ::recv(w.fd, w.in.data() + had, want - had, MSG_DONTWAIT);
    w.in.resize(had + static_cast<size_t>(std::max<ssize_t>(n, 0)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Next::kWait;
    if (n <= 0) {
      ::close(w.fd);
      return Next::kDone;
    }
    if (w.in.size() < want) continue;
    if (!w.have_header) {
      std::memcpy(&w.header, w.in.data(), sizeof(FrameHeader));
      const bool hello = w.stage == Stage::kHello;
      const size_t most = hello ? handshake::Hello::kMaxBytes : auth::kProofBytes;
      const FrameType type = hello ? FrameType::kHello : FrameType::kProof;
      if (!wire::check_header(w.header).empty() || w.header.type != static_cast<uint16_t>(type) ||
          w.header.body_len > most || w.header.data_len != 0) {
        if (hello) {
          log_warning("refused a connection from " + peer_address(w.fd) + ": no valid handshake");
          ::close(w.fd);
        } else {
          log_warning("refused a connection from " + peer_address(w.fd) + ": no proof of the link secret");
          answer_and_close(w.fd, handshake::refusal(LLM_AUTH_FAILED));
        }
        return Next::kDone;
      }
      w.have_header = true;
      continue;
    }
    const std::string body = w.in.substr(sizeof(FrameHeader));
    w.in.clear();
    w.have_header = false;
    const Next next = w.stage == Stage::kHello ? hello_read(w, body) : proof_read(w, body);
    if (next == Next::kWait) continue;  // the proof may have come already
    if (next == Next::kGreeted) greeted(w, now);
    return Next::kDone;
  }
}

Listener::Next Listener::hello_read(Waiting &w, const std::string &body) {
  const wire::Hello &h = w.hello.fixed;
  if (!w.hello.parse(body) || h.conn_count == 0 || h.conn_count > handshake::kMaxConnections ||
      h.conn_index >= h.conn_count) {
    log_warning("refused a connection from " + peer_address(w.fd) + ": no valid handshake");
    ::close(w.fd);
    return Next::kDone;
  }
  // A connection past what this end grants is told the count and closed,
  // before anything else: the initiator opens no more.
  const uint32_t granted = std::min(uint32_t{h.conn_count}, options_.connections_per_link);
  if (h.conn_index >= granted) {
    answer_and_close(w.fd, handshake::surplus(granted));
    return Next::kDone;
  }
  w.transcript = body;
  if (options_.auth_key.empty() && !w.hello.authenticated()) return Next::kGreeted;
  std::string refusal;
  if (options_.auth_key.empty()) {
    refusal = "it offers a link secret and this end has none";
  } else if (!w.hello.authenticated()) {
    refusal = "it did not prove the link secret";
  }
  if (!refusal.empty()) {
    log_warning("refused a connection from " + peer_address(w.fd) + " claiming cluster " + std::to_string(h.cluster_id) +
                ": " + refusal);
    answer_and_close(w.fd, handshake::refusal(LLM_AUTH_FAILED));
    return Next::kDone;
  }
  // With a secret, the initiator proves it before this end says anything
  // about itself; the transcript is what both proofs cover.
  std::string nonce(auth::kNonceBytes, '\0');
  auth::random_bytes(reinterpret_cast<uint8_t *>(nonce.data()), nonce.size());
  w.transcript += nonce;
  const std::string challenge = handshake::frame(FrameType::kChallenge, nonce);
  // A fresh socket's buffer takes a frame this small whole.
  if (::send(w.fd, challenge.data(), challenge.size(), MSG_DONTWAIT | MSG_NOSIGNAL) !=
      static_cast<ssize_t>(challenge.size())) {
    ::close(w.fd);
    return Next::kDone;
  }
  w.stage = Stage::kProof;
  return Next::kWait;
}

Listener::Next Listener::proof_read(Waiting &w, const std::string &body) {
  if (body.size() != auth::kProofBytes ||
      !auth::same(auth::prove(options_.auth_key, auth::kInitiatorLabel, w.transcript),
                  reinterpret_cast<const uint8_t *>(body.data()))) {
    log_warning("refused a connection from " + peer_address(w.fd) + " claiming cluster " +
                std::to_string(w.hello.fixed.cluster_id) + ": wrong proof of the link secret");
    answer_and_close(w.fd, handshake::refusal(LLM_AUTH_FAILED));
    return Next::kDone;
  }
  return Next::kGreeted;
}

void Listener::greeted(Waiting &w, Clock::time_point now) {
  const wire::Hello &h = w.hello.fixed;
  if (h.expected_peer_id != options_.cluster_id) {
    answer_and_close(w.fd, handshake::refusal(LLM_LINK_FAILED));
    return;
  }
  // Copies: the hello's fields may lie unaligned in the receive buffer.
  const uint64_t cluster_id = h.cluster_id, link_nonce = h.link_nonce;
  const auto key = std::make_pair(cluster_id, link_nonce);
  auto it = forming_.find(key);
  if (it == forming_.end()) {
    if (forming_.size() >= options_.max_forming) {
      auto oldest = std::min_element(forming_.begin(), forming_.end(), [](const auto &a, const auto &b) {
        return a.second.deadline < b.second.deadline;
      });
      for (int fd : oldest->second.link.fds) {
        if (fd >= 0) ::close(fd);
      }
      forming_.erase(oldest);
      ++evicted_;
    }
    it = forming_.emplace(key, Forming{}).first;
    Forming &f = it->second;
    f.deadline = now + std::chrono::milliseconds(options_.handshake_timeout_ms);
    f.link.peer_id = h.cluster_id;
    f.link.nonce = h.link_nonce;
    f.link.role = h.role;
    f.link.asked = h.conn_count;
    f.link.authenticated = !options_.auth_key.empty();
    f.link.encrypted = (h.flags & wire::kEncrypted) != 0;
    f.link.certificates = (h.flags & wire::kCertificates) != 0;
    const uint32_t granted = std::min(uint32_t{h.conn_count}, options_.connections_per_link);
    f.link.fds.assign(granted, -1);
    f.link.transcripts.assign(granted, {});
    f.link.parts.assign(granted, {});
  }
  Forming &f = it->second;
  forming_count_ = forming_.size();
  if (f.link.asked != h.conn_count || f.link.fds[h.conn_index] >= 0) {
    ::close(w.fd);
    return;
  }
  ::fcntl(w.fd, F_SETFL, ::fcntl(w.fd, F_GETFL) & ~O_NONBLOCK);
  f.link.fds[h.conn_index] = w.fd;
  f.link.transcripts[h.conn_index] = std::move(w.transcript);
  f.link.parts[h.conn_index] = std::move(w.hello.parts);
  if (++f.arrived < f.link.fds.size()) return;
  FormedLink link = std::move(f.link);
  forming_.erase(it);
  forming_count_ = forming_.size();
  on_link_(link);
}

void Listener::answer_and_close(int fd, const std::string &bytes) {
  [[maybe_unused]] ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  ::close(fd);
}

}  // namespace datadist
