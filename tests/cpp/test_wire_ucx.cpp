// Paths' bytes on the wire: the UCX path's trailer of a frame (its key
// table, paths/ucx/ucx_path.h) decodes as encoded, each segment finds the
// key whose range holds it, and a malformed table, a malformed trailer or a
// segment outside every key is refused; a hello carries the paths' parts
// inside what the proof covers.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "transport/handshake.h"
#include "transport/paths/ucx/ucx_kind.h"
#include "transport/paths/ucx/ucx_path.h"
#include "transport/wire.h"

namespace datadist::wire {
namespace {

constexpr uint64_t kBase = uint64_t{1} << 40;

struct Key {
  uint64_t base;
  uint64_t length;
  std::string packed;
};

// One range of 64 bytes at `segment`, with `keys` as the UCX path's
// trailer (`count` overrides the table's count when not 0).
std::vector<uint8_t> Body(uint64_t segment, const std::vector<Key> &keys, uint32_t count = 0) {
  Target t{};
  t.kind = kById;
  t.cache_id = 2;
  t.range_count = 1;
  const Range r{0, 0, 0, 0, 64};
  const Segment s{segment, 64};
  std::vector<uint8_t> table;
  const uint32_t head[2] = {count != 0 ? count : static_cast<uint32_t>(keys.size()), 0};
  table.insert(table.end(), reinterpret_cast<const uint8_t *>(head), reinterpret_cast<const uint8_t *>(head) + 8);
  for (const Key &k : keys) {
    const ucx::Key key{k.base, k.length, static_cast<uint32_t>(k.packed.size()), 0};
    table.insert(table.end(), reinterpret_cast<const uint8_t *>(&key),
                 reinterpret_cast<const uint8_t *>(&key) + sizeof(key));
    table.insert(table.end(), k.packed.begin(), k.packed.end());
    table.resize(table.size() + (8 - k.packed.size() % 8) % 8, 0);
  }
  return encode_request(t, {r}, {}, {s}, {}, ucx::UcxKind::kId, table);
}

// The frame read as the owner reads it: the request, then its path's
// trailer; the first problem.
std::string Decode(const std::vector<uint8_t> &body, ucx::KeyTable &out) {
  Request req;
  std::string problem = decode_request(body, req, true);
  if (!problem.empty()) return problem;
  EXPECT_EQ(req.trailer_path, ucx::UcxKind::kId);
  return ucx::decode_keys(req.trailer, req.segments, out);
}

TEST(WireUcx, KeysDecodeAsEncodedAndSegmentsFindTheirKey) {
  const std::vector<Key> keys = {{kBase, 4096, "first-key"}, {kBase + 8192, 4096, std::string(40, 'k')}};
  ucx::KeyTable table;
  ASSERT_EQ(Decode(Body(kBase + 8192 + 4032, keys), table), "");
  ASSERT_EQ(table.keys.size(), 2u);
  EXPECT_EQ(table.packed[0], "first-key");
  EXPECT_EQ(table.packed[1], std::string(40, 'k'));
  EXPECT_EQ(table.keys[1].base, kBase + 8192);
  ASSERT_EQ(table.segment_key.size(), 1u);
  EXPECT_EQ(table.segment_key[0], 1u);
}

TEST(WireUcx, MalformedTablesAndStraySegmentsAreRefused) {
  const std::vector<Key> one = {{kBase, 4096, "key"}};
  const auto problem = [](const std::vector<uint8_t> &body) {
    ucx::KeyTable table;
    return Decode(body, table);
  };
  // A segment running past its key's end, or before every key.
  EXPECT_EQ(problem(Body(kBase + 4096 - 32, one)), "UCX segment outside every key");
  EXPECT_EQ(problem(Body(kBase - 64, one)), "UCX segment outside every key");
  EXPECT_EQ(problem(Body(kBase, one, 2)), "UCX key table too short");
  EXPECT_EQ(problem(Body(kBase, {})), "bad UCX key count");
  EXPECT_EQ(problem(Body(kBase, {{kBase, 0, "key"}})), "bad UCX key");
  EXPECT_EQ(problem(Body(kBase, {{kBase, 4096, ""}})), "bad UCX key");
  EXPECT_EQ(problem(Body(kBase, {{~uint64_t{0} - 8, 4096, "key"}})), "bad UCX key");
  std::vector<uint8_t> padded = Body(kBase, one);  // "key" and five bytes of padding
  padded.back() = 1;
  EXPECT_EQ(problem(padded), "UCX key padding not zero");
  // The trailer's head says how long it is: a byte more or less, or a
  // reserved field that is not zero, is refused before the path reads it.
  std::vector<uint8_t> extra = Body(kBase, one);
  extra.push_back(0);
  EXPECT_EQ(problem(extra), "path trailer length mismatch");
  std::vector<uint8_t> short_one = Body(kBase, one);
  short_one.pop_back();
  EXPECT_EQ(problem(short_one), "path trailer length mismatch");
  std::vector<uint8_t> reserved = Body(kBase, one);
  const size_t head_at = sizeof(Target) + sizeof(Range) + sizeof(Segment);
  reserved[head_at + 2] = 1;  // PathPart::zero
  EXPECT_EQ(problem(reserved), "path trailer length mismatch");
  // Not on a frame without segments.
  Request req;
  EXPECT_EQ(decode_request(Body(kBase, one), req, false), "a path's trailer without segments");
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
