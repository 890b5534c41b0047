// The CUDA IPC path's trailer of frames on device memory
// (paths/device/exports.h): descriptor exports decode as encoded, each
// segment finds the export it starts in, and a malformed descriptor export
// is refused.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "transport/paths/device/exports.h"
#include "transport/paths/same_host/same_host_kind.h"
#include "transport/wire.h"

namespace datadist::wire {
namespace {

using device_exports::DeviceExport;
using device_exports::DeviceFd;
using device_exports::kExportFd;

constexpr uint64_t kBase = uint64_t{1} << 40;
constexpr uint64_t kPiece = uint64_t{2} << 20;

DeviceExport FdExport(int32_t fd, uint64_t base, uint64_t size, uint64_t serial) {
  DeviceExport e{};
  const DeviceFd named{fd, 0, size, serial};
  std::memcpy(e.handle, &named, sizeof(named));
  e.base = base;
  e.kind = kExportFd;
  return e;
}

// One range of 64 bytes whose segment starts 32 bytes before the second
// piece: it runs from the first export on into the second.
std::vector<uint8_t> Body(const std::vector<DeviceExport> &exports) {
  Target t{};
  t.kind = kById;
  t.cache_id = 2;
  t.range_count = 1;
  const Range r{0, 0, 0, 0, 64};
  const Segment s{kBase + kPiece - 32, 64};
  return encode_request(t, {r}, {}, {s}, {}, same_host::SameHostKind::kId, device_exports::encode_table(exports));
}

// The frame read as the owner reads it: the request, then its path's
// trailer; the first problem.
std::string Decode(const std::vector<uint8_t> &body, std::vector<DeviceExport> &exports,
                   std::vector<uint32_t> &segment_export) {
  Request req;
  std::string problem = decode_request(body, req, true);
  if (!problem.empty()) return problem;
  EXPECT_EQ(req.trailer_path, same_host::SameHostKind::kId);
  return device_exports::decode_table(req.trailer, req.segments, exports, segment_export);
}

TEST(WireExports, DescriptorExportsDecodeAsEncoded) {
  const std::vector<DeviceExport> exports = {FdExport(9, kBase + kPiece, kPiece, 2), FdExport(7, kBase, kPiece, 1)};
  std::vector<DeviceExport> got;
  std::vector<uint32_t> segment_export;
  ASSERT_EQ(Decode(Body(exports), got, segment_export), "");
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].kind, kExportFd);
  DeviceFd named{};
  std::memcpy(&named, got[1].handle, sizeof(named));
  EXPECT_EQ(named.fd, 7);
  EXPECT_EQ(named.size, kPiece);
  EXPECT_EQ(named.serial, 1u);
  // The segment lies in the export with the greatest base at or below it.
  ASSERT_EQ(segment_export.size(), 1u);
  EXPECT_EQ(segment_export[0], 1u);
}

TEST(WireExports, MalformedDescriptorExportsAreRefused) {
  struct Case {
    const char *what;
    DeviceExport e;
    std::string problem;
  };
  std::vector<Case> cases;
  cases.push_back({"a negative descriptor", FdExport(-1, kBase, kPiece, 1), "bad device fd export"});
  cases.push_back({"no size", FdExport(3, kBase, 0, 1), "bad device fd export"});
  cases.push_back({"a size past the address space", FdExport(3, kBase, ~uint64_t{0} - kBase + 1, 1),
                   "bad device fd export"});
  DeviceExport padded = FdExport(3, kBase, kPiece, 1);
  padded.handle[sizeof(DeviceFd)] = 1;
  cases.push_back({"bytes past the descriptor", padded, "bad device fd export"});
  DeviceExport zero = FdExport(3, kBase, kPiece, 1);
  zero.handle[4] = 1;  // DeviceFd::zero
  cases.push_back({"a non-zero reserved field", zero, "bad device fd export"});
  DeviceExport unknown = FdExport(3, kBase, kPiece, 1);
  unknown.kind = 2;
  cases.push_back({"an unknown kind", unknown, "unknown device export kind"});
  for (const Case &c : cases) {
    std::vector<DeviceExport> got;
    std::vector<uint32_t> segment_export;
    EXPECT_EQ(Decode(Body({c.e}), got, segment_export), c.problem) << c.what;
  }
}

}  // namespace
}  // namespace datadist::wire
