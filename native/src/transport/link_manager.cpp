#include "transport/link_manager.h"

#include <dirent.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <random>
#include <system_error>
#include <type_traits>

#include "error_detail.h"
#include "log.h"
#include "thread_name.h"
#include "transport/auth.h"
#include "transport/handshake.h"
#include "transport/socket_util.h"
#include "transport/tls.h"

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

constexpr size_t kMaxMadeCounts = 8 * kMaxLinks;

uint64_t new_nonce() {
  static std::mt19937_64 gen{std::random_device{}()};
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  return gen();
}

bool send_body(int fd, FrameType type, const std::string &body, Status status = LLM_SUCCESS) {
  const std::string bytes = handshake::frame(type, body, status);
  return net::write_full(fd, bytes.data(), bytes.size());
}

// Reads the body of a frame whose header was read: exactly `len` bytes.
bool recv_body(int fd, const FrameHeader &header, size_t len, std::string &body) {
  if (header.body_len != len) return false;
  body.resize(len);
  return len == 0 || net::read_full(fd, body.data(), len);
}

// Reads an ack whose header was read.
bool recv_ack(int fd, const FrameHeader &header, handshake::HelloAck &out) {
  if (!wire::check_header(header).empty() || header.type != static_cast<uint16_t>(FrameType::kHelloAck) ||
      header.body_len > handshake::HelloAck::kMaxBytes) {
    return false;
  }
  std::string body(header.body_len, '\0');
  return net::read_full(fd, body.data(), body.size()) && out.parse(body);
}

void close_all(const std::vector<int> &fds) {
  for (int fd : fds) {
    if (fd >= 0) ::close(fd);
  }
}

void send_to_all(const std::vector<int> &fds, const std::string &bytes) {
  for (int fd : fds) net::write_full(fd, bytes.data(), bytes.size());
}

}  // namespace

// Watches the answer hub's fd (readable while an answer waits unread):
// once it fires, the timer comes back sweep_after later and reads what
// nobody read meanwhile; only then is the fd watched again.
class LinkManager::AnswerWatch : public IoHandler {
 public:
  AnswerWatch(AnswerHub &hub, DeadlineTimer &timer) : hub_(hub), timer_(timer) {}
  bool start(IoLoop &loop, const std::shared_ptr<AnswerWatch> &self) {
    loop_ = &loop;
    id_ = loop.add(hub_.fd(), std::weak_ptr<IoHandler>(self), 0);
    return id_ != 0 && loop.arm(id_, EPOLLIN);
  }
  void stop() {
    if (id_ != 0) loop_->remove(id_);
  }
  void on_ready(uint64_t, uint32_t) override {
    const auto after = hub_.sweep_after();
    if (after.count() == 0) return;  // the sweep is off: not watched again
    const Clock::time_point due = Clock::now() + after;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pending_ = true;
      due_ = due;
      seen_ = hub_.drives();
    }
    timer_.at(due);
  }
  // From the timer: sweeps when due, then watches the fd again.
  void on_timer(Clock::time_point now) {
    uint64_t seen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!pending_ || now < due_) return;
      pending_ = false;
      seen = seen_;
    }
    hub_.sweep(seen);
    loop_->arm(id_, EPOLLIN);
  }

 private:
  AnswerHub &hub_;
  DeadlineTimer &timer_;
  IoLoop *loop_ = nullptr;
  uint64_t id_ = 0;
  std::mutex mu_;
  bool pending_ = false;  // the fd fired; the sweep is due at due_ (mu_)
  Clock::time_point due_{};
  uint64_t seen_ = 0;  // the hub's drives() then
};

LinkManager::LinkManager(uint64_t cluster_id, uint32_t role, Registry &registry, TransportOptions options)
    : cluster_id_(cluster_id),
      role_(role),
      registry_(registry),
      options_(options),
      io_loop_(options.io_threads),
      kinds_(make_kinds(options.paths, PathServices{io_loop_, registry, options.answers})) {
  housekeeping_ = std::thread([this] {
    name_this_thread("dd-keeper");
    housekeeping_loop();
  });
}

LinkManager::~LinkManager() { shutdown(llm_datadist::LLM_LINK_FAILED); }

