// A rank-table comm (native/src/comm_links.h) that loses a link: from the
// loss on, until the member is linked again, the comm reads as linking it
// again (an operation toward the member is told to retry, never that it was
// never linked). The loss is told before the link is taken out of the
// table; the test holds that moment open, so a comm that took the dying
// link for a live one would settle on it.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>

#include "comm_links.h"
#include "registry.h"
#include "transport/link_manager.h"

namespace datadist {
namespace {

using namespace std::chrono_literals;
using llm_datadist::LLM_SUCCESS;

constexpr uint64_t kAccepting = 10, kConnecting = 11;

TEST(CommLinks, ALostLinkReadsAsLinkingAgainUntilTheMemberIsBack) {
  Registry registry_a, registry_b;
  TransportOptions options;
  options.paths.same_host = false;
  options.io_threads = 2;
  LinkManager a(kAccepting, 0, registry_a, options);
  LinkManager b(kConnecting, 1, registry_b, options);
  CommLinks comms(kAccepting, a);
  ASSERT_EQ(a.listen("127.0.0.1", 0), LLM_SUCCESS);
  // Hold the moment between telling the loss and taking the link out.
  const auto told = a.loss_observer();
  a.set_loss_observer([told](uint64_t peer) {
    told(peer);
    std::this_thread::sleep_for(200ms);
  });

  CommSpec spec;
  spec.name = "pair";
  spec.members = {{kAccepting, 0, "127.0.0.1", a.listen_port()}, {kConnecting, 1, "127.0.0.1", 1}};
  spec.total_time_ms = 20000;
  uint64_t comm_id = 0;
  ASSERT_EQ(comms.link(spec, comm_id), LLM_SUCCESS);
  ASSERT_EQ(b.link(kAccepting, "127.0.0.1", a.listen_port(), "", 5000), LLM_SUCCESS);
  CommState state = CommState::kPreparing;
  for (int i = 0; i < 500 && state != CommState::kOk; ++i) {
    std::this_thread::sleep_for(10ms);
    ASSERT_EQ(comms.state(comm_id, state), LLM_SUCCESS);
  }
  ASSERT_EQ(state, CommState::kOk);

  // The connecting member drops its end and does not come back.
  ASSERT_EQ(b.unlink(kAccepting, true, 1000), LLM_SUCCESS);
  for (int i = 0; i < 500 && a.find(kConnecting) != nullptr; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(a.find(kConnecting), nullptr);
  for (int i = 0; i < 30; ++i) {
    EXPECT_TRUE(comms.relinking(kConnecting)) << "the member's link is gone and the comm is not linking it again";
    ASSERT_EQ(comms.state(comm_id, state), LLM_SUCCESS);
    EXPECT_EQ(state, CommState::kPreparing);
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(comms.unlink(comm_id, 1000), LLM_SUCCESS);
}

}  // namespace
}  // namespace datadist
