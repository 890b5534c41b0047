// The staging pipeline (native/src/device/staging.h) with host copies in
// place of the driver's: chunking, order, overlap of copy and send, failures
// and back-pressure of a bounded pool. The copier runs a lane's copies only
// when that lane is waited for, as a GPU's asynchronous copies may, so a
// chunk handed on before its copy ran would show wrong bytes.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "device/staging.h"

namespace datadist::staging {
namespace {

using namespace std::chrono_literals;

// Buffers from the heap, counted.
Pool MakePool(size_t bytes, size_t buffers) {
  return Pool(
      bytes, buffers, [](size_t n, std::string &) { return new uint8_t[n]; }, [](uint8_t *p) { delete[] p; });
}

class DeferredCopier : public Copier {
 public:
  // Copy number `fail_at` (from 1) is refused; 0: none.
  explicit DeferredCopier(size_t fail_at = 0) : fail_at_(fail_at) {}

  bool to_host(size_t lane, uint8_t *host, const uint8_t *device, size_t n, std::string &why) override {
    return queue(lane, host, device, n, "out", why);
  }
  bool to_device(size_t lane, uint8_t *device, const uint8_t *host, size_t n, std::string &why) override {
    return queue(lane, device, host, n, "in", why);
  }
  bool wait(size_t lane, std::string &) override {
    for (auto &copy : pending_[lane]) copy();
    pending_[lane].clear();
    log.push_back("wait " + std::to_string(lane));
    return true;
  }

  std::vector<std::string> log;
  std::vector<size_t> lanes_used;

 private:
  bool queue(size_t lane, uint8_t *to, const uint8_t *from, size_t n, const char *kind, std::string &why) {
    if (++copies_ == fail_at_) {
      why = "refused copy " + std::to_string(copies_);
      return false;
    }
    pending_[lane].push_back([to, from, n] { std::memcpy(to, from, n); });
    log.push_back(std::string(kind) + " " + std::to_string(lane) + " " + std::to_string(n));
    return true;
  }

  size_t fail_at_;
  size_t copies_ = 0;
  std::map<size_t, std::vector<std::function<void()>>> pending_;
};

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed + i * 7 + i / 251);
  return out;
}

// Ranges of one "device" allocation: short ones, an empty one, long ones.
struct Ranges {
  std::vector<uint8_t> memory = Pattern(20000, 3);
  std::vector<iovec> iov;
  std::vector<uint8_t> stream;  // the ranges' bytes, in order
  Ranges() {
    const std::pair<size_t, size_t> spans[] = {{0, 3}, {10, 5000}, {6000, 0}, {6100, 10}, {7000, 8199}, {16000, 100}};
    for (auto [at, n] : spans) {
      iov.push_back({memory.data() + at, n});
      stream.insert(stream.end(), memory.begin() + at, memory.begin() + at + n);
    }
  }
};