Status LinkManager::start_paths() {
  for (const auto &kind : kinds_) {
    std::string why;
    const Status st = kind->start(why);
    if (st != LLM_SUCCESS) return refuse(st, why);
  }
  return LLM_SUCCESS;
}

Status LinkManager::listen(const std::string &ip, uint16_t port) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return llm_datadist::LLM_FAILED;
  if (listener_) return LLM_SUCCESS;
  ListenerOptions opts;
  opts.cluster_id = cluster_id_;
  opts.auth_key = options_.auth_key;
  opts.connections_per_link = options_.connections_per_peer;
  opts.user_timeout_ms = options_.user_timeout_ms;
  opts.handshake_timeout_ms = options_.handshake_timeout_ms;
  auto listener = std::make_unique<Listener>(opts, [this](FormedLink &formed) { admit(formed); });
  std::string error;
  if (!listener->start(ip, port, error)) {
    log_warning("cannot listen on " + ip + ":" + std::to_string(port) + ": " + error);
    return LLM_PARAM_INVALID;
  }
  listen_port_ = listener->port();
  listen_ip_ = ip;
  listener_ = std::move(listener);
  return LLM_SUCCESS;
}

void LinkManager::stop_listening() {
  std::unique_ptr<Listener> listener;
  {
    std::lock_guard<std::mutex> lock(mu_);
    listener.swap(listener_);
    listen_port_ = 0;
    listen_ip_.clear();
  }
  if (listener) listener->stop();
}

uint16_t LinkManager::listen_port() const {
  std::lock_guard<std::mutex> lock(mu_);
  return listen_port_;
}

ListenerStats LinkManager::listener_stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return listener_ ? listener_->stats() : ListenerStats{};
}

bool LinkManager::may_replace(const std::shared_ptr<Link> &existing, const FormedLink &formed) {
  // A link whose peer has closed it (a forced unlink, an exit) is gone,
  // whether or not this end's readers have seen it yet.
  if (formed.authenticated || existing->is_down() || existing->peer_closed()) return true;
  // A stranger may claim any id without a secret. The link stays while it
  // answers; a probe with a deadline finds out whether it still does (the
  // timer fails it at the deadline otherwise).
  existing->probe(Clock::now() + std::chrono::milliseconds(options_.user_timeout_ms));
  log_warning("refused a link from " + std::to_string(formed.peer_id) +
              ": a link with that cluster is up and this end has no secret to tell them apart");
  return false;
}

