// LlmDataDist::PushKvBlocks: local blocks to the blocks of a peer's cache,
// layer by layer. Every case checks the bytes that arrived and that every
// other byte of the destination stayed as it was.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "test_support.h"

namespace dd_test {
namespace {

using namespace llm_datadist;

class PushKvBlocksTest : public LinkedPairTest {
 protected:
  // Pushes and compares the destination with the model of the push.
  void PushAndCheck(HostCache &src, HostCache &dst, const std::vector<uint64_t> &src_blocks,
                    const std::vector<uint64_t> &dst_blocks, const KvCacheExtParam &ext,
                    const std::vector<LayerPair> &layers, uint32_t per_layer) {
    ASSERT_EQ(src.slot_bytes(), dst.slot_bytes());
    Bytes expected = dst.Snapshot();
    ApplyUnits(expected, src.Snapshot(), src.slot_bytes(), layers, per_layer, src_blocks, dst_blocks);
    const Bytes src_before = src.Snapshot();
    ASSERT_STATUS(LLM_SUCCESS, client_->PushKvBlocks(src.cache(), dst.At(kServerId), src_blocks, dst_blocks, ext));
    EXPECT_TRUE(SameBytes(dst.Snapshot(), expected));
    EXPECT_TRUE(SameBytes(src.Snapshot(), src_before)) << "the source changed";
  }

  // Expects `st` from a push of `src` and no change on either side.
  void ExpectRefused(Status expected_status, const Cache &src, const CacheIndex &dst_index,
                     const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks,
                     const KvCacheExtParam &ext, HostCache &dst, const std::string &what) {
    const Bytes before = dst.Snapshot();
    EXPECT_STATUS(expected_status, client_->PushKvBlocks(src, dst_index, src_blocks, dst_blocks, ext)) << what;
    EXPECT_TRUE(SameBytes(dst.Snapshot(), before)) << what << ": the destination changed";
  }

  void SetUp() override {
    LinkedPairTest::SetUp();
    if (HasFatalFailure()) return;
    ASSERT_STATUS(LLM_SUCCESS, src_.RegisterWith(*client_));
    ASSERT_STATUS(LLM_SUCCESS, dst_.RegisterWith(*server_));
  }

