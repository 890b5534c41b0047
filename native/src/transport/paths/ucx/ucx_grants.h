// One-sided UCX access: the owner of a cache grants a linked peer the
// cache's memory once, as the packed keys of its tensors with the cache's
// geometry, and the peer then gets and puts within it on its own endpoint,
// with no frame to the owner per operation. Granted only where the peer's
// endpoint reads and writes the owner's memory by itself (DATADIST_UCX_RMA_
// FENCED: rc, dc, srd; DIRECT: cma, xpmem, knem, cuda_ipc), never over
// UCX's tcp, whose gets and puts need the owner's process.
//
// Revocation. A cache leaving the owner's registry (deallocated,
// unregistered, finalized) is revoked: the owner sends a revocation, and
// the holder answers once no operation under the grant is in flight (its
// puts flushed) and none can start. The memory stays held until then:
//  - FENCED: or until the link is gone, since the owner's unmap (before the
//    memory goes) ends whatever the holder posts;
//  - DIRECT: nothing of the owner's stops the holder's own system calls, so
//    such a grant also has a slot in a table both processes map, as on the
//    same-host path (paths/same_host/grants.h): the holder counts itself in
//    before each operation and checks the grant stands, and the owner marks
//    it revoked and waits for the count to drop. The memory goes once the
//    holder answered or the count is seen at 0 after the mark, which needs
//    no link.
// A holder that does not free the grant within kRevokeWait leaves the
// memory held (quarantined) until it does, or exits.

// The messages are path messages (wire::FrameType::kPathMessage), each
// opening with its kind.
//
// Threads: every method may be called from any thread.
#ifndef DATADIST_TRANSPORT_PATHS_UCX_UCX_GRANTS_H_
#define DATADIST_TRANSPORT_PATHS_UCX_UCX_GRANTS_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "registry.h"
#include "transport/paths/same_host/grants.h"
#include "transport/pidfd.h"
#include "transport/paths/ucx/ucx_path.h"
#include "transport/wire.h"

namespace datadist::ucx {

enum GrantMessageKind : uint32_t {
  // How this end's endpoint reaches the peer's memory (NONE: it asks for
  // no grant), and its pid. The initiator sends it first, once its link
  // runs; the acceptor sends its own once it read the initiator's (then
  // the peer's link surely runs: before, its handshake reads the ack).
  kWantGrants = 0x55430001,
  kGrant = 0x55430002,       // owner: one cache in host memory, its tensors' keys
  kRevoke = 0x55430003,      // owner: a grant is revoked
  kRevoked = 0x55430004,     // holder: nothing runs or will run under that grant
  kTable = 0x55430005,       // owner (DIRECT): its grant table, a descriptor in its process, and its pid
  kTableTaken = 0x55430006,  // holder: whether it took the table (the owner closes its descriptor)
};

// The kind of a path message that is one of these; 0 otherwise.
uint32_t grant_message_kind(const uint8_t *body, size_t size);
// The holder's first message: its endpoint's reach (DATADIST_UCX_RMA_*) and pid.
std::vector<uint8_t> want_grants_message(int rma, pid_t pid);
// Reads a kWantGrants message; false when it is malformed.
bool read_want_grants(const uint8_t *body, size_t size, int &rma, pid_t &pid);

// The owner's side on one link.
class Grantor : public RegistryWatcher, public std::enable_shared_from_this<Grantor> {
 public:
  using Send = std::function<void(std::vector<uint8_t> body)>;
  static constexpr std::chrono::milliseconds kRevokeWait{2000};

  // `rma`: how the holder's endpoint reaches this end's memory; `holder`:
  // its pid (DIRECT: watched before memory it may reach goes).
  Grantor(std::shared_ptr<Worker> worker, Registry &registry, Send send, int rma, pid_t holder);
  ~Grantor() override;
  // Grants every cache there is and, from now on, every one added (DIRECT:
  // after the table, which it makes first; false with `why` where it
  // cannot: nothing is granted).
  bool start(std::string &why);
  void added(const std::shared_ptr<CacheEntry> &entry) override;
  void removed(const std::shared_ptr<CacheEntry> &entry) override;
  // The holder's answer to a revocation or to the table; false when malformed.
  bool take_answer(const uint8_t *body, size_t size);
  // The link is gone: every grant ends (no message), see above.
  void reap();
  void counters(std::map<std::string, uint64_t> &out) const;

