#include "transport/paths/same_host/same_host_kind.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <utility>
#include <vector>

#include "log.h"
#include "transport/paths/device/cuda_ipc_path.h"
#include "transport/paths/same_host/same_host_path.h"

namespace datadist::same_host {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;

namespace {

std::string encode(const SameHostPart &part) {
  return std::string(reinterpret_cast<const char *>(&part), sizeof(part));
}

// False unless `bytes` is one whole part with no unknown caps.
bool decode(const std::string &bytes, SameHostPart &out) {
  if (bytes.size() != sizeof(out)) return false;
  std::memcpy(&out, bytes.data(), sizeof(out));
  return out.zero == 0 && (out.caps & ~kAllCaps) == 0;
}

void close_all(std::vector<int> &fds) {
  for (int fd : fds) {
    if (fd >= 0) ::close(fd);
  }
  fds.clear();
}

class Handshake : public PathHandshake {
 public:
  Handshake(SameHostKind &kind, uint64_t peer_id) : kind_(kind), peer_id_(peer_id) {}
  ~Handshake() override {
    for (auto &pair : pairs_) close_pair(pair);
    close_pair(answers_);
  }

  // Every connection's hello offers a local socket pair the acceptor may
  // move the link to; the first one's also the link's answer socket pair.
  // What is not used closes with the handshake.
  std::string hello_part(uint32_t index) override {
    SameHostPart part{};
    part.info = local_info();
    part.caps = kOpensDevice | kTakesFds | kBigDeviceFrames;
    SocketPair pair = make_socket_pair();
    pairs_.push_back(pair);
    if (pair.theirs >= 0) {
      part.caps |= kLocalSocket;
      part.local_socket = static_cast<uint32_t>(pair.theirs);
      if (index == 0 && kind_.answer_sockets()) answers_ = make_socket_pair(SOCK_SEQPACKET);
      if (index == 0 && answers_.theirs >= 0) {
        part.caps |= kAnswerSocket;
        part.answer_socket = static_cast<uint32_t>(answers_.theirs);
      }
    }
    return encode(part);
  }

  // The acceptor took the part: the path, with the acceptor's memory
  // probed; the acceptor is told by the link's first frame when it was
  // reached.
  Status settle(const std::string &bytes, bool, std::string &why) override {
    if (bytes.empty()) return LLM_SUCCESS;
    if (!decode(bytes, peer_)) {
      why = "its same-host part of the ack is malformed";
      return LLM_LINK_FAILED;
    }
    offered_ = true;
    peer_memory_ = kind_.reach(peer_id_, peer_.info);
    peer_copies_ = (peer_.caps & kCopiesForYou) != 0;
    announce_ = true;
    return LLM_SUCCESS;
  }

  bool moved_connections(size_t count, bool answers, std::vector<int> &fds, int &answer_fd) override {
    if (!offered_ || pairs_.size() < count || (answers && answers_.mine < 0)) return false;
    fds.clear();
    for (size_t i = 0; i < count; ++i) {
      if (pairs_[i].mine < 0) {
        for (size_t j = 0; j < i; ++j) pairs_[j].mine = fds[j];  // left for the destructor
        fds.clear();
        return false;
      }
      fds.push_back(std::exchange(pairs_[i].mine, -1));
    }
    answer_fd = answers ? std::exchange(answers_.mine, -1) : -1;
    return true;
  }

  // Offered back where this end offers the path too; this end serves the
  // initiator's same-host frames where it reaches its memory.
  Status accept(const std::vector<std::string> &parts, bool, std::string &why) override {
    if (parts.empty() || parts[0].empty()) return LLM_SUCCESS;
    if (!decode(parts[0], peer_)) {
      why = "its same-host part of the hello is malformed";
      return LLM_LINK_FAILED;
    }
    hellos_ = parts;
    offered_ = true;
    peer_memory_ = kind_.reach(peer_id_, peer_.info);
    return LLM_SUCCESS;
  }