  // 4 tensors = 2 layers of K and V; 16 blocks of 64 bytes locally, 24
  // blocks remotely.
  HostCache src_{4, 16, 64, 1};
  HostCache dst_{4, 24, 64, 2};
};

TEST_F(PushKvBlocksTest, RandomBlockMapsEveryLayer) {
  std::mt19937 rng(12345);
  for (int round = 0; round < 20; ++round) {
    std::vector<uint64_t> src_blocks, dst_blocks;
    RandomBlockMap(rng, 1 + rng() % 16, src_.num_slots(), dst_.num_slots(), src_blocks, dst_blocks);
    PushAndCheck(src_, dst_, src_blocks, dst_blocks, KvCacheExtParam{}, LayerPairs(0, 0, 2), 2);
    if (HasFailure()) {
      ADD_FAILURE() << "round " << round;
      return;
    }
    src_.Fill(1000 + round);  // new source bytes for the next round
  }
}

TEST_F(PushKvBlocksTest, ConsecutiveRunsAndSingles) {
  PushAndCheck(src_, dst_, {2, 3, 4, 5, 9, 0, 1}, {10, 11, 12, 13, 0, 23, 22}, KvCacheExtParam{},
               LayerPairs(0, 0, 2), 2);
}

TEST_F(PushKvBlocksTest, OneSourceBlockToSeveralDestinations) {
  PushAndCheck(src_, dst_, {7, 7, 7}, {1, 5, 20}, KvCacheExtParam{}, LayerPairs(0, 0, 2), 2);
}

TEST_F(PushKvBlocksTest, ExplicitAllLayersRange) {
  PushAndCheck(src_, dst_, {0, 1}, {4, 5}, MakeExt({0, 1}, {0, 1}), LayerPairs(0, 0, 2), 2);
}

TEST_F(PushKvBlocksTest, SingleLayerToTheSameLayer) {
  PushAndCheck(src_, dst_, {3, 8}, {6, 2}, MakeExt({1, 1}, {1, 1}), LayerPairs(1, 1, 1), 2);
  PushAndCheck(src_, dst_, {4}, {7}, MakeExt({0, 0}, {0, 0}), LayerPairs(0, 0, 1), 2);
}

TEST_F(PushKvBlocksTest, SingleLayerToAnotherLayer) {
  PushAndCheck(src_, dst_, {3, 8, 9}, {6, 2, 3}, MakeExt({1, 1}, {0, 0}), LayerPairs(1, 0, 1), 2);
  PushAndCheck(src_, dst_, {15}, {23}, MakeExt({0, 0}, {1, 1}), LayerPairs(0, 1, 1), 2);
}

TEST_F(PushKvBlocksTest, SourceRangeAloneAlsoNamesTheDestination) {
  // The missing destination range equals the given source range.
  PushAndCheck(src_, dst_, {5}, {9}, MakeExt({1, 1}, {-1, -1}), LayerPairs(1, 1, 1), 2);
}

TEST_F(PushKvBlocksTest, DestinationRangeAloneAlsoNamesTheSource) {
  PushAndCheck(src_, dst_, {6}, {10}, MakeExt({-1, -1}, {1, 1}), LayerPairs(1, 1, 1), 2);
}

TEST_F(PushKvBlocksTest, RangeToAnEqualWidthRangeOfABiggerCache) {
  // 3 local layers, 5 remote layers: local (0, 1) lands on remote (3, 4),
  // local (1, 2) on remote (0, 1).
  HostCache src(6, 8, 48, 3), dst(10, 8, 48, 4);
  ASSERT_STATUS(LLM_SUCCESS, src.RegisterWith(*client_));
  ASSERT_STATUS(LLM_SUCCESS, dst.RegisterWith(*server_));
  PushAndCheck(src, dst, {0, 1, 7}, {7, 6, 0}, MakeExt({0, 1}, {3, 4}), LayerPairs(0, 3, 2), 2);
  PushAndCheck(src, dst, {2, 3}, {2, 3}, MakeExt({1, 2}, {0, 1}), LayerPairs(1, 0, 2), 2);
}

TEST_F(PushKvBlocksTest, AllLayersIntoACacheWithMoreLayers) {
  // (-1, -1) moves every local layer to the same index remotely.
  HostCache src(4, 8, 32, 5), dst(8, 8, 32, 6);
  ASSERT_STATUS(LLM_SUCCESS, src.RegisterWith(*client_));
  ASSERT_STATUS(LLM_SUCCESS, dst.RegisterWith(*server_));
  PushAndCheck(src, dst, {1, 2}, {3, 4}, KvCacheExtParam{}, LayerPairs(0, 0, 2), 2);
}

TEST_F(PushKvBlocksTest, SourceNeedsOnlyItsCacheId) {
  // The source Cache carries nothing but its id: the description defaults
  // to kDevice with no tensors, and no addresses are given.
  Cache bare;
  bare.cache_id = src_.id();
  Bytes expected = dst_.Snapshot();
  ApplyUnits(expected, src_.Snapshot(), 64, LayerPairs(0, 0, 2), 2, {1, 2}, {3, 4});
  ASSERT_STATUS(LLM_SUCCESS, client_->PushKvBlocks(bare, dst_.At(kServerId), {1, 2}, {3, 4}));
  EXPECT_TRUE(SameBytes(dst_.Snapshot(), expected));
}

TEST_F(PushKvBlocksTest, ServerPushesToClient) {
  HostCache server_src(4, 8, 64, 7), client_dst(4, 8, 64, 8);
  ASSERT_STATUS(LLM_SUCCESS, server_src.RegisterWith(*server_));
  ASSERT_STATUS(LLM_SUCCESS, client_dst.RegisterWith(*client_));
  Bytes expected = client_dst.Snapshot();
  ApplyUnits(expected, server_src.Snapshot(), 64, LayerPairs(0, 0, 2), 2, {0, 1, 5}, {7, 6, 5});
  ASSERT_STATUS(LLM_SUCCESS, server_->PushKvBlocks(server_src.cache(), client_dst.At(kClientId), {0, 1, 5}, {7, 6, 5}));
  EXPECT_TRUE(SameBytes(client_dst.Snapshot(), expected));
}

// The server has a host pool, so the destination can be allocated.
class PushKvBlocksPoolTest : public PushKvBlocksTest {
 protected:
  Options ServerOptions() const override { return {{OPTION_HOST_MEM_POOL_CFG, "{\"memory_size\": 1048576}"}}; }
};

TEST_F(PushKvBlocksPoolTest, IntoAnAllocatedCache) {
  Cache allocated;
  ASSERT_STATUS(LLM_SUCCESS, server_->AllocateCache(dst_.Desc(), allocated));
  ASSERT_EQ(allocated.tensor_addrs.size(), 4u);
  for (uintptr_t addr : allocated.tensor_addrs) std::memset(reinterpret_cast<void *>(addr), 0xAB, 24 * 64);
  ASSERT_STATUS(LLM_SUCCESS, client_->PushKvBlocks(src_.cache(), MakeIndex(kServerId, allocated.cache_id), {3, 4},
                                                   {20, 0}));
  for (uint32_t t = 0; t < 4; ++t) {
    const auto *base = reinterpret_cast<const uint8_t *>(allocated.tensor_addrs[t]);
    for (uint64_t b = 0; b < 24; ++b) {
      const uint8_t *block = base + b * 64;
      if (b == 20 || b == 0) {
        EXPECT_EQ(std::memcmp(block, src_.Slot(t, b == 20 ? 3 : 4), 64), 0) << "tensor " << t << " block " << b;
      } else {
        EXPECT_EQ(std::count(block, block + 64, 0xAB), 64) << "tensor " << t << " block " << b;
      }
    }
  }
}

TEST_F(PushKvBlocksPoolTest, FromAnAllocatedCache) {
  // The source comes from the server's pool; the client receives.
  HostCache client_dst(4, 8, 64, 30);
  ASSERT_STATUS(LLM_SUCCESS, client_dst.RegisterWith(*client_));
  CacheDesc desc = client_dst.Desc();
  Cache allocated;
  ASSERT_STATUS(LLM_SUCCESS, server_->AllocateCache(desc, allocated));
  for (uint32_t t = 0; t < 4; ++t) {
    auto *base = reinterpret_cast<uint8_t *>(allocated.tensor_addrs[t]);
    for (uint64_t i = 0; i < 8 * 64; ++i) base[i] = static_cast<uint8_t>(t * 31 + i * 7);
  }
  const Bytes before = client_dst.Snapshot();
  ASSERT_STATUS(LLM_SUCCESS, server_->PushKvBlocks(allocated, client_dst.At(kClientId), {1, 2}, {6, 0}));
  Bytes expected = before;
  for (uint32_t t = 0; t < 4; ++t) {
    const auto *base = reinterpret_cast<const uint8_t *>(allocated.tensor_addrs[t]);
    std::memcpy(expected[t].data() + 6 * 64, base + 1 * 64, 64);
    std::memcpy(expected[t].data() + 0 * 64, base + 2 * 64, 64);
  }
  EXPECT_TRUE(SameBytes(client_dst.Snapshot(), expected));
}

class PushKvBlocksPerLayerTest : public PushKvBlocksTest, public ::testing::WithParamInterface<int> {};

TEST_P(PushKvBlocksPerLayerTest, EveryLayer) {
  const uint32_t per_layer = static_cast<uint32_t>(GetParam());
  HostCache src(8, 8, 40, 9), dst(8, 10, 40, 10);
  ASSERT_STATUS(LLM_SUCCESS, src.RegisterWith(*client_));
  ASSERT_STATUS(LLM_SUCCESS, dst.RegisterWith(*server_));
  const uint32_t layers = 8 / per_layer;
  std::mt19937 rng(per_layer);
  std::vector<uint64_t> src_blocks, dst_blocks;
  RandomBlockMap(rng, 6, 8, 10, src_blocks, dst_blocks);
  PushAndCheck(src, dst, src_blocks, dst_blocks, MakeExt({-1, -1}, {-1, -1}, per_layer),
               LayerPairs(0, 0, layers), per_layer);
}

TEST_P(PushKvBlocksPerLayerTest, LastLayerToFirst) {
  const uint32_t per_layer = static_cast<uint32_t>(GetParam());
  HostCache src(8, 8, 40, 11), dst(8, 10, 40, 12);
  ASSERT_STATUS(LLM_SUCCESS, src.RegisterWith(*client_));
  ASSERT_STATUS(LLM_SUCCESS, dst.RegisterWith(*server_));
  const int32_t last = static_cast<int32_t>(8 / per_layer) - 1;
  PushAndCheck(src, dst, {0, 5, 6}, {9, 1, 2}, MakeExt({last, last}, {0, 0}, per_layer),
               LayerPairs(static_cast<uint32_t>(last), 0, 1), per_layer);
}

TEST_P(PushKvBlocksPerLayerTest, UpperHalfToLowerHalf) {
  const uint32_t per_layer = static_cast<uint32_t>(GetParam());
  HostCache src(8, 8, 40, 13), dst(8, 10, 40, 14);
  ASSERT_STATUS(LLM_SUCCESS, src.RegisterWith(*client_));
  ASSERT_STATUS(LLM_SUCCESS, dst.RegisterWith(*server_));
  const int32_t layers = static_cast<int32_t>(8 / per_layer);
  const int32_t half = layers / 2;
  PushAndCheck(src, dst, {4, 5}, {8, 9}, MakeExt({half, layers - 1}, {0, layers - half - 1}, per_layer),
               LayerPairs(static_cast<uint32_t>(half), 0, static_cast<uint32_t>(layers - half)), per_layer);
}

INSTANTIATE_TEST_SUITE_P(TensorNumPerLayer, PushKvBlocksPerLayerTest, ::testing::Values(1, 2, 4),
                         [](const ::testing::TestParamInfo<int> &info) { return "N" + std::to_string(info.param); });

TEST_F(PushKvBlocksTest, LargePushOverManyFrames) {
  // 2 tensors of 20 blocks of 1 MiB: 36 MiB in one call.
  HostCache src(2, 20, 1 << 20, 15), dst(2, 20, 1 << 20, 16);
  ASSERT_STATUS(LLM_SUCCESS, src.RegisterWith(*client_));
  ASSERT_STATUS(LLM_SUCCESS, dst.RegisterWith(*server_));
  std::vector<uint64_t> src_blocks, dst_blocks;
  for (uint64_t b = 0; b < 18; ++b) {
    src_blocks.push_back(b);
    dst_blocks.push_back(b < 9 ? b + 2 : 19 - (b - 9));  // a run, then backwards
  }
  PushAndCheck(src, dst, src_blocks, dst_blocks, KvCacheExtParam{}, LayerPairs(0, 0, 1), 2);
}

TEST_F(PushKvBlocksTest, LargePushWithOneBadBlockWritesNothing) {
  HostCache src(2, 20, 1 << 20, 17), dst(2, 20, 1 << 20, 18);
  ASSERT_STATUS(LLM_SUCCESS, src.RegisterWith(*client_));
  ASSERT_STATUS(LLM_SUCCESS, dst.RegisterWith(*server_));
  std::vector<uint64_t> src_blocks, dst_blocks;
  for (uint64_t b = 0; b < 18; ++b) {
    src_blocks.push_back(b);
    dst_blocks.push_back(b);
  }
  dst_blocks.back() = 20;  // one past the remote cache
  ExpectRefused(LLM_PARAM_INVALID, src.cache(), dst.At(kServerId), src_blocks, dst_blocks, KvCacheExtParam{}, dst,
                "last destination block out of range");
  dst_blocks.back() = 17;
  dst_blocks.front() = 1000;
  ExpectRefused(LLM_PARAM_INVALID, src.cache(), dst.At(kServerId), src_blocks, dst_blocks, KvCacheExtParam{}, dst,
                "first destination block out of range");
}

TEST_F(PushKvBlocksTest, ConcurrentPushesOnOneLink) {
  // Four threads push to disjoint destination blocks at once.
  constexpr int kThreads = 4;
  Bytes expected = dst_.Snapshot();
  std::vector<std::vector<uint64_t>> srcs(kThreads), dsts(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (uint64_t k = 0; k < 6; ++k) {
      srcs[t].push_back((t * 5 + k * 3) % 16);
      dsts[t].push_back(t * 6 + k);
    }
    ApplyUnits(expected, src_.Snapshot(), 64, LayerPairs(0, 0, 2), 2, srcs[t], dsts[t]);
  }
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int repeat = 0; repeat < 10; ++repeat) {
        if (client_->PushKvBlocks(src_.cache(), dst_.At(kServerId), srcs[t], dsts[t]) != LLM_SUCCESS) ++failures;
      }
    });
  }
  for (auto &thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(SameBytes(dst_.Snapshot(), expected));
}

