#include "transport/tcp_transport.h"

#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <random>
#include <type_traits>

#include "log.h"
#include "transport/auth.h"
#include "transport/socket_util.h"

namespace datadist {

using llm_datadist::LLM_ALREADY_LINK;
using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_NOT_YET_LINK;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;
using llm_datadist::LLM_TIMEOUT;
using wire::FrameHeader;
using wire::FrameType;

namespace {

constexpr int kHandshakeTimeoutMs = 2000;
constexpr auto kFormingLimit = std::chrono::seconds(10);
constexpr auto kDeadlinePoll = std::chrono::milliseconds(20);
constexpr uint32_t kMaxConnections = 64;

uint64_t new_nonce() {
  static std::mt19937_64 gen{std::random_device{}()};
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  return gen();
}

// A handshake frame's body: a fixed part T (Hello or HelloAck), then the
// same-host info and the authentication bytes (a nonce in a hello, a proof
// in an ack) when the fixed part's flags announce them.
template <typename T>
struct Greeting {
  static constexpr size_t kAuthBytes = std::is_same_v<T, wire::Hello> ? auth::kNonceBytes : auth::kProofBytes;
  T fixed{};
  wire::SameHostInfo same_host{};
  std::array<uint8_t, auth::kProofBytes> auth{};

  // The body as sent, without the authentication bytes when `with_auth` is false.
  std::string bytes(bool with_auth = true) const {
    std::string out(reinterpret_cast<const char *>(&fixed), sizeof(T));
    if (fixed.flags & wire::kOffersSameHost) out.append(reinterpret_cast<const char *>(&same_host), sizeof(same_host));
    if (with_auth && (fixed.flags & wire::kAuthenticated)) out.append(reinterpret_cast<const char *>(auth.data()), kAuthBytes);
    return out;
  }
};

bool send_body(int fd, FrameType type, const std::string &body, Status status = LLM_SUCCESS) {
  FrameHeader header = wire::make_header(type, 0, static_cast<uint32_t>(body.size()), 0, status);
  iovec iov[2] = {{&header, sizeof(header)}, {const_cast<char *>(body.data()), body.size()}};
  return net::writev_full(fd, iov, body.empty() ? 1 : 2);
}

// Reads the body of a frame whose header was read: exactly `len` bytes.
bool recv_body(int fd, const FrameHeader &header, size_t len, std::string &body) {
  if (header.body_len != len) return false;
  body.resize(len);
  return len == 0 || net::read_full(fd, body.data(), len);
}

// Reads a handshake frame of type `type` whose header was read.
template <typename T>
bool recv_greeting(int fd, FrameType type, const FrameHeader &header, Greeting<T> &out) {
  if (!wire::check_header(header).empty() || header.type != static_cast<uint16_t>(type)) return false;
  if (header.body_len < sizeof(T) || header.body_len > sizeof(T) + sizeof(out.same_host) + out.kAuthBytes) return false;
  if (!net::read_full(fd, &out.fixed, sizeof(T))) return false;
  const bool offers = (out.fixed.flags & wire::kOffersSameHost) != 0;
  const bool authed = (out.fixed.flags & wire::kAuthenticated) != 0;
  if (header.body_len != sizeof(T) + (offers ? sizeof(out.same_host) : 0) + (authed ? out.kAuthBytes : 0)) return false;
  if (offers && !net::read_full(fd, &out.same_host, sizeof(out.same_host))) return false;
  return !authed || net::read_full(fd, out.auth.data(), out.kAuthBytes);
}

// A refusal: an ack with `status` that names nothing of this end.
void refuse(int fd, Status status) { send_body(fd, FrameType::kHelloAck, Greeting<wire::HelloAck>{}.bytes(), status); }

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

void close_all(const std::vector<int> &fds) {
  for (int fd : fds) {
    if (fd >= 0) ::close(fd);
  }
}

}  // namespace

TcpTransport::TcpTransport(uint64_t cluster_id, uint32_t role, Registry &registry, TransportOptions options)
    : cluster_id_(cluster_id), role_(role), registry_(registry), options_(options) {
  housekeeping_ = std::thread([this] { housekeeping_loop(); });
}

TcpTransport::~TcpTransport() { shutdown(llm_datadist::LLM_LINK_FAILED); }

Status TcpTransport::listen(const std::string &ip, uint16_t port) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return llm_datadist::LLM_FAILED;
  if (listen_fd_ >= 0) return LLM_SUCCESS;
  std::string error;
  uint16_t bound = 0;
  int fd = net::listen_tcp(ip, port, bound, error);
  if (fd < 0) {
    log_warning("cannot listen on " + ip + ":" + std::to_string(port) + ": " + error);
    return LLM_PARAM_INVALID;
  }
  listen_fd_ = fd;
  listen_port_ = bound;
  listen_ip_ = ip;
  accept_thread_ = std::thread([this, fd] { accept_loop(fd); });
  return LLM_SUCCESS;
}

