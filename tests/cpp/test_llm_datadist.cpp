// LlmDataDist: life cycle (Initialize / Finalize), roles and options, cache
// registration and allocation.
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <set>

#include "test_support.h"

namespace dd_test {
namespace {

using namespace llm_datadist;

// Calls every method but Initialize / Finalize with arguments that would be
// valid on a linked, initialised instance and returns their statuses.
std::vector<std::pair<std::string, Status>> CallEveryMethod(LlmDataDist &dd) {
  HostCache host(2, 4, 16, 1);
  std::vector<std::pair<std::string, Status>> out;
  std::vector<Status> rets;
  out.emplace_back("SetRole", dd.SetRole(LlmRole::kDecoder));
  out.emplace_back("LinkLlmClusters", dd.LinkLlmClusters({MakeClusterInfo(5, 1234)}, rets, 1000));
  out.emplace_back("UnlinkLlmClusters", dd.UnlinkLlmClusters({MakeClusterInfo(5, 1234)}, rets, 1000));
  out.emplace_back("UnlinkLlmClusters(force)", dd.UnlinkLlmClusters({MakeClusterInfo(5, 1234)}, rets, 1000, true));
  int64_t id = -1;
  out.emplace_back("RegisterKvCache", dd.RegisterKvCache(host.Desc(), host.Addrs(), RegisterCfg{}, id));
  out.emplace_back("UnregisterKvCache", dd.UnregisterKvCache(1));
  Cache allocated;
  out.emplace_back("AllocateCache", dd.AllocateCache(host.Desc(), allocated));
  out.emplace_back("DeallocateCache", dd.DeallocateCache(1));
  Cache cache;
  cache.cache_id = 1;
  cache.cache_desc = host.Desc();
  const CacheIndex remote = MakeIndex(5, 1, 0);
  out.emplace_back("PullKvCache", dd.PullKvCache(remote, cache));
  out.emplace_back("PullKvBlocks", dd.PullKvBlocks(remote, cache, {0}, {1}));
  out.emplace_back("PushKvCache", dd.PushKvCache(cache, remote));
  out.emplace_back("PushKvBlocks", dd.PushKvBlocks(cache, remote, {0}, {1}));
  out.emplace_back("CopyKvCache", dd.CopyKvCache(cache, cache, 0, 1));
  out.emplace_back("CopyKvBlocks", dd.CopyKvBlocks(cache, cache, {0}, {{1}}));
  return out;
}

TEST(Lifecycle, EveryMethodFailsBeforeInitialize) {
  LlmDataDist dd(1, LlmRole::kPrompt);
  for (const auto &[name, st] : CallEveryMethod(dd)) {
    EXPECT_STATUS(LLM_FAILED, st) << name;
  }
}

TEST(Lifecycle, EveryMethodFailsAfterFinalize) {
  LlmDataDist dd(1, LlmRole::kPrompt);
  ASSERT_STATUS(LLM_SUCCESS, dd.Initialize(BaseOptions()));
  dd.Finalize();
  for (const auto &[name, st] : CallEveryMethod(dd)) {
    EXPECT_STATUS(LLM_FAILED, st) << name;
  }
}

TEST(Lifecycle, InitializeWithoutListeningSucceeds) {
  LlmDataDist dd(1, LlmRole::kDecoder);
  EXPECT_STATUS(LLM_SUCCESS, dd.Initialize(BaseOptions()));
  dd.Finalize();
}

TEST(Lifecycle, InitializeAcceptsEveryRole) {
  for (LlmRole role : {LlmRole::kPrompt, LlmRole::kDecoder, LlmRole::kMix}) {
    LlmDataDist dd(7, role);
    EXPECT_STATUS(LLM_SUCCESS, dd.Initialize(BaseOptions())) << static_cast<int>(role);
    dd.Finalize();
  }
}

TEST(Lifecycle, SecondInitializeIsANoOpSuccess) {
  LlmDataDist dd(1, LlmRole::kPrompt);
  const uint16_t port = InitListening(dd);
  ASSERT_NE(port, 0);
  EXPECT_STATUS(LLM_SUCCESS, dd.Initialize(BaseOptions()));
  // Even with options that would be refused on a first call.
  EXPECT_STATUS(LLM_SUCCESS, dd.Initialize({{OPTION_LISTEN_IP_INFO, "not an address"}}));
  // Still the same instance: it keeps listening where it did.
  LlmDataDist client(2, LlmRole::kDecoder);
  ASSERT_STATUS(LLM_SUCCESS, client.Initialize(BaseOptions()));
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_SUCCESS, client.LinkLlmClusters({MakeClusterInfo(1, port)}, rets, 2000));
  client.Finalize();
  dd.Finalize();
}

TEST(Lifecycle, FinalizeTwiceIsSafe) {
  LlmDataDist dd(1, LlmRole::kPrompt);
  ASSERT_STATUS(LLM_SUCCESS, dd.Initialize(BaseOptions()));
  dd.Finalize();
  dd.Finalize();
  int64_t id = -1;
  HostCache host(2, 4, 16, 1);
  EXPECT_STATUS(LLM_FAILED, dd.RegisterKvCache(host.Desc(), host.Addrs(), RegisterCfg{}, id));
}

TEST(Lifecycle, FinalizeWithoutInitializeIsSafe) {
  LlmDataDist dd(1, LlmRole::kPrompt);
  dd.Finalize();
  dd.Finalize();
}

TEST(Lifecycle, DestructorCleansUpLinkedInstances) {
  // Neither side calls Finalize: the destructors must tear down the link,
  // the listener and the registered caches.
  HostCache host(2, 4, 16, 1);
  {
    LlmDataDist server(1, LlmRole::kPrompt);
    const uint16_t port = InitListening(server);
    ASSERT_NE(port, 0);
    LlmDataDist client(2, LlmRole::kDecoder);
    ASSERT_STATUS(LLM_SUCCESS, client.Initialize(BaseOptions()));
    std::vector<Status> rets;
    ASSERT_STATUS(LLM_SUCCESS, client.LinkLlmClusters({MakeClusterInfo(1, port)}, rets, 2000));
    ASSERT_STATUS(LLM_SUCCESS, host.RegisterWith(server));
  }
  SUCCEED();
}

TEST(Lifecycle, BadListenStringIsParamInvalid) {
  const uint16_t port = PickFreePort();
  ASSERT_NE(port, 0);
  const std::string p = std::to_string(port);
  for (const std::string &bad : {std::string("127.0.0.1"), std::string("127.0.0.1:"), std::string(":" + p),
                                std::string("127.0.0.1:99999"), std::string("127.0.0.1:12ab"),
                                std::string("127.0.0.1:-1"), std::string("localhost-is-no-ip:" + p),
                                std::string("300.1.2.3:" + p), std::string("127.0.0.1 " + p)}) {
    LlmDataDist dd(1, LlmRole::kPrompt);
    Options options = BaseOptions();
    options[OPTION_LISTEN_IP_INFO] = bad;
    EXPECT_STATUS(LLM_PARAM_INVALID, dd.Initialize(options)) << "listen '" << bad << "'";
    // A refused Initialize leaves the instance uninitialised.
    EXPECT_STATUS(LLM_FAILED, dd.SetRole(LlmRole::kPrompt)) << "listen '" << bad << "'";
  }
}

TEST(Lifecycle, InitializeCanBeRetriedAfterAFailure) {
  LlmDataDist dd(1, LlmRole::kPrompt);
  Options options = BaseOptions();
  options[OPTION_LISTEN_IP_INFO] = "127.0.0.1:x";
  ASSERT_STATUS(LLM_PARAM_INVALID, dd.Initialize(options));
  const uint16_t port = InitListening(dd);
  ASSERT_NE(port, 0);
  LlmDataDist client(2, LlmRole::kDecoder);
  ASSERT_STATUS(LLM_SUCCESS, client.Initialize(BaseOptions()));
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_SUCCESS, client.LinkLlmClusters({MakeClusterInfo(1, port)}, rets, 2000));
}

