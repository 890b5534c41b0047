// Transfers of caches in device memory through the C++ API (PushKvBlocks,
// PullKvBlocks, PushKvCache, PullKvCache) between every mix of host and
// device caches, and the engine's watch of a CUDA event, on the CUDA
// driver stand-in (tests/cuda_standin), whose device memory the host
// cannot touch: a stray dereference kills the
// process. The driver is loaded once per process, so the test runs this
// binary again with the stand-in named in $DATADIST_AIO_CUDA_DRIVER and
// only the DeviceTransfersChild tests selected; they skip anywhere else.
#include <dlfcn.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "engine.h"
#include "error_detail.h"
#include "test_support.h"

extern char **environ;

namespace dd_test {
namespace {

using namespace llm_datadist;

constexpr char kChildEnv[] = "DATADIST_TEST_DEVICE_CHILD";

TEST(DeviceTransfers, EveryMixOfHostAndDeviceCachesOnTheDriverStandIn) {
#ifndef DATADIST_TEST_STANDIN_DRIVER
  GTEST_SKIP() << "the CUDA driver stand-in was not built (no C compiler)";
#else
  if (std::getenv(kChildEnv) != nullptr) GTEST_SKIP() << "this is the child";
  std::vector<std::string> env_strings;
  for (char **e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    if (entry.rfind("DATADIST_AIO_CUDA_DRIVER=", 0) == 0 || entry.rfind("GTEST_", 0) == 0) continue;
    env_strings.push_back(entry);
  }
  env_strings.push_back(std::string("DATADIST_AIO_CUDA_DRIVER=") + DATADIST_TEST_STANDIN_DRIVER);
  env_strings.push_back(std::string(kChildEnv) + "=1");
  std::vector<char *> envp;
  for (std::string &entry : env_strings) envp.push_back(entry.data());
  envp.push_back(nullptr);
  std::string self = "/proc/self/exe", filter = "--gtest_filter=DeviceTransfersChild.*";
  char *argv[] = {self.data(), filter.data(), nullptr};
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data()), 0);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(50);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      FAIL() << "the child did not finish within 50 s";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(WIFEXITED(status)) << "the child died (signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "a DeviceTransfersChild test failed: its output is above";
#endif
}

// A cache of one instance in host or device memory, read and written
// through a host cache of the same shape with CopyKvBlocks.
class Side {
 public:
  Side(LlmDataDist &dd, bool device, uint32_t tensors, uint64_t blocks, uint64_t block_bytes, uint32_t seed)
      : dd_(dd), device_(device), host_(tensors, blocks, block_bytes, seed) {
    EXPECT_STATUS(LLM_SUCCESS, host_.RegisterWith(dd));
    if (device_) {
      CacheDesc desc = host_.Desc();
      desc.placement = CachePlacement::kDevice;
      EXPECT_STATUS(LLM_SUCCESS, dd.AllocateCache(desc, device_cache_));
      Store();
    }
  }
  ~Side() {
    if (device_) dd_.DeallocateCache(device_cache_.cache_id);
    dd_.UnregisterKvCache(host_.id());
  }

  const Cache &cache() const { return device_ ? device_cache_ : host_.cache(); }
  CacheIndex At(uint64_t cluster_id, uint32_t batch_index = 0) const {
    return MakeIndex(cluster_id, cache().cache_id, batch_index);
  }
  uint64_t block_bytes() const { return host_.slot_bytes(); }
  void Fill(uint32_t seed) {
    host_.Fill(seed);
    Store();
  }
  Bytes Snapshot() {
    if (device_) {
      EXPECT_STATUS(LLM_SUCCESS, dd_.CopyKvBlocks(device_cache_, host_.cache(), All(), Each()));
    }
    return host_.Snapshot();
  }

 private:
  void Store() {
    if (device_) {
      EXPECT_STATUS(LLM_SUCCESS, dd_.CopyKvBlocks(host_.cache(), device_cache_, All(), Each()));
    }
  }
  std::vector<uint64_t> All() const {
    std::vector<uint64_t> all(host_.num_slots());
    for (uint64_t i = 0; i < all.size(); ++i) all[i] = i;
    return all;
  }
  std::vector<std::vector<uint64_t>> Each() const {
    std::vector<std::vector<uint64_t>> each;
    for (uint64_t i = 0; i < host_.num_slots(); ++i) each.push_back({i});
    return each;
  }

  LlmDataDist &dd_;
  const bool device_;
  HostCache host_;
  Cache device_cache_;
};

class DeviceTransfersChild : public LinkedPairTest {
 protected:
  void SetUp() override {
    if (std::getenv(kChildEnv) == nullptr) GTEST_SKIP() << "runs in the child of DeviceTransfers";
    LinkedPairTest::SetUp();
  }
};