void TcpTransport::stop_listening() {
  std::thread accept;
  int fd;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fd = listen_fd_;
    listen_fd_ = -1;
    listen_port_ = 0;
    listen_ip_.clear();
    accept.swap(accept_thread_);
  }
  if (fd < 0) return;
  ::shutdown(fd, SHUT_RDWR);
  if (accept.joinable()) accept.join();
  ::close(fd);
}

uint16_t TcpTransport::listen_port() const {
  std::lock_guard<std::mutex> lock(mu_);
  return listen_port_;
}

void TcpTransport::accept_loop(int listen_fd) {
  for (;;) {
    int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;  // the listener was shut down
    }
    accept_one(fd);
  }
}

void TcpTransport::accept_one(int fd) {
  net::tune_data_socket(fd, options_.user_timeout_ms);
  net::set_receive_timeout(fd, kHandshakeTimeoutMs);
  FrameHeader header;
  Greeting<wire::Hello> hello;
  const wire::Hello &h = hello.fixed;
  if (!net::read_full(fd, &header, sizeof(header)) || !recv_greeting(fd, FrameType::kHello, header, hello) ||
      h.conn_count == 0 || h.conn_count > kMaxConnections || h.conn_index >= h.conn_count) {
    log_warning("refused a connection from " + peer_address(fd) + ": no valid handshake");
    ::close(fd);
    return;
  }
  // With a secret, the initiator proves it before this end says anything
  // about itself; the transcript is what both proofs cover.
  std::string transcript = hello.bytes();
  const bool authed = (h.flags & wire::kAuthenticated) != 0;
  if (!options_.auth_key.empty() || authed) {
    std::string refusal;
    if (options_.auth_key.empty()) {
      refusal = "it offers a link secret and this end has none";
    } else if (!authed) {
      refusal = "it did not prove the link secret";
    } else {
      std::array<uint8_t, auth::kNonceBytes> nonce;
      auth::random_bytes(nonce.data(), nonce.size());
      transcript.append(reinterpret_cast<const char *>(nonce.data()), nonce.size());
      std::string proof;
      if (!send_body(fd, FrameType::kChallenge, std::string(reinterpret_cast<const char *>(nonce.data()), nonce.size())) ||
          !net::read_full(fd, &header, sizeof(header)) || !wire::check_header(header).empty() ||
          header.type != static_cast<uint16_t>(FrameType::kProof) || !recv_body(fd, header, auth::kProofBytes, proof)) {
        refusal = "no proof of the link secret";
      } else if (!auth::same(auth::prove(options_.auth_key, auth::kInitiatorLabel, transcript),
                             reinterpret_cast<const uint8_t *>(proof.data()))) {
        refusal = "wrong proof of the link secret";
      }
    }
    if (!refusal.empty()) {
      log_warning("refused a connection from " + peer_address(fd) + " claiming cluster " +
                  std::to_string(h.cluster_id) + ": " + refusal);
      refuse(fd, llm_datadist::LLM_AUTH_FAILED);
      ::close(fd);
      return;
    }
  }
  if (h.expected_peer_id != cluster_id_) {
    refuse(fd, LLM_LINK_FAILED);
    ::close(fd);
    return;
  }
  const auto key = std::make_pair(h.cluster_id, h.link_nonce);
  bool complete;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Forming &forming = forming_[key];
    if (forming.fds.empty()) {
      forming.fds.assign(h.conn_count, -1);
      forming.transcripts.assign(h.conn_count, {});
      forming.started = Clock::now();
      forming.role = h.role;
      forming.offers_same_host = (h.flags & wire::kOffersSameHost) != 0;
      forming.same_host = hello.same_host;
    }
    if (forming.fds.size() != h.conn_count || forming.fds[h.conn_index] >= 0) {
      ::close(fd);
      return;
    }
    forming.fds[h.conn_index] = fd;
    forming.transcripts[h.conn_index] = std::move(transcript);
    complete = ++forming.arrived == forming.fds.size();
  }
  if (complete) admit(h.cluster_id, h.link_nonce);
}