// ------------------------------------------------------------------ errors

TEST_F(PushKvBlocksTest, EmptySourceBlocksIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {}, {}, {}, dst_, "both empty");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {}, {1}, {}, dst_, "source empty");
}

TEST_F(PushKvBlocksTest, UnequalListLengthsIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1, 2}, {3}, {}, dst_, "2 vs 1");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3, 4}, {}, dst_, "1 vs 2");
}

TEST_F(PushKvBlocksTest, DestinationBatchIndexMustBeZero) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId, 1), {1}, {3}, {}, dst_, "batch_index 1");
}

TEST_F(PushKvBlocksTest, UnequalRangeWidthsIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({0, 1}, {0, 0}), dst_,
                "(0,1) vs (0,0)");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({1, 1}, {0, 1}), dst_,
                "(1,1) vs (0,1)");
}

TEST_F(PushKvBlocksTest, FirstAboveSecondIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({1, 0}, {1, 0}), dst_,
                "both (1,0)");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({1, 0}, {-1, -1}), dst_,
                "src (1,0)");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({-1, -1}, {1, 0}), dst_,
                "dst (1,0)");
}

TEST_F(PushKvBlocksTest, ValuesBelowMinusOneAreParamInvalid) {
  for (const auto &bad : std::vector<std::pair<int32_t, int32_t>>{{-2, 0}, {-2, -2}, {-5, -1}}) {
    const std::string what = "(" + std::to_string(bad.first) + "," + std::to_string(bad.second) + ")";
    ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt(bad, bad), dst_,
                  "both " + what);
    ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt(bad, {0, 0}), dst_,
                  "src " + what);
    ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({0, 0}, bad), dst_,
                  "dst " + what);
  }
}

