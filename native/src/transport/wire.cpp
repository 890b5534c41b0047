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
  if (h.type < static_cast<uint16_t>(FrameType::kHello) || h.type > static_cast<uint16_t>(FrameType::kPathMessage)) {
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
                                    const std::vector<Stride> &strides, const std::vector<DeviceExport> &exports) {
  const size_t tables = (ranges.size() + bounds.size()) * sizeof(Range);
  const size_t stride_bytes = strides.size() * sizeof(Stride);
  const size_t segment_bytes = segments.size() * sizeof(Segment);
  const size_t export_bytes = exports.empty() ? 0 : 2 * sizeof(uint32_t) + exports.size() * sizeof(DeviceExport);
  std::vector<uint8_t> body(sizeof(Target) + tables + stride_bytes + segment_bytes + export_bytes);
  Target t = target;
  t.range_count = static_cast<uint32_t>(ranges.size());
  t.bound_count = static_cast<uint16_t>(bounds.size());
  t.flags = static_cast<uint8_t>(strides.empty() ? t.flags & ~kStrided : t.flags | kStrided);
  t.flags = static_cast<uint8_t>(exports.empty() ? t.flags & ~kDeviceSegments : t.flags | kDeviceSegments);
  std::memcpy(body.data(), &t, sizeof(t));
  uint8_t *at = body.data() + sizeof(Target);
  if (!ranges.empty()) std::memcpy(at, ranges.data(), ranges.size() * sizeof(Range));
  if (!bounds.empty()) std::memcpy(at + ranges.size() * sizeof(Range), bounds.data(), bounds.size() * sizeof(Range));
  if (!strides.empty()) std::memcpy(at + tables, strides.data(), stride_bytes);
  if (!segments.empty()) std::memcpy(at + tables + stride_bytes, segments.data(), segment_bytes);
  if (!exports.empty()) {
    uint8_t *table = at + tables + stride_bytes + segment_bytes;
    const uint32_t head[2] = {static_cast<uint32_t>(exports.size()), 0};
    std::memcpy(table, head, sizeof(head));
    std::memcpy(table + sizeof(head), exports.data(), exports.size() * sizeof(DeviceExport));
  }
  return body;
}

