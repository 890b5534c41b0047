// The same-host path's part in a link's handshake (paths.h).
//
// Its part of a hello or an ack is one SameHostPart: who this process is on
// its host (Info, with its probe buffer), what it reads of device memory,
// and in a hello the initiator's descriptors the acceptor may move the link
// to. The acceptor probes the initiator's memory; where it reaches it, it
// serves the initiator's same-host frames, says so in its ack
// (kCopiesForYou) and may take the offered local sockets (pidfd_getfd), so
// the link runs on Unix socket pairs. The initiator probes the acceptor's
// memory in turn and tells it by the link's first frame.
#ifndef DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_KIND_H_
#define DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_KIND_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "transport/paths/paths.h"
#include "transport/paths/same_host/same_host.h"

namespace datadist::same_host {

#pragma pack(push, 1)
struct SameHostPart {
  Info info;
  uint32_t caps;           // Caps
  uint32_t local_socket;   // hello, with kLocalSocket: the descriptor's number in the initiator's process
  uint32_t answer_socket;  // hello, with kAnswerSocket: likewise, of the link's answer socket
  uint32_t zero;
};
static_assert(sizeof(SameHostPart) == 72, "same-host part layout");
#pragma pack(pop)

enum Caps : uint32_t {
  // Hello or ack: the sender reads same-host frames whose segments are
  // exported device memory (the CUDA IPC path's trailer); an end sends them only
  // to a peer that said so. The acceptor says it back only to one that did.
  kOpensDevice = 1,
  // Beside kOpensDevice: it also reads device exports of kind kExportFd,
  // taking each descriptor out of the peer's process (pidfd_getfd).
  kTakesFds = 2,
  // Beside kOpensDevice: it reads frames naming device exports of up to
  // wire::kMaxTrailerFrameData bytes (else kMaxFrameData).
  kBigDeviceFrames = 4,
  // Ack only: the acceptor reached the initiator's memory.
  kCopiesForYou = 8,
  // Hello only: `local_socket` names one end of a Unix stream socket pair
  // the initiator made for this connection.
  kLocalSocket = 16,
  // Hello only, the first connection's, beside kLocalSocket: `answer_socket`
  // names one end of a Unix seqpacket pair for the link's answers.
  kAnswerSocket = 32,
};
constexpr uint32_t kAllCaps = 63;

// What a link's handshake settled of the same-host path, both ends having
// offered it.
struct Terms {
  bool peer_copies = false;  // the peer reaches this end's memory already (its ack said so)
  std::shared_ptr<PeerMemory> peer_memory;  // set where this end reaches the peer's
  bool announce = false;  // the peer does not know yet: the link's first frame tells it
  bool one_sided = false;  // access "one_sided" here
  pid_t peer_pid = 0;
  uint32_t peer_caps = 0;  // what the peer said it reads (kOpensDevice, kTakesFds, kBigDeviceFrames)
};
// The link's same-host paths under `terms`, in the order operations try
// them: CUDA IPC first (it carries the frames of device memory the
// same-host path would stage), then kernel copies. Also for tests that make
// links by hand.
void link_paths(const std::shared_ptr<CopyPool> &pool, const Terms &terms,
                std::vector<std::shared_ptr<DataPath>> &out);

class SameHostKind : public PathKind {
 public:
  static constexpr uint16_t kId = 1;
  // `answer_sockets`: the initiator offers each link an answer socket too.
  SameHostKind(bool one_sided, bool answer_sockets)
      : one_sided_(one_sided), answer_sockets_(answer_sockets), pool_(std::make_shared<CopyPool>()) {}

  uint16_t id() const override { return kId; }
  std::unique_ptr<PathHandshake> handshake(uint64_t peer_id, bool acceptor) override;

  // The memory to serve a peer's same-host frames with, or nullptr when it
  // cannot be reached (a refusal by the kernel is logged once).
  std::shared_ptr<PeerMemory> reach(uint64_t peer_id, const Info &info);
  // Logs, once, why the kernel kept a link from its local sockets.
  void socket_refused(uint64_t peer_id, const std::string &what, const std::string &why);

  bool one_sided() const { return one_sided_; }
  bool answer_sockets() const { return answer_sockets_; }
  const std::shared_ptr<CopyPool> &pool() const { return pool_; }

 private:
  const bool one_sided_;
  const bool answer_sockets_;
  const std::shared_ptr<CopyPool> pool_;  // shared by every link's same-host path
  std::atomic<bool> refusal_logged_{false};
  std::atomic<bool> socket_refusal_logged_{false};
};

}  // namespace datadist::same_host

#endif  // DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_KIND_H_