TEST_F(PushKvBlocksTest, TensorNumPerLayerZeroIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({-1, -1}, {-1, -1}, 0), dst_,
                "default ranges");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({0, 0}, {0, 0}, 0), dst_,
                "(0,0)");
}

TEST_F(PushKvBlocksTest, TensorNumPerLayerNotDividingTheTensorsIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({-1, -1}, {-1, -1}, 3), dst_,
                "4 tensors, 3 per layer");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({-1, -1}, {-1, -1}, 8), dst_,
                "4 tensors, 8 per layer");
}

TEST_F(PushKvBlocksTest, SourceLayerBeyondTheCacheIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({2, 2}, {0, 0}), dst_,
                "layer 2 of 2");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({1, 2}, {0, 1}), dst_,
                "layers 1..2 of 2");
}

TEST_F(PushKvBlocksTest, DestinationLayerBeyondTheRemoteCacheIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({0, 0}, {2, 2}), dst_,
                "remote layer 2 of 2");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1}, {3}, MakeExt({0, 1}, {1, 2}), dst_,
                "remote layers 1..2 of 2");
  // All local layers into a remote cache with fewer.
  HostCache small(2, 24, 64, 19);
  ASSERT_STATUS(LLM_SUCCESS, small.RegisterWith(*server_));
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), small.At(kServerId), {1}, {3}, {}, small,
                "2 local layers into 1 remote layer");
}

