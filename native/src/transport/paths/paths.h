// The data paths a link may have, and how a link's handshake settles them.
// Each kind of path takes part in the handshake with bytes of its own (a
// part of each hello and of the ack, wire::PathPart) that only it reads;
// the link manager, the listener and the handshake frames carry them
// without knowing any path. make_kinds is the one list that knows every
// kind: a new path is a folder of its own and a line there.
#ifndef DATADIST_TRANSPORT_PATHS_PATHS_H_
#define DATADIST_TRANSPORT_PATHS_PATHS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "llm_datadist/llm_error_codes.h"
#include "transport/data_path.h"

namespace datadist {

class AnswerHub;
class IoLoop;
class Registry;

// Which paths an engine offers (from its LLMConfig).
struct PathOptions {
  // Offer the same-host path (kernel copies, CUDA IPC) to peers on this host.
  bool same_host = true;
  // Access "one_sided": this end grants its caches to peers that reach its
  // memory by themselves (on one host, paths/same_host/grants.h; over UCX's
  // RMA transports, paths/ucx/ucx_grants.h) and moves bytes itself under
  // theirs; false ("owner"): the owner of the memory moves every byte.
  bool one_sided = true;
  // Move operations' bytes with UCX (transport "ucx"): links are made only
  // with peers that say so too.
  bool ucx = false;
  // Transport "auto": UCX where it has a one-sided network transport (RDMA)
  // and both ends offer it, for peers on other hosts.
  bool ucx_auto = false;
  // Offer the test path (paths/test/test_path.h): between engines of one
  // process only; for tests ($DATADIST_AIO_TEST_PATH=1).
  bool test_path = false;
};

// What a kind of path may use of the engine's transport.
struct PathServices {
  IoLoop &io_loop;
  Registry &registry;  // this engine's caches
  // Where links' answer sockets are watched; nullptr: links have none.
  AnswerHub *answers = nullptr;
};

// One link's handshake as one kind of path takes part in it, at either end;
// made by the kind for the link, gone once the link is made or refused.
// Called on the handshake's thread only.
class PathHandshake {
 public:
  virtual ~PathHandshake() = default;

  // -- initiator -------------------------------------------------------------
  // This kind's part of the hello of connection `index` (empty: none).
  virtual std::string hello_part(uint32_t index) {
    (void)index;
    return {};
  }
  // The acceptor's part of the ack (empty: it sent none). `served`: a kind
  // settled before this one serves the link's frames of the peer. Not
  // LLM_SUCCESS: the link is not made, `why` says why.
  virtual Status settle(const std::string &part, bool served, std::string &why) = 0;
  // The acceptor moved the link's `count` connections (wire::kConnectionsMoved,
  // and its answer socket where `answers`): the descriptors this kind offered
  // for them (`fds`, `answer_fd`), now the link's; false when this kind
  // offered none.
  virtual bool moved_connections(size_t count, bool answers, std::vector<int> &fds, int &answer_fd) {
    (void)count;
    (void)answers;
    (void)fds;
    (void)answer_fd;
    return false;
  }

  // -- acceptor --------------------------------------------------------------
  // The initiator's parts of this kind, one per connection (empty where a
  // hello had none), and `served` as in settle(). Not LLM_SUCCESS: the link
  // is refused, `why` says why.
  virtual Status accept(const std::vector<std::string> &parts, bool served, std::string &why) = 0;
  // Takes the descriptors the link runs on in place of its `count`
  // connections, as the initiator offered them in its parts, and (where
  // `answers`) its answer socket (-1 when it cannot be had); false, taking
  // nothing, when this kind offered none or one cannot be taken.
  virtual bool take_connections(size_t count, bool answers, std::vector<int> &fds, int &answer_fd) {
    (void)count;
    (void)answers;
    (void)fds;
    (void)answer_fd;
    return false;
  }
  // This kind's part of the ack (empty: none), after accept().
  virtual std::string ack_part() = 0;

  // -- both ------------------------------------------------------------------
  // Whether this kind serves the peer's frames on this link.
  virtual bool serves_peer() const { return false; }
  // The link's paths of this kind, in the order operations try them.
  virtual void paths(std::vector<std::shared_ptr<DataPath>> &out) = 0;
};

// A kind of path, for the life of the engine's transport.
class PathKind {
 public:
  virtual ~PathKind() = default;
  // The number of its parts in hellos and acks.
  virtual uint16_t id() const = 0;
  // Settled after the kinds that do not yield, and told whether one of them
  // serves the link (settle(), accept()).
  virtual bool yields() const { return false; }
  // Before any link; not LLM_SUCCESS (with `why`) when the engine cannot
  // start with this kind as configured.
  virtual Status start(std::string &why) {
    (void)why;
    return llm_datadist::LLM_SUCCESS;
  }
  // At the transport's shutdown, once every link is reaped.
  virtual void stop() {}
  // Its part in one link's handshake with `peer_id`; nullptr: it takes no
  // part (its path is off).
  virtual std::unique_ptr<PathHandshake> handshake(uint64_t peer_id, bool acceptor) = 0;
};

// Every kind the options turn on, in the order a link lists their paths
// (operations try them so): UCX, the same host (device memory by CUDA IPC,
// host memory by a kernel copy).
std::vector<std::unique_ptr<PathKind>> make_kinds(const PathOptions &options, const PathServices &services);

// The path every link has, after those its handshake settled: inline on
// the link's connections (paths/inline/), which carries every frame the
// others do not.
std::shared_ptr<DataPath> inline_path();

// Every path's counters, at 0: link_stats names them all on every link.
void zero_counters(std::map<std::string, uint64_t> &out);

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PATHS_PATHS_H_
