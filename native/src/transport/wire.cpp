#include "wire.h"

#include <algorithm>
#include <cstring>
#include <iterator>

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
  if (h.type < static_cast<uint16_t>(FrameType::kHello) || h.type > static_cast<uint16_t>(FrameType::kPathMessage) ||
      h.type == kUnassignedFrameType) {
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
                                    const std::vector<Range> &bounds, const std::vector<Segment> &segments,
                                    const std::vector<Stride> &strides, uint16_t trailer_path,
                                    const std::vector<uint8_t> &trailer) {
  const size_t tables = (ranges.size() + bounds.size()) * sizeof(Range);
  const size_t stride_bytes = strides.size() * sizeof(Stride);
  const size_t segment_bytes = segments.size() * sizeof(Segment);
  const size_t trailer_bytes = trailer.empty() ? 0 : sizeof(PathPart) + trailer.size();
  std::vector<uint8_t> body(sizeof(Target) + tables + stride_bytes + segment_bytes + trailer_bytes);
  Target t = target;
  t.range_count = static_cast<uint32_t>(ranges.size());
  t.bound_count = static_cast<uint16_t>(bounds.size());
  t.flags = static_cast<uint8_t>(strides.empty() ? t.flags & ~kStrided : t.flags | kStrided);
  t.flags = static_cast<uint8_t>(trailer.empty() ? t.flags & ~kPathTrailer : t.flags | kPathTrailer);
  std::memcpy(body.data(), &t, sizeof(t));
  uint8_t *at = body.data() + sizeof(Target);
  if (!ranges.empty()) std::memcpy(at, ranges.data(), ranges.size() * sizeof(Range));
  if (!bounds.empty()) std::memcpy(at + ranges.size() * sizeof(Range), bounds.data(), bounds.size() * sizeof(Range));
  if (!strides.empty()) std::memcpy(at + tables, strides.data(), stride_bytes);
  if (!segments.empty()) std::memcpy(at + tables + stride_bytes, segments.data(), segment_bytes);
  if (!trailer.empty()) {
    uint8_t *tail = at + tables + stride_bytes + segment_bytes;
    const PathPart head{trailer_path, 0, static_cast<uint32_t>(trailer.size())};
    std::memcpy(tail, &head, sizeof(head));
    std::memcpy(tail + sizeof(head), trailer.data(), trailer.size());
  }
  return body;
}

namespace {

// Replaces each strided range (and its segment) by the ranges it stands for.
std::string unroll(const std::vector<Stride> &strides, Request &out) {
  const bool with_segments = !out.segments.empty();
  uint64_t elements = 0;
  for (size_t i = 0; i < strides.size(); ++i) {
    const Stride &s = strides[i];
    const uint64_t length = out.ranges[i].length;
    if (s.count == 0 || s.reserved != 0) return "bad stride";
    if (!with_segments && s.segment_stride != 0) return "segment stride without segments";
    if (s.count > 1 && (s.stride < length || (with_segments && s.segment_stride < length))) {
      return "strided ranges overlap";
    }
    uint64_t reach;
    if (__builtin_mul_overflow(static_cast<uint64_t>(s.count - 1), s.stride, &reach) ||
        __builtin_add_overflow(reach, out.ranges[i].offset, &reach)) {
      return "strided range wraps around";
    }
    if (with_segments && (__builtin_mul_overflow(static_cast<uint64_t>(s.count - 1), s.segment_stride, &reach) ||
                          __builtin_add_overflow(reach, out.segments[i].addr, &reach))) {
      return "strided segment wraps around the address space";
    }
    elements += s.count;
    if (elements > kMaxElements) return "too many ranges once unrolled";
  }
  std::vector<Range> ranges;
  std::vector<Segment> segments;
  ranges.reserve(elements);
  if (with_segments) segments.reserve(elements);
  for (size_t i = 0; i < strides.size(); ++i) {
    Range r = out.ranges[i];
    for (uint32_t j = 0; j < strides[i].count; ++j, r.offset += strides[i].stride) ranges.push_back(r);
    if (!with_segments) continue;
    Segment seg = out.segments[i];
    for (uint32_t j = 0; j < strides[i].count; ++j, seg.addr += strides[i].segment_stride) segments.push_back(seg);
  }
  out.ranges = std::move(ranges);
  out.segments = std::move(segments);
  return {};
}

}  // namespace

