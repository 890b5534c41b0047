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

TEST(WireUcx, AHelloCarriesItsWorkerAddressInTheBytesItsProofCovers) {
  handshake::Hello hello;
  hello.fixed = {1, 2, 3, 0, 0, 1, kOffersUcx | kAuthenticated};
  hello.ucx_address = std::string(300, 'w');
  const std::string bytes = hello.bytes();
  handshake::Hello back;
  ASSERT_TRUE(back.parse(bytes));
  EXPECT_TRUE(back.offers_ucx());
  EXPECT_EQ(back.ucx_address, hello.ucx_address);
  // What a proof covers (all but the authentication bytes) holds the address.
  EXPECT_NE(hello.bytes(false).find(hello.ucx_address), std::string::npos);
  // A length past the limit, an empty address, or a body cut short is refused.
  std::string cut = bytes;
  cut.resize(bytes.size() - 1);
  EXPECT_FALSE(handshake::Hello().parse(cut));
  std::string empty = bytes.substr(0, sizeof(Hello));
  const uint32_t zero = 0;
  empty.append(reinterpret_cast<const char *>(&zero), sizeof(zero));
  empty.append(bytes.end() - static_cast<std::ptrdiff_t>(auth::kNonceBytes), bytes.end());
  EXPECT_FALSE(handshake::Hello().parse(empty));
  std::string huge = bytes.substr(0, sizeof(Hello));
  const uint32_t too_long = kMaxUcxAddress + 1;
  huge.append(reinterpret_cast<const char *>(&too_long), sizeof(too_long));
  huge.append(too_long + auth::kNonceBytes, 'x');
  EXPECT_FALSE(handshake::Hello().parse(huge));
}

}  // namespace
}  // namespace datadist::wire