  // Only from a peer whose memory this end reaches: it has just proven
  // that it may take the peer's descriptors (the kernel's ptrace rule).
  bool take_connections(size_t count, bool answers, std::vector<int> &fds, int &answer_fd) override {
    if (!peer_memory_ || hellos_.size() < count) return false;
    const auto pid = static_cast<pid_t>(peer_.info.pid);
    std::vector<int> taken;
    std::string why;
    for (size_t i = 0; i < count; ++i) {
      SameHostPart part{};
      int fd = -1;
      if (decode(hellos_[i], part) && (part.caps & kLocalSocket) != 0 && part.info.pid == peer_.info.pid) {
        fd = take_socket(pid, part.local_socket, why, SOCK_STREAM);
        if (fd < 0) kind_.socket_refused(peer_id_, "keep their TCP connections for control frames", why);
      }
      if (fd < 0) {
        close_all(taken);
        return false;
      }
      taken.push_back(fd);
    }
    answer_fd = -1;
    if (answers && (peer_.caps & kAnswerSocket) != 0) {
      answer_fd = take_socket(pid, peer_.answer_socket, why, SOCK_SEQPACKET);
      if (answer_fd < 0) kind_.socket_refused(peer_id_, "carry their answers on their connections", why);
    }
    fds = std::move(taken);
    return true;
  }

  std::string ack_part() override {
    if (!offered_) return {};
    SameHostPart part{};
    part.info = local_info();
    // Said back only to a peer that said it: one that did not may not know it.
    const uint32_t device = peer_.caps & kOpensDevice;
    part.caps = device | (device != 0 ? peer_.caps & (kTakesFds | kBigDeviceFrames) : 0u);
    if (peer_memory_) part.caps |= kCopiesForYou;
    return encode(part);
  }

  bool serves_peer() const override { return offered_ && peer_memory_ != nullptr; }

  void paths(std::vector<std::shared_ptr<DataPath>> &out) override {
    if (!offered_) return;
    Terms terms;
    terms.peer_copies = peer_copies_;
    terms.peer_memory = peer_memory_;
    terms.announce = announce_;
    terms.one_sided = kind_.one_sided();
    terms.peer_pid = static_cast<pid_t>(peer_.info.pid);
    terms.peer_caps = peer_.caps;
    link_paths(kind_.pool(), terms, out);
  }

 private:
  SameHostKind &kind_;
  const uint64_t peer_id_;
  std::vector<SocketPair> pairs_;  // initiator: offered per connection
  SocketPair answers_;             // initiator: offered with the first connection
  std::vector<std::string> hellos_;  // acceptor: every connection's part
  SameHostPart peer_{};  // the peer's part (its first connection's at the acceptor)
  bool offered_ = false;  // both ends offered the path
  std::shared_ptr<PeerMemory> peer_memory_;
  bool peer_copies_ = false;
  bool announce_ = false;
};

}  // namespace

void link_paths(const std::shared_ptr<CopyPool> &pool, const Terms &terms,
                std::vector<std::shared_ptr<DataPath>> &out) {
  auto same_host = std::make_shared<SameHostPath>(pool, true, terms.peer_copies, terms.peer_memory, terms.announce,
                                                  terms.one_sided, terms.peer_pid);
  const bool device = (terms.peer_caps & kOpensDevice) != 0;
  out.push_back(std::make_shared<CudaIpcPath>(same_host, device, device && (terms.peer_caps & kTakesFds) != 0,
                                              device && (terms.peer_caps & kBigDeviceFrames) != 0));
  out.push_back(std::move(same_host));
}

std::unique_ptr<PathHandshake> SameHostKind::handshake(uint64_t peer_id, bool) {
  return std::make_unique<Handshake>(*this, peer_id);
}

std::shared_ptr<PeerMemory> SameHostKind::reach(uint64_t peer_id, const Info &info) {
  std::string why;
  switch (probe(info, why)) {
    case Probe::kReachable:
      return std::make_shared<PeerMemory>(static_cast<pid_t>(info.pid));
    case Probe::kRefused:
      if (!refusal_logged_.exchange(true)) {
        log_warning("the kernel refuses copies between this process and cluster " + std::to_string(peer_id) +
                    " on the same host (" + why +
                    "; ptrace rules, seccomp, a container, a PID namespace of its own or another user); such links move "
                    "their bytes over TCP");
      }
      return nullptr;
    default:
      return nullptr;
  }
}

void SameHostKind::socket_refused(uint64_t peer_id, const std::string &what, const std::string &why) {
  if (why.empty() || socket_refusal_logged_.exchange(true)) return;
  log_message(LogLevel::kInfo, "same-host links to cluster " + std::to_string(peer_id) + " " + what + ": " + why);
}

}  // namespace datadist::same_host
