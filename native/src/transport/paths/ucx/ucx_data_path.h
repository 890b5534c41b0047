// The UCX path: a frame names the initiator's memory with the UCX keys of
// the tensors it lies in, and the owner gets it into (a write) or puts its
// own into it (a read) with UCX's one-sided operations, from the thread
// that progresses the worker (ucx_path.h). Needs: both ends moving bytes
// with UCX (transport "ucx", or "auto" where a one-sided network transport
// is there), its endpoint made at the handshake. Checks: each segment
// inside the key that names it (the wire decoder), this end's ranges as
// always. Fails: memory this end's UCX cannot map has the frame sent again
// inline; a get or put that fails is a refusal of the operation; an
// endpoint error fails the link.
#ifndef DATADIST_TRANSPORT_PATHS_UCX_UCX_DATA_PATH_H_
#define DATADIST_TRANSPORT_PATHS_UCX_UCX_DATA_PATH_H_

#include <atomic>
#include <memory>
#include <string>

#include "transport/data_path.h"
#include "transport/paths/ucx/ucx_path.h"

namespace datadist {

class UcxDataPath : public DataPath {
 public:
  explicit UcxDataPath(std::shared_ptr<ucx::Peer> peer) : peer_(std::move(peer)) {}

  const char *name() const override { return "ucx"; }
  void start(PathHost &host, LinkFailer fail) override;
  bool active() const override { return true; }
  int device_by_reference() const override;
  Carry carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
              Carried &out) override;
  void refused(const std::string &why) override;
  bool serves(const wire::Request &req) const override;
  std::string read_trailer(const wire::Request &req, std::shared_ptr<const void> &view) const override;
  void serve(std::shared_ptr<ServedFrame> frame) override;
  void counters(std::map<std::string, uint64_t> &out) const override;
  // Its counters' names, at 0 (paths.h).
  static void zero_counters(std::map<std::string, uint64_t> &out);
  void reap() override;

 private:
  const std::shared_ptr<ucx::Peer> peer_;
  // Initiator side: frames naming this end's memory for the peer to move,
  // and those sent again inline because the peer's memory was a device's.
  // Owner side: bytes this end moved.
  std::atomic<uint64_t> frames_{0}, fallbacks_{0}, bytes_served_{0};
  std::atomic<bool> unmapped_logged_{false};  // said once that some memory goes inline
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PATHS_UCX_UCX_DATA_PATH_H_