namespace {

// The key table of a kUcxSegments body, from `at` to its end.
std::string decode_ucx_keys(const std::vector<uint8_t> &body, size_t at, Request &out) {
  uint32_t head[2] = {0, 0};
  if (body.size() < at + sizeof(head)) return "UCX key table missing";
  std::memcpy(head, body.data() + at, sizeof(head));
  if (head[0] == 0 || head[0] > kMaxUcxKeys || head[1] != 0) return "bad UCX key count";
  at += sizeof(head);
  for (uint32_t i = 0; i < head[0]; ++i) {
    UcxKey key{};
    if (body.size() - at < sizeof(key)) return "UCX key table too short";
    std::memcpy(&key, body.data() + at, sizeof(key));
    at += sizeof(key);
    if (key.key_length == 0 || key.key_length > kMaxUcxKeyBytes || key.zero != 0 || key.length == 0 ||
        key.base + key.length < key.base) {
      return "bad UCX key";
    }
    const size_t padded = (static_cast<size_t>(key.key_length) + 7) / 8 * 8;
    if (body.size() - at < padded) return "UCX key table too short";
    if (!std::all_of(body.begin() + static_cast<std::ptrdiff_t>(at + key.key_length),
                     body.begin() + static_cast<std::ptrdiff_t>(at + padded), [](uint8_t b) { return b == 0; })) {
      return "UCX key padding not zero";
    }
    out.ucx_keys.push_back(key);
    out.ucx_key_bytes.emplace_back(reinterpret_cast<const char *>(body.data() + at), key.key_length);
    at += padded;
  }
  if (at != body.size()) return "UCX key table length mismatch";
  return {};
}

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
  const Target &t = out.target;
  if (t.kind < kById || t.kind > kRawAddress) return "unknown target kind";
  if ((t.flags & ~(kWithinSlot | kReleaseKey | kStrided | kDeviceSegments | kUcxSegments)) != 0) {
    return "unknown target flags";
  }
  const bool device_segments = (t.flags & kDeviceSegments) != 0;
  const bool ucx_segments = (t.flags & kUcxSegments) != 0;
  if ((device_segments || ucx_segments) && !with_segments) return "device segments without segments";
  if (device_segments && ucx_segments) return "device and UCX segments together";
  if ((t.flags & kReleaseKey) != 0 && t.kind != kByKey) return "key release without a key";
  if (t.range_count > kMaxRanges || t.bound_count > kMaxBounds) return "too many ranges";
  const size_t count = static_cast<size_t>(t.range_count) + t.bound_count;
  const size_t strides = (t.flags & kStrided) != 0 ? t.range_count : 0;
  const size_t segments = with_segments ? t.range_count : 0;
  const size_t fixed = sizeof(Target) + count * sizeof(Range) + strides * sizeof(Stride) + segments * sizeof(Segment);
  size_t export_count = 0;
  if (device_segments) {
    uint32_t head[2] = {0, 0};
    if (body.size() < fixed + sizeof(head)) return "export table missing";
    std::memcpy(head, body.data() + fixed, sizeof(head));
    if (head[0] == 0 || head[0] > kMaxExports || head[1] != 0) return "bad export count";
    export_count = head[0];
    if (body.size() != fixed + sizeof(head) + export_count * sizeof(DeviceExport)) return "export table length mismatch";
    out.exports.resize(export_count);
    std::memcpy(out.exports.data(), body.data() + fixed + sizeof(head), export_count * sizeof(DeviceExport));
    for (const DeviceExport &e : out.exports) {
      if (e.kind == kExportIpc) continue;
      if (e.kind != kExportFd) return "unknown device export kind";
      DeviceFd fd{};
      std::memcpy(&fd, e.handle, sizeof(fd));
      const bool rest_zero = std::all_of(e.handle + sizeof(fd), e.handle + sizeof(e.handle),
                                         [](uint8_t b) { return b == 0; });
      if (fd.fd < 0 || fd.zero != 0 || fd.size == 0 || e.base + fd.size < e.base || !rest_zero) {
        return "bad device fd export";
      }
    }
  } else if (ucx_segments) {
    std::string problem = decode_ucx_keys(body, fixed, out);
    if (!problem.empty()) return problem;
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
  const uint64_t most = device_segments ? kMaxDeviceFrameData : kMaxFrameData;
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
  if (ucx_segments) {
    // Each segment inside one key's range.
    out.segment_key.resize(out.segments.size());
    for (size_t i = 0; i < out.segments.size(); ++i) {
      const Segment &s = out.segments[i];
      size_t k = 0;
      while (k < out.ucx_keys.size() && !(s.addr >= out.ucx_keys[k].base &&
                                          s.length <= out.ucx_keys[k].length &&
                                          s.addr - out.ucx_keys[k].base <= out.ucx_keys[k].length - s.length)) {
        ++k;
      }
      if (k == out.ucx_keys.size()) return "UCX segment outside every key";
      out.segment_key[i] = static_cast<uint32_t>(k);
    }
  }
  if (device_segments) {
    // Each segment's export: the greatest base at or below its address.
    std::vector<uint32_t> by_base(out.exports.size());
    for (uint32_t i = 0; i < by_base.size(); ++i) by_base[i] = i;
    std::sort(by_base.begin(), by_base.end(),
              [&](uint32_t a, uint32_t b) { return out.exports[a].base < out.exports[b].base; });
    out.segment_export.resize(out.segments.size());
    for (size_t i = 0; i < out.segments.size(); ++i) {
      auto it = std::upper_bound(by_base.begin(), by_base.end(), out.segments[i].addr,
                                 [&](uint64_t addr, uint32_t e) { return addr < out.exports[e].base; });
      if (it == by_base.begin()) return "device segment below every export";
      out.segment_export[i] = *std::prev(it);
    }
  }
  return {};
}

}  // namespace datadist::wire
