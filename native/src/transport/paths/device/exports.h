// Device allocations named across processes of one host: an export made
// here (cuda::Export) as the wire names it, and one named by a peer opened
// here. Used by the CUDA IPC path (the initiator names its memory, the owner
// opens it) and by one-sided grants (the owner names its caches' memory,
// the holder opens it).
#ifndef DATADIST_TRANSPORT_PATHS_DEVICE_EXPORTS_H_
#define DATADIST_TRANSPORT_PATHS_DEVICE_EXPORTS_H_

#include <sys/types.h>

#include <memory>
#include <string>

#include "device/cuda_driver.h"
#include "transport/wire.h"

namespace datadist::device_exports {

// `e`, an export of device `ordinal`'s memory, as the wire names it: its
// legacy IPC handle, or its descriptor's number in this process.
wire::DeviceExport to_wire(const cuda::Export &e, int ordinal);

// The allocation `e` names in process `peer`, opened in `in`'s context: a
// legacy IPC handle opened, or the descriptor taken out of `peer` (the
// kernel's ptrace rule) and imported. Null with `why` when that fails.
std::shared_ptr<cuda::PeerAllocation> open(const wire::DeviceExport &e, pid_t peer,
                                           const std::shared_ptr<cuda::Device> &in, std::string &why);

// A cache key for `e` opened in device `ordinal`'s context.
std::string key(const wire::DeviceExport &e, int ordinal);

}  // namespace datadist::device_exports

#endif  // DATADIST_TRANSPORT_PATHS_DEVICE_EXPORTS_H_