void TcpTransport::admit(uint64_t peer_id, uint64_t nonce) {
  Forming forming;
  std::shared_ptr<Link> replaced;
  Status st = LLM_SUCCESS;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = forming_.find({peer_id, nonce});
    forming = std::move(it->second);
    forming_.erase(it);
    auto existing = links_.find(peer_id);
    if (existing != links_.end() && existing->second->initiated_here()) {
      st = LLM_ALREADY_LINK;
    } else if (linking_.count(peer_id) != 0) {
      st = LLM_ALREADY_LINK;
    } else if (existing != links_.end()) {
      replaced = existing->second;  // the peer linked again: its old link is gone
      links_.erase(existing);
    }
  }
  if (replaced) replaced->fail(LLM_LINK_FAILED, "replaced by a new link from the same cluster");
  Greeting<wire::HelloAck> ack;
  ack.fixed = {cluster_id_, role_.load(), 0};
  if (st != LLM_SUCCESS) {
    for (int fd : forming.fds) send_body(fd, FrameType::kHelloAck, ack.bytes(), st);
    close_all(forming.fds);
    return;
  }
  // Both ends want the same-host path: this end offers its own memory and
  // says whether it reached the initiator's.
  LinkPaths paths;
  paths.offered = options_.same_host && forming.offers_same_host;
  if (paths.offered) {
    paths.peer_memory = reach(peer_id, forming.same_host);
    ack.fixed.flags = wire::kOffersSameHost | (paths.peer_memory ? uint32_t{wire::kCopiesForYou} : 0u);
    ack.same_host = same_host::local_info();
  }
  if (!options_.auth_key.empty()) ack.fixed.flags |= wire::kAuthenticated;
  // Known before the initiator hears back, so its link_clusters returns with
  // both ends in place.
  auto link = std::make_shared<Link>(peer_id, forming.role, false, forming.fds, this, paths);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;  // the unstarted link closes its sockets
    links_[peer_id] = link;
    made_.push_back(link);
    ++made_count_[peer_id];
  }
  bool sent = true;
  for (size_t i = 0; i < forming.fds.size(); ++i) {
    if (!options_.auth_key.empty()) {
      ack.auth = auth::prove(options_.auth_key, auth::kAcceptorLabel, forming.transcripts[i] + ack.bytes(false));
    }
    sent = send_body(forming.fds[i], FrameType::kHelloAck, ack.bytes()) && sent;
  }
  if (!sent) {
    link->fail(LLM_LINK_FAILED, "the initiator went away during the handshake");
    return;
  }
  for (int fd : forming.fds) net::set_receive_timeout(fd, 0);
  link->start();
}

Status TcpTransport::greet(int fd, uint64_t peer_id, uint64_t nonce, uint32_t index, uint32_t count,
                           std::string &transcript) {
  Greeting<wire::Hello> hello;
  hello.fixed = {cluster_id_, peer_id, nonce, role_.load(), index, count, 0};
  if (options_.same_host) {
    hello.fixed.flags |= wire::kOffersSameHost;
    hello.same_host = same_host::local_info();
  }
  const bool authed = !options_.auth_key.empty();
  if (authed) {
    hello.fixed.flags |= wire::kAuthenticated;
    auth::random_bytes(hello.auth.data(), auth::kNonceBytes);
  }
  transcript = hello.bytes();
  if (!send_body(fd, FrameType::kHello, transcript)) return LLM_LINK_FAILED;
  if (!authed) return LLM_SUCCESS;
  // The acceptor's challenge, or its refusal.
  FrameHeader header;
  std::string body;
  if (!net::read_full(fd, &header, sizeof(header)) || !wire::check_header(header).empty()) {
    return (errno == EAGAIN || errno == EWOULDBLOCK) ? LLM_TIMEOUT : LLM_LINK_FAILED;
  }
  if (header.type == static_cast<uint16_t>(FrameType::kHelloAck) && header.status != LLM_SUCCESS) {
    return header.status;
  }
  if (header.type != static_cast<uint16_t>(FrameType::kChallenge) || !recv_body(fd, header, auth::kNonceBytes, body)) {
    return LLM_LINK_FAILED;
  }
  transcript += body;
  const auth::Proof proof = auth::prove(options_.auth_key, auth::kInitiatorLabel, transcript);
  const std::string sent(reinterpret_cast<const char *>(proof.data()), proof.size());
  return send_body(fd, FrameType::kProof, sent) ? LLM_SUCCESS : LLM_LINK_FAILED;
}

