// The wire protocol between two engines: framed, versioned, binary,
// little-endian. Every frame is a fixed header, a body of at most
// kMaxBodyBytes and, for data-carrying frames, exactly `data_len` raw bytes.
//
// A cache operation never carries a raw remote pointer: it names a cache
// (by id, by key, or the blocks cache of a model id) and byte ranges inside
// its tensors; the owner resolves and bounds-checks them itself.
#ifndef DATADIST_TRANSPORT_WIRE_H_
#define DATADIST_TRANSPORT_WIRE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "llm_datadist/llm_error_codes.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire encoding assumes a little-endian host"
#endif

namespace datadist::wire {

using llm_datadist::Status;

constexpr uint32_t kMagic = 0x4F414444;  // "DDAO"
constexpr uint16_t kVersion = 3;
constexpr uint32_t kMaxBodyBytes = 1u << 20;
constexpr uint64_t kMaxFrameData = 64ull << 20;
// A frame by reference with a path's trailer (kPathTrailer) may name this
// many bytes, where its path allows it (the path checks its own bound).
constexpr uint64_t kMaxTrailerFrameData = 256ull << 20;
constexpr uint32_t kMaxBounds = 2;
constexpr uint32_t kMaxRanges = (kMaxBodyBytes - 64) / 32 - kMaxBounds;
// The ranges of one request once its strided ranges are unrolled.
constexpr uint32_t kMaxElements = 1u << 16;
// An answer that refuses (kWriteAck, kReadData with a status) carries the
// owner's reason as its body: text of at most this many bytes.
constexpr uint32_t kMaxReasonBytes = 512;

enum class FrameType : uint16_t {
  kHello = 1,
  kHelloAck = 2,
  kWrite = 3,
  kWriteAck = 4,
  kRead = 5,
  kReadData = 6,
  kLookup = 7,
  kLookupReply = 8,
  kUnlink = 9,     // the initiator is going away; answered once the owner dropped the link
  kUnlinkAck = 10,
  // Operations by reference: the body names the owner's ranges and, one per
  // range, the initiator's own memory (Segment); no data follows. The path
  // that serves the frame moves the bytes: from the initiator's memory for
  // kWriteFrom, into it for kReadInto. Answered by kWriteAck / kReadData
  // without data.
  kWriteFrom = 11,
  kReadInto = 12,
  // 13: no frame has this type (kUnassignedFrameType).
  // Handshake with a link secret: the acceptor's fresh nonce, then the
  // initiator's proof (see transport/auth.h).
  kChallenge = 14,
  kProof = 15,
  // A data path's own message to its counterpart on the peer's end of the
  // link: the body is the path's (the link hands it to the link's paths
  // until one takes it); no data, no answer.
  kPathMessage = 16,
};
constexpr uint16_t kUnassignedFrameType = 13;

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t body_len;
  uint32_t status;
  uint64_t op_id;
  uint64_t data_len;
};
static_assert(sizeof(FrameHeader) == 32, "header layout");

enum HelloFlags : uint32_t {
  kAuthenticated = 4,   // hello: the initiator's nonce follows; ack: the acceptor's proof
  // Ack only: a uint32 follows the fixed part, the connections the acceptor
  // keeps (fewer than the hello's conn_count; it decides). An ack without
  // the flag keeps them all. A connection past that count is answered by a
  // bare ack with the flag, then closed.
  kGrantsConnections = 8,
  // Ack only: the link runs on descriptors a path of the acceptor's took
  // from the initiator in place of its connections (one each, named by the
  // path's parts of the hellos); the TCP connections close after the acks.
  // Every ack of a link says the same.
  kConnectionsMoved = 16,
  // Ack only, beside kConnectionsMoved: the link also has an answer socket
  // so taken (each message one answer frame without data, either way).
  kAnswerSocket = 32,
  // Hello or ack: the sender's link encryption is on. Once the ack is out,
  // every connection of the link that stays TCP (not moved) runs a TLS 1.3
  // handshake keyed from the link secret and that connection's handshake
  // (tls.h), and carries nothing but TLS records from there. A link is made
  // only when both ends say the same.
  kEncrypted = 1024,
  // A refusal's ack only: the acceptor refused because the two ends'
  // encryption differs (its own is kEncrypted and kCertificates).
  kEncryptionDiffers = 2048,
  // Hello or ack, beside kEncrypted: the sender's TLS is authenticated by
  // certificates (tls.h), not keyed from the link secret.
  kCertificates = 4096,
  // Hello or ack: the data paths' parts follow (PathPart): what the sender
  // offers (hello) or took (ack) of each path, in the path's own bytes.
  kPathParts = 8192,
};

// A path's own bytes in a handshake or a frame, after this head: with
// kPathParts, after the granted count, a uint32 count (1 to kMaxPathParts)
// then `count` parts, each this and its `length` bytes, no path number twice
// (a path this end lacks ignores its part); with kPathTrailer, one after a
// request's segments, running to the body's end. The number is the path's
// (paths/paths.h).
struct PathPart {
  uint16_t path;
  uint16_t zero;
  uint32_t length;  // at most kMaxPathPartBytes
};
static_assert(sizeof(PathPart) == 8, "path part layout");
constexpr uint32_t kMaxPathParts = 4;
constexpr uint32_t kMaxPathPartBytes = 8192 + 256;

