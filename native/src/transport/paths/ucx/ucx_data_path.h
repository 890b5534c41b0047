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
//
// One-sided (access "one_sided" at both ends, ucx_grants.h): where this
// end's endpoint reaches the peer's memory by itself (`direct`, FENCED or
// DIRECT), it asks the peer for grants, and an operation on a granted cache
// is this end's own gets or puts on that endpoint, checked here against the
// grant's geometry as the owner checks a frame; the owner is not involved.
#ifndef DATADIST_TRANSPORT_PATHS_UCX_UCX_DATA_PATH_H_
#define DATADIST_TRANSPORT_PATHS_UCX_UCX_DATA_PATH_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>
#include <string>

#include "transport/data_path.h"
#include "transport/paths/ucx/ucx_grants.h"
#include "transport/paths/ucx/ucx_path.h"

namespace datadist {

class UcxDataPath : public DataPath {
 public:
  // `direct`: the endpoint for one-sided moves under the peer's grants
  // (null: this end moves nothing one-sided), `direct_rma` its reach;
  // `grants`: this end grants its caches to a peer that asks.
  // `initiator`: this end made the link.
  UcxDataPath(std::shared_ptr<ucx::Peer> peer, std::shared_ptr<ucx::Peer> direct, int direct_rma, bool grants,
              bool initiator)
      : peer_(std::move(peer)),
        direct_(std::move(direct)),
        direct_rma_(direct_ ? direct_rma : DATADIST_UCX_RMA_NONE),
        grants_(grants),
        initiator_(initiator) {}

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
  bool move(bool write, const PlannedFrame &planned, const std::shared_ptr<cuda::Device> &device,
            const Settle &settle) override;
  void running() override;
  bool takes(const std::vector<uint8_t> &body, bool &ok) override;
  void counters(std::map<std::string, uint64_t> &out) const override;
  // Its counters' names, at 0 (paths.h).
  static void zero_counters(std::map<std::string, uint64_t> &out);
  void reap() override;

 private:
  std::shared_ptr<ucx::Grantor> grantor() const;

  const std::shared_ptr<ucx::Peer> peer_;
  const std::shared_ptr<ucx::Peer> direct_;
  const int direct_rma_;
  const bool grants_;
  const bool initiator_;
  LinkFailer fail_;  // set by start()
  std::unique_ptr<ucx::GrantBook> book_;  // made by start() where direct_ is
  mutable std::mutex grantor_mu_;
  std::shared_ptr<ucx::Grantor> grantor_;  // made when the peer asks
  // One-sided operations this end moved, and their bytes.
  std::atomic<uint64_t> one_sided_ops_{0}, one_sided_written_{0}, one_sided_read_{0};
  // Operations that found their grant revoked in its slot (DIRECT); the
  // owner then served them.
  std::atomic<uint64_t> found_revoked_{0};
  // Initiator side: frames naming this end's memory for the peer to move,
  // and those sent again inline because the peer's memory was a device's.
  // Owner side: bytes this end moved.
  std::atomic<uint64_t> frames_{0}, fallbacks_{0}, bytes_served_{0};
  std::atomic<bool> unmapped_logged_{false};  // said once that some memory goes inline
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PATHS_UCX_UCX_DATA_PATH_H_