TEST(Lifecycle, ListeningOnAPortInUseFails) {
  LlmDataDist first(1, LlmRole::kPrompt);
  const uint16_t port = InitListening(first);
  ASSERT_NE(port, 0);
  LlmDataDist second(2, LlmRole::kPrompt);
  Options options = BaseOptions();
  options[OPTION_LISTEN_IP_INFO] = "127.0.0.1:" + std::to_string(port);
  EXPECT_NE(StatusName(second.Initialize(options)), StatusName(LLM_SUCCESS));
  EXPECT_STATUS(LLM_FAILED, second.SetRole(LlmRole::kPrompt));
}

TEST(Lifecycle, InvalidRoleIsParamInvalid) {
  {
    LlmDataDist dd(1, LlmRole::kEnd);
    EXPECT_STATUS(LLM_PARAM_INVALID, dd.Initialize(BaseOptions()));
    EXPECT_STATUS(LLM_FAILED, dd.SetRole(LlmRole::kPrompt));
  }
  {
    LlmDataDist dd(1, static_cast<LlmRole>(0));
    EXPECT_STATUS(LLM_PARAM_INVALID, dd.Initialize(BaseOptions()));
  }
}

TEST(Lifecycle, MalformedOptionValuesAreParamInvalid) {
  const std::vector<std::pair<const char *, const char *>> bad = {
      {OPTION_SYNC_CACHE_WAIT_TIME, "abc"},
      {OPTION_SYNC_CACHE_WAIT_TIME, "0"},
      {OPTION_SYNC_CACHE_WAIT_TIME, "-5"},
      {OPTION_HOST_MEM_POOL_CFG, "{\"memory_size\": }"},
      {OPTION_HOST_MEM_POOL_CFG, "{\"memory_size\": 0}"},
      {OPTION_HOST_MEM_POOL_CFG, "{}"},
      {OPTION_HOST_MEM_POOL_CFG, "not json"},
      {OPTION_ANSWER_SWEEP_MS, "-1"},
      {OPTION_ANSWER_SWEEP_MS, "600001"},
      {OPTION_ANSWER_SWEEP_MS, "soon"},
  };
  for (const auto &[key, value] : bad) {
    LlmDataDist dd(1, LlmRole::kPrompt);
    Options options = BaseOptions();
    options[key] = value;
    EXPECT_STATUS(LLM_PARAM_INVALID, dd.Initialize(options)) << key << " = " << value;
  }
}

