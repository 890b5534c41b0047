// Fuzz target: the frame decoder. One input is a flags byte, then a frame
// header (when at least 32 bytes follow) and a request body. Checks what the
// decoder promises: a header it accepts is within every limit, a body it
// accepts is within every limit and encodes back to the same bytes.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "transport/wire.h"

namespace {

namespace wire = datadist::wire;

void require(bool ok, const char *what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_wire: %s\n", what);
    std::abort();
  }
}

void check_header(const uint8_t *data) {
  wire::FrameHeader h;
  std::memcpy(&h, data, sizeof(h));
  if (!wire::check_header(h).empty()) return;
  require(h.magic == wire::kMagic && h.version == wire::kVersion, "accepted a foreign header");
  require(h.type >= static_cast<uint16_t>(wire::FrameType::kHello) &&
              h.type <= static_cast<uint16_t>(wire::FrameType::kPathMessage),
          "accepted an unknown frame type");
  require(h.body_len <= wire::kMaxBodyBytes && h.data_len <= wire::kMaxFrameData, "accepted an oversized frame");
  const auto type = static_cast<wire::FrameType>(h.type);
  require(h.data_len == 0 || type == wire::FrameType::kWrite || type == wire::FrameType::kReadData,
          "accepted data on a frame that carries none");
}

