// A data path that exists only in this test (transport/data_path.h): a
// class of its own, handed to two links in their list, and nothing else
// touched. Both links live in this process, so the initiator's memory is
// addressable here and the path moves bytes with memcpy. The links run
// their one sequence per side: the initiator's frames go by the first path
// that carries them, the owner resolves its ranges, the path moves the
// bytes, and the link answers (refusals, the answer and the counters
// included).
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "completion_queue.h"
#include "link_host.h"
#include "registry.h"
#include "request.h"
#include "transport/data_path.h"
#include "transport/io_loop.h"
#include "transport/link.h"
#include "transport/paths/same_host/same_host.h"

namespace datadist {
namespace {

using llm_datadist::LLM_SUCCESS;

class InProcessPath : public DataPath {
 public:
  const char *name() const override { return "in_process"; }
  bool active() const override { return true; }
  Carry carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
              Carried &out) override {
    (void)planned;
    (void)exports_ok;
    (void)out;
    if (device != nullptr || body_bytes > wire::kMaxBodyBytes) return Carry::kNext;
    carried.fetch_add(1);
    return Carry::kCarries;
  }
  bool serves(const wire::Request &req) const override {
    return (req.target.flags & wire::kPathTrailer) == 0;
  }
  void serve(std::shared_ptr<ServedFrame> frame) override {
    const wire::Request &req = frame->req;
    for (size_t i = 0; i < req.segments.size(); ++i) {
      auto *theirs = reinterpret_cast<uint8_t *>(static_cast<uintptr_t>(req.segments[i].addr));
      auto *mine = static_cast<uint8_t *>(frame->target.iov[i].iov_base);
      const size_t n = req.segments[i].length;
      if (frame->write) {
        std::memcpy(mine, theirs, n);
      } else {
        std::memcpy(theirs, mine, n);
      }
      served.fetch_add(n);
    }
    frame->done(Moved{});
  }
  void counters(std::map<std::string, uint64_t> &out) const override { out["in_process_bytes_served"] += served; }

  std::atomic<uint64_t> carried{0}, served{0};
};

constexpr uint64_t kSlot = 64, kSlots = 4;

// Runs one operation of `frames` on `link`; its status.
Status run(Link &link, bool write, std::vector<PlannedFrame> frames) {
  static const auto completions = std::make_shared<CompletionQueue>();
  auto request = std::make_shared<Request>(1, 1, completions, std::weak_ptr<RequestTracker>{});
  link.submit(write, std::move(frames), request, 0, std::chrono::steady_clock::now() + std::chrono::seconds(10),
              nullptr);
  request->release(0, LLM_SUCCESS);  // the submitter's hold
  EXPECT_TRUE(request->wait(10000));
  return request->results().at(0);
}

PlannedFrame frame(int64_t cache_id, uint64_t slot, uint64_t length, uint8_t *local) {
  PlannedFrame f;
  f.target = wire::Target{};
  f.target.kind = wire::kById;
  f.target.cache_id = cache_id;
  f.ranges = {{0, 0, slot, 0, length}};
  f.local = {{local, length}};
  return f;
}

TEST(DataPath, APathOfItsOwnCarriesAndServesFramesThroughTheLinksSequences) {
  TestLinkHost initiator_host, owner_host;
  // The owner's cache: one tensor of 4 slots of 64 bytes, remote-accessible.
  std::vector<uint8_t> theirs(kSlot * kSlots, 0);
  const int64_t cache_id = add_slot_cache(owner_host, theirs, kSlot, kSlots);
  ASSERT_GE(cache_id, 0);

  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  auto initiator_path = std::make_shared<InProcessPath>();
  auto owner_path = std::make_shared<InProcessPath>();
  auto initiator = std::make_shared<Link>(2, 1, true, std::vector<int>{fds[0]}, &initiator_host,
                                          std::vector<std::shared_ptr<DataPath>>{initiator_path});
  auto owner = std::make_shared<Link>(1, 0, false, std::vector<int>{fds[1]}, &owner_host,
                                      std::vector<std::shared_ptr<DataPath>>{owner_path});
  ASSERT_TRUE(initiator->start());
  ASSERT_TRUE(owner->start());
  EXPECT_STREQ(initiator->transport(), "in_process");

  // A write into slots 1 and 2, moved by the path at the owner.
  std::vector<uint8_t> mine(2 * kSlot);
  std::iota(mine.begin(), mine.end(), uint8_t{1});
  EXPECT_EQ(run(*initiator, true, {frame(cache_id, 1, 2 * kSlot, mine.data())}), LLM_SUCCESS);
  EXPECT_EQ(0, std::memcmp(theirs.data() + kSlot, mine.data(), mine.size()));
  EXPECT_EQ(theirs[0], 0);
  EXPECT_EQ(theirs[3 * kSlot], 0);

  // A read of slot 2 back.
  std::vector<uint8_t> back(kSlot, 0);
  EXPECT_EQ(run(*initiator, false, {frame(cache_id, 2, kSlot, back.data())}), LLM_SUCCESS);
  EXPECT_EQ(0, std::memcmp(back.data(), mine.data() + kSlot, kSlot));

  // A range past the cache: the link refuses it before the path is asked.
  std::vector<uint8_t> spare(2 * kSlot);
  EXPECT_EQ(run(*initiator, true, {frame(cache_id, 3, 2 * kSlot, spare.data())}), llm_datadist::LLM_PARAM_INVALID);

  EXPECT_EQ(initiator_path->carried.load(), 3u);
  EXPECT_EQ(owner_path->served.load(), 3 * kSlot);
  std::map<std::string, uint64_t> counters;
  owner->path_counters(counters);
  EXPECT_EQ(counters["in_process_bytes_served"], 3 * kSlot);

  initiator->fail(llm_datadist::LLM_LINK_FAILED, "");
  owner->fail(llm_datadist::LLM_LINK_FAILED, "");
  initiator->reap();
  owner->reap();
}

}  // namespace
}  // namespace datadist
