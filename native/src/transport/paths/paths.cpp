#include "transport/paths/paths.h"

#include "transport/paths/device/cuda_ipc_path.h"
#include "transport/paths/same_host/same_host_path.h"
#include "transport/paths/ucx/ucx_data_path.h"

namespace datadist {

std::vector<std::shared_ptr<DataPath>> make_paths(const Negotiated &n) {
  std::vector<std::shared_ptr<DataPath>> list;
  if (n.ucx) list.push_back(std::make_shared<UcxDataPath>(n.ucx));
  if (n.offered) {
    auto same_host = std::make_shared<SameHostPath>(n.offered, n.peer_copies, n.peer_memory, n.announce, n.one_sided,
                                                    static_cast<pid_t>(n.peer_pid));
    list.push_back(std::make_shared<CudaIpcPath>(same_host, n.peer_opens_device, n.peer_takes_fds,
                                                 n.peer_big_device_frames));
    list.push_back(same_host);
  }
  return list;
}

void zero_counters(std::map<std::string, uint64_t> &out) {
  UcxDataPath::zero_counters(out);
  CudaIpcPath::zero_counters(out);
  SameHostPath::zero_counters(out);
}

}  // namespace datadist