 private:
  struct Given {
    std::shared_ptr<CacheEntry> pin;  // the memory stays until the grant is through
    uint64_t number = 0;
    uint32_t slot = 0;  // DIRECT: its slot in table_
    uint64_t state = 0;
  };
  // DIRECT: marks the grant revoked in its slot.
  void mark_revoked(const Given &given);
  // DIRECT: whether no operation runs under the grant (marked revoked).
  bool quiet(const Given &given) const;
  // Lets the grant go: its slot free again, its memory with the last pin.
  void let_go(Given given);
  // Not through: held until the holder (`holder`) leaves the slot or exits.
  void hold(Given given, std::shared_ptr<Pidfd> holder);

  const std::shared_ptr<Worker> worker_;
  Registry &registry_;
  const Send send_;
  const int rma_;
  const pid_t holder_;
  mutable std::mutex mu_;
  std::condition_variable answered_cv_;
  std::unordered_map<const CacheEntry *, Given> given_;
  std::map<uint64_t, Given> revoking_;     // sent, not answered yet (waited for)
  std::map<uint64_t, Given> quarantined_;  // not answered in time
  std::shared_ptr<same_host::GrantTable> table_;  // DIRECT
  uint64_t next_number_ = 1;
  bool started_ = false;
  bool reaped_ = false;
  std::atomic<uint64_t> granted_{0}, revoked_{0}, revoke_waits_{0}, held_{0}, refused_{0};
};

// A grant as its holder keeps it: the owner's cache as a registry entry whose
// addresses are the owner's (never touched here), and each tensor's key.
struct HeldGrant {
  std::shared_ptr<CacheEntry> cache;
  std::vector<std::string> keys;
  uint64_t number = 0;
  uint32_t slot = 0;  // DIRECT: in the owner's table
  uint64_t state = 0;
  std::shared_ptr<same_host::GrantTable> table;  // DIRECT: the table the slot is in
  // Under the book's lock: operations under the grant now, and whether it
  // was revoked (then answered once none is left).
  size_t in_flight = 0;
  bool revoked = false;
};

// The holder's side on one link.
class GrantBook {
 public:
  // `direct`: grants come with slots of the owner's table (DIRECT), and
  // none is used before the table is taken.
  GrantBook(Grantor::Send send, bool direct) : send_(std::move(send)), direct_(direct) {}
  // Takes a kGrant, kRevoke or kTable message; false when it is malformed.
  bool take(const uint8_t *body, size_t size);
  // The standing grant of the cache `target` names, counted in for one
  // operation (leave() once it ended); null when none stands. `revoked`:
  // set when the grant was found revoked in its slot (then forgotten).
  std::shared_ptr<HeldGrant> enter(const wire::Target &target, bool *revoked = nullptr);
  // Counts an operation out; a revocation waiting for it is answered.
  void leave(const std::shared_ptr<HeldGrant> &grant);
  size_t held() const;
  // The link is gone: every grant is forgotten, nothing is answered.
  void clear();

 private:
  // Forgets a grant (mu_ held).
  void forget_locked(const HeldGrant &grant);

  const Grantor::Send send_;
  const bool direct_;
  mutable std::mutex mu_;
  std::shared_ptr<same_host::GrantTable> table_;  // DIRECT, once taken
  std::map<uint64_t, std::shared_ptr<HeldGrant>> by_number_;
  std::map<int64_t, uint64_t> by_id_;
  std::map<uint64_t, int64_t> by_model_;
  bool cleared_ = false;
};

}  // namespace datadist::ucx

#endif  // DATADIST_TRANSPORT_PATHS_UCX_UCX_GRANTS_H_