TEST(Lifecycle, WellFormedOptionsAreAccepted) {
  LlmDataDist dd(1, LlmRole::kMix);
  Options options = BaseOptions();
  options[OPTION_SYNC_CACHE_WAIT_TIME] = "2500";
  options[OPTION_HOST_MEM_POOL_CFG] = "{\"memory_size\": 1048576, \"page_shift\": 12}";
  options[OPTION_TCP_CONNECTIONS_PER_PEER] = "1";
  options[OPTION_ANSWER_SWEEP_MS] = "0";
  EXPECT_STATUS(LLM_SUCCESS, dd.Initialize(options));
}

// ---------------------------------------------------------------- caches

class CacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dd_ = std::make_unique<LlmDataDist>(1, LlmRole::kPrompt);
    ASSERT_STATUS(LLM_SUCCESS, dd_->Initialize(Opts()));
  }
  void TearDown() override { dd_->Finalize(); }
  virtual Options Opts() const { return BaseOptions(); }

  Status Register(const CacheDesc &desc, const std::vector<uint64_t> &addrs, int64_t &id) {
    return dd_->RegisterKvCache(desc, addrs, RegisterCfg{}, id);
  }

  std::unique_ptr<LlmDataDist> dd_;
};

TEST_F(CacheTest, RegisterKvCacheIdsStartAtOneAndIncrease) {
  HostCache a(2, 4, 16, 1), b(4, 8, 32, 2), c(1, 1, 8, 3);
  ASSERT_STATUS(LLM_SUCCESS, a.RegisterWith(*dd_));
  ASSERT_STATUS(LLM_SUCCESS, b.RegisterWith(*dd_));
  ASSERT_STATUS(LLM_SUCCESS, c.RegisterWith(*dd_));
  EXPECT_EQ(a.id(), 1);
  EXPECT_EQ(b.id(), 2);
  EXPECT_EQ(c.id(), 3);
  // Freed ids are not handed out again.
  ASSERT_STATUS(LLM_SUCCESS, dd_->UnregisterKvCache(c.id()));
  HostCache d(2, 4, 16, 4);
  ASSERT_STATUS(LLM_SUCCESS, d.RegisterWith(*dd_));
  EXPECT_GT(d.id(), 3);
}

TEST_F(CacheTest, RegisteredCacheIsUsable) {
  HostCache a(2, 4, 16, 1), b(2, 4, 16, 2);
  ASSERT_STATUS(LLM_SUCCESS, a.RegisterWith(*dd_));
  ASSERT_STATUS(LLM_SUCCESS, b.RegisterWith(*dd_));
  Bytes expected = b.Snapshot();
  ApplyUnits(expected, a.Snapshot(), 16, LayerPairs(0, 0, 2), 1, {3}, {0});
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(a.cache(), b.cache(), 3, 0));
  EXPECT_TRUE(SameBytes(b.Snapshot(), expected));
}

