// One-sided same-host access: the owner of a cache grants a linked peer on
// its host the cache once (its addresses and geometry), and the peer then
// moves bytes into and out of it with its own kernel copies, no frame to the
// owner per operation. A cache in device memory is granted as its tensors'
// allocations, exported (legacy CUDA IPC handles, or descriptors of
// cuMemCreate memory the holder takes as it takes the table); the holder
// opens them once and copies on streams of its own, counted in the slot
// until its stream says the copies landed.
//
// What keeps a grant safe is a table of slots in memory both processes map
// (a memfd the owner makes; the holder takes the descriptor out of the
// owner's process, which the same ptrace rule allows as the copies). Each
// grant has a slot: its state (a generation; odd once revoked) and the
// holder's copies in flight. The holder counts itself in before a copy and
// reads the state after (both sequentially consistent), and copies only if
// the grant still stands; the owner marks the state revoked, then waits for
// the count to drop. So once a revocation has returned, no copy under the
// grant is running or will start, and the memory may be reused. A
// revocation sends nothing: the holder finds it in the slot when it next
// uses the grant, and forgets revoked grants as new ones come.
//
// Threads: every method may be called from any thread.
#ifndef DATADIST_TRANSPORT_PATHS_SAME_HOST_GRANTS_H_
#define DATADIST_TRANSPORT_PATHS_SAME_HOST_GRANTS_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "device/cuda_driver.h"
#include "registry.h"
#include "transport/wire.h"
#include "transport/paths/device/exports.h"
#include "transport/pidfd.h"

namespace datadist::same_host {

// One grant's place in the shared table, a cache line of its own.
struct alignas(64) GrantSlot {
  std::atomic<uint64_t> state;     // generation << 1, | 1 once revoked
  std::atomic<uint64_t> in_flight;  // the holder's copies under the grant now
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "the slots are shared between processes");

// The shared table: made by the owner, opened by the holder.
class GrantTable {
 public:
  static constexpr uint32_t kSlots = 1024;
  // A new table in a memfd; nullptr with `why` when the kernel refuses.
  static std::shared_ptr<GrantTable> create(std::string &why);
  // Maps the table behind `fd` (taken over: closed here); nullptr with
  // `why` when it is not a table of kSlots slots.
  static std::shared_ptr<GrantTable> open(int fd, std::string &why);
  // The holder's side: the owner's table, its descriptor `number` taken out
  // of process `owner` (the kernel's ptrace rule); nullptr with `why`.
  static std::shared_ptr<GrantTable> take(pid_t owner, uint32_t number, std::string &why);
  ~GrantTable();
  GrantTable(const GrantTable &) = delete;
  GrantTable &operator=(const GrantTable &) = delete;

  GrantSlot &slot(uint32_t index) { return slots_[index]; }
  int fd() const { return fd_; }  // the owner's descriptor until the holder took it (-1 at the holder)
  // The holder has its own descriptor now: the owner's is closed.
  void close_fd();
  // The owner's side: a free slot for a new grant, its state set to a new
  // generation, standing; false when every slot is taken.
  bool claim(uint32_t &slot, uint64_t &state);
  // The owner's side: the grant of `slot` is through, the slot free again.
  void release(uint32_t slot);

 private:
  GrantTable(GrantSlot *slots, int fd) : slots_(slots), fd_(fd) {}
  GrantSlot *const slots_;
  std::atomic<int> fd_;
  std::mutex claim_mu_;
  std::vector<uint32_t> free_slots_;  // the owner's, filled on the first claim
  bool filled_ = false;
  uint64_t generation_ = 0;
};

// Memory a holder is still inside when its grant goes (a copy past the
// revocation's wait, or any operation when its link is gone): `pin` is
// held until the holder leaves `slot` of `table` or `holder` exits. For
// every grantor of the process, the same-host path's and UCX's.
void hold_until_quiet(std::shared_ptr<GrantTable> table, uint32_t slot, std::shared_ptr<CacheEntry> pin,
                      std::shared_ptr<Pidfd> holder);
// Lets go of what is held that may go now; called by every revocation.
void sweep_held();

// The id of the granted cache `target` names: its id, or the blocks cache
// `by_model` keeps for its model id; false for any other target, or an
// unknown model.
bool granted_id(const wire::Target &target, const std::map<uint64_t, int64_t> &by_model, int64_t &id);
// Whether `cache`, granted, still stands for the model `target` names (a
// model's cache that was replaced no longer does); true for targets by id.
bool names_model(const wire::Target &target, const CacheEntry &cache);

// The same-host path's messages (wire::FrameType::kPathMessage bodies),
// each opening with its kind.
enum MessageKind : uint32_t {
  // The sender reaches the receiver's memory, which may send its operations
  // by reference from now on: the path's first message, the kind alone.
  kReachesYouMessage = 0x53480000,
  kGrantTableMessage = 0x53480001,  // the owner's table: its descriptor's number in the owner's process
  kGrantMessage = 0x53480002,       // a grant of one cache in host memory
  kDeviceGrantMessage = 0x53480003,  // a grant of one cache in device memory
  kTableTakenMessage = 0x53480004,  // the holder's answer to the table: taken (or not), the owner closes its descriptor
};

// The kind of a path message that is one of these; 0 otherwise.
uint32_t message_kind(const uint8_t *body, size_t size);
// The path's first message (kReachesYouMessage).
std::vector<uint8_t> reaches_you_message();
// The holder's answer to a table: whether it took it.
std::vector<uint8_t> table_taken_message(bool taken);

// The owner's side on one link: grants the peer every remotely accessible
// host-memory cache of the registry, now and as they come, and revokes
// each as it leaves the registry (and all of them when the link goes).
class Grantor : public RegistryWatcher, public std::enable_shared_from_this<Grantor> {
 public:
  using Send = std::function<void(std::vector<uint8_t> body)>;
  // How long a revocation waits for the holder's copies in flight before
  // it leaves the memory held (quarantined) and returns.
  static constexpr std::chrono::milliseconds kRevokeWait{2000};