void LinkManager::admit(FormedLink &formed) {
  const uint64_t peer_id = formed.peer_id;
  std::shared_ptr<Link> existing;
  Status st = LLM_SUCCESS;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(peer_id);
    if (it != links_.end()) existing = it->second;
    if ((existing && existing->initiated_here()) || linking_.count(peer_id) != 0) {
      st = LLM_ALREADY_LINK;
    } else if (!existing && links_.size() + linking_.size() >= kMaxLinks) {
      st = llm_datadist::LLM_CLUSTER_NUM_EXCEED_LIMIT;
    } else if (!start_timer_locked()) {
      st = LLM_LINK_FAILED;
    }
  }
  if (st == LLM_SUCCESS && existing && !may_replace(existing, formed)) st = LLM_ALREADY_LINK;
  handshake::HelloAck ack;
  ack.fixed = {cluster_id_, role_.load(), 0};
  if (options_.encrypt) ack.fixed.flags |= wire::kEncrypted;
  if (options_.certs) ack.fixed.flags |= wire::kCertificates;
  if (st == LLM_SUCCESS && (formed.encrypted != options_.encrypt || formed.certificates != (options_.certs != nullptr))) {
    // Said back, with this end's setting, so the initiator can name both.
    log_warning("refused a link from " + encryption_differs(peer_id, formed.encrypted, formed.certificates));
    ack.fixed.flags |= wire::kEncryptionDiffers;
    st = LLM_LINK_FAILED;
  }
  if (st != LLM_SUCCESS) {
    send_to_all(formed.fds, handshake::frame(FrameType::kHelloAck, ack.bytes(), st));
    close_all(formed.fds);
    return;
  }
  PathTalks talks = path_talks(peer_id, true);
  int answers = -1;  // the link's answer socket, where it has one
  std::string why;
  if (settle_paths(talks, &formed, nullptr, why) != LLM_SUCCESS) {
    log_warning("refused a link from " + std::to_string(peer_id) + ": " + why);
    send_to_all(formed.fds, handshake::frame(FrameType::kHelloAck, ack.bytes(), LLM_LINK_FAILED));
    close_all(formed.fds);
    return;
  }
  // The peer linked again: its old link is gone, reaped before the new one
  // moves bytes (nothing its paths started lands after).
  if (existing) existing->fail(LLM_LINK_FAILED, "replaced by a new link from the same cluster");
  reap_down_links_of(peer_id);
  if (formed.fds.size() < formed.asked) {
    ack.fixed.flags |= wire::kGrantsConnections;
    ack.granted = static_cast<uint32_t>(formed.fds.size());
  }
  if (!options_.auth_key.empty()) ack.fixed.flags |= wire::kAuthenticated;
  // The link runs on descriptors a path took from the initiator when one
  // could take them all; its TCP connections then only carry the acks, and
  // close after.
  std::vector<int> link_fds = formed.fds;
  struct CloseAtEnd {
    std::vector<int> fds;
    ~CloseAtEnd() { close_all(fds); }
  } tcp_after;
  for (auto &talk : talks) {
    std::vector<int> taken;
    if (talk && talk->take_connections(formed.fds.size(), options_.answers != nullptr, taken, answers)) {
      ack.fixed.flags |= wire::kConnectionsMoved | (answers >= 0 ? uint32_t{wire::kAnswerSocket} : 0u);
      tcp_after.fds = formed.fds;
      link_fds = std::move(taken);
      break;
    }
  }
  // What this end says back: the paths it took.
  ack.parts = parts_of(talks, [](PathHandshake &talk) { return talk.ack_part(); });
  // TLS on the connections the link keeps on TCP; the I/O threads run each
  // handshake once the initiator, past its ack, starts it.
  std::vector<std::unique_ptr<tls::Session>> sessions;
  if (options_.encrypt && (ack.fixed.flags & wire::kConnectionsMoved) == 0) {
    std::string tls_why;
    sessions = secure(link_fds, true, formed.transcripts, ack.bytes(false), tls_why);
    if (sessions.empty()) {
      log_warning("refused a link from " + std::to_string(peer_id) + ": " + tls_why);
      send_to_all(formed.fds, handshake::refusal(LLM_LINK_FAILED));
      close_all(formed.fds);
      if (answers >= 0) ::close(answers);
      return;
    }
  }
  const bool handshakes = !sessions.empty();
  const Clock::time_point handshake_deadline = Clock::now() + std::chrono::milliseconds(options_.handshake_timeout_ms);
  std::shared_ptr<Link> link;
  try {
    link = std::make_shared<Link>(peer_id, formed.role, false, link_fds, this, link_paths(talks), answers,
                                  std::move(sessions));
    if (handshakes) link->set_handshake_deadline(handshake_deadline);
  } catch (const std::bad_alloc &) {
    send_to_all(formed.fds, handshake::refusal(LLM_LINK_FAILED));
    close_all(link_fds);
    if (answers >= 0) ::close(answers);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;  // the unstarted link closes its sockets
    made_.push_back(link);  // from now on shutdown() reaps it, whatever happens
  }
  // Threads first: a link that cannot have them is refused, and only a
  // started link is known (before the initiator hears back, so its
  // link_clusters returns with both ends in place).
  if (!link->start()) {
    log_warning("refused a link from " + std::to_string(peer_id) + ": cannot start its threads");
    send_to_all(formed.fds, handshake::refusal(LLM_LINK_FAILED));
    link->fail(LLM_LINK_FAILED, "");
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!publish(peer_id, link)) return;  // the initiator is gone: its link fails there
  }
  // A peer that proved the secret and then does not finish its TLS
  // handshakes holds nothing past the handshake timeout.
  if (handshakes) timer_->at(handshake_deadline);
  bool sent = true;
  for (size_t i = 0; i < formed.fds.size(); ++i) {
    if (!options_.auth_key.empty()) {
      ack.auth = auth::prove(options_.auth_key, auth::kAcceptorLabel, formed.transcripts[i] + ack.bytes(false));
    }
    sent = send_body(formed.fds[i], FrameType::kHelloAck, ack.bytes()) && sent;
  }
  if (!sent) link->fail(LLM_LINK_FAILED, "the initiator went away during the handshake");
}

