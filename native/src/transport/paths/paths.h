// The data paths a link may have, settled at its handshake: the one list
// that knows every path (a new path is a folder of its own and a line in
// make_paths).
#ifndef DATADIST_TRANSPORT_PATHS_PATHS_H_
#define DATADIST_TRANSPORT_PATHS_PATHS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/data_path.h"

namespace datadist {

namespace same_host {
class PeerMemory;
}
namespace ucx {
class Peer;
}

// What both ends' handshake settled about a link's paths
// (LinkManager::negotiate).
struct Negotiated {
  // Both ends move bytes with UCX: the endpoint to the peer's worker.
  std::shared_ptr<ucx::Peer> ucx;
  // This end offered the same-host path (the peer may reach its memory).
  bool offered = false;
  // The peer reaches this end's memory already (its ack said so).
  bool peer_copies = false;
  // Set when this end reaches the peer's memory; `announce`: the peer does
  // not know yet, and is told by the link's first frame.
  std::shared_ptr<same_host::PeerMemory> peer_memory;
  bool announce = false;
  // The peer reads same-host frames naming exported device memory
  // (wire::kDeviceHandles), of cuMemCreate memory as descriptors too
  // (kDeviceFds), of up to wire::kMaxDeviceFrameData bytes (kBigDeviceFrames).
  bool peer_opens_device = false;
  bool peer_takes_fds = false;
  bool peer_big_device_frames = false;
  // One-sided access (LLMConfig.access "one_sided"): this end grants its
  // caches to a peer that reaches its memory, and uses the peer's grants;
  // the peer's process id.
  bool one_sided = false;
  int64_t peer_pid = 0;
};

// The link's paths in the order operations started here try them: UCX,
// then the same host (device memory by CUDA IPC, host memory by a kernel
// copy); inline on the connections takes what none carries.
std::vector<std::shared_ptr<DataPath>> make_paths(const Negotiated &negotiated);

// Every path's counters, at 0: link_stats names them all on every link.
void zero_counters(std::map<std::string, uint64_t> &out);

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PATHS_PATHS_H_