Status TcpTransport::link(uint64_t peer_id, const std::string &ip, uint16_t port, const std::string &local_ip,
                          int timeout_ms) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return llm_datadist::LLM_FAILED;
    if (links_.count(peer_id) != 0 || !linking_.insert(peer_id).second) return LLM_ALREADY_LINK;
  }
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto remaining = [&] {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return static_cast<int>(left > 0 ? left : 0);
  };
  std::vector<int> fds;
  std::vector<std::string> transcripts;
  Status st = LLM_SUCCESS;
  const uint64_t nonce = new_nonce();
  const uint32_t count = options_.connections_per_peer;
  for (uint32_t i = 0; i < count && st == LLM_SUCCESS; ++i) {
    bool timed_out = false;
    int fd = net::connect_tcp(ip, port, local_ip, remaining(), timed_out);
    if (fd < 0) {
      st = timed_out ? LLM_TIMEOUT : LLM_LINK_FAILED;
      break;
    }
    fds.push_back(fd);
    net::tune_data_socket(fd, options_.user_timeout_ms);
    net::set_receive_timeout(fd, std::max(1, remaining()));
    transcripts.emplace_back();
    st = greet(fd, peer_id, nonce, i, count, transcripts.back());
  }
  uint32_t peer_role = 0;
  Greeting<wire::HelloAck> ack;
  for (size_t i = 0; i < fds.size() && st == LLM_SUCCESS; ++i) {
    const int left = remaining();
    if (left == 0) {
      st = LLM_TIMEOUT;
      break;
    }
    net::set_receive_timeout(fds[i], left);
    FrameHeader header;
    if (!net::read_full(fds[i], &header, sizeof(header)) || !recv_greeting(fds[i], FrameType::kHelloAck, header, ack)) {
      st = (errno == EAGAIN || errno == EWOULDBLOCK) ? LLM_TIMEOUT : LLM_LINK_FAILED;
    } else if (header.status != LLM_SUCCESS) {
      st = header.status;
    } else if (!options_.auth_key.empty() &&
               ((ack.fixed.flags & wire::kAuthenticated) == 0 ||
                !auth::same(auth::prove(options_.auth_key, auth::kAcceptorLabel, transcripts[i] + ack.bytes(false)),
                            ack.auth.data()))) {
      log_warning("cluster " + std::to_string(peer_id) + " at " + ip + ":" + std::to_string(port) +
                  " did not prove the link secret");
      st = llm_datadist::LLM_AUTH_FAILED;
    } else if (ack.fixed.cluster_id != peer_id) {
      st = LLM_LINK_FAILED;
    }
    peer_role = ack.fixed.role;
  }
  // The peer offered its memory in return: probe it, and tell it (first
  // frame of the link) when reached.
  LinkPaths paths;
  if (st == LLM_SUCCESS && options_.same_host && (ack.fixed.flags & wire::kOffersSameHost) != 0) {
    paths.offered = true;
    paths.peer_copies = (ack.fixed.flags & wire::kCopiesForYou) != 0;
    paths.peer_memory = reach(peer_id, ack.same_host);
    paths.announce = true;
  }
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(mu_);
    linking_.erase(peer_id);
    if (st == LLM_SUCCESS && stopping_) st = llm_datadist::LLM_FAILED;
    if (st == LLM_SUCCESS) {
      for (int fd : fds) net::set_receive_timeout(fd, 0);
      link = std::make_shared<Link>(peer_id, peer_role, true, fds, this, paths);
      links_[peer_id] = link;
      made_.push_back(link);
      ++made_count_[peer_id];
    }
  }
  if (!link) {
    close_all(fds);
    return st;
  }
  link->start();
  return LLM_SUCCESS;
}

Status TcpTransport::unlink(uint64_t peer_id, bool force, int timeout_ms) {
  std::shared_ptr<Link> link;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(peer_id);
    if (it == links_.end()) return force ? LLM_SUCCESS : LLM_NOT_YET_LINK;
    link = it->second;
    links_.erase(it);
  }
  const Status st = force ? LLM_SUCCESS : link->request_unlink(timeout_ms);
  // Closing the connections also tells a peer that did not answer.
  link->fail(LLM_LINK_FAILED, "");
  return st == LLM_SUCCESS ? LLM_SUCCESS : llm_datadist::LLM_UNLINK_FAILED;
}

void TcpTransport::detach(const std::shared_ptr<Link> &link) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(link->peer_id());
  if (it != links_.end() && it->second == link) links_.erase(it);
}