LinkManager::PathTalks LinkManager::path_talks(uint64_t peer_id, bool acceptor) {
  PathTalks talks;
  for (const auto &kind : kinds_) talks.push_back(kind->handshake(peer_id, acceptor));
  return talks;
}

handshake::Parts LinkManager::parts_of(PathTalks &talks, const std::function<std::string(PathHandshake &)> &part) {
  handshake::Parts parts;
  for (size_t i = 0; i < talks.size(); ++i) {
    if (!talks[i]) continue;
    std::string bytes = part(*talks[i]);
    if (!bytes.empty()) parts.push_back({kinds_[i]->id(), std::move(bytes)});
  }
  return parts;
}

Status LinkManager::settle_paths(PathTalks &talks, const FormedLink *hellos, const handshake::Parts *ack,
                                 std::string &why) {
  bool served = false;
  for (const bool yielding : {false, true}) {
    for (size_t i = 0; i < talks.size(); ++i) {
      if (!talks[i] || kinds_[i]->yields() != yielding) continue;
      const uint16_t id = kinds_[i]->id();
      Status st;
      if (hellos != nullptr) {
        std::vector<std::string> parts;
        for (const handshake::Parts &conn : hellos->parts) {
          const std::string *part = handshake::find_part(conn, id);
          parts.push_back(part != nullptr ? *part : std::string());
        }
        st = talks[i]->accept(parts, served, why);
      } else {
        const std::string *part = handshake::find_part(*ack, id);
        st = talks[i]->settle(part != nullptr ? *part : std::string(), served, why);
      }
      if (st != LLM_SUCCESS) return st;
      served = served || talks[i]->serves_peer();
    }
  }
  return LLM_SUCCESS;
}

std::vector<std::shared_ptr<DataPath>> LinkManager::link_paths(PathTalks &talks) {
  std::vector<std::shared_ptr<DataPath>> paths;
  for (auto &talk : talks) {
    if (talk) talk->paths(paths);
  }
  return paths;
}

bool LinkManager::start_timer_locked() {
  if (timer_) return true;
  // With the first link, as the I/O loop's threads.
  std::shared_ptr<DeadlineTimer> timer = DeadlineTimer::create(io_loop_, [this] { on_timer(); });
  if (!timer) return false;
  if (options_.answers != nullptr) {
    auto watch = std::make_shared<AnswerWatch>(*options_.answers, *timer);
    if (!watch->start(io_loop_, watch)) {
      timer->stop();
      return false;
    }
    answer_watch_ = std::move(watch);
  }
  timer_ = std::move(timer);
  return true;
}

bool LinkManager::publish(uint64_t peer_id, const std::shared_ptr<Link> &link) {
  // Link::fail marks the link down before it calls link_down(), which takes
  // mu_: seen up here, a later loss finds it in links_.
  if (link->is_down()) return false;
  links_[peer_id] = link;
  ++made_count_[peer_id];
  for (auto it = made_count_.begin(); made_count_.size() > kMaxMadeCounts && it != made_count_.end();) {
    it = links_.count(it->first) == 0 ? made_count_.erase(it) : std::next(it);
  }
  return true;
}

std::string LinkManager::encryption_differs(uint64_t peer_id, bool peer_encrypts, bool peer_certificates) const {
  auto name = [](bool on, bool certificates) {
    return !on ? "\"off\"" : certificates ? "\"tls\" with certificates" : "\"tls\"";
  };
  return words("cluster ", peer_id, ": link encryption differs (link_encryption ",
               name(options_.encrypt, options_.certs != nullptr), " on this end, cluster ", cluster_id_, "; ",
               name(peer_encrypts, peer_certificates), " on cluster ", peer_id,
               "); set the same LLMConfig.link_encryption (llm.LinkEncryption), and certificates (tls_cert_file, "
               "tls_key_file, tls_ca_file) on both or on neither");
}

bool LinkManager::encrypts_alike(uint32_t flags) const {
  return ((flags & wire::kEncrypted) != 0) == options_.encrypt &&
         ((flags & wire::kCertificates) != 0) == (options_.certs != nullptr);
}