TEST_F(PushKvBlocksTest, UnknownRemoteCacheIsKvCacheNotExist) {
  for (int64_t id : {dst_.id() + 100, int64_t{0}, int64_t{-1}}) {
    EXPECT_STATUS(LLM_KV_CACHE_NOT_EXIST, client_->PushKvBlocks(src_.cache(), MakeIndex(kServerId, id), {1}, {3}))
        << "remote id " << id;
  }
  // A remote cache the peer unregistered.
  ASSERT_STATUS(LLM_SUCCESS, server_->UnregisterKvCache(dst_.id()));
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, src_.cache(), dst_.At(kServerId), {1}, {3}, {}, dst_, "unregistered");
}

TEST_F(PushKvBlocksTest, RemoteBlockOutOfRangeIsParamInvalidAndWritesNothing) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {0, 1, 2}, {5, 24, 6}, {}, dst_,
                "middle block one past the end");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {0, 1, 2}, {5, 6, UINT64_MAX}, {}, dst_,
                "huge block index");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {0, 1, 2}, {22, 23, 24}, {}, dst_,
                "run crossing the end");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {0}, {24}, MakeExt({1, 1}, {1, 1}), dst_,
                "one layer");
}

TEST_F(PushKvBlocksTest, LocalBlockOutOfRangeIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {0, 16}, {0, 1}, {}, dst_, "block 16 of 16");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {UINT64_MAX}, {0}, {}, dst_, "huge");
}