std::string decode_request(const std::vector<uint8_t> &body, Request &out, bool with_segments) {
  if (body.size() < sizeof(Target)) return "request body too short";
  std::memcpy(&out.target, body.data(), sizeof(Target));
  out.by_reference = with_segments;
  const Target &t = out.target;
  if (t.kind < kById || t.kind > kRawAddress) return "unknown target kind";
  if ((t.flags & ~(kWithinSlot | kReleaseKey | kStrided | kPathTrailer)) != 0) return "unknown target flags";
  const bool trailed = (t.flags & kPathTrailer) != 0;
  if (trailed && !with_segments) return "a path's trailer without segments";
  if ((t.flags & kReleaseKey) != 0 && t.kind != kByKey) return "key release without a key";
  if (t.range_count > kMaxRanges || t.bound_count > kMaxBounds) return "too many ranges";
  const size_t count = static_cast<size_t>(t.range_count) + t.bound_count;
  const size_t strides = (t.flags & kStrided) != 0 ? t.range_count : 0;
  const size_t segments = with_segments ? t.range_count : 0;
  const size_t fixed = sizeof(Target) + count * sizeof(Range) + strides * sizeof(Stride) + segments * sizeof(Segment);
  if (trailed) {
    // The path's trailer runs to the body's end; its path reads it.
    PathPart head{};
    if (body.size() < fixed + sizeof(head)) return "path trailer missing";
    std::memcpy(&head, body.data() + fixed, sizeof(head));
    if (head.zero != 0 || head.length == 0 || body.size() - fixed - sizeof(head) != head.length) {
      return "path trailer length mismatch";
    }
    out.trailer_path = head.path;
    out.trailer.assign(body.begin() + static_cast<std::ptrdiff_t>(fixed + sizeof(head)), body.end());
  } else if (body.size() != fixed) {
    return "range table length mismatch";
  }
  out.ranges.resize(t.range_count);
  out.bounds.resize(t.bound_count);
  const uint8_t *at = body.data() + sizeof(Target);
  if (t.range_count != 0) std::memcpy(out.ranges.data(), at, t.range_count * sizeof(Range));
  if (t.bound_count != 0) {
    std::memcpy(out.bounds.data(), at + t.range_count * sizeof(Range), t.bound_count * sizeof(Range));
  }
  at += count * sizeof(Range);
  std::vector<Stride> stride_table(strides);
  if (strides != 0) std::memcpy(stride_table.data(), at, strides * sizeof(Stride));
  at += strides * sizeof(Stride);
  out.segments.resize(segments);
  if (segments != 0) std::memcpy(out.segments.data(), at, segments * sizeof(Segment));
  for (size_t i = 0; i < segments; ++i) {
    if (out.segments[i].length != out.ranges[i].length) return "segment length differs from its range";
  }
  const uint64_t most = trailed ? kMaxTrailerFrameData : kMaxFrameData;
  for (const Range &r : out.ranges) {
    if (r.length == 0 || r.length > most) return "bad range length";
  }
  if (strides != 0) {
    std::string problem = unroll(stride_table, out);
    if (!problem.empty()) return problem;
  }
  out.total_bytes = 0;
  for (const Range &r : out.ranges) {
    out.total_bytes += r.length;
    if (out.total_bytes > most) return "ranges exceed the frame limit";
  }
  for (const Segment &s : out.segments) {
    if (s.addr + s.length < s.addr) return "segment wraps around the address space";
  }
  return {};
}

}  // namespace datadist::wire
