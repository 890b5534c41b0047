// MemoryUse and CacheEntry::wait_unused (registry.h): the hold an
// owner-served operation keeps on a cache's memory, which unregistering a
// registered cache waits for, cutting what outlasts its patience.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "registry.h"

namespace datadist {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

TEST(MemoryUse, AnUnusedCacheIsWaitedForNotAtAll) {
  auto entry = std::make_shared<CacheEntry>();
  entry->withdrawn.store(true);
  const auto start = Clock::now();
  EXPECT_TRUE(entry->wait_unused(milliseconds(5000), milliseconds(5000)));
  EXPECT_LT(Clock::now() - start, milliseconds(1000));
}

TEST(MemoryUse, AWithdrawnCacheGivesNoUse) {
  auto entry = std::make_shared<CacheEntry>();
  int cuts = 0;
  auto use = MemoryUse::take(entry, [&cuts] { ++cuts; });
  ASSERT_NE(use, nullptr);
  entry->withdrawn.store(true);
  EXPECT_EQ(MemoryUse::take(entry, [&cuts] { ++cuts; }), nullptr);
  use.reset();
  EXPECT_TRUE(entry->wait_unused(milliseconds(0), milliseconds(0)));
  EXPECT_EQ(cuts, 0);
}

TEST(MemoryUse, TheWaitEndsWhenTheLastUseGoes) {
  auto entry = std::make_shared<CacheEntry>();
  std::atomic<int> cuts{0};
  auto first = MemoryUse::take(entry, [&cuts] { ++cuts; });
  auto second = MemoryUse::take(entry, [&cuts] { ++cuts; });
  ASSERT_TRUE(first && second);
  entry->withdrawn.store(true);
  std::thread ender([&] {
    std::this_thread::sleep_for(milliseconds(100));
    first.reset();
    std::this_thread::sleep_for(milliseconds(100));
    second.reset();
  });
  const auto start = Clock::now();
  EXPECT_TRUE(entry->wait_unused(milliseconds(5000), milliseconds(5000)));
  const auto took = Clock::now() - start;
  ender.join();
  EXPECT_GE(took, milliseconds(190));
  EXPECT_LT(took, milliseconds(4000));
  EXPECT_EQ(cuts.load(), 0) << "a use that ended in time was cut";
}

TEST(MemoryUse, UsesThatOutlastThePatienceAreCutThenWaitedFor) {
  auto entry = std::make_shared<CacheEntry>();
  std::shared_ptr<MemoryUse> held[2];
  std::thread enders[2];
  std::atomic<int> cuts{0};
  for (int i = 0; i < 2; ++i) {
    // A cut ends its operation, which lets go of the use soon after, on another thread.
    held[i] = MemoryUse::take(entry, [&, i] {
      ++cuts;
      enders[i] = std::thread([&, i] {
        std::this_thread::sleep_for(milliseconds(20));
        held[i].reset();
      });
    });
    ASSERT_NE(held[i], nullptr);
  }
  entry->withdrawn.store(true);
  const auto start = Clock::now();
  EXPECT_TRUE(entry->wait_unused(milliseconds(200), milliseconds(5000)));
  EXPECT_GE(Clock::now() - start, milliseconds(200));
  EXPECT_EQ(cuts.load(), 2);
  for (std::thread &ender : enders) ender.join();
}

TEST(MemoryUse, AUseThatOutlastsItsCutIsReported) {
  auto entry = std::make_shared<CacheEntry>();
  int cuts = 0;
  auto use = MemoryUse::take(entry, [&cuts] { ++cuts; });
  ASSERT_NE(use, nullptr);
  entry->withdrawn.store(true);
  EXPECT_FALSE(entry->wait_unused(milliseconds(50), milliseconds(50)));
  EXPECT_EQ(cuts, 1);
  use.reset();
  EXPECT_TRUE(entry->wait_unused(milliseconds(0), milliseconds(0)));
}

}  // namespace
}  // namespace datadist
