// The UCX path's part in a link's handshake (paths.h): its part of a hello
// (the first connection's) or of an ack is this end's UCX worker address.
// Transport "ucx": a link is made only with a peer that offers it too, and
// both ends make an endpoint to the other's worker. Transport "auto": the
// acceptor takes UCX only where no path settled before it serves the link
// (another host, or memory out of reach), and goes on without it where
// UCX refuses the peer's address; the initiator follows.
#ifndef DATADIST_TRANSPORT_PATHS_UCX_UCX_KIND_H_
#define DATADIST_TRANSPORT_PATHS_UCX_UCX_KIND_H_

#include <memory>
#include <string>

#include "transport/paths/paths.h"
#include "transport/paths/ucx/ucx_path.h"

namespace datadist::ucx {

class UcxKind : public PathKind {
 public:
  static constexpr uint16_t kId = 2;
  // `required`: transport "ucx" (else "auto"); `one_sided`: access
  // "one_sided" (grants asked for and given, ucx_grants.h).
  UcxKind(bool required, bool one_sided, IoLoop &io_loop)
      : required_(required), one_sided_(one_sided), io_loop_(io_loop) {}

  uint16_t id() const override { return kId; }
  bool yields() const override { return true; }
  // Transport "ucx": makes the worker, LLM_FEATURE_NOT_ENABLED with the
  // reason when UCX is missing or refuses. "auto": makes it where this host
  // has an RDMA device and UCX a one-sided network transport over it (or
  // $DATADIST_AIO_UCX_AUTO is 1; 0: never), else goes on without.
  Status start(std::string &why) override;
  void stop() override;
  std::unique_ptr<PathHandshake> handshake(uint64_t peer_id, bool acceptor) override;

 private:
  const bool required_;
  const bool one_sided_;
  IoLoop &io_loop_;
  std::shared_ptr<Worker> worker_;  // progressed by io_loop_ until stop()
};

}  // namespace datadist::ucx

#endif  // DATADIST_TRANSPORT_PATHS_UCX_UCX_KIND_H_