std::vector<std::unique_ptr<tls::Session>> LinkManager::secure(const std::vector<int> &fds, bool server,
                                                               const std::vector<std::string> &transcripts,
                                                               const std::string &ack, std::string &why) {
  std::vector<std::unique_ptr<tls::Session>> sessions;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (i >= transcripts.size()) {
      why = "a connection without a handshake";
      return {};
    }
    // Certificates authenticate the TLS handshake themselves: no key from the secret.
    const tls::Key key = options_.certs ? tls::Key{} : tls::derive_key(options_.auth_key, transcripts[i] + ack);
    std::unique_ptr<tls::Session> session = tls::Session::create(fds[i], server, key, why, options_.certs.get());
    if (!session) return {};
    sessions.push_back(std::move(session));
  }
  return sessions;
}

Status LinkManager::greet(int fd, uint64_t peer_id, uint64_t nonce, uint32_t index, uint32_t count,
                           handshake::Parts parts, std::string &transcript, uint32_t &granted) {
  handshake::Hello hello;
  hello.fixed = {cluster_id_, peer_id, nonce, role_.load(), index, count, 0};
  hello.parts = std::move(parts);
  if (options_.encrypt) hello.fixed.flags |= wire::kEncrypted;
  if (options_.certs) hello.fixed.flags |= wire::kCertificates;
  const bool authed = !options_.auth_key.empty();
  if (authed) {
    hello.fixed.flags |= wire::kAuthenticated;
    auth::random_bytes(hello.auth.data(), auth::kNonceBytes);
  }
  transcript = hello.bytes();
  if (!send_body(fd, FrameType::kHello, transcript)) return LLM_LINK_FAILED;
  if (!authed) return LLM_SUCCESS;
  // The acceptor's challenge, its refusal, or (a connection past those it
  // grants) the count it grants.
  FrameHeader header;
  std::string body;
  if (!net::read_full(fd, &header, sizeof(header)) || !wire::check_header(header).empty()) {
    return (errno == EAGAIN || errno == EWOULDBLOCK) ? LLM_TIMEOUT : LLM_LINK_FAILED;
  }
  if (header.type == static_cast<uint16_t>(FrameType::kHelloAck)) {
    handshake::HelloAck ack;
    if (header.status != LLM_SUCCESS) return header.status;
    if (!recv_ack(fd, header, ack) || !ack.grants() || ack.granted == 0 || ack.granted > index) return LLM_LINK_FAILED;
    granted = ack.granted;
    return LLM_SUCCESS;
  }
  if (header.type != static_cast<uint16_t>(FrameType::kChallenge) || !recv_body(fd, header, auth::kNonceBytes, body)) {
    return LLM_LINK_FAILED;
  }
  transcript += body;
  const auth::Proof proof = auth::prove(options_.auth_key, auth::kInitiatorLabel, transcript);
  const std::string sent(reinterpret_cast<const char *>(proof.data()), proof.size());
  return send_body(fd, FrameType::kProof, sent) ? LLM_SUCCESS : LLM_LINK_FAILED;
}

