// The transport's I/O loop (native/src/transport/io_loop.h): a fixed number
// of threads serve any number of descriptors, one handler at a time per
// descriptor, armed once per arm(); handlers whose owner is gone are
// skipped; the blocking pool gives every job a thread at once and lets idle
// threads end.
#include <gtest/gtest.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "transport/io_loop.h"

namespace datadist {
namespace {

using namespace std::chrono_literals;

// Counts the events of one socket pair's end and the threads that ran them.
class Counter : public IoHandler {
 public:
  void on_ready(uint64_t tag, uint32_t events) override {
    const int now = ++inside;
    if (now > 1) overlapped = true;
    std::this_thread::sleep_for(1ms);
    {
      std::lock_guard<std::mutex> lock(mu);
      tags.insert(tag);
      threads.insert(std::this_thread::get_id());
      last_events = events;
      ++calls;
    }
    --inside;
    cv.notify_all();
  }
  bool wait_calls(int n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, 60s, [&] { return calls >= n; });
  }
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  uint32_t last_events = 0;
  std::set<uint64_t> tags;
  std::set<std::thread::id> threads;
  std::atomic<int> inside{0};
  std::atomic<bool> overlapped{false};
};

struct Pair {
  Pair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fd), 0); }
  ~Pair() {
    ::close(fd[0]);
    ::close(fd[1]);
  }
  int fd[2];
};

size_t TaskCount() {
  size_t n = 0;
  FILE *f = std::fopen("/proc/self/status", "r");
  char line[256];
  while (f != nullptr && std::fgets(line, sizeof(line), f) != nullptr) {
    if (std::sscanf(line, "Threads: %zu", &n) == 1) break;
  }
  if (f != nullptr) std::fclose(f);
  return n;
}

TEST(IoLoop, AFixedNumberOfThreadsServesEveryDescriptor) {
  IoLoop loop(2);
  EXPECT_EQ(loop.threads(), 2u);
  EXPECT_EQ(loop.running_threads(), 0u);  // none before the first descriptor
  auto counter = std::make_shared<Counter>();
  std::vector<std::unique_ptr<Pair>> pairs;
  std::vector<uint64_t> ids;
  const size_t before = TaskCount();
  for (uint64_t i = 0; i < 64; ++i) {
    pairs.push_back(std::make_unique<Pair>());
    const uint64_t id = loop.add(pairs.back()->fd[0], counter, i);
    ASSERT_NE(id, 0u);
    ids.push_back(id);
  }
  EXPECT_EQ(loop.running_threads(), 2u);
  EXPECT_EQ(TaskCount(), before + 2);  // 64 descriptors, two threads
  // Disarmed when added: nothing fires though every socket is writable.
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(counter->calls, 0);
  for (uint64_t id : ids) ASSERT_TRUE(loop.arm(id, EPOLLOUT));
  ASSERT_TRUE(counter->wait_calls(64));
  std::this_thread::sleep_for(50ms);
  // Each fired once per arm (still writable, but disarmed since).
  EXPECT_EQ(counter->calls, 64);
  EXPECT_EQ(counter->tags.size(), 64u);
  EXPECT_LE(counter->threads.size(), 2u);
  EXPECT_EQ(counter->last_events & EPOLLOUT, static_cast<uint32_t>(EPOLLOUT));
  for (uint64_t id : ids) loop.remove(id);
  EXPECT_FALSE(loop.arm(ids[0], EPOLLOUT));  // no longer watched
}

// Armed again by its own handler (as a link does), a descriptor fires once
// per arm: four threads never run its handler twice at a time.
class Rearming : public IoHandler {
 public:
  explicit Rearming(IoLoop &loop) : loop_(loop) {}
  void on_ready(uint64_t, uint32_t) override {
    if (++inside > 1) overlapped = true;
    std::this_thread::sleep_for(100us);
    --inside;
    if (++calls < 100) loop_.arm(id, EPOLLOUT);
  }
  uint64_t id = 0;
  std::atomic<int> calls{0};
  std::atomic<int> inside{0};
  std::atomic<bool> overlapped{false};