TEST_F(CacheTest, RegisterKvCacheWithMultiDimensionalShape) {
  // 3 slots of 4 x 8 halves: slot = 64 bytes.
  HostCache a(2, {3, 4, 8}, DT_FLOAT16, 1), b(2, {3, 4, 8}, DT_FLOAT16, 2);
  ASSERT_EQ(a.slot_bytes(), 64u);
  ASSERT_STATUS(LLM_SUCCESS, a.RegisterWith(*dd_));
  ASSERT_STATUS(LLM_SUCCESS, b.RegisterWith(*dd_));
  Bytes expected = b.Snapshot();
  ApplyUnits(expected, a.Snapshot(), 64, LayerPairs(0, 0, 2), 1, {2}, {1});
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(a.cache(), b.cache(), 2, 1));
  EXPECT_TRUE(SameBytes(b.Snapshot(), expected));
}

TEST_F(CacheTest, RegisterKvCacheEmptyAddrsIsParamInvalid) {
  HostCache a(2, 4, 16, 1);
  int64_t id = -7;
  EXPECT_STATUS(LLM_PARAM_INVALID, Register(a.Desc(), {}, id));
  CacheDesc zero = a.Desc();
  zero.num_tensors = 0;
  EXPECT_STATUS(LLM_PARAM_INVALID, Register(zero, {}, id));
}

TEST_F(CacheTest, RegisterKvCacheAddrCountMustEqualNumTensors) {
  HostCache a(3, 4, 16, 1);
  std::vector<uint64_t> addrs = a.Addrs();
  CacheDesc desc = a.Desc();
  int64_t id = -7;
  desc.num_tensors = 4;
  EXPECT_STATUS(LLM_PARAM_INVALID, Register(desc, addrs, id));
  desc.num_tensors = 2;
  EXPECT_STATUS(LLM_PARAM_INVALID, Register(desc, addrs, id));
  // Nothing was registered: the next good registration gets id 1.
  ASSERT_STATUS(LLM_SUCCESS, a.RegisterWith(*dd_));
  EXPECT_EQ(a.id(), 1);
}

TEST_F(CacheTest, RegisterKvCacheZeroAddressIsParamInvalid) {
  HostCache a(3, 4, 16, 1);
  for (size_t which = 0; which < 3; ++which) {
    std::vector<uint64_t> addrs = a.Addrs();
    addrs[which] = 0;
    int64_t id = -7;
    EXPECT_STATUS(LLM_PARAM_INVALID, Register(a.Desc(), addrs, id)) << "zero at " << which;
  }
}

TEST_F(CacheTest, RegisterKvCacheAtMost240Addresses) {
  HostCache ok(kMaxRegisterAddrs, 2, 8, 1);
  ASSERT_STATUS(LLM_SUCCESS, ok.RegisterWith(*dd_));
  EXPECT_EQ(ok.id(), 1);
  HostCache too_many(kMaxRegisterAddrs + 1, 2, 8, 2);
  int64_t id = -7;
  EXPECT_STATUS(LLM_PARAM_INVALID, Register(too_many.Desc(), too_many.Addrs(), id));
}