TEST(Staging, OutGathersRangesIntoFullChunksInOrder) {
  Pool pool = MakePool(4096, 2);
  DeferredCopier copier;
  Ranges ranges;
  std::vector<uint8_t> got;
  std::vector<size_t> chunks;
  Result r = stage_out(pool, copier, ranges.iov, kDepth, [&](const uint8_t *p, size_t n) {
    got.insert(got.end(), p, p + n);
    chunks.push_back(n);
    return true;
  });
  ASSERT_EQ(r.outcome, Outcome::kDone) << r.why;
  EXPECT_EQ(r.moved, ranges.stream.size());
  EXPECT_EQ(got, ranges.stream);  // every chunk's copy ran before it was handed on
  const size_t total = ranges.stream.size();  // 13312 bytes: 3 full chunks and 1024
  ASSERT_EQ(chunks.size(), (total + 4095) / 4096);
  for (size_t i = 0; i + 1 < chunks.size(); ++i) EXPECT_EQ(chunks[i], 4096u);
  EXPECT_EQ(chunks.back(), total - 4096 * (chunks.size() - 1));
  EXPECT_EQ(pool.made(), 2u);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(Staging, OutQueuesTheNextCopyBeforeTheFirstChunkLeaves) {
  Pool pool = MakePool(4096, 4);
  DeferredCopier copier;
  Ranges ranges;
  size_t sunk = 0;
  std::vector<std::string> at_first_sink;
  stage_out(pool, copier, ranges.iov, 2, [&](const uint8_t *, size_t) {
    if (sunk++ == 0) at_first_sink = copier.log;
    return true;
  });
  // Chunk 0 on lane 0 and chunk 1 on lane 1 were queued, and only lane 0 waited for.
  bool lane1_copy = false;
  for (const std::string &entry : at_first_sink) {
    if (entry.rfind("out 1 ", 0) == 0) lane1_copy = true;
    EXPECT_NE(entry, "wait 1");
  }
  EXPECT_TRUE(lane1_copy);
  EXPECT_EQ(at_first_sink.back(), "wait 0");
  EXPECT_LE(pool.made(), 2u);  // depth 2: never more buffers than that
}

TEST(Staging, InSpreadsTheStreamOverTheRangesInOrder) {
  Pool pool = MakePool(4096, 2);
  DeferredCopier copier;
  Ranges ranges;
  std::vector<uint8_t> memory(ranges.memory.size(), 0);
  std::vector<iovec> into;
  for (const iovec &v : ranges.iov) {
    into.push_back({memory.data() + (static_cast<uint8_t *>(v.iov_base) - ranges.memory.data()), v.iov_len});
  }
  size_t offset = 0;
  std::vector<size_t> chunks;
  Result r = stage_in(pool, copier, into, kDepth, [&](uint8_t *p, size_t n) {
    std::memcpy(p, ranges.stream.data() + offset, n);
    offset += n;
    chunks.push_back(n);
    return true;
  });
  ASSERT_EQ(r.outcome, Outcome::kDone) << r.why;
  EXPECT_EQ(r.moved, ranges.stream.size());
  for (const iovec &v : ranges.iov) {
    const size_t at = static_cast<uint8_t *>(v.iov_base) - ranges.memory.data();
    EXPECT_EQ(0, std::memcmp(memory.data() + at, v.iov_base, v.iov_len)) << "range at " << at;
  }
  for (size_t i = 0; i + 1 < chunks.size(); ++i) EXPECT_EQ(chunks[i], 4096u);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(Staging, AFailedCopyStopsTheStreamAndReturnsEveryBuffer) {
  Pool pool = MakePool(4096, 2);
  Ranges ranges;
  for (size_t fail_at : {1, 2, 4, 7}) {
    DeferredCopier copier(fail_at);
    std::vector<uint8_t> got;
    Result r = stage_out(pool, copier, ranges.iov, kDepth, [&](const uint8_t *p, size_t n) {
      got.insert(got.end(), p, p + n);
      return true;
    });
    EXPECT_EQ(r.outcome, Outcome::kCopyFailed) << fail_at;
    EXPECT_NE(r.why.find("refused copy"), std::string::npos) << r.why;
    EXPECT_EQ(r.moved, got.size());
    EXPECT_LT(got.size(), ranges.stream.size());
    EXPECT_TRUE(std::equal(got.begin(), got.end(), ranges.stream.begin())) << "only whole, correct chunks left";
    EXPECT_EQ(pool.in_use(), 0u);
  }
  // Coming in: the source is not read past the failure.
  DeferredCopier copier(3);
  std::vector<uint8_t> memory(ranges.memory.size());
  size_t read = 0;
  Result r = stage_in(pool, copier, {{memory.data(), memory.size()}}, kDepth, [&](uint8_t *, size_t n) {
    read += n;
    return true;
  });
  EXPECT_EQ(r.outcome, Outcome::kCopyFailed);
  EXPECT_EQ(r.moved, read);
  EXPECT_LT(read, memory.size());
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(Staging, ASinkOrSourceThatFailsEndsTheTransfer) {
  Pool pool = MakePool(4096, 2);
  DeferredCopier copier;
  Ranges ranges;
  size_t calls = 0;
  Result r = stage_out(pool, copier, ranges.iov, kDepth, [&](const uint8_t *, size_t) { return ++calls < 2; });
  EXPECT_EQ(r.outcome, Outcome::kIoFailed);
  EXPECT_EQ(r.moved, 4096u);
  EXPECT_EQ(calls, 2u);
  std::vector<uint8_t> memory(10000);
  r = stage_in(pool, copier, {{memory.data(), memory.size()}}, kDepth, [](uint8_t *, size_t) { return false; });
  EXPECT_EQ(r.outcome, Outcome::kIoFailed);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(Staging, APoolOfTwoMakesTheNextTransferWait) {
  Pool pool = MakePool(4096, 2);
  Ranges ranges;
  std::mutex mu;
  std::condition_variable cv;
  bool go = false;
  std::atomic<bool> first_started{false}, second_sunk{false}, second_done{false};
  // The first transfer holds both buffers while its sink is held up.
  std::thread first([&] {
    DeferredCopier copier;
    stage_out(pool, copier, ranges.iov, kDepth, [&](const uint8_t *, size_t) {
      first_started = true;
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return go; });
      return true;
    });
  });
  while (!first_started) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(pool.in_use(), 2u);
  std::thread second([&] {
    DeferredCopier copier;
    std::vector<uint8_t> got;
    Result r = stage_out(pool, copier, ranges.iov, kDepth, [&](const uint8_t *p, size_t n) {
      second_sunk = true;
      got.insert(got.end(), p, p + n);
      return true;
    });
    EXPECT_EQ(r.outcome, Outcome::kDone);
    EXPECT_EQ(got, ranges.stream);
    second_done = true;
  });
  for (int i = 0; i < 60000 && pool.waiters() == 0; ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(pool.waiters(), 1u);  // waits for a buffer: none is made beyond the two
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(second_sunk);
  EXPECT_EQ(pool.made(), 2u);
  {
    std::lock_guard<std::mutex> lock(mu);
    go = true;
  }
  cv.notify_all();
  first.join();
  second.join();
  EXPECT_TRUE(second_done);
  EXPECT_EQ(pool.made(), 2u);
  EXPECT_EQ(pool.in_use(), 0u);
}

TEST(Staging, ATransferThatFindsOneBufferFreeGoesOnWithOne) {
  Pool pool = MakePool(4096, 2);
  std::string why;
  uint8_t *held = pool.acquire(why);
  ASSERT_NE(held, nullptr);
  DeferredCopier copier;
  Ranges ranges;
  std::vector<uint8_t> got;
  Result r = stage_out(pool, copier, ranges.iov, kDepth, [&](const uint8_t *p, size_t n) {
    got.insert(got.end(), p, p + n);
    return true;
  });
  EXPECT_EQ(r.outcome, Outcome::kDone);
  EXPECT_EQ(got, ranges.stream);
  for (const std::string &entry : copier.log) EXPECT_EQ(entry.find(" 1 "), std::string::npos) << entry;
  pool.release(held);
  EXPECT_EQ(pool.made(), 2u);
}

TEST(Staging, AFailedAllocationIsReportedAndFreesItsRoom) {
  int calls = 0;
  Pool pool(
      4096, 1,
      [&](size_t n, std::string &why) -> uint8_t * {
        if (++calls == 1) {
          why = "no pinned memory";
          return nullptr;
        }
        return new uint8_t[n];
      },
      [](uint8_t *p) { delete[] p; });
  DeferredCopier copier;
  Ranges ranges;
  Result r = stage_out(pool, copier, ranges.iov, kDepth, [](const uint8_t *, size_t) { return true; });
  EXPECT_EQ(r.outcome, Outcome::kCopyFailed);
  EXPECT_NE(r.why.find("no pinned memory"), std::string::npos) << r.why;
  r = stage_out(pool, copier, ranges.iov, kDepth, [](const uint8_t *, size_t) { return true; });
  EXPECT_EQ(r.outcome, Outcome::kDone);
  EXPECT_EQ(pool.made(), 1u);
}

}  // namespace
}  // namespace datadist::staging
