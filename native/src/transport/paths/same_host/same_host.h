// The same-host path: when two engines share a kernel and each may reach
// the other's memory, the owner of a cache moves an operation's bytes with
// one kernel copy (process_vm_readv / process_vm_writev) instead of TCP.
// The owner still resolves and checks every one of its own ranges; the
// initiator's ranges are checked against its mappings before a byte moves,
// so a request naming memory the initiator does not have is refused with
// nothing written.
//
// Threads: every function may be called from any thread. PeerMemory and
// CopyPool are shared by the transport's I/O threads.
#ifndef DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_H_
#define DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_H_

#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "llm_datadist/llm_error_codes.h"
#include "transport/wire.h"

namespace datadist::same_host {

using llm_datadist::Status;

#pragma pack(push, 1)
// Who a process is on its host: the kernel's boot id, its pid, and where a
// probe buffer (kProbeMagic then a random token) lies in its memory. A peer
// that reads the buffer back through the kernel has proven that it runs on
// the same host and may reach this memory.
struct Info {
  uint8_t boot_id[16];
  uint64_t pid;
  uint64_t probe_addr;
  uint8_t probe[24];
};
static_assert(sizeof(Info) == 56, "same-host info layout");
#pragma pack(pop)

// This process as its peers see it; the probe buffer lives as long as the
// process. All zero boot id when the kernel's cannot be read (never same-host).
const Info &local_info();

enum class Probe {
  kReachable,  // same kernel, and the peer's probe buffer read back intact
  kOtherHost,  // another kernel boot: never tried
  kRefused,    // the kernel refused the copy (EPERM): ptrace rules, seccomp, another user
  kMismatch,   // no such process here, or its buffer was not where it said
};

// Tries to read `peer`'s probe buffer; `why` says what failed.
Probe probe(const Info &peer, std::string &why);

// Local sockets: a same-host link runs on Unix socket pairs instead of its
// TCP connections (cheaper system calls, no TCP/IP stack). The initiator
// makes one pair per connection and names one end in its hello; the
// acceptor, which has just proven it may reach the initiator's memory, takes
// that end out of the initiator's process with pidfd_getfd.
struct SocketPair {
  int mine = -1;    // the initiator's end
  int theirs = -1;  // the end the acceptor takes; closed once it has
};
// A new pair (both ends -1 when the kernel gives none).
// `type`: SOCK_STREAM for a connection, SOCK_SEQPACKET for an answer socket.
SocketPair make_socket_pair(int type = SOCK_STREAM);
void close_pair(SocketPair &pair);
// Takes descriptor `number` out of process `pid`. Returns the new
// descriptor, or -1 with `why` set: the kernel refused (no pidfd_getfd,
// ptrace rules) or the descriptor is not a Unix socket of `type` made by `pid`.
int take_socket(pid_t pid, uint32_t number, std::string &why, int type = SOCK_STREAM);
// Takes descriptor `number` out of process `pid`, whatever it is (the new
// descriptor is close-on-exec); -1 with `why` set when the kernel refuses.
int take_descriptor(pid_t pid, uint32_t number, std::string &why);

// A peer process's memory, reached by kernel copies. Its ranges are checked
// against the readable (or writable) mappings the kernel lists for it; the
// list is read once and read again when a range is not found in it.
class PeerMemory {
 public:
  explicit PeerMemory(pid_t pid);

  pid_t pid() const { return pid_; }
  // True if every segment lies inside the peer's mappings (writable ones
  // when `for_write`).
  bool mapped(const std::vector<wire::Segment> &segments, bool for_write);
  // Copies between local iovecs and the peer's segments, pair by pair
  // (equal lengths): from the peer when `from_peer`, else into it. Returns
  // 0 or the errno of the call that failed (ESRCH: the peer is gone).
  int copy(const iovec *local, const iovec *remote, size_t count, bool from_peer) const;

 private:
  using Spans = std::vector<std::pair<uintptr_t, uintptr_t>>;  // sorted, merged [start, end)
  void reload();
  static bool covered(const Spans &spans, const wire::Segment &segment);

  const pid_t pid_;
  std::mutex mu_;
  Spans readable_;
  Spans writable_;
};

// Threads that share large copies with the thread that receives a frame.
// Started on first use, so an engine that never copies on one host starts
// none; stopped by the destructor.
class CopyPool {
 public:
  // `helpers` threads besides the caller; 0 picks one fewer than the cores.
  explicit CopyPool(size_t helpers = 0);
  ~CopyPool();
  CopyPool(const CopyPool &) = delete;
  CopyPool &operator=(const CopyPool &) = delete;

  size_t threads() const { return helpers_ + 1; }
  // Runs job(0) .. job(count - 1), on the caller and the helpers; returns
  // once all have run.
  void run(size_t count, const std::function<void(size_t)> &job);

 private:
  struct Batch;
  void helper_loop();
  static void work_on(Batch &batch);

  const size_t helpers_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Batch>> batches_;
  std::vector<std::thread> threads_;
  bool stopping_ = false;
};

// Copies the pairs (local[i], remote[i]) with `memory`, split over `pool`
// when the operation is large (nullptr: all of it on the calling thread).
// Returns 0 or the first errno.
int copy_pairs(PeerMemory &memory, CopyPool *pool, const std::vector<iovec> &local,
               const std::vector<wire::Segment> &remote, bool from_peer);

}  // namespace datadist::same_host

#endif  // DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_H_