// Whether a CUDA driver would load here: the refusals below are those of a
// machine without one.
bool CudaDriverPresent() {
  const char *named = std::getenv("DATADIST_AIO_CUDA_DRIVER");
  void *driver = dlopen(named != nullptr && *named != '\0' ? named : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (driver != nullptr) dlclose(driver);
  return driver != nullptr;
}

TEST_F(CacheTest, RegisterKvCacheDevicePlacementWithoutADriverIsNotEnabled) {
  if (CudaDriverPresent()) GTEST_SKIP() << "a CUDA driver is installed: DEVICE placement works here";
  HostCache a(2, 4, 16, 1);
  CacheDesc desc = a.Desc();
  desc.placement = CachePlacement::kDevice;
  int64_t id = -7;
  EXPECT_STATUS(LLM_FEATURE_NOT_ENABLED, Register(desc, a.Addrs(), id));
  // CacheDesc defaults to kDevice.
  CacheDesc defaulted;
  defaulted.num_tensors = 2;
  defaulted.data_type = DT_UINT8;
  defaulted.shape = {4, 16};
  EXPECT_STATUS(LLM_FEATURE_NOT_ENABLED, Register(defaulted, a.Addrs(), id));
}

TEST_F(CacheTest, RegisterKvCacheBadGeometryIsParamInvalid) {
  HostCache a(2, 4, 16, 1);
  int64_t id = -7;
  CacheDesc desc = a.Desc();
  desc.data_type = DT_UNDEFINED;
  EXPECT_STATUS(LLM_PARAM_INVALID, Register(desc, a.Addrs(), id)) << "undefined data type";
  desc = a.Desc();
  desc.shape = {};
  EXPECT_STATUS(LLM_PARAM_INVALID, Register(desc, a.Addrs(), id)) << "no dims";
  desc.shape = {4, 0};
  EXPECT_STATUS(LLM_PARAM_INVALID, Register(desc, a.Addrs(), id)) << "zero dim";
  desc.shape = {-4, 16};
  EXPECT_STATUS(LLM_PARAM_INVALID, Register(desc, a.Addrs(), id)) << "negative dim";
}

TEST_F(CacheTest, UnregisterKvCacheUnknownIdSucceeds) {
  EXPECT_STATUS(LLM_SUCCESS, dd_->UnregisterKvCache(12345));
  EXPECT_STATUS(LLM_SUCCESS, dd_->UnregisterKvCache(-1));
  HostCache a(2, 4, 16, 1);
  ASSERT_STATUS(LLM_SUCCESS, a.RegisterWith(*dd_));
  EXPECT_STATUS(LLM_SUCCESS, dd_->UnregisterKvCache(a.id()));
  EXPECT_STATUS(LLM_SUCCESS, dd_->UnregisterKvCache(a.id()));
}

TEST_F(CacheTest, UnregisteredCacheIsGone) {
  HostCache a(2, 4, 16, 1), b(2, 4, 16, 2);
  ASSERT_STATUS(LLM_SUCCESS, a.RegisterWith(*dd_));
  ASSERT_STATUS(LLM_SUCCESS, b.RegisterWith(*dd_));
  ASSERT_STATUS(LLM_SUCCESS, dd_->UnregisterKvCache(a.id()));
  const Bytes before = b.Snapshot();
  EXPECT_STATUS(LLM_KV_CACHE_NOT_EXIST, dd_->CopyKvCache(a.cache(), b.cache()));
  EXPECT_STATUS(LLM_KV_CACHE_NOT_EXIST, dd_->CopyKvBlocks(a.cache(), b.cache(), {0}, {{1}}));
  EXPECT_TRUE(SameBytes(b.Snapshot(), before));
}

TEST_F(CacheTest, AllocateCacheWithoutPoolIsNotEnabled) {
  HostCache shape_only(2, 4, 16, 1);
  Cache cache;
  EXPECT_STATUS(LLM_FEATURE_NOT_ENABLED, dd_->AllocateCache(shape_only.Desc(), cache));
  EXPECT_EQ(cache.cache_id, -1);
}

class PoolCacheTest : public CacheTest {
 protected:
  Options Opts() const override {
    Options options = BaseOptions();
    options[OPTION_HOST_MEM_POOL_CFG] = "{\"memory_size\": 67108864}";
    return options;
  }
  static CacheDesc HostDesc(uint32_t num_tensors, std::vector<int64_t> shape, DataType dt = DT_UINT8) {
    CacheDesc desc;
    desc.placement = CachePlacement::kHost;
    desc.num_tensors = num_tensors;
    desc.data_type = dt;
    desc.shape = std::move(shape);
    return desc;
  }
};

TEST_F(PoolCacheTest, AllocateCacheGivesWritableTensors) {
  const CacheDesc desc = HostDesc(4, {8, 128}, DT_FLOAT16);
  Cache cache;
  ASSERT_STATUS(LLM_SUCCESS, dd_->AllocateCache(desc, cache));
  EXPECT_EQ(cache.cache_id, 1);
  ASSERT_EQ(cache.tensor_addrs.size(), 4u);
  EXPECT_EQ(cache.cache_desc.num_tensors, 4u);
  EXPECT_EQ(cache.cache_desc.shape, desc.shape);
  EXPECT_EQ(cache.cache_desc.placement, CachePlacement::kHost);
  // Distinct, non-overlapping tensors of 8 * 128 * 2 bytes.
  std::set<uintptr_t> seen;
  for (uintptr_t addr : cache.tensor_addrs) {
    ASSERT_NE(addr, 0u);
    seen.insert(addr);
  }
  ASSERT_EQ(seen.size(), 4u);
  uintptr_t prev = 0;
  for (uintptr_t addr : seen) {
    if (prev != 0) {
      EXPECT_GE(addr - prev, 2048u);
    }
    prev = addr;
  }
  for (size_t t = 0; t < 4; ++t) std::memset(reinterpret_cast<void *>(cache.tensor_addrs[t]), int(t + 1), 2048);
  for (size_t t = 0; t < 4; ++t) {
    const auto *p = reinterpret_cast<const uint8_t *>(cache.tensor_addrs[t]);
    EXPECT_EQ(p[0], t + 1);
    EXPECT_EQ(p[2047], t + 1);
  }
  EXPECT_STATUS(LLM_SUCCESS, dd_->DeallocateCache(cache.cache_id));
}

TEST_F(PoolCacheTest, AllocatedAndRegisteredCachesShareIds) {
  HostCache a(2, 4, 16, 1);
  ASSERT_STATUS(LLM_SUCCESS, a.RegisterWith(*dd_));
  Cache cache;
  ASSERT_STATUS(LLM_SUCCESS, dd_->AllocateCache(HostDesc(2, {4, 16}), cache));
  EXPECT_EQ(a.id(), 1);
  EXPECT_EQ(cache.cache_id, 2);
  // The allocated cache takes part in copies like a registered one.
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(a.cache(), cache, 1, 3));
  for (uint32_t t = 0; t < 2; ++t) {
    EXPECT_EQ(std::memcmp(reinterpret_cast<const void *>(cache.tensor_addrs[t] + 3 * 16), a.Slot(t, 1), 16), 0);
  }
}