std::shared_ptr<same_host::PeerMemory> TcpTransport::reach(uint64_t peer_id, const wire::SameHostInfo &info) {
  std::string why;
  switch (same_host::probe(info, why)) {
    case same_host::Probe::kReachable:
      return std::make_shared<same_host::PeerMemory>(static_cast<pid_t>(info.pid));
    case same_host::Probe::kRefused:
      if (!refusal_logged_.exchange(true)) {
        log_warning("the kernel refuses copies between this process and cluster " + std::to_string(peer_id) +
                    " on the same host (" + why +
                    "; ptrace rules, seccomp, a container or another user); such links move their bytes over TCP");
      }
      return nullptr;
    default:
      return nullptr;
  }
}

const char *TcpTransport::link_transport(uint64_t peer_id) const {
  std::shared_ptr<Link> link = find(peer_id);
  return link ? link->transport() : nullptr;
}

uint64_t TcpTransport::links_made(uint64_t peer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = made_count_.find(peer_id);
  return it == made_count_.end() ? 0 : it->second;
}

std::shared_ptr<Link> TcpTransport::find(uint64_t peer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(peer_id);
  return it == links_.end() ? nullptr : it->second;
}

size_t TcpTransport::link_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return links_.size();
}

void TcpTransport::link_down(const std::shared_ptr<Link> &link) {
  bool lost = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(link->peer_id());
    if (it != links_.end() && it->second == link) {
      links_.erase(it);
      lost = !stopping_;  // an unlink from either end has removed it already
    }
    down_.push_back(link);
    ++generation_;
  }
  cv_.notify_all();
  if (lost && loss_observer_) loss_observer_(link->peer_id());
}

void TcpTransport::operations_started() {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++generation_;
    // Already polling deadlines, the housekeeper sees the new operations at
    // its next round; only an idle one needs waking (a wake-up per operation
    // costs the latency of small transfers).
    wake = housekeeper_idle_;
  }
  if (wake) cv_.notify_all();
}

void TcpTransport::reap(const std::vector<std::shared_ptr<Link>> &links) {
  for (auto &link : links) link->reap();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto &link : links) made_.erase(std::remove(made_.begin(), made_.end(), link), made_.end());
}

void TcpTransport::reap_down_links() {
  std::vector<std::shared_ptr<Link>> down;
  {
    std::lock_guard<std::mutex> lock(mu_);
    down.swap(down_);
  }
  reap(down);
}

void TcpTransport::housekeeping_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    bool open = !forming_.empty();
    for (auto &entry : links_) open = open || entry.second->open_operations() != 0;
    const uint64_t seen = generation_;
    auto woken = [&] { return stopping_ || !down_.empty() || generation_ != seen; };
    if (open) {
      cv_.wait_for(lock, kDeadlinePoll, woken);
    } else {
      housekeeper_idle_ = true;
      cv_.wait(lock, woken);
      housekeeper_idle_ = false;
    }
    if (stopping_) return;
    const Clock::time_point now = Clock::now();
    std::vector<std::shared_ptr<Link>> overdue;
    for (auto &entry : links_) {
      if (entry.second->overdue(now)) overdue.push_back(entry.second);
    }
    std::vector<int> stale;
    for (auto it = forming_.begin(); it != forming_.end();) {
      if (now - it->second.started < kFormingLimit) {
        ++it;
        continue;
      }
      stale.insert(stale.end(), it->second.fds.begin(), it->second.fds.end());
      it = forming_.erase(it);
    }
    lock.unlock();
    close_all(stale);
    for (auto &link : overdue) link->fail(LLM_TIMEOUT, "an operation exceeded sync_kv_timeout; closing the link");
    reap_down_links();
    lock.lock();
  }
}

void TcpTransport::shutdown(Status reason) {
  stop_listening();
  std::thread housekeeping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !housekeeping_.joinable()) return;
    stopping_ = true;
    housekeeping.swap(housekeeping_);
    for (auto &entry : forming_) close_all(entry.second.fds);
    forming_.clear();
  }
  cv_.notify_all();
  if (housekeeping.joinable()) housekeeping.join();
  // Every link made, including one whose threads are still telling us it
  // went down: reaping joins those threads.
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    links = made_;
  }
  for (auto &link : links) link->fail(reason, "");
  reap(links);
  std::lock_guard<std::mutex> lock(mu_);
  links_.clear();
  down_.clear();
}

}  // namespace datadist
