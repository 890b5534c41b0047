#include "transport/paths/device/exports.h"

#include <algorithm>
#include <cstring>
#include <iterator>

#include "transport/paths/same_host/same_host.h"

namespace datadist::device_exports {

std::vector<uint8_t> encode_table(const std::vector<DeviceExport> &exports) {
  const uint32_t head[2] = {static_cast<uint32_t>(exports.size()), 0};
  std::vector<uint8_t> out(sizeof(head) + exports.size() * sizeof(DeviceExport));
  std::memcpy(out.data(), head, sizeof(head));
  if (!exports.empty()) std::memcpy(out.data() + sizeof(head), exports.data(), exports.size() * sizeof(DeviceExport));
  return out;
}

std::string decode_table(const std::vector<uint8_t> &trailer, const std::vector<wire::Segment> &segments,
                         std::vector<DeviceExport> &exports, std::vector<uint32_t> &segment_export) {
  uint32_t head[2] = {0, 0};
  if (trailer.size() < sizeof(head)) return "export table missing";
  std::memcpy(head, trailer.data(), sizeof(head));
  if (head[0] == 0 || head[0] > kMaxExports || head[1] != 0) return "bad export count";
  if (trailer.size() != sizeof(head) + head[0] * sizeof(DeviceExport)) return "export table length mismatch";
  exports.resize(head[0]);
  std::memcpy(exports.data(), trailer.data() + sizeof(head), head[0] * sizeof(DeviceExport));
  for (const DeviceExport &e : exports) {
    if (e.kind == kExportIpc) continue;
    if (e.kind != kExportFd) return "unknown device export kind";
    DeviceFd fd{};
    std::memcpy(&fd, e.handle, sizeof(fd));
    const bool rest_zero =
        std::all_of(e.handle + sizeof(fd), e.handle + sizeof(e.handle), [](uint8_t b) { return b == 0; });
    if (fd.fd < 0 || fd.zero != 0 || fd.size == 0 || e.base + fd.size < e.base || !rest_zero) {
      return "bad device fd export";
    }
  }
  // Each segment's export: the greatest base at or below its address.
  std::vector<uint32_t> by_base(exports.size());
  for (uint32_t i = 0; i < by_base.size(); ++i) by_base[i] = i;
  std::sort(by_base.begin(), by_base.end(), [&](uint32_t a, uint32_t b) { return exports[a].base < exports[b].base; });
  segment_export.resize(segments.size());
  for (size_t i = 0; i < segments.size(); ++i) {
    auto it = std::upper_bound(by_base.begin(), by_base.end(), segments[i].addr,
                               [&](uint64_t addr, uint32_t e) { return addr < exports[e].base; });
    if (it == by_base.begin()) return "device segment below every export";
    segment_export[i] = *std::prev(it);
  }
  return {};
}

DeviceExport to_wire(const cuda::Export &e, int ordinal) {
  DeviceExport out{};
  if (e.fd >= 0) {
    const DeviceFd fd{e.fd, 0, e.size, e.serial};
    std::memcpy(out.handle, &fd, sizeof(fd));
    out.kind = kExportFd;
  } else {
    std::memcpy(out.handle, e.handle.reserved, sizeof(out.handle));
    out.kind = kExportIpc;
  }
  out.base = e.base;
  out.ordinal = ordinal;
  return out;
}

std::shared_ptr<cuda::PeerAllocation> open(const DeviceExport &e, pid_t peer,
                                           const std::shared_ptr<cuda::Device> &in, std::string &why) {
  if (e.kind == kExportFd) {
    DeviceFd named{};
    std::memcpy(&named, e.handle, sizeof(named));
    const int fd = same_host::take_descriptor(peer, static_cast<uint32_t>(named.fd), why);
    if (fd < 0) return nullptr;
    return cuda::PeerAllocation::import(in, fd, named.size, why);
  }
  cuda::CUipcMemHandle handle{};
  std::memcpy(handle.reserved, e.handle, sizeof(handle.reserved));
  return cuda::PeerAllocation::open(in, handle, why);
}

std::string key(const DeviceExport &e, int ordinal) {
  std::string out(reinterpret_cast<const char *>(e.handle), sizeof(e.handle));
  return out + ":" + std::to_string(e.kind) + ":" + std::to_string(ordinal);
}

}  // namespace datadist::device_exports