 private:
  IoLoop &loop_;
};

TEST(IoLoop, OneHandlerAtATimePerDescriptor) {
  IoLoop loop(4);
  Pair pair;
  auto handler = std::make_shared<Rearming>(loop);
  handler->id = loop.add(pair.fd[0], handler, 0);
  ASSERT_NE(handler->id, 0u);
  ASSERT_TRUE(loop.arm(handler->id, EPOLLOUT));
  for (int i = 0; i < 60000 && handler->calls < 100; ++i) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(handler->calls.load(), 100);  // one call per arm, no more
  EXPECT_FALSE(handler->overlapped.load());
  loop.remove(handler->id);
}

TEST(IoLoop, AHandlerWhoseOwnerIsGoneIsSkipped) {
  IoLoop loop(1);
  Pair pair;
  auto counter = std::make_shared<Counter>();
  std::weak_ptr<Counter> weak = counter;
  const uint64_t id = loop.add(pair.fd[0], counter, 1);
  counter.reset();
  ASSERT_TRUE(weak.expired());
  ASSERT_TRUE(loop.arm(id, EPOLLOUT));
  std::this_thread::sleep_for(50ms);  // fires, finds nobody, and the loop goes on
  auto second = std::make_shared<Counter>();
  Pair other;
  const uint64_t id2 = loop.add(other.fd[0], second, 2);
  ASSERT_TRUE(loop.arm(id2, EPOLLOUT));
  EXPECT_TRUE(second->wait_calls(1));
}

TEST(IoLoop, EveryBlockingJobGetsAThreadAtOnceAndIdleOnesEnd) {
  IoLoop loop(1, 200ms);
  // Each job waits until all have started: a job left waiting for a thread
  // would hold every other one until the (generous) wait gives up, and that
  // job would not see them all.
  constexpr int kJobs = 6;
  std::mutex mu;
  std::condition_variable cv;
  int started = 0, finished = 0, saw_all = 0;
  for (int i = 0; i < kJobs; ++i) {
    ASSERT_TRUE(loop.run_blocking([&] {
      std::unique_lock<std::mutex> lock(mu);
      ++started;
      cv.notify_all();
      if (cv.wait_for(lock, 60s, [&] { return started == kJobs; })) ++saw_all;
      ++finished;
      cv.notify_all();
    }));
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 120s, [&] { return finished == kJobs; }));
    EXPECT_EQ(saw_all, kJobs);
  }
  // A job that comes while threads are idle takes one of them; where they
  // have already ended (idle past 200 ms), one new thread. (A job's thread
  // is idle once back from it, after the job said it finished.)
  auto deadline = std::chrono::steady_clock::now() + 60s;
  while (loop.idle_blocking_threads() < loop.blocking_threads() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  const size_t threads = loop.blocking_threads();
  std::atomic<bool> ran{false};
  ASSERT_TRUE(loop.run_blocking([&] { ran = true; }));
  deadline = std::chrono::steady_clock::now() + 60s;
  while (!ran && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(ran.load());
  EXPECT_LE(loop.blocking_threads(), std::max<size_t>(threads, 1));
  // Idle past 200 ms: they end.
  while (loop.blocking_threads() > 0 && std::chrono::steady_clock::now() < deadline + 60s) {
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(loop.blocking_threads(), 0u);
}

TEST(IoLoop, QueuedBlockingJobsRunBeforeTheLoopIsGone) {
  std::atomic<int> ran{0};
  {
    IoLoop loop(1);
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(loop.run_blocking([&] {
        std::this_thread::sleep_for(20ms);
        ++ran;
      }));
    }
  }
  EXPECT_EQ(ran.load(), 3);
}

}  // namespace
}  // namespace datadist
