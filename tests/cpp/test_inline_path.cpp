// The inline path (native/src/transport/paths/inline/) at the owner, the
// initiator played by the test on the other end of a socket pair: a write
// whose bytes follow its frame lands in the cache and is acked; one whose
// connection ends before its bytes are in leaves nothing holding the link
// (the frame waiting for them held it, and with it the link's descriptors);
// a write of no ranges is answered like any other.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

#include "link_host.h"
#include "transport/link.h"
#include "transport/wire.h"

namespace datadist {
namespace {

using namespace std::chrono_literals;
using llm_datadist::LLM_SUCCESS;

constexpr uint64_t kSlot = 4096, kSlots = 4;

// An owner's link with one remote-accessible cache of 4 slots; `peer` is
// the test's end of its connection.
struct Owner {
  Owner() : bytes(kSlot * kSlots, 0) {
    cache_id = add_slot_cache(host, bytes, kSlot, kSlots);
    EXPECT_GE(cache_id, 0);
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    peer = fds[1];
    link = std::make_shared<Link>(2, 1, false, std::vector<int>{fds[0]}, &host);
    EXPECT_TRUE(link->start());
  }
  ~Owner() {
    if (link) {
      link->fail(llm_datadist::LLM_LINK_FAILED, "");
      link->reap();
    }
    if (peer >= 0) ::close(peer);
  }
  // Sends a kWrite of `ranges` (op 1) and the first `sent` of its bytes.
  void write(const std::vector<wire::Range> &ranges, const std::vector<uint8_t> &data, size_t sent) {
    wire::Target target{};
    target.kind = wire::kById;
    target.cache_id = cache_id;
    const std::vector<uint8_t> body = wire::encode_request(target, ranges);
    const wire::FrameHeader header =
        wire::make_header(wire::FrameType::kWrite, 1, static_cast<uint32_t>(body.size()), data.size());
    ASSERT_EQ(::send(peer, &header, sizeof(header), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(header)));
    ASSERT_EQ(::send(peer, body.data(), body.size(), MSG_NOSIGNAL), static_cast<ssize_t>(body.size()));
    if (sent > 0) {
      ASSERT_EQ(::send(peer, data.data(), sent, MSG_NOSIGNAL), static_cast<ssize_t>(sent));
    }
  }
  // The next answer's header (type 0 when none came within 5 s).
  wire::FrameHeader answer() {
    wire::FrameHeader header{};
    pollfd p{peer, POLLIN, 0};
    if (::poll(&p, 1, 5000) <= 0) return header;
    if (::recv(peer, &header, sizeof(header), MSG_WAITALL) != static_cast<ssize_t>(sizeof(header))) return {};
    std::vector<uint8_t> body(header.body_len);
    if (!body.empty()) ::recv(peer, body.data(), body.size(), MSG_WAITALL);
    return header;
  }

  TestLinkHost host;
  std::vector<uint8_t> bytes;
  int64_t cache_id = -1;
  int peer = -1;
  std::shared_ptr<Link> link;
};

std::vector<uint8_t> pattern(size_t n) {
  std::vector<uint8_t> data(n);
  std::iota(data.begin(), data.end(), uint8_t{7});
  return data;
}

TEST(InlinePath, AWriteWhoseBytesFollowLandsAndIsAcked) {
  Owner o;
  const std::vector<uint8_t> data = pattern(2 * kSlot);
  o.write({{0, 0, 1, 0, 2 * kSlot}}, data, data.size());
  const wire::FrameHeader ack = o.answer();
  EXPECT_EQ(ack.type, static_cast<uint16_t>(wire::FrameType::kWriteAck));
  EXPECT_EQ(ack.op_id, 1u);
  EXPECT_EQ(ack.status, LLM_SUCCESS);
  EXPECT_EQ(0, std::memcmp(o.bytes.data() + kSlot, data.data(), data.size()));
  EXPECT_EQ(o.bytes[0], 0);
  EXPECT_EQ(o.bytes[3 * kSlot], 0);
  std::map<std::string, uint64_t> counters;
  o.link->path_counters(counters);
  EXPECT_EQ(counters["owner_served_bytes"], 2 * kSlot);
}

TEST(InlinePath, AWriteCutShortLeavesNothingHoldingTheLink) {
  Owner o;
  const std::vector<uint8_t> data = pattern(2 * kSlot);
  o.write({{0, 0, 1, 0, 2 * kSlot}}, data, kSlot);  // half its bytes, then the end
  ::close(o.peer);
  o.peer = -1;
  for (int i = 0; i < 5000 && !o.host.down.load(); ++i) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(o.host.down.load());
  o.link->reap();
  // Reaped, the link is held by nothing but this test.
  std::weak_ptr<Link> weak = o.link;
  o.link.reset();
  EXPECT_TRUE(weak.expired());
}

TEST(InlinePath, AWriteOfNoRangesIsAnswered) {
  Owner o;
  o.write({}, {}, 0);
  const wire::FrameHeader ack = o.answer();
  EXPECT_EQ(ack.type, static_cast<uint16_t>(wire::FrameType::kWriteAck));
  EXPECT_EQ(ack.op_id, 1u);
  EXPECT_FALSE(o.link->is_down());
}

}  // namespace
}  // namespace datadist