// 4 tensors (2 layers); blocks of 80 KiB, so an operation spans several
// staging chunks whose edges fall inside blocks.
constexpr uint32_t kTensors = 4;
constexpr uint64_t kBlocks = 20;
constexpr uint64_t kBlockBytes = 80 << 10;

TEST_F(DeviceTransfersChild, KvBlocksAndKvCacheEveryMix) {
  const std::pair<bool, bool> mixes[] = {{false, true}, {true, false}, {true, true}};  // (client's, server's) on the device
  uint32_t seed = 10;
  for (auto [client_device, server_device] : mixes) {
    SCOPED_TRACE(std::string("client ") + (client_device ? "device" : "host") + ", server " +
                 (server_device ? "device" : "host"));
    Side mine(*client_, client_device, kTensors, kBlocks, kBlockBytes, ++seed);
    Side theirs(*server_, server_device, kTensors, kBlocks, kBlockBytes, ++seed);
    const std::vector<uint64_t> src = {0, 1, 2, 7, 8, 19}, dst = {4, 5, 6, 0, 1, 12};

    // PushKvBlocks, every layer, then layer 1 into layer 0.
    Bytes expected = theirs.Snapshot();
    ApplyUnits(expected, mine.Snapshot(), kBlockBytes, LayerPairs(0, 0, 2), 2, src, dst);
    ASSERT_STATUS(LLM_SUCCESS, client_->PushKvBlocks(mine.cache(), theirs.At(kServerId), src, dst));
    EXPECT_TRUE(SameBytes(theirs.Snapshot(), expected));
    ApplyUnits(expected, mine.Snapshot(), kBlockBytes, LayerPairs(1, 0, 1), 2, {3}, {9});
    ASSERT_STATUS(LLM_SUCCESS,
                  client_->PushKvBlocks(mine.cache(), theirs.At(kServerId), {3}, {9}, MakeExt({1, 1}, {0, 0})));
    EXPECT_TRUE(SameBytes(theirs.Snapshot(), expected));

    // PullKvBlocks.
    theirs.Fill(++seed);
    expected = mine.Snapshot();
    ApplyUnits(expected, theirs.Snapshot(), kBlockBytes, LayerPairs(0, 0, 2), 2, src, dst);
    ASSERT_STATUS(LLM_SUCCESS, client_->PullKvBlocks(theirs.At(kServerId), mine.cache(), src, dst));
    EXPECT_TRUE(SameBytes(mine.Snapshot(), expected));

    // PushKvCache / PullKvCache: a block as a batch slot.
    mine.Fill(++seed);
    expected = theirs.Snapshot();
    ApplyUnits(expected, mine.Snapshot(), kBlockBytes, LayerPairs(0, 0, 2), 2, {2}, {17});
    ASSERT_STATUS(LLM_SUCCESS, client_->PushKvCache(mine.cache(), theirs.At(kServerId, 17), 2));
    EXPECT_TRUE(SameBytes(theirs.Snapshot(), expected));
    expected = mine.Snapshot();
    ApplyUnits(expected, theirs.Snapshot(), kBlockBytes, LayerPairs(0, 0, 2), 2, {11}, {13});
    ASSERT_STATUS(LLM_SUCCESS, client_->PullKvCache(theirs.At(kServerId, 11), mine.cache(), 13));
    EXPECT_TRUE(SameBytes(mine.Snapshot(), expected));

    // A block past the server's cache: refused by the server, nothing written.
    expected = theirs.Snapshot();
    EXPECT_STATUS(LLM_PARAM_INVALID, client_->PushKvBlocks(mine.cache(), theirs.At(kServerId), {0, 1}, {3, kBlocks}));
    EXPECT_TRUE(SameBytes(theirs.Snapshot(), expected));
  }
}

}  // namespace
}  // namespace dd_test

namespace dd_test {
namespace {

// The stand-in's entry points a model would call, with void * for handles.
struct ModelStream {
  using Fn = void (*)(void *);
  int (*cuInit)(unsigned) = nullptr;
  int (*cuDevicePrimaryCtxRetain)(void **, int) = nullptr;
  int (*cuCtxSetCurrent)(void *) = nullptr;
  int (*cuStreamCreate)(void **, unsigned) = nullptr;
  int (*cuStreamSynchronize)(void *) = nullptr;
  int (*cuStreamDestroy)(void *) = nullptr;
  int (*cuEventCreate)(void **, unsigned) = nullptr;
  int (*cuEventRecord)(void *, void *) = nullptr;
  int (*cuEventDestroy)(void *) = nullptr;
  int (*cuLaunchHostFunc)(void *, Fn, void *) = nullptr;
  void *stream = nullptr;

