#include "transport/paths/device/exports.h"

#include <cstring>

#include "transport/paths/same_host/same_host.h"

namespace datadist::device_exports {

wire::DeviceExport to_wire(const cuda::Export &e, int ordinal) {
  wire::DeviceExport out{};
  if (e.fd >= 0) {
    const wire::DeviceFd fd{e.fd, 0, e.size, e.serial};
    std::memcpy(out.handle, &fd, sizeof(fd));
    out.kind = wire::kExportFd;
  } else {
    std::memcpy(out.handle, e.handle.reserved, sizeof(out.handle));
    out.kind = wire::kExportIpc;
  }
  out.base = e.base;
  out.ordinal = ordinal;
  return out;
}

std::shared_ptr<cuda::PeerAllocation> open(const wire::DeviceExport &e, pid_t peer,
                                           const std::shared_ptr<cuda::Device> &in, std::string &why) {
  if (e.kind == wire::kExportFd) {
    wire::DeviceFd named{};
    std::memcpy(&named, e.handle, sizeof(named));
    const int fd = same_host::take_descriptor(peer, static_cast<uint32_t>(named.fd), why);
    if (fd < 0) return nullptr;
    return cuda::PeerAllocation::import(in, fd, named.size, why);
  }
  cuda::CUipcMemHandle handle{};
  std::memcpy(handle.reserved, e.handle, sizeof(handle.reserved));
  return cuda::PeerAllocation::open(in, handle, why);
}

std::string key(const wire::DeviceExport &e, int ordinal) {
  std::string out(reinterpret_cast<const char *>(e.handle), sizeof(e.handle));
  return out + ":" + std::to_string(e.kind) + ":" + std::to_string(ordinal);
}

}  // namespace datadist::device_exports
