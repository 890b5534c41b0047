#include "wire.h"

#include <cstring>

namespace datadist::wire {

FrameHeader make_header(FrameType type, uint64_t op_id, uint32_t body_len, uint64_t data_len, Status status) {
  FrameHeader h;
  h.magic = kMagic;
  h.version = kVersion;
  h.type = static_cast<uint16_t>(type);
  h.body_len = body_len;
  h.status = status;
  h.op_id = op_id;
  h.data_len = data_len;
  return h;
}

std::string check_header(const FrameHeader &h) {
  if (h.magic != kMagic) return "bad magic";
  if (h.version != kVersion) return "unsupported protocol version " + std::to_string(h.version);
  if (h.type < static_cast<uint16_t>(FrameType::kHello) || h.type > static_cast<uint16_t>(FrameType::kProof)) {
    return "unknown frame type " + std::to_string(h.type);
  }
  if (h.body_len > kMaxBodyBytes) return "body too long";
  if (h.data_len > kMaxFrameData) return "data too long";
  const auto type = static_cast<FrameType>(h.type);
  const bool carries_data = type == FrameType::kWrite || type == FrameType::kReadData;
  if (!carries_data && h.data_len != 0) return "unexpected data";
  return {};
}

std::vector<uint8_t> encode_request(const Target &target, const std::vector<Range> &ranges,
                                    const std::vector<Range> &bounds, const std::vector<Segment> &segments) {
  const size_t tables = (ranges.size() + bounds.size()) * sizeof(Range);
  std::vector<uint8_t> body(sizeof(Target) + tables + segments.size() * sizeof(Segment));
  Target t = target;
  t.range_count = static_cast<uint32_t>(ranges.size());
  t.bound_count = static_cast<uint16_t>(bounds.size());
  std::memcpy(body.data(), &t, sizeof(t));
  uint8_t *at = body.data() + sizeof(Target);
  if (!ranges.empty()) std::memcpy(at, ranges.data(), ranges.size() * sizeof(Range));
  if (!bounds.empty()) std::memcpy(at + ranges.size() * sizeof(Range), bounds.data(), bounds.size() * sizeof(Range));
  if (!segments.empty()) std::memcpy(at + tables, segments.data(), segments.size() * sizeof(Segment));
  return body;
}

std::string decode_request(const std::vector<uint8_t> &body, Request &out, bool with_segments) {
  if (body.size() < sizeof(Target)) return "request body too short";
  std::memcpy(&out.target, body.data(), sizeof(Target));
  const Target &t = out.target;
  if (t.kind < kById || t.kind > kRawAddress) return "unknown target kind";
  if ((t.flags & ~(kWithinSlot | kReleaseKey)) != 0) return "unknown target flags";
  if ((t.flags & kReleaseKey) != 0 && t.kind != kByKey) return "key release without a key";
  if (t.range_count > kMaxRanges || t.bound_count > kMaxBounds) return "too many ranges";
  const size_t count = static_cast<size_t>(t.range_count) + t.bound_count;
  const size_t segments = with_segments ? t.range_count : 0;
  if (body.size() != sizeof(Target) + count * sizeof(Range) + segments * sizeof(Segment)) {
    return "range table length mismatch";
  }
  out.ranges.resize(t.range_count);
  out.bounds.resize(t.bound_count);
  const uint8_t *at = body.data() + sizeof(Target);
  if (t.range_count != 0) std::memcpy(out.ranges.data(), at, t.range_count * sizeof(Range));
  if (t.bound_count != 0) {
    std::memcpy(out.bounds.data(), at + t.range_count * sizeof(Range), t.bound_count * sizeof(Range));
  }
  out.total_bytes = 0;
  for (const Range &r : out.ranges) {
    if (r.length == 0 || r.length > kMaxFrameData) return "bad range length";
    out.total_bytes += r.length;
    if (out.total_bytes > kMaxFrameData) return "ranges exceed the frame limit";
  }
  out.segments.resize(segments);
  if (segments != 0) std::memcpy(out.segments.data(), at + count * sizeof(Range), segments * sizeof(Segment));
  for (size_t i = 0; i < segments; ++i) {
    const Segment &s = out.segments[i];
    if (s.length != out.ranges[i].length) return "segment length differs from its range";
    if (s.addr + s.length < s.addr) return "segment wraps around the address space";
  }
  return {};
}

}  // namespace datadist::wire
