// The same-host path: a frame names the initiator's host memory, and the
// owner copies the bytes with one kernel call (same_host.h), into or out of
// its own host memory, or staged through pinned buffers where its memory is
// a device's. Needs: both ends on one host, and the kernel's consent to copy
// between the processes (probed at the handshake). Checks: the initiator's
// segments mapped in its process (readable for a write, writable for a
// read). Fails: a refusal of the operation; the link, where the initiator's
// process is gone.
//
// One-sided (grants.h), where both ends' access is "one_sided": the owner
// grants the peer its remotely accessible host caches once the peer said it
// reaches its memory, and the peer then moves host-memory operations on
// caches named by id or by a model's blocks key itself (move()), checked
// against the grant's geometry, with no frame to the owner. Reads through a
// key, and caches without a grant go by frames as above. Device memory:
// the peer's is opened from the grant's exports and copied on this end's
// streams; this end's own, with the peer's host memory, goes staged
// through this end's buffers.
#ifndef DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_PATH_H_
#define DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_PATH_H_

#include <sys/uio.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/data_path.h"
#include "transport/paths/same_host/grants.h"
#include "transport/paths/same_host/same_host.h"

namespace datadist {

class SameHostPath : public DataPath {
 public:
  // `offered`: this end offered the path (the peer may announce that it
  // copies for this end). `peer_copies`: the peer reaches this end's
  // memory already (its ack said so). `peer_memory`: set where this end
  // reaches the peer's; `announce`: the peer does not know yet, and is
  // told by the link's first frame.
  // `one_sided`: this end grants its caches to a peer that reaches its
  // memory, and moves bytes itself under the peer's grants; `peer_pid`: the
  // peer's process. `pool`: threads that share large copies.
  SameHostPath(std::shared_ptr<same_host::CopyPool> pool, bool offered, bool peer_copies, std::shared_ptr<same_host::PeerMemory> peer_memory, bool announce,
               bool one_sided = false, pid_t peer_pid = 0);
  ~SameHostPath() override;

  const char *name() const override { return "same_host"; }
  bool active() const override { return peer_copies_.load(std::memory_order_acquire); }
  Carry carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
              Carried &out) override;
  bool serves(const wire::Request &req) const override;
  bool checks_initiator_first() const override { return true; }
  bool reap_waits() const override { return true; }
  void serve(std::shared_ptr<ServedFrame> frame) override;
  bool move(bool write, const PlannedFrame &planned, const std::shared_ptr<cuda::Device> &device,
            const Settle &settle) override;
  void start(PathHost &host, LinkFailer fail) override;
  void running() override;
  void reap() override;
  bool first_message(std::vector<uint8_t> &body) const override;
  bool takes(const std::vector<uint8_t> &body, bool &ok) override;
  void counters(std::map<std::string, uint64_t> &out) const override;
  // Its counters' names, at 0 (paths.h).
  static void zero_counters(std::map<std::string, uint64_t> &out);

  // The peer's memory as this end reaches it (null: it does not).
  const std::shared_ptr<same_host::PeerMemory> &peer_memory() const { return peer_memory_; }

  // Device `ordinal`, opened here once per link (for host memory of this
  // end copied to and from the peer's device memory, by this path or the
  // CUDA IPC path); null with `why`.
  std::shared_ptr<cuda::Device> device_for(int ordinal, std::string &why);

 private:
  // A copy between device memory of this end (`device`) and the peer's
  // segments, staged; returns 0, an errno of the kernel copy, or -1 with
  // `why` when the device copy failed.
  int copy_staged(const cuda::Device &device, const std::vector<iovec> &mine, const std::vector<wire::Segment> &theirs,
                  bool from_peer, std::string &why);

  // One operation this end moves itself under a grant.
  struct OneSided {
    bool write = false;
    uint64_t bytes = 0;
    std::vector<iovec> mine;  // this end's memory, range by range
    std::shared_ptr<same_host::GrantUse> use;  // in the grant's slot until the bytes have moved
    Settle settle;
  };
  struct StreamMove;
  // Counts a moved operation and settles it.
  void settle_moved(OneSided &op, Status status, std::string why);
  // Moves `op` between this end's memory (`device`'s, or host memory) and
  // the peer's device memory under `grant`, on a stream of this end's;
  // false (nothing moved) where the grant's allocations cannot be opened
  // here or it names memory past them: the operation goes by frames.
  bool move_on_stream(OneSided op, const std::shared_ptr<cuda::Device> &device,
                      const std::shared_ptr<const same_host::Grant> &grant, const wire::Request &req,
                      const std::vector<iovec> &theirs);
  // Settles the operation whose stream copies landed (or failed).
  void settle_stream(std::shared_ptr<StreamMove> moving);
  // The grant's allocations opened in `in`'s context, a tensor each
  // (opened once, kept with the grant); false with `why`.
  bool open_grant(const same_host::Grant &grant, const std::shared_ptr<cuda::Device> &in,
                  std::vector<std::shared_ptr<cuda::PeerAllocation>> &out, std::string &why);

  // Grants this end's caches to the peer (once it reaches this end's memory).
  void start_granting();
  // This end's grants to the peer, once made (else null).
  std::shared_ptr<same_host::Grantor> grantor() const;

  const std::shared_ptr<same_host::CopyPool> pool_;
  const bool offered_;
  const bool announce_;
  std::atomic<bool> peer_copies_;
  const std::shared_ptr<same_host::PeerMemory> peer_memory_;
  const bool one_sided_;
  const pid_t peer_pid_;
  LinkFailer fail_;
  std::atomic<bool> running_{false};
  mutable std::mutex grants_mu_;
  std::shared_ptr<same_host::Grantor> grantor_;  // this end's grants to the peer
  // The peer's grants to this end (set where this end reaches its memory).
  std::unique_ptr<same_host::GrantBook> book_;
  std::atomic<bool> moves_{true};  // cleared when the kernel refused a one-sided copy
  // Cleared when this end cannot open or copy the peer's device memory.
  std::atomic<bool> device_moves_{true};
  std::map<int, std::shared_ptr<cuda::Device>> devices_;  // device_for()'s (grants_mu_)
  std::atomic<uint64_t> staged_bytes_served_{0}, stream_waits_{0};
  std::atomic<uint64_t> one_sided_ops_{0}, one_sided_written_{0}, one_sided_read_{0};
  // Of those bytes, moved by this end's stream copies from or into the
  // peer's device memory; staged through this end's device buffers.
  std::atomic<uint64_t> one_sided_device_{0}, one_sided_staged_{0};
  // Operations that found their grant revoked in its slot (then served by the owner).
  std::atomic<uint64_t> found_revoked_{0};
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_PATH_H_
