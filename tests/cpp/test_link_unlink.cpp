// A link asked to unlink (native/src/transport/link.h, request_unlink), its
// peer played by the test on the other ends of two socket pairs: the peer
// answers on the connection the question took, or closes without an answer,
// or closes another connection first (which the link may read before the
// answer), or never answers.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <thread>
#include <vector>

#include "link_host.h"
#include "transport/link.h"
#include "transport/paths/same_host/same_host.h"
#include "transport/wire.h"

namespace datadist {
namespace {

using namespace std::chrono_literals;
using llm_datadist::LLM_SUCCESS;
using llm_datadist::LLM_TIMEOUT;

// The link's two connections; `peer[i]` is the test's end of connection i.
struct Linked {
  Linked() {
    std::vector<int> mine;
    for (int i = 0; i < 2; ++i) {
      int fds[2];
      EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
      mine.push_back(fds[0]);
      peer[i] = fds[1];
    }
    link = std::make_shared<Link>(7, 1, true, mine, &host);
    EXPECT_TRUE(link->start());
  }
  ~Linked() {
    link->fail(llm_datadist::LLM_LINK_FAILED, "");
    link->reap();
    for (int fd : peer) {
      if (fd >= 0) ::close(fd);
    }
  }
  // Waits for the question on either connection; its index and header.
  int question(wire::FrameHeader &header) {
    pollfd p[2] = {{peer[0], POLLIN, 0}, {peer[1], POLLIN, 0}};
    if (::poll(p, 2, 5000) <= 0) return -1;
    const int i = (p[0].revents & POLLIN) != 0 ? 0 : 1;
    if (::recv(peer[i], &header, sizeof(header), MSG_WAITALL) != static_cast<ssize_t>(sizeof(header))) return -1;
    return i;
  }
  void close_peer(int i) {
    ::close(peer[i]);
    peer[i] = -1;
  }

  TestLinkHost host;
  int peer[2] = {-1, -1};
  std::shared_ptr<Link> link;
};

TEST(LinkUnlink, TheAckOnTheQuestionsConnectionAnswersIt) {
  Linked l;
  auto unlinked = std::async(std::launch::async, [&] { return l.link->request_unlink(5000); });
  wire::FrameHeader header{};
  const int i = l.question(header);
  ASSERT_GE(i, 0);
  EXPECT_EQ(header.type, static_cast<uint16_t>(wire::FrameType::kUnlink));
  const wire::FrameHeader ack = wire::make_header(wire::FrameType::kUnlinkAck, header.op_id, 0, 0);
  ASSERT_EQ(::send(l.peer[i], &ack, sizeof(ack), MSG_NOSIGNAL), static_cast<ssize_t>(sizeof(ack)));
  EXPECT_EQ(unlinked.get(), LLM_SUCCESS);
}

TEST(LinkUnlink, TheOtherConnectionClosingFirstStillAnswersIt) {
  // The peer drops its end, acks and closes every connection; the close of
  // the connection the question did not take can be read first.
  Linked l;
  auto unlinked = std::async(std::launch::async, [&] { return l.link->request_unlink(5000); });
  wire::FrameHeader header{};
  const int i = l.question(header);
  ASSERT_GE(i, 0);
  l.close_peer(1 - i);
  std::this_thread::sleep_for(100ms);  // the link reads that close before anything else comes
  l.close_peer(i);
  EXPECT_EQ(unlinked.get(), LLM_SUCCESS);
  EXPECT_TRUE(l.link->is_down());
}

TEST(LinkUnlink, APeerThatNeverAnswersIsATimeout) {
  Linked l;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(l.link->request_unlink(200), LLM_TIMEOUT);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 200ms + 10s);  // the timeout, and slack for a loaded host
}

}  // namespace
}  // namespace datadist
