// Fuzz target: the frame decoder. One input is a flags byte, then a frame
// header (when at least 32 bytes follow) and a request body. Checks what the
// decoder promises: a header it accepts is within every limit, a body it
// accepts is within every limit and encodes back to the same bytes, and a
// path's trailer its path accepts (the CUDA IPC path's export table, the UCX
// path's key table) is within that path's limits. With flags bit 2 the body
// is a UCX grant path message, which a holder's book reads: what it takes
// is within the grants' limits, and each revocation is answered once.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "transport/paths/device/exports.h"
#include "transport/paths/same_host/same_host_kind.h"
#include "transport/paths/ucx/ucx_grants.h"
#include "transport/paths/ucx/ucx_kind.h"
#include "transport/paths/ucx/ucx_path.h"
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

// The trailer as the path it names reads it (the owner's link hands it to
// that path): what the path accepts is within its limits.
void check_trailer(const wire::Request &req) {
  namespace dx = datadist::device_exports;
  namespace ucx = datadist::ucx;
  if (req.trailer_path == datadist::same_host::SameHostKind::kId) {
    // The CUDA IPC path's export table, and each segment in the export with
    // the greatest base at or below it.
    std::vector<dx::DeviceExport> exports;
    std::vector<uint32_t> segment_export;
    if (!dx::decode_table(req.trailer, req.segments, exports, segment_export).empty()) return;
    require(!exports.empty() && exports.size() <= dx::kMaxExports, "export table wrong");
    require(segment_export.size() == req.segments.size(), "segment exports differ");
    require(dx::encode_table(exports) == req.trailer, "the export table does not encode back");
    for (const dx::DeviceExport &e : exports) {
      require(e.kind == dx::kExportIpc || e.kind == dx::kExportFd, "accepted an unknown export kind");
      if (e.kind != dx::kExportFd) continue;
      dx::DeviceFd fd;
      std::memcpy(&fd, e.handle, sizeof(fd));
      require(fd.fd >= 0 && fd.zero == 0 && fd.size != 0 && e.base + fd.size >= e.base, "accepted a bad fd export");
      for (size_t b = sizeof(fd); b < sizeof(e.handle); ++b) require(e.handle[b] == 0, "accepted fd export padding");
    }
    for (size_t i = 0; i < segment_export.size(); ++i) {
      require(segment_export[i] < exports.size(), "a segment names no export");
      const uint64_t base = exports[segment_export[i]].base;
      require(base <= req.segments[i].addr, "a segment lies below its export");
      if (exports.size() > 64) continue;  // the nearest-below check is quadratic
      for (const dx::DeviceExport &e : exports) {
        require(e.base <= base || e.base > req.segments[i].addr, "a segment's export is not the nearest below it");
      }
    }
  } else if (req.trailer_path == ucx::UcxKind::kId) {
    // The UCX path's key table, and each segment inside the key it names.
    ucx::KeyTable table;
    if (!ucx::decode_keys(req.trailer, req.segments, table).empty()) return;
    require(!table.keys.empty() && table.keys.size() <= ucx::kMaxKeys, "UCX key table wrong");
    require(table.packed.size() == table.keys.size(), "UCX key bytes differ");
    require(table.segment_key.size() == req.segments.size(), "segment keys differ");
    for (size_t k = 0; k < table.keys.size(); ++k) {
      const ucx::Key &key = table.keys[k];
      require(key.key_length != 0 && key.key_length <= ucx::kMaxKeyBytes && key.zero == 0 && key.length != 0 &&
                  key.base + key.length >= key.base && table.packed[k].size() == key.key_length,
              "accepted a bad UCX key");
    }
    for (size_t i = 0; i < table.segment_key.size(); ++i) {
      require(table.segment_key[i] < table.keys.size(), "a segment names no key");
      const ucx::Key &key = table.keys[table.segment_key[i]];
      const wire::Segment &s = req.segments[i];
      require(s.addr >= key.base && s.addr + s.length <= key.base + key.length, "a segment runs outside its key");
    }
  }
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
  // Frames with a path's trailer carry no bytes and may name more.
  const bool trailed = (t.flags & wire::kPathTrailer) != 0;
  const uint64_t most = trailed ? wire::kMaxTrailerFrameData : wire::kMaxFrameData;
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
  require(trailed == !req.trailer.empty() && (!trailed || with_segments), "trailer wrong");
  if (trailed) check_trailer(req);
  // The body again from what was decoded.
  auto encode = [&](const std::vector<wire::Range> &ranges, const std::vector<wire::Segment> &segments) {
    return wire::encode_request(t, ranges, req.bounds, segments, {}, req.trailer_path, req.trailer);
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

// A UCX grant path message, as the holder's book takes it (ucx_grants.h).
void check_ucx_grant(const std::vector<uint8_t> &body) {
  namespace ucx = datadist::ucx;
  std::vector<std::vector<uint8_t>> sent;
  // A holder whose endpoint is FENCED: a DIRECT one's table is a descriptor
  // taken out of another process, which this target does not do.
  ucx::GrantBook book([&](std::vector<uint8_t> message) { sent.push_back(std::move(message)); }, false);
  const uint32_t kind = ucx::grant_message_kind(body.data(), body.size());
  int rma = -1;
  pid_t pid = 0;
  if (ucx::read_want_grants(body.data(), body.size(), rma, pid)) {
    require(kind == ucx::kWantGrants && body.size() == 16 && rma >= 0 && rma <= 2 && pid > 0,
            "accepted a bad request for grants");
  }
  if (!book.take(body.data(), body.size())) {
    require(sent.empty(), "answered a malformed message");
    return;
  }
  require(kind == ucx::kGrant || kind == ucx::kRevoke, "took a message that is neither a grant nor a revocation");
  if (kind == ucx::kRevoke) {
    require(sent.size() == 1 && ucx::grant_message_kind(sent[0].data(), sent[0].size()) == ucx::kRevoked &&
                sent[0].size() == 16 && std::memcmp(sent[0].data() + 8, body.data() + 8, 8) == 0,
            "a revocation not answered once, by its number");
    return;
  }
  require(sent.empty() && book.held() == 1, "a grant taken is not held, or answered");
  wire::Target target{};
  target.kind = wire::kById;
  std::memcpy(&target.cache_id, body.data() + 16, sizeof(target.cache_id));
  std::shared_ptr<ucx::HeldGrant> grant = book.enter(target);
  require(grant != nullptr && grant->cache->id == target.cache_id && grant->cache->id > 0, "a grant not found by its id");
  require(!grant->keys.empty() && grant->keys.size() == grant->cache->addrs.size(), "keys and tensors differ");
  for (const std::string &key : grant->keys) require(!key.empty() && key.size() <= ucx::kMaxKeyBytes, "a bad key");
  for (uint8_t *addr : grant->cache->addrs) {
    const auto at = reinterpret_cast<uintptr_t>(addr);
    require(at != 0 && at + grant->cache->geometry.tensor_size >= at, "a tensor at 0 or wrapping");
  }
  // Its revocation, with the operation in flight, is answered at its leave.
  std::vector<uint8_t> revoke(16, 0);
  const uint32_t revoke_kind = ucx::kRevoke;
  std::memcpy(revoke.data(), &revoke_kind, sizeof(revoke_kind));
  std::memcpy(revoke.data() + 8, &grant->number, sizeof(grant->number));
  require(book.take(revoke.data(), revoke.size()) && sent.empty(), "a revocation answered with a use in flight");
  require(book.enter(target) == nullptr, "a revoked grant entered");
  book.leave(grant);
  require(sent.size() == 1 && book.held() == 0, "a revocation not answered at the last leave");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) { return 0; }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  const bool with_segments = (data[0] & 1) != 0;
  const bool grant_message = (data[0] & 2) != 0;
  ++data;
  --size;
  if (grant_message) {
    check_ucx_grant(std::vector<uint8_t>(data, data + size));
    return 0;
  }
  if (size >= sizeof(wire::FrameHeader)) {
    check_header(data);
    data += sizeof(wire::FrameHeader);
    size -= sizeof(wire::FrameHeader);
  }
  check_request(std::vector<uint8_t>(data, data + size), with_segments);
  return 0;
}