Status LinkManager::link(uint64_t peer_id, const std::string &ip, uint16_t port, const std::string &local_ip,
                          int timeout_ms) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return llm_datadist::LLM_FAILED;
    if (links_.count(peer_id) != 0 || linking_.count(peer_id) != 0) return LLM_ALREADY_LINK;
    if (links_.size() + linking_.size() >= kMaxLinks) return llm_datadist::LLM_CLUSTER_NUM_EXCEED_LIMIT;
    if (!start_timer_locked()) return LLM_LINK_FAILED;
    linking_.insert(peer_id);
  }
  // A link to the peer that went down is reaped first (nothing its paths
  // or puts lands after the new link's operations).
  reap_down_links_of(peer_id);
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto remaining = [&] {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    return static_cast<int>(left > 0 ? left : 0);
  };
  std::vector<int> fds;
  std::vector<std::string> transcripts;
  PathTalks talks = path_talks(peer_id, false);
  Status st = LLM_SUCCESS;
  const uint64_t nonce = new_nonce();
  const uint32_t count = options_.connections_per_peer;
  uint32_t granted = 0;  // set when a surplus connection was answered
  for (uint32_t i = 0; i < count && st == LLM_SUCCESS && granted == 0; ++i) {
    bool timed_out = false;
    int fd = net::connect_tcp(ip, port, local_ip, remaining(), timed_out);
    if (fd < 0) {
      st = timed_out ? LLM_TIMEOUT : LLM_LINK_FAILED;
      break;
    }
    net::tune_data_socket(fd, options_.user_timeout_ms);
    net::set_receive_timeout(fd, std::max(1, remaining()));
    std::string transcript;
    st = greet(fd, peer_id, nonce, i, count, parts_of(talks, [i](PathHandshake &talk) { return talk.hello_part(i); }), transcript, granted);
    if (granted != 0) {
      ::close(fd);  // past what the acceptor keeps
      break;
    }
    fds.push_back(fd);
    transcripts.push_back(std::move(transcript));
  }
  uint32_t peer_role = 0;
  handshake::HelloAck ack;
  handshake::HelloAck first;
  std::vector<std::string> ack_bytes;  // per connection, what its TLS key covers of the ack
  for (size_t i = 0; i < fds.size() && st == LLM_SUCCESS; ++i) {
    const int left = remaining();
    if (left == 0) {
      st = LLM_TIMEOUT;
      break;
    }
    net::set_receive_timeout(fds[i], left);
    FrameHeader header;
    if (!net::read_full(fds[i], &header, sizeof(header)) || !recv_ack(fds[i], header, ack)) {
      st = (errno == EAGAIN || errno == EWOULDBLOCK) ? LLM_TIMEOUT : LLM_LINK_FAILED;
    } else if (header.status != LLM_SUCCESS) {
      st = header.status;
      if ((ack.fixed.flags & wire::kEncryptionDiffers) != 0) {
        st = refuse(st, "link to " + encryption_differs(peer_id, (ack.fixed.flags & wire::kEncrypted) != 0,
                                                          (ack.fixed.flags & wire::kCertificates) != 0));
      }
    } else if (!options_.auth_key.empty() &&
               (!ack.authenticated() ||
                !auth::same(auth::prove(options_.auth_key, auth::kAcceptorLabel, transcripts[i] + ack.bytes(false)),
                            ack.auth.data()))) {
      log_warning("cluster " + std::to_string(peer_id) + " at " + ip + ":" + std::to_string(port) +
                  " did not prove the link secret");
      st = llm_datadist::LLM_AUTH_FAILED;
    } else if (ack.fixed.cluster_id != peer_id) {
      st = LLM_LINK_FAILED;
    } else if (!encrypts_alike(ack.fixed.flags)) {
      // An acceptor that does not know the flag, or did not check it.
      st = refuse(LLM_LINK_FAILED, "link to " + encryption_differs(peer_id, (ack.fixed.flags & wire::kEncrypted) != 0,
                                                                   (ack.fixed.flags & wire::kCertificates) != 0));
    } else {
      ack_bytes.push_back(ack.bytes(false));
      // The acceptor decides how many connections the link has; every ack
      // says the same. Connections past them were answered and closed.
      const uint32_t kept = ack.grants() ? ack.granted : count;
      if (i == 0 && kept >= 1 && kept <= fds.size()) {
        close_all(std::vector<int>(fds.begin() + kept, fds.end()));
        fds.resize(kept);
        transcripts.resize(kept);
      }
      if (kept != fds.size()) st = LLM_LINK_FAILED;
      // Every ack says the same of the link: whether its connections moved,
      // and the paths' parts.
      if (i == 0) first = ack;
      if (((first.fixed.flags ^ ack.fixed.flags) & (wire::kConnectionsMoved | wire::kAnswerSocket)) != 0 ||
          first.parts != ack.parts) {
        st = LLM_LINK_FAILED;
      }
    }
    peer_role = ack.fixed.role;
  }
  // The paths, from what the acceptor took.
  int answers = -1;  // the link's answer socket, where it has one
  if (st == LLM_SUCCESS) {
    std::string why;
    st = settle_paths(talks, nullptr, &ack.parts, why);
    if (st != LLM_SUCCESS) {
      log_warning("link to cluster " + std::to_string(peer_id) + " at " + ip + ":" + std::to_string(port) + ": " + why);
    }
  }
  // The acceptor took the descriptors a path offered: the link runs on this
  // end's halves (and its answer socket, which it takes only beside them).
  const bool moved = (ack.fixed.flags & wire::kConnectionsMoved) != 0;
  if (st == LLM_SUCCESS && (moved || (ack.fixed.flags & wire::kAnswerSocket) != 0)) {
    std::vector<int> halves;
    bool found = false;
    for (auto &talk : talks) {
      found = moved && talk &&
              talk->moved_connections(fds.size(), (ack.fixed.flags & wire::kAnswerSocket) != 0, halves, answers);
      if (found) break;
    }
    if (!found) {
      st = LLM_LINK_FAILED;
    } else {
      close_all(fds);
      fds = std::move(halves);
    }
  }
  // TLS on the connections the link keeps on TCP, each handshake to its end here.
  std::vector<std::unique_ptr<tls::Session>> sessions;
  if (st == LLM_SUCCESS && options_.encrypt && !moved) {
    std::string why;
    transcripts.resize(std::min(transcripts.size(), ack_bytes.size()));
    for (size_t i = 0; i < transcripts.size(); ++i) transcripts[i] += ack_bytes[i];
    sessions = secure(fds, false, transcripts, "", why);
    for (size_t i = 0; i < sessions.size() && why.empty(); ++i) {
      if (!sessions[i]->handshake_until(deadline)) why = sessions[i]->error();
    }
    if (sessions.empty() || !why.empty()) {
      st = refuse(LLM_LINK_FAILED, words("the TLS handshake with cluster ", peer_id, " at ", ip, ":", port,
                                         " failed: ", why));
      sessions.clear();
    }
  }
  std::shared_ptr<Link> link;
  if (st == LLM_SUCCESS) {
    for (int fd : fds) net::set_receive_timeout(fd, 0);
    try {
      link = std::make_shared<Link>(peer_id, peer_role, true, fds, this, link_paths(talks), answers,
                                    std::move(sessions));
      fds.clear();  // the link's now
    } catch (const std::bad_alloc &) {
      st = LLM_LINK_FAILED;
      if (answers >= 0) ::close(answers);
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (st == LLM_SUCCESS && stopping_) st = llm_datadist::LLM_FAILED;
    if (st == LLM_SUCCESS) {
      made_.push_back(link);  // from now on shutdown() reaps it, whatever happens
    } else {
      linking_.erase(peer_id);
    }
  }
  if (st != LLM_SUCCESS) {
    close_all(fds);
    return st;  // an unstarted link closes its connections
  }
  if (!link->start()) {
    log_warning("link to cluster " + std::to_string(peer_id) + ": cannot start its threads");
    link->fail(LLM_LINK_FAILED, "");  // closes the connections; the peer's end goes down
    std::lock_guard<std::mutex> lock(mu_);
    linking_.erase(peer_id);
    return LLM_LINK_FAILED;
  }
  std::lock_guard<std::mutex> lock(mu_);
  linking_.erase(peer_id);
  if (!publish(peer_id, link)) {
    return refuse(LLM_LINK_FAILED, words("the link to cluster ", peer_id, " was closed by the peer as it started"));
  }
  return LLM_SUCCESS;
}