  template <typename F>
  static void find(void *lib, const char *name, F &slot) {
    slot = reinterpret_cast<F>(dlsym(lib, name));
    ASSERT_NE(slot, nullptr) << name;
  }
};

// A host function that holds its stream until the flag it is given is set.
void hold_until_set(void *flag) {
  auto *open = static_cast<std::atomic<bool> *>(flag);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!open->load() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST_F(DeviceTransfersChild, WatchEventCompletesOnceTheEventHas) {
  void *lib = dlopen(std::getenv("DATADIST_AIO_CUDA_DRIVER"), RTLD_NOW);
  ASSERT_NE(lib, nullptr);
  ModelStream m;
  ModelStream::find(lib, "cuInit", m.cuInit);
  ModelStream::find(lib, "cuDevicePrimaryCtxRetain", m.cuDevicePrimaryCtxRetain);
  ModelStream::find(lib, "cuCtxSetCurrent", m.cuCtxSetCurrent);
  ModelStream::find(lib, "cuStreamCreate", m.cuStreamCreate);
  ModelStream::find(lib, "cuStreamSynchronize", m.cuStreamSynchronize);
  ModelStream::find(lib, "cuStreamDestroy_v2", m.cuStreamDestroy);
  ModelStream::find(lib, "cuEventCreate", m.cuEventCreate);
  ModelStream::find(lib, "cuEventRecord", m.cuEventRecord);
  ModelStream::find(lib, "cuEventDestroy_v2", m.cuEventDestroy);
  ModelStream::find(lib, "cuLaunchHostFunc", m.cuLaunchHostFunc);
  ASSERT_EQ(m.cuInit(0), 0);
  void *context = nullptr;
  ASSERT_EQ(m.cuDevicePrimaryCtxRetain(&context, 0), 0);
  ASSERT_EQ(m.cuCtxSetCurrent(context), 0);
  ASSERT_EQ(m.cuStreamCreate(&m.stream, 1), 0);

  datadist::Engine engine(9);
  ASSERT_EQ(engine.initialize({}), LLM_SUCCESS);
  // Two events behind two holds on the model's stream.
  std::atomic<bool> first{false}, second{false};
  void *events[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(m.cuEventCreate(&events[i], 0), 0);
    ASSERT_EQ(m.cuLaunchHostFunc(m.stream, &hold_until_set, i == 0 ? &first : &second), 0);
    ASSERT_EQ(m.cuEventRecord(events[i], m.stream), 0);
  }
  auto handle = [](void *event) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(event)); };
  std::shared_ptr<datadist::Request> done, cancelled;
  ASSERT_EQ(engine.watch_event(handle(events[0]), done), LLM_SUCCESS);
  ASSERT_EQ(engine.watch_event(handle(events[1]), cancelled), LLM_SUCCESS);
  ASSERT_TRUE(done->watch());  // a completion-queue entry when it completes
  EXPECT_FALSE(done->wait(50));
  first = true;
  ASSERT_TRUE(done->wait(5000));
  EXPECT_EQ(done->results(), std::vector<Status>{LLM_SUCCESS});
  // The entry is pushed right after the waiters are woken: look until it came.
  bool queued = false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!queued && std::chrono::steady_clock::now() < until) {
    for (const datadist::Completion &c : engine.completions()->drain()) queued |= c.request_id == done->id();
    if (!queued) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_TRUE(queued);
  // A watch stopped before its event completes settles at once, as cancelled.
  EXPECT_FALSE(cancelled->done());
  EXPECT_TRUE(engine.unwatch_event(cancelled->id()));
  ASSERT_TRUE(cancelled->wait(1000));
  EXPECT_EQ(cancelled->results(), std::vector<Status>{datadist::kCancelledStatus});
  EXPECT_FALSE(engine.unwatch_event(cancelled->id()));
  // A handle the driver does not know.
  std::shared_ptr<datadist::Request> refused;
  EXPECT_EQ(engine.watch_event(0xdead0, refused), LLM_PARAM_INVALID);
  EXPECT_NE(datadist::error_detail().find("CUDA_ERROR_INVALID_HANDLE"), std::string::npos) << datadist::error_detail();
  EXPECT_EQ(refused, nullptr);
  second = true;
  ASSERT_EQ(m.cuStreamSynchronize(m.stream), 0);
  engine.finalize();
  EXPECT_EQ(engine.requests_in_flight(), 0u);
  for (void *event : events) m.cuEventDestroy(event);
  m.cuStreamDestroy(m.stream);
}

}  // namespace
}  // namespace dd_test