  // `holder`: the peer's pid, watched while a revocation waits so that a
  // holder that died in a copy does not hold the memory for good.
  Grantor(Registry &registry, Send send, pid_t holder);
  ~Grantor() override;
  // Makes the table, sends it, then a grant of every cache there is and,
  // from now on, of every one added. False (with `why`) when no table can
  // be made: the peer is granted nothing, and its operations are served
  // by this end as before.
  bool start(std::string &why);
  void added(const std::shared_ptr<CacheEntry> &entry) override;
  void removed(const std::shared_ptr<CacheEntry> &entry) override;
  // The holder's answer to the table (kTableTakenMessage): this end's
  // descriptor of it closes. False when the message is malformed.
  bool take_answer(const uint8_t *body, size_t size);
  // The link is gone: every grant is revoked (no message).
  void reap();
  void counters(std::map<std::string, uint64_t> &out) const;

 private:
  struct Given {
    std::shared_ptr<CacheEntry> pin;  // the memory stays until the revocation is through
    uint32_t slot = 0;
    uint64_t state = 0;
  };
  // Marks the grant revoked and waits for its copies in flight; then the
  // slot is free again and the pin let go, else both stay quarantined.
  void revoke(Given given);
  // The exports of a device cache's tensors, each inside one allocation;
  // false where one cannot be exported so (its operations stay served here).
  static bool export_tensors(const CacheEntry &entry, std::vector<device_exports::DeviceExport> &out);
  Registry &registry_;
  const Send send_;
  const pid_t holder_;
  std::shared_ptr<GrantTable> table_;
  mutable std::mutex mu_;
  std::unordered_map<const CacheEntry *, Given> given_;
  bool started_ = false;
  bool reaped_ = false;
  std::atomic<uint64_t> granted_{0}, revoked_{0}, revoke_waits_{0}, quarantined_{0}, refused_{0};
};

// A grant as its holder keeps it: the owner's cache as a registry entry
// whose addresses are the owner's (never touched here).
struct Grant {
  std::shared_ptr<CacheEntry> cache;
  uint32_t slot = 0;
  uint64_t state = 0;
  // A cache in device memory: each tensor's allocation as the owner
  // exported it (empty: host memory).
  std::vector<device_exports::DeviceExport> exports;
  // Those allocations opened here, a tensor each, in device `opened_in`'s
  // context, on first use (opened_mu); closed with the grant, which is let
  // go of off the driver's thread.
  mutable std::mutex opened_mu;
  mutable std::vector<std::shared_ptr<cuda::PeerAllocation>> opened;
  mutable int opened_in = -1;
};

// Counts the holder in to a grant's slot for one copy; `entered` is false
// when the grant was revoked (no copy may start). Leaves on destruction.
class GrantUse {
 public:
  GrantUse(std::shared_ptr<GrantTable> table, const Grant &grant);
  ~GrantUse();
  GrantUse(const GrantUse &) = delete;
  GrantUse &operator=(const GrantUse &) = delete;
  bool entered() const { return entered_; }

 private:
  std::shared_ptr<GrantTable> table_;
  GrantSlot &slot_;
  bool entered_ = false;
};

// The holder's side on one link: the owner's table and grants.
class GrantBook {
 public:
  explicit GrantBook(pid_t owner) : owner_(owner) {}
  // Takes one of the owner's messages; false when it is malformed (the link
  // fails). A table that cannot be taken leaves the book without one: its
  // grants are then not used. `answer`: set for the table, the message to
  // send back (kTableTakenMessage).
  bool take(const uint8_t *body, size_t size, std::vector<uint8_t> &answer);
  // The grant of the cache `target` names (by id, or the blocks cache of a
  // model id), if one is held and the table is there.
  std::shared_ptr<const Grant> find(const wire::Target &target) const;
  // Forgets a grant found revoked.
  void drop(const std::shared_ptr<const Grant> &grant);
  std::shared_ptr<GrantTable> table() const;
  // The grants held that still stand.
  size_t held() const;
  // Lets go of the table and every grant (the link is gone).
  void clear();

 private:
  const pid_t owner_;
  // Forgets the grants the owner revoked (mu_ held).
  void forget_revoked_locked();

  mutable std::mutex mu_;
  std::shared_ptr<GrantTable> table_;
  std::map<int64_t, std::shared_ptr<const Grant>> by_id_;
  std::map<uint64_t, int64_t> by_model_;
};

}  // namespace datadist::same_host

#endif  // DATADIST_TRANSPORT_PATHS_SAME_HOST_GRANTS_H_