TEST_F(PoolCacheTest, DeallocateCacheReturnsMemoryToThePool) {
  // 40 MiB twice from a 64 MiB pool only works if the first is returned.
  const CacheDesc desc = HostDesc(2, {20, 1 << 20});
  Cache first;
  ASSERT_STATUS(LLM_SUCCESS, dd_->AllocateCache(desc, first));
  Cache second;
  EXPECT_STATUS(LLM_OUT_OF_MEMORY, dd_->AllocateCache(desc, second));
  ASSERT_STATUS(LLM_SUCCESS, dd_->DeallocateCache(first.cache_id));
  ASSERT_STATUS(LLM_SUCCESS, dd_->AllocateCache(desc, second));
  EXPECT_GT(second.cache_id, first.cache_id);
  // The deallocated id no longer names a cache.
  EXPECT_STATUS(LLM_KV_CACHE_NOT_EXIST, dd_->CopyKvCache(first, second));
}

TEST_F(PoolCacheTest, AllocateCacheLargerThanThePoolIsOutOfMemory) {
  Cache cache;
  EXPECT_STATUS(LLM_OUT_OF_MEMORY, dd_->AllocateCache(HostDesc(1, {65, 1 << 20}), cache));
  EXPECT_EQ(cache.cache_id, -1);
}

TEST_F(PoolCacheTest, AllocateCacheDevicePlacementWithoutADriverIsNotEnabled) {
  if (CudaDriverPresent()) GTEST_SKIP() << "a CUDA driver is installed: DEVICE placement works here";
  CacheDesc desc = HostDesc(2, {4, 16});
  desc.placement = CachePlacement::kDevice;
  Cache cache;
  EXPECT_STATUS(LLM_FEATURE_NOT_ENABLED, dd_->AllocateCache(desc, cache));
}

TEST_F(PoolCacheTest, AllocateCacheBadDescIsParamInvalid) {
  Cache cache;
  EXPECT_STATUS(LLM_PARAM_INVALID, dd_->AllocateCache(HostDesc(2, {4, 16}, DT_UNDEFINED), cache));
  EXPECT_STATUS(LLM_PARAM_INVALID, dd_->AllocateCache(HostDesc(0, {4, 16}), cache));
  EXPECT_STATUS(LLM_PARAM_INVALID, dd_->AllocateCache(HostDesc(2, {}), cache));
  EXPECT_STATUS(LLM_PARAM_INVALID, dd_->AllocateCache(HostDesc(2, {4, 0}), cache));
  EXPECT_EQ(cache.cache_id, -1);
}

TEST_F(PoolCacheTest, DeallocateCacheUnknownIdSucceeds) {
  EXPECT_STATUS(LLM_SUCCESS, dd_->DeallocateCache(777));
}

}  // namespace
}  // namespace dd_test