// A hello is followed by its path parts (kPathParts), then by the
// initiator's nonce (kAuthenticated); the ack by the granted count
// (kGrantsConnections), its path parts, then the acceptor's proof.
struct Hello {
  uint64_t cluster_id;
  uint64_t expected_peer_id;  // the id the initiator means to reach
  uint64_t link_nonce;        // identifies the link the connection belongs to
  uint32_t role;
  uint32_t conn_index;
  uint32_t conn_count;
  uint32_t flags;
};
static_assert(sizeof(Hello) == 40, "hello layout");

struct HelloAck {
  uint64_t cluster_id;
  uint32_t role;
  uint32_t flags;
};

// The initiator's memory for one range of an operation by reference.
struct Segment {
  uint64_t addr;
  uint64_t length;
};
static_assert(sizeof(Segment) == 16, "segment layout");

// kRawAddress: each range's `offset` is an address in the owner's memory,
// accepted only inside one tensor the owner registered (tensor, slot 0).
enum TargetKind : uint8_t { kById = 1, kByKey = 2, kBlocksOfModel = 3, kRawAddress = 4 };
enum TargetFlags : uint8_t {
  kWithinSlot = 1,  // every range must stay inside one slot
  kReleaseKey = 2,  // a read through a key: the owner releases the key once every tensor was read
  kStrided = 4,     // a Stride per range follows the bounds
  // Frames by reference only: after the segments, a PathPart and its bytes,
  // the trailer of the path that carried the frame (what the owner needs
  // to reach the segments: export handles, keys), which only that path
  // reads; it serves the frame.
  kPathTrailer = 8,
};

// Names a cache on the owner and how the initiator sees its geometry.
struct Target {
  uint8_t kind;
  uint8_t flags;
  uint16_t bound_count;  // ranges after the data ranges that only bound the operation
  uint32_t range_count;
  int64_t cache_id;
  uint64_t req_id;
  uint64_t model_id;
  uint64_t prefix_id;
  uint64_t expected_slot_size;  // 0: any
  // Non-zero: the request belongs to an ordered group (one config of a
  // layer-wise transfer, sent on one connection); once a request of the
  // group is refused, the owner refuses the rest of it.
  uint64_t group;
};
static_assert(sizeof(Target) == 56, "target layout");

// Bytes [slot * slot_size + offset, + length) of tensor `tensor`; for a
// target named by key, `slot` counts from the slot the key is bound to.
// Every frame of an operation split over several frames also carries the
// operation's outermost ranges as bounds, checked like its own ranges, so the
// owner refuses all of the operation's frames or none of them.
struct Range {
  uint32_t tensor;
  uint32_t reserved;
  uint64_t slot;
  uint64_t offset;
  uint64_t length;
};
static_assert(sizeof(Range) == 32, "range layout");

// With kStrided, range i stands for `count` ranges of its length, the j-th
// at offset + j * stride (stride >= length when count > 1, so they do not
// overlap); on a frame by reference its segment repeats likewise, at
// addr + j * segment_stride (0 on any other frame). The owner unrolls and
// checks every one of them as a range of its own.
struct Stride {
  uint32_t count;
  uint32_t reserved;
  uint64_t stride;
  uint64_t segment_stride;
};
static_assert(sizeof(Stride) == 24, "stride layout");

struct LookupReply {
  int64_t cache_id;
  uint32_t num_tensors;
  uint32_t remote_accessible;
  uint64_t slot_size;
  uint64_t num_slots;
  uint64_t bound_slot;
};
#pragma pack(pop)

FrameHeader make_header(FrameType type, uint64_t op_id, uint32_t body_len, uint64_t data_len,
                        Status status = llm_datadist::LLM_SUCCESS);

// Empty string when the header may be followed; otherwise why not.
std::string check_header(const FrameHeader &header);

// A decoded request body: the target, its ranges (strided ranges unrolled)
// and its bounds, and for a frame by reference the initiator's segment of
// each range and the trailer of its path (kPathTrailer).
struct Request {
  Target target{};
  // Decoded with segments: the frame names the sender's memory (kWriteFrom,
  // kReadInto) instead of carrying its bytes.
  bool by_reference = false;
  std::vector<Range> ranges;
  std::vector<Range> bounds;
  std::vector<Segment> segments;
  uint16_t trailer_path = 0;
  std::vector<uint8_t> trailer;
  uint64_t total_bytes = 0;
};

// Encodes a target, ranges, bounds, (frames by reference) segments, when
// not empty one stride per range (sets kStrided) and, when not empty, the
// trailer of path `trailer_path` (sets kPathTrailer) into a body.
std::vector<uint8_t> encode_request(const Target &target, const std::vector<Range> &ranges,
                                    const std::vector<Range> &bounds = {},
                                    const std::vector<Segment> &segments = {},
                                    const std::vector<Stride> &strides = {}, uint16_t trailer_path = 0,
                                    const std::vector<uint8_t> &trailer = {});
// Empty string on success; otherwise why the body is malformed. A body with
// `with_segments` must carry one segment per range, of the range's length.
std::string decode_request(const std::vector<uint8_t> &body, Request &out, bool with_segments = false);

}  // namespace datadist::wire

#endif  // DATADIST_TRANSPORT_WIRE_H_