Status LinkManager::unlink(uint64_t peer_id, bool force, int timeout_ms) {
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

void LinkManager::detach(const std::shared_ptr<Link> &link) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(link->peer_id());
  if (it != links_.end() && it->second == link) links_.erase(it);
}

const char *LinkManager::link_transport(uint64_t peer_id) const {
  std::shared_ptr<Link> link = find(peer_id);
  return link ? link->transport() : nullptr;
}

bool LinkManager::link_security(uint64_t peer_id, std::string &transport, Link::Security &security) const {
  std::shared_ptr<Link> link = find(peer_id);
  if (!link) return false;
  transport = link->transport();
  security = link->security();
  return true;
}

uint64_t LinkManager::links_made(uint64_t peer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = made_count_.find(peer_id);
  return it == made_count_.end() ? 0 : it->second;
}

std::shared_ptr<Link> LinkManager::find(uint64_t peer_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = links_.find(peer_id);
  return it == links_.end() ? nullptr : it->second;
}

size_t LinkManager::link_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return links_.size();
}

bool LinkManager::link_stats(uint64_t peer_id, LinkStats &stats) const {
  std::shared_ptr<Link> link = find(peer_id);
  if (!link) return false;
  stats.connections = link->connection_count();
  stats.refused_groups = link->refused_group_count();
  stats.local_sockets = link->local_socket_count();
  stats.answer_socket = link->has_answer_socket();
  stats.security = link->security();
  stats.paths.clear();
  zero_counters(stats.paths);
  link->path_counters(stats.paths);
  return true;
}

