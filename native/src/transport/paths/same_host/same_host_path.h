// The same-host path: a frame names the initiator's host memory, and the
// owner copies the bytes with one kernel call (same_host.h), into or out of
// its own host memory, or staged through pinned buffers where its memory is
// a device's. Needs: both ends on one host, and the kernel's consent to copy
// between the processes (probed at the handshake). Checks: the initiator's
// segments mapped in its process (readable for a write, writable for a
// read). Fails: a refusal of the operation; the link, where the initiator's
// process is gone.
#ifndef DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_PATH_H_
#define DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_PATH_H_

#include <sys/uio.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "transport/data_path.h"
#include "transport/paths/same_host/same_host.h"

namespace datadist {

class SameHostPath : public DataPath {
 public:
  // `offered`: this end offered the path (the peer may announce that it
  // copies for this end). `peer_copies`: the peer reaches this end's
  // memory already (its ack said so). `peer_memory`: set where this end
  // reaches the peer's; `announce`: the peer does not know yet, and is
  // told by the link's first frame.
  SameHostPath(bool offered, bool peer_copies, std::shared_ptr<same_host::PeerMemory> peer_memory, bool announce);

  const char *name() const override { return "same_host"; }
  bool active() const override { return peer_copies_.load(std::memory_order_acquire); }
  Carry carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
              Carried &out) override;
  bool serves(const wire::Request &req) const override;
  bool checks_initiator_first() const override { return true; }
  bool reap_waits() const override { return true; }
  void serve(std::shared_ptr<ServedFrame> frame) override;
  bool first_frame(wire::FrameType &type) const override;
  bool takes(wire::FrameType type, const std::vector<uint8_t> &body, bool &ok) override;
  void counters(std::map<std::string, uint64_t> &out) const override;
  // Its counters' names, at 0 (paths.h).
  static void zero_counters(std::map<std::string, uint64_t> &out);

  // The peer's memory as this end reaches it (null: it does not).
  const std::shared_ptr<same_host::PeerMemory> &peer_memory() const { return peer_memory_; }

 private:
  // A copy between device memory of this end (`device`) and the peer's
  // segments, staged; returns 0, an errno of the kernel copy, or -1 with
  // `why` when the device copy failed.
  int copy_staged(const cuda::Device &device, const std::vector<iovec> &mine, const std::vector<wire::Segment> &theirs,
                  bool from_peer, std::string &why);

  const bool offered_;
  const bool announce_;
  std::atomic<bool> peer_copies_;
  const std::shared_ptr<same_host::PeerMemory> peer_memory_;
  std::atomic<uint64_t> staged_bytes_served_{0}, stream_waits_{0};
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PATHS_SAME_HOST_SAME_HOST_PATH_H_
