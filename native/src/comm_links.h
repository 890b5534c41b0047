// CommLinks: two-sided links over a rank table (LLM-DataDist's `link`,
// `unlink`, `query_register_mem_status`). A comm names up to 4 members by
// cluster id and rank; every member calls link() with the same member list.
// For each pair the member with the lower rank accepts on its listener and
// the higher one connects, so all may call at the same moment. The links
// made are the transport's ordinary links, keyed by the peer's cluster id:
// transfers then work exactly as after link_clusters.
//
// A comm keeps its links: when one is lost (a peer died or was held up past
// sync_kv_timeout, which closes the link), the comm is kPreparing again and
// the pair links anew the same way, within the comm's total time; transfers
// to that peer meanwhile fail with LLM_PROCESSING_LINK, which callers retry.
//
// Threads: one thread per comm; it links, then sleeps until a link of the
// comm is lost or the comm is unlinked, and ends when the comm is unlinked
// or a linking round ran out of time (kFailed). Public methods may be called
// from any thread; shutdown() stops and joins every comm thread and must
// come before the transport's shutdown.
#ifndef DATADIST_COMM_LINKS_H_
#define DATADIST_COMM_LINKS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "transport/link_manager.h"

namespace datadist {

inline constexpr size_t kMaxCommMembers = 4;

// Where a member of a comm is: its cluster id, its rank and the address it
// accepts links on (port 0: unknown, the caller's own listen port is used).
struct CommMember {
  uint64_t cluster_id = 0;
  uint32_t rank = 0;
  std::string ip;
  uint16_t port = 0;
};

struct CommSpec {
  std::string name;
  std::vector<CommMember> members;
  uint32_t total_time_ms = 0;  // the time links may take in all
  uint32_t retry_count = 1;    // attempts the total time is shared among
};

// Values of RegisterMemStatus.
enum class CommState : int32_t { kOk = 0, kPreparing = 1, kFailed = 2 };

class CommLinks {
 public:
  CommLinks(uint64_t cluster_id, LinkManager &transport);
  ~CommLinks();
  CommLinks(const CommLinks &) = delete;
  CommLinks &operator=(const CommLinks &) = delete;

  // Starts linking the comm and returns its id at once (ids count from 1).
  // LLM_PARAM_INVALID when this cluster is not a member, a rank or cluster
  // id repeats, there are fewer than 2 or more than 4 members, or an
  // address is missing; LLM_ALREADY_LINK when a live comm has the same name
  // or shares a peer with this one; LLM_FAILED after shutdown.
  Status link(const CommSpec &spec, uint64_t &comm_id);
  // LLM_PARAM_INVALID for an unknown comm id.
  Status state(uint64_t comm_id, CommState &out) const;
  // Stops linking, then removes the comm's links on both ends (a peer that
  // already dropped its end is not an error). LLM_PARAM_INVALID for an
  // unknown comm id.
  Status unlink(uint64_t comm_id, int timeout_ms);
  // Whether a comm is linking `peer` again after its link was lost.
  bool relinking(uint64_t peer) const;
  void shutdown();

 private:
  struct Comm {
    CommSpec spec;
    CommState state = CommState::kPreparing;
    bool stop = false;
    std::set<uint64_t> lost;       // links lost since the comm was kOk, not yet taken up
    std::set<uint64_t> relinking;  // peers being linked again
    std::thread thread;
  };

  void run(uint64_t comm_id, std::shared_ptr<Comm> comm);
  // Links `peers` (cluster ids of members) within the comm's total time,
  // from now. Called and returns with `lock` held; kPreparing if stopped.
  CommState establish(Comm &comm, const std::vector<uint64_t> &peers, std::unique_lock<std::mutex> &lock);
  // The transport's loss observer.
  void lost(uint64_t peer);
  // Joins a comm's thread after telling it to stop.
  void stop(const std::shared_ptr<Comm> &comm);

  const uint64_t cluster_id_;
  LinkManager &transport_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::shared_ptr<Comm>> comms_;
  uint64_t next_id_ = 1;
  bool stopping_ = false;
};

}  // namespace datadist

#endif  // DATADIST_COMM_LINKS_H_
