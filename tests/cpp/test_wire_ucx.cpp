// UCX frames and handshakes on the wire: a frame's key table (wire.h,
// UcxKey) decodes as encoded, each segment finds the key whose range holds
// it, and a malformed table or a segment outside every key is refused; a
// hello carries its UCX worker address inside what the proof covers.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "transport/handshake.h"
#include "transport/wire.h"

namespace datadist::wire {
namespace {

constexpr uint64_t kBase = uint64_t{1} << 40;

struct Key {
  uint64_t base;
  uint64_t length;
  std::string packed;
};

// One range of 64 bytes at `segment`, with `keys` appended as a UCX frame's
// key table (`count` overrides the table's count when not 0).
std::vector<uint8_t> Body(uint64_t segment, const std::vector<Key> &keys, uint32_t count = 0) {
  Target t{};
  t.kind = kById;
  t.cache_id = 2;
  t.range_count = 1;
  t.flags = kUcxSegments;
  const Range r{0, 0, 0, 0, 64};
  const Segment s{segment, 64};
  std::vector<uint8_t> body = encode_request(t, {r}, {}, {s}, {}, {});
  const uint32_t head[2] = {count != 0 ? count : static_cast<uint32_t>(keys.size()), 0};
  body.insert(body.end(), reinterpret_cast<const uint8_t *>(head), reinterpret_cast<const uint8_t *>(head) + 8);
  for (const Key &k : keys) {
    const UcxKey key{k.base, k.length, static_cast<uint32_t>(k.packed.size()), 0};
    body.insert(body.end(), reinterpret_cast<const uint8_t *>(&key), reinterpret_cast<const uint8_t *>(&key) + sizeof(key));
    body.insert(body.end(), k.packed.begin(), k.packed.end());
    body.resize(body.size() + (8 - k.packed.size() % 8) % 8, 0);
  }
  return body;
}

TEST(WireUcx, KeysDecodeAsEncodedAndSegmentsFindTheirKey) {
  const std::vector<Key> keys = {{kBase, 4096, "first-key"}, {kBase + 8192, 4096, std::string(40, 'k')}};
  Request req;
  ASSERT_EQ(decode_request(Body(kBase + 8192 + 4032, keys), req, true), "");
  ASSERT_EQ(req.ucx_keys.size(), 2u);
  EXPECT_EQ(req.ucx_key_bytes[0], "first-key");
  EXPECT_EQ(req.ucx_key_bytes[1], std::string(40, 'k'));
  EXPECT_EQ(req.ucx_keys[1].base, kBase + 8192);
  ASSERT_EQ(req.segment_key.size(), 1u);
  EXPECT_EQ(req.segment_key[0], 1u);
}

TEST(WireUcx, MalformedTablesAndStraySegmentsAreRefused) {
  const std::vector<Key> one = {{kBase, 4096, "key"}};
  Request req;
  // A segment running past its key's end, or before every key.
  EXPECT_EQ(decode_request(Body(kBase + 4096 - 32, one), req, true), "UCX segment outside every key");
  req = {};
  EXPECT_EQ(decode_request(Body(kBase - 64, one), req, true), "UCX segment outside every key");
  req = {};
  EXPECT_EQ(decode_request(Body(kBase, one, 2), req, true), "UCX key table too short");
  req = {};
  EXPECT_EQ(decode_request(Body(kBase, {}), req, true), "bad UCX key count");
  req = {};
  EXPECT_EQ(decode_request(Body(kBase, {{kBase, 0, "key"}}), req, true), "bad UCX key");
  req = {};
  EXPECT_EQ(decode_request(Body(kBase, {{kBase, 4096, ""}}), req, true), "bad UCX key");
  req = {};
  EXPECT_EQ(decode_request(Body(kBase, {{~uint64_t{0} - 8, 4096, "key"}}), req, true), "bad UCX key");
  req = {};
  std::vector<uint8_t> padded = Body(kBase, one);  // "key" and five bytes of padding
  padded.back() = 1;
  EXPECT_EQ(decode_request(padded, req, true), "UCX key padding not zero");
  req = {};
  std::vector<uint8_t> extra = Body(kBase, one);
  extra.push_back(0);
  EXPECT_EQ(decode_request(extra, req, true), "UCX key table length mismatch");
  // Not on a frame without segments, nor beside device segments.
  req = {};
  EXPECT_EQ(decode_request(Body(kBase, one), req, false), "device segments without segments");
  std::vector<uint8_t> both = Body(kBase, one);
  both[1] |= kDeviceSegments;
  req = {};
  EXPECT_EQ(decode_request(both, req, true), "device and UCX segments together");
}

TEST(WireUcx, AHelloCarriesThePathsPartsInTheBytesItsProofCovers) {
  handshake::Hello hello;
  hello.fixed = {1, 2, 3, 0, 0, 1, kAuthenticated};
  hello.parts = {{2, std::string(300, 'w')}, {1, std::string(72, 's')}};
  const std::string bytes = hello.bytes();
  EXPECT_NE(hello.fixed.flags & kPathParts, 0u);  // set by the parts
  handshake::Hello back;
  ASSERT_TRUE(back.parse(bytes));
  ASSERT_TRUE(back.has_parts());
  EXPECT_EQ(back.parts, hello.parts);
  ASSERT_NE(handshake::find_part(back.parts, 2), nullptr);
  EXPECT_EQ(*handshake::find_part(back.parts, 2), std::string(300, 'w'));
  EXPECT_EQ(handshake::find_part(back.parts, 3), nullptr);
  EXPECT_EQ(back.bytes(), bytes);  // read back, it is the same bytes
  // What a proof covers (all but the authentication bytes) holds the parts.
  EXPECT_NE(hello.bytes(false).find(std::string(300, 'w')), std::string::npos);

  // Bodies of parts built by hand, each followed by a nonce.
  auto body = [](uint32_t count, const std::vector<std::pair<PathPart, std::string>> &parts) {
    handshake::Hello h;
    h.fixed = {1, 2, 3, 0, 0, 1, kAuthenticated | kPathParts};
    std::string out(reinterpret_cast<const char *>(&h.fixed), sizeof(h.fixed));
    out.append(reinterpret_cast<const char *>(&count), sizeof(count));
    for (const auto &[head, bytes] : parts) {
      out.append(reinterpret_cast<const char *>(&head), sizeof(head));
      out += bytes;
    }
    return out + std::string(auth::kNonceBytes, 'n');
  };
  const std::string one(8, 'x');
  EXPECT_TRUE(handshake::Hello().parse(body(1, {{{7, 0, 8}, one}})));
  // A body cut short, no parts, too many, one too long, a number twice, a
  // reserved field that is not zero, or a length past the body is refused.
  std::string cut = bytes;
  cut.resize(bytes.size() - 1);
  EXPECT_FALSE(handshake::Hello().parse(cut));
  EXPECT_FALSE(handshake::Hello().parse(body(0, {})));
  std::vector<std::pair<PathPart, std::string>> many;
  for (uint16_t i = 0; i <= kMaxPathParts; ++i) many.push_back({{i, 0, 8}, one});
  EXPECT_FALSE(handshake::Hello().parse(body(kMaxPathParts + 1, many)));
  EXPECT_FALSE(handshake::Hello().parse(
      body(1, {{{7, 0, kMaxPathPartBytes + 1}, std::string(kMaxPathPartBytes + 1, 'x')}})));
  EXPECT_FALSE(handshake::Hello().parse(body(2, {{{7, 0, 8}, one}, {{7, 0, 8}, one}})));
  EXPECT_FALSE(handshake::Hello().parse(body(1, {{{7, 1, 8}, one}})));
  EXPECT_FALSE(handshake::Hello().parse(body(1, {{{7, 0, 4096}, one}})));
  EXPECT_FALSE(handshake::Hello().parse(body(2, {{{7, 0, 8}, one}})));
}

}  // namespace
}  // namespace datadist::wire
