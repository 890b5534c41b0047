// Device allocations named across processes of one host: an export made
// here (cuda::Export) as the wire names it, and one named by a peer opened
// here. Used by the CUDA IPC path (the initiator names its memory, the owner
// opens it) and by one-sided grants (the owner names its caches' memory,
// the holder opens it).
#ifndef DATADIST_TRANSPORT_PATHS_DEVICE_EXPORTS_H_
#define DATADIST_TRANSPORT_PATHS_DEVICE_EXPORTS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "device/cuda_driver.h"
#include "transport/wire.h"

namespace datadist::device_exports {

#pragma pack(push, 1)
// One device allocation of a process and its base address there: of kind
// kExportIpc, as cuIpcGetMemHandle exported it; of kind kExportFd, memory of
// cuMemCreate exported as a POSIX file descriptor of that process (the
// handle bytes are a DeviceFd).
enum DeviceExportKind : uint32_t { kExportIpc = 0, kExportFd = 1 };
struct DeviceExport {
  uint8_t handle[64];
  uint64_t base;
  int32_t ordinal;  // the exporter's device (a hint: where to open it)
  uint32_t kind;    // DeviceExportKind
};
static_assert(sizeof(DeviceExport) == 80, "device export layout");
// The handle of a kExportFd export; the rest of the 64 bytes are zero.
struct DeviceFd {
  int32_t fd;       // the descriptor's number in the exporter's process
  uint32_t zero;
  uint64_t size;    // bytes mapped at the base: what the opener maps
  uint64_t serial;  // the exporter's number for this export (a reused descriptor number differs in it)
};
static_assert(sizeof(DeviceFd) == 24, "device fd layout");
#pragma pack(pop)
constexpr uint32_t kMaxExports = 1024;

// The CUDA IPC path's trailer of a frame by reference (wire::kPathTrailer):
// a uint32 count, a uint32 zero, then `count` exports of the initiator's.
// A segment lies in the export with the greatest base at or below its
// address, at that distance from the base, and may run on into exports
// whose bases follow without a gap; the owner opens (or imports) each
// export and checks every segment against the size of what it opened.
std::vector<uint8_t> encode_table(const std::vector<DeviceExport> &exports);
// Reads a trailer so made: the exports, and for each of `segments` the
// index of the export it lies in. Empty string on success, else why the
// trailer is malformed.
std::string decode_table(const std::vector<uint8_t> &trailer, const std::vector<wire::Segment> &segments,
                         std::vector<DeviceExport> &exports, std::vector<uint32_t> &segment_export);

// `e`, an export of device `ordinal`'s memory, as the wire names it: its
// legacy IPC handle, or its descriptor's number in this process.
DeviceExport to_wire(const cuda::Export &e, int ordinal);

// The allocation `e` names in process `peer`, opened in `in`'s context: a
// legacy IPC handle opened, or the descriptor taken out of `peer` (the
// kernel's ptrace rule) and imported. Null with `why` when that fails.
std::shared_ptr<cuda::PeerAllocation> open(const DeviceExport &e, pid_t peer,
                                           const std::shared_ptr<cuda::Device> &in, std::string &why);

// A cache key for `e` opened in device `ordinal`'s context.
std::string key(const DeviceExport &e, int ordinal);

}  // namespace datadist::device_exports

#endif  // DATADIST_TRANSPORT_PATHS_DEVICE_EXPORTS_H_