void check_request(const std::vector<uint8_t> &body, bool with_segments) {
  wire::Request req;
  if (!wire::decode_request(body, req, with_segments).empty()) return;
  const wire::Target &t = req.target;
  require(t.kind >= wire::kById && t.kind <= wire::kRawAddress, "accepted an unknown target kind");
  const bool strided = (t.flags & wire::kStrided) != 0;
  require(strided ? req.ranges.size() >= t.range_count && req.ranges.size() <= wire::kMaxElements
                  : req.ranges.size() == t.range_count,
          "range counts differ");
  require(req.bounds.size() == t.bound_count, "bound counts differ");
  require(t.range_count <= wire::kMaxRanges && t.bound_count <= wire::kMaxBounds, "too many ranges accepted");
  // Frames naming device exports carry no bytes and may name more.
  const uint64_t most = (t.flags & wire::kDeviceSegments) != 0 ? wire::kMaxDeviceFrameData : wire::kMaxFrameData;
  uint64_t total = 0;
  for (const wire::Range &r : req.ranges) {
    require(r.length != 0 && r.length <= most, "accepted a bad range length");
    total += r.length;
  }
  require(total == req.total_bytes && total <= most, "total bytes wrong or over the limit");
  require(req.segments.size() == (with_segments ? req.ranges.size() : 0), "segment count differs");
  for (size_t i = 0; i < req.segments.size(); ++i) {
    const wire::Segment &s = req.segments[i];
    require(s.length == req.ranges[i].length, "segment length differs from its range");
    require(s.addr + s.length >= s.addr, "accepted a wrapping segment");
  }
  // Device segments: an export table within its limit, and each segment in
  // the export with the greatest base at or below it.
  const bool device = (t.flags & wire::kDeviceSegments) != 0;
  require(device == !req.exports.empty() && req.exports.size() <= wire::kMaxExports, "export table wrong");
  require(req.segment_export.size() == (device ? req.segments.size() : 0), "segment exports differ");
  for (const wire::DeviceExport &e : req.exports) {
    require(e.kind == wire::kExportIpc || e.kind == wire::kExportFd, "accepted an unknown export kind");
    if (e.kind != wire::kExportFd) continue;
    wire::DeviceFd fd;
    std::memcpy(&fd, e.handle, sizeof(fd));
    require(fd.fd >= 0 && fd.zero == 0 && fd.size != 0 && e.base + fd.size >= e.base, "accepted a bad fd export");
    for (size_t b = sizeof(fd); b < sizeof(e.handle); ++b) require(e.handle[b] == 0, "accepted fd export padding");
  }
  for (size_t i = 0; i < req.segment_export.size(); ++i) {
    require(req.segment_export[i] < req.exports.size(), "a segment names no export");
    const uint64_t base = req.exports[req.segment_export[i]].base;
    require(base <= req.segments[i].addr, "a segment lies below its export");
    if (req.exports.size() > 64) continue;  // the nearest-below check is quadratic
    for (const wire::DeviceExport &e : req.exports) {
      require(e.base <= base || e.base > req.segments[i].addr, "a segment's export is not the nearest below it");
    }
  }
  // UCX segments: a key table within its limits, and each segment inside
  // the key it names.
  const bool ucx = (t.flags & wire::kUcxSegments) != 0;
  require(!(ucx && device), "accepted device and UCX segments together");
  require(ucx == !req.ucx_keys.empty() && req.ucx_keys.size() <= wire::kMaxUcxKeys, "UCX key table wrong");
  require(req.ucx_key_bytes.size() == req.ucx_keys.size(), "UCX key bytes differ");
  require(req.segment_key.size() == (ucx ? req.segments.size() : 0), "segment keys differ");
  for (size_t k = 0; k < req.ucx_keys.size(); ++k) {
    const wire::UcxKey &key = req.ucx_keys[k];
    require(key.key_length != 0 && key.key_length <= wire::kMaxUcxKeyBytes && key.zero == 0 && key.length != 0 &&
                key.base + key.length >= key.base && req.ucx_key_bytes[k].size() == key.key_length,
            "accepted a bad UCX key");
  }
  for (size_t i = 0; i < req.segment_key.size(); ++i) {
    require(req.segment_key[i] < req.ucx_keys.size(), "a segment names no key");
    const wire::UcxKey &key = req.ucx_keys[req.segment_key[i]];
    const wire::Segment &s = req.segments[i];
    require(s.addr >= key.base && s.addr + s.length <= key.base + key.length, "a segment runs outside its key");
  }
  // The body again from what was decoded: the key table after the rest.
  auto encode = [&](const std::vector<wire::Range> &ranges, const std::vector<wire::Segment> &segments) {
    std::vector<uint8_t> out = wire::encode_request(t, ranges, req.bounds, segments, {}, req.exports);
    if (!ucx) return out;
    const uint32_t head[2] = {static_cast<uint32_t>(req.ucx_keys.size()), 0};
    out.insert(out.end(), reinterpret_cast<const uint8_t *>(head), reinterpret_cast<const uint8_t *>(head) + sizeof(head));
    for (size_t k = 0; k < req.ucx_keys.size(); ++k) {
      const auto *key = reinterpret_cast<const uint8_t *>(&req.ucx_keys[k]);
      out.insert(out.end(), key, key + sizeof(wire::UcxKey));
      out.insert(out.end(), req.ucx_key_bytes[k].begin(), req.ucx_key_bytes[k].end());
      out.resize(out.size() + (8 - req.ucx_key_bytes[k].size() % 8) % 8, 0);
    }
    return out;
  };
  // Unrolled, a strided request is the plain request of its rows.
  if (!strided) {
    require(encode(req.ranges, req.segments) == body, "does not encode back");
    return;
  }
  // Rows past what one plain request may carry have no plain form to compare.
  if (req.ranges.size() > wire::kMaxRanges) return;
  wire::Request plain;
  const std::vector<uint8_t> unrolled = encode(req.ranges, req.segments);
  require(wire::decode_request(unrolled, plain, with_segments).empty(), "the unrolled request is refused");
  require(plain.ranges.size() == req.ranges.size() && plain.total_bytes == req.total_bytes,
          "the unrolled request differs");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) { return 0; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  const bool with_segments = (data[0] & 1) != 0;
  ++data;
  --size;
  if (size >= sizeof(wire::FrameHeader)) {
    check_header(data);
    data += sizeof(wire::FrameHeader);
    size -= sizeof(wire::FrameHeader);
  }
  check_request(std::vector<uint8_t>(data, data + size), with_segments);
  return 0;
}