TEST_F(PushKvBlocksTest, BlockSizeMismatchIsParamInvalid) {
  HostCache bigger_blocks(4, 24, 128, 20), smaller_blocks(4, 24, 32, 21);
  ASSERT_STATUS(LLM_SUCCESS, bigger_blocks.RegisterWith(*server_));
  ASSERT_STATUS(LLM_SUCCESS, smaller_blocks.RegisterWith(*server_));
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), bigger_blocks.At(kServerId), {1, 2}, {3, 4}, {}, bigger_blocks,
                "remote blocks of 128 bytes");
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), smaller_blocks.At(kServerId), {1, 2}, {3, 4}, {}, smaller_blocks,
                "remote blocks of 32 bytes");
}

TEST_F(PushKvBlocksTest, DestinationBlockNamedTwiceIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {1, 2}, {3, 3}, {}, dst_, "block 3 twice");
}

TEST_F(PushKvBlocksTest, NoLinkIsNotYetLink) {
  ExpectRefused(LLM_NOT_YET_LINK, src_.cache(), MakeIndex(kUnlinkedId, dst_.id()), {1}, {3}, {}, dst_,
                "unknown cluster");
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, Unlink(rets));
  ExpectRefused(LLM_NOT_YET_LINK, src_.cache(), dst_.At(kServerId), {1}, {3}, {}, dst_, "after unlink");
}

TEST_F(PushKvBlocksTest, UnknownSourceCacheIsKvCacheNotExist) {
  Cache unknown;
  unknown.cache_id = src_.id() + 100;
  unknown.cache_desc = src_.Desc();
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, unknown, dst_.At(kServerId), {1}, {3}, {}, dst_, "default ranges");
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, unknown, dst_.At(kServerId), {1}, {3}, MakeExt({0, 0}, {0, 0}), dst_,
                "layer 0");
  // An id the caller unregistered.
  ASSERT_STATUS(LLM_SUCCESS, client_->UnregisterKvCache(src_.id()));
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, src_.cache(), dst_.At(kServerId), {1}, {3}, {}, dst_, "unregistered");
}

TEST_F(PushKvBlocksTest, PushAfterAFailureStillWorks) {
  ExpectRefused(LLM_PARAM_INVALID, src_.cache(), dst_.At(kServerId), {0}, {99}, {}, dst_, "out of range");
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, src_.cache(), MakeIndex(kServerId, 999), {0}, {1}, {}, dst_, "unknown");
  PushAndCheck(src_, dst_, {0, 9}, {1, 2}, KvCacheExtParam{}, LayerPairs(0, 0, 2), 2);
}

// GetLastErrorMessage says why the last call of this thread failed, in words.
TEST_F(PushKvBlocksTest, LastErrorMessageNamesTheIndex) {
  const CacheIndex dst = dst_.At(kServerId);
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->PushKvBlocks(src_.cache(), dst, {0, 1, 2}, {0, 1}));
  EXPECT_NE(client_->GetLastErrorMessage().find("differ in length: 3 != 2"), std::string::npos)
      << client_->GetLastErrorMessage();
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->PushKvBlocks(src_.cache(), dst, {0, 99}, {0, 1}));
  EXPECT_NE(client_->GetLastErrorMessage().find("src_blocks[1] = 99 is out of range: the local cache has 16 blocks"),
            std::string::npos)
      << client_->GetLastErrorMessage();
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->PushKvBlocks(src_.cache(), dst, {0, 1, 2}, {5, 6, 5}));
  EXPECT_NE(client_->GetLastErrorMessage().find("dst_blocks[2] = 5 repeats dst_blocks[0]"), std::string::npos)
      << client_->GetLastErrorMessage();
  KvCacheExtParam ext;
  ext.src_layer_range = {1, 2};
  ext.dst_layer_range = {0, 1};
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->PushKvBlocks(src_.cache(), dst, {0}, {0}, ext));
  EXPECT_NE(client_->GetLastErrorMessage().find("layer range too long"), std::string::npos)
      << client_->GetLastErrorMessage();
  ASSERT_STATUS(LLM_SUCCESS, client_->PushKvBlocks(src_.cache(), dst, {0}, {0}));
  EXPECT_EQ(client_->GetLastErrorMessage(), "");
}

}  // namespace
}  // namespace dd_test