void LinkManager::link_down(const std::shared_ptr<Link> &link) {
  const auto held = [&] {
    auto it = links_.find(link->peer_id());
    return it != links_.end() && it->second == link ? it : links_.end();
  };
  bool lost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lost = held() != links_.end() && !stopping_;  // an unlink from either end has removed it already
  }
  // The observer (a comm that links the peer again) hears of it while the
  // link can still be found, and before the reap settles its operations:
  // otherwise an operation toward the peer in between would be refused as
  // never linked (LLM_NOT_YET_LINK) instead of as being linked again.
  if (lost && loss_observer_) loss_observer_(link->peer_id());
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = held();
    if (it != links_.end()) links_.erase(it);
    down_.push_back(link);
    ++generation_;
  }
  cv_.notify_all();
}

void LinkManager::reap(const std::vector<std::shared_ptr<Link>> &links) {
  for (auto &link : links) link->reap();
  std::lock_guard<std::mutex> lock(mu_);
  for (auto &link : links) made_.erase(std::remove(made_.begin(), made_.end(), link), made_.end());
}

void LinkManager::reap_down_links() {
  std::vector<std::shared_ptr<Link>> down;
  {
    std::lock_guard<std::mutex> lock(mu_);
    down.swap(down_);
  }
  reap(down);
}

void LinkManager::reap_down_links_of(uint64_t peer_id) {
  std::vector<std::shared_ptr<Link>> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = down_.begin(); it != down_.end();) {
      if ((*it)->peer_id() == peer_id) {
        gone.push_back(std::move(*it));
        it = down_.erase(it);
      } else {
        ++it;
      }
    }
  }
  reap(gone);
}

void LinkManager::housekeeping_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !down_.empty(); });
    if (stopping_) return;
    lock.unlock();
    reap_down_links();
    lock.lock();
  }
}

void LinkManager::on_timer() {
  const Clock::time_point now = Clock::now();
  // Answers that no event loop came for are read first, so their
  // operations settle and none is taken for overdue.
  if (answer_watch_) answer_watch_->on_timer(now);
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    for (auto &entry : links_) links.push_back(entry.second);
  }
  Clock::time_point next = Clock::time_point::max();
  for (auto &link : links) {
    if (link->handshake_overdue(now)) {
      link->fail(LLM_LINK_FAILED, "the peer did not finish its TLS handshake within the handshake timeout; "
                                  "closing the link");
      continue;
    }
    if (link->overdue(now)) {
      // An answer that came after the sweep still counts.
      link->read_answers(AnswerHub::Reader::kLink);
      if (link->overdue(now)) {
        link->fail(LLM_TIMEOUT, "an operation exceeded sync_kv_timeout; closing the link");
        continue;
      }
    }
    next = std::min(next, link->next_deadline());
  }
  if (next != Clock::time_point::max()) timer_->at(next);
}

void LinkManager::shutdown(Status reason) {
  stop_listening();
  std::thread housekeeping;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !housekeeping_.joinable()) return;
    stopping_ = true;
    housekeeping.swap(housekeeping_);
  }
  cv_.notify_all();
  if (housekeeping.joinable()) housekeeping.join();
  // No link starts any more (stopping_): the timer stays as it is.
  if (answer_watch_) answer_watch_->stop();
  if (timer_) timer_->stop();
  // Every link made, including one whose threads are still telling us it
  // went down: reaping joins those threads.
  std::vector<std::shared_ptr<Link>> links;
  {
    std::lock_guard<std::mutex> lock(mu_);
    links = made_;
  }
  for (auto &link : links) link->fail(reason, "");
  reap(links);
  // Caches may keep mappings (and so the worker) past the loop: it stops
  // watching the worker now.
  for (const auto &kind : kinds_) kind->stop();
  std::lock_guard<std::mutex> lock(mu_);
  links_.clear();
  down_.clear();
}

}  // namespace datadist
