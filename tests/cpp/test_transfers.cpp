// LlmDataDist::PushKvCache, PullKvCache and PullKvBlocks between two linked
// instances: bytes that arrive, bytes that must stay, and the errors.
#include <cstring>

#include "test_support.h"

namespace dd_test {
namespace {

using namespace llm_datadist;

// The client owns `local_`, the server `remote_`: 4 tensors (2 layers of K
// and V), 48-byte slots; 6 slots locally, 5 remotely.
class TransferTest : public LinkedPairTest {
 protected:
  void SetUp() override {
    LinkedPairTest::SetUp();
    if (HasFatalFailure()) return;
    ASSERT_STATUS(LLM_SUCCESS, local_.RegisterWith(*client_));
    ASSERT_STATUS(LLM_SUCCESS, remote_.RegisterWith(*server_));
  }

  // Runs `op`, expects `st` and no change in `watched`.
  template <typename Op>
  void ExpectRefused(Status st, HostCache &watched, const std::string &what, Op op) {
    const Bytes before = watched.Snapshot();
    EXPECT_STATUS(st, op()) << what;
    EXPECT_TRUE(SameBytes(watched.Snapshot(), before)) << what << ": bytes changed";
  }

  HostCache local_{4, 6, 48, 1};
  HostCache remote_{4, 5, 48, 2};
};

// ------------------------------------------------------------ PushKvCache

using PushKvCacheTest = TransferTest;

TEST_F(PushKvCacheTest, SlotToSlotEveryLayer) {
  for (uint32_t src_slot : {0u, 3u, 5u}) {
    for (uint32_t dst_slot : {0u, 2u, 4u}) {
      local_.Fill(100 + src_slot * 10 + dst_slot);
      Bytes expected = remote_.Snapshot();
      ApplyUnits(expected, local_.Snapshot(), 48, LayerPairs(0, 0, 2), 2, {src_slot}, {dst_slot});
      ASSERT_STATUS(LLM_SUCCESS, client_->PushKvCache(local_.cache(), remote_.At(kServerId, dst_slot), src_slot));
      EXPECT_TRUE(SameBytes(remote_.Snapshot(), expected)) << src_slot << " -> " << dst_slot;
    }
  }
}

TEST_F(PushKvCacheTest, DefaultArgumentsMoveSlotZeroToTheIndexedSlot) {
  Bytes expected = remote_.Snapshot();
  ApplyUnits(expected, local_.Snapshot(), 48, LayerPairs(0, 0, 2), 2, {0}, {3});
  ASSERT_STATUS(LLM_SUCCESS, client_->PushKvCache(local_.cache(), remote_.At(kServerId, 3)));
  EXPECT_TRUE(SameBytes(remote_.Snapshot(), expected));
}

TEST_F(PushKvCacheTest, LayerRanges) {
  struct Case {
    std::pair<int32_t, int32_t> src, dst;
    uint32_t src_first, dst_first, count;
  };
  for (const Case &c : std::vector<Case>{{{1, 1}, {1, 1}, 1, 1, 1},
                                         {{1, 1}, {0, 0}, 1, 0, 1},
                                         {{0, 0}, {1, 1}, 0, 1, 1},
                                         {{0, 1}, {0, 1}, 0, 0, 2},
                                         {{1, 1}, {-1, -1}, 1, 1, 1},
                                         {{-1, -1}, {0, 0}, 0, 0, 1}}) {
    const std::string what = "src (" + std::to_string(c.src.first) + "," + std::to_string(c.src.second) +
                             ") dst (" + std::to_string(c.dst.first) + "," + std::to_string(c.dst.second) + ")";
    Bytes expected = remote_.Snapshot();
    ApplyUnits(expected, local_.Snapshot(), 48, LayerPairs(c.src_first, c.dst_first, c.count), 2, {2}, {1});
    ASSERT_STATUS(LLM_SUCCESS, client_->PushKvCache(local_.cache(), remote_.At(kServerId, 1), 2, -1,
                                                    MakeExt(c.src, c.dst)))
        << what;
    EXPECT_TRUE(SameBytes(remote_.Snapshot(), expected)) << what;
    remote_.Fill(77);
  }
}

TEST_F(PushKvCacheTest, TensorNumPerLayerOneAndFour) {
  // N = 1: tensor 3 (layer 3) to tensor 0 (layer 0).
  Bytes expected = remote_.Snapshot();
  ApplyUnits(expected, local_.Snapshot(), 48, LayerPairs(3, 0, 1), 1, {1}, {4});
  ASSERT_STATUS(LLM_SUCCESS, client_->PushKvCache(local_.cache(), remote_.At(kServerId, 4), 1, -1,
                                                  MakeExt({3, 3}, {0, 0}, 1)));
  EXPECT_TRUE(SameBytes(remote_.Snapshot(), expected));
  // N = 4: the only layer.
  expected = remote_.Snapshot();
  ApplyUnits(expected, local_.Snapshot(), 48, LayerPairs(0, 0, 1), 4, {5}, {0});
  ASSERT_STATUS(LLM_SUCCESS, client_->PushKvCache(local_.cache(), remote_.At(kServerId, 0), 5, -1,
                                                  MakeExt({-1, -1}, {-1, -1}, 4)));
  EXPECT_TRUE(SameBytes(remote_.Snapshot(), expected));
}

TEST_F(PushKvCacheTest, SourceNeedsOnlyItsCacheId) {
  Cache bare;
  bare.cache_id = local_.id();
  Bytes expected = remote_.Snapshot();
  ApplyUnits(expected, local_.Snapshot(), 48, LayerPairs(0, 0, 2), 2, {4}, {2});
  ASSERT_STATUS(LLM_SUCCESS, client_->PushKvCache(bare, remote_.At(kServerId, 2), 4));
  EXPECT_TRUE(SameBytes(remote_.Snapshot(), expected));
}

TEST_F(PushKvCacheTest, ServerPushesToClient) {
  Bytes expected = local_.Snapshot();
  ApplyUnits(expected, remote_.Snapshot(), 48, LayerPairs(0, 0, 2), 2, {4}, {5});
  ASSERT_STATUS(LLM_SUCCESS, server_->PushKvCache(remote_.cache(), local_.At(kClientId, 5), 4));
  EXPECT_TRUE(SameBytes(local_.Snapshot(), expected));
}

TEST_F(PushKvCacheTest, SizeMustBeMinusOne) {
  for (int64_t size : {int64_t{0}, int64_t{1}, int64_t{48}, int64_t{-2}}) {
    ExpectRefused(LLM_PARAM_INVALID, remote_, "size " + std::to_string(size),
                  [&] { return client_->PushKvCache(local_.cache(), remote_.At(kServerId, 1), 0, size); });
  }
}

TEST_F(PushKvCacheTest, SourceSlotOutOfRangeIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, remote_, "src slot 6 of 6",
                [&] { return client_->PushKvCache(local_.cache(), remote_.At(kServerId, 1), 6); });
}

TEST_F(PushKvCacheTest, DestinationSlotOutOfRangeIsParamInvalidAndWritesNothing) {
  ExpectRefused(LLM_PARAM_INVALID, remote_, "dst slot 5 of 5",
                [&] { return client_->PushKvCache(local_.cache(), remote_.At(kServerId, 5), 0); });
  ExpectRefused(LLM_PARAM_INVALID, remote_, "dst slot huge",
                [&] { return client_->PushKvCache(local_.cache(), remote_.At(kServerId, UINT32_MAX), 0); });
}

TEST_F(PushKvCacheTest, SlotSizeMismatchIsParamInvalid) {
  HostCache other(4, 5, 64, 3);
  ASSERT_STATUS(LLM_SUCCESS, other.RegisterWith(*server_));
  ExpectRefused(LLM_PARAM_INVALID, other, "remote slot 64 vs local 48",
                [&] { return client_->PushKvCache(local_.cache(), other.At(kServerId, 0), 0); });
}

TEST_F(PushKvCacheTest, LayerRangeErrorsAreParamInvalid) {
  const std::vector<std::pair<std::string, KvCacheExtParam>> bad = {
      {"unequal widths", MakeExt({0, 1}, {0, 0})},
      {"first > second", MakeExt({1, 0}, {1, 0})},
      {"below -1", MakeExt({-2, 0}, {0, 0})},
      {"N = 0", MakeExt({-1, -1}, {-1, -1}, 0)},
      {"N = 3 does not divide 4", MakeExt({-1, -1}, {-1, -1}, 3)},
      {"local layer beyond", MakeExt({2, 2}, {0, 0})},
      {"remote layer beyond", MakeExt({0, 0}, {2, 2})},
  };
  for (const auto &[what, ext] : bad) {
    ExpectRefused(LLM_PARAM_INVALID, remote_, what,
                  [&] { return client_->PushKvCache(local_.cache(), remote_.At(kServerId, 1), 0, -1, ext); });
  }
}

TEST_F(PushKvCacheTest, UnknownCachesAndNoLink) {
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, remote_, "unknown remote id",
                [&] { return client_->PushKvCache(local_.cache(), MakeIndex(kServerId, remote_.id() + 50, 0)); });
  Cache unknown;
  unknown.cache_id = local_.id() + 50;
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, remote_, "unknown local id",
                [&] { return client_->PushKvCache(unknown, remote_.At(kServerId, 0)); });
  ExpectRefused(LLM_NOT_YET_LINK, remote_, "unlinked cluster",
                [&] { return client_->PushKvCache(local_.cache(), MakeIndex(kUnlinkedId, remote_.id(), 0)); });
}

// ------------------------------------------------------------ PullKvCache

using PullKvCacheTest = TransferTest;

TEST_F(PullKvCacheTest, WholeSlotEveryLayer) {
  for (uint32_t src_slot : {0u, 4u}) {
    for (uint32_t dst_slot : {1u, 5u}) {
      remote_.Fill(200 + src_slot * 10 + dst_slot);
      Bytes expected = local_.Snapshot();
      ApplyUnits(expected, remote_.Snapshot(), 48, LayerPairs(0, 0, 2), 2, {src_slot}, {dst_slot});
      const Bytes remote_before = remote_.Snapshot();
      ASSERT_STATUS(LLM_SUCCESS, client_->PullKvCache(remote_.At(kServerId, src_slot), local_.cache(), dst_slot));
      EXPECT_TRUE(SameBytes(local_.Snapshot(), expected)) << src_slot << " -> " << dst_slot;
      EXPECT_TRUE(SameBytes(remote_.Snapshot(), remote_before)) << "the source changed";
    }
  }
}

TEST_F(PullKvCacheTest, FirstBytesOfASlot) {
  for (int64_t size : {int64_t{1}, int64_t{17}, int64_t{48}}) {
    remote_.Fill(300 + static_cast<uint32_t>(size));
    Bytes expected = local_.Snapshot();
    ApplyUnits(expected, remote_.Snapshot(), 48, LayerPairs(0, 0, 2), 2, {2}, {3}, static_cast<uint64_t>(size));
    ASSERT_STATUS(LLM_SUCCESS, client_->PullKvCache(remote_.At(kServerId, 2), local_.cache(), 3, size));
    EXPECT_TRUE(SameBytes(local_.Snapshot(), expected)) << "size " << size;
  }
}

TEST_F(PullKvCacheTest, LayerRanges) {
  struct Case {
    std::pair<int32_t, int32_t> src, dst;
    uint32_t src_first, dst_first, count;
  };
  // src = the remote cache, dst = the local one; a range given on one side
  // only stands for both.
  for (const Case &c : std::vector<Case>{{{1, 1}, {0, 0}, 1, 0, 1},
                                         {{0, 0}, {1, 1}, 0, 1, 1},
                                         {{0, 1}, {0, 1}, 0, 0, 2},
                                         {{1, 1}, {-1, -1}, 1, 1, 1},
                                         {{-1, -1}, {1, 1}, 1, 1, 1}}) {
    const std::string what = "src (" + std::to_string(c.src.first) + "," + std::to_string(c.src.second) +
                             ") dst (" + std::to_string(c.dst.first) + "," + std::to_string(c.dst.second) + ")";
    Bytes expected = local_.Snapshot();
    ApplyUnits(expected, remote_.Snapshot(), 48, LayerPairs(c.src_first, c.dst_first, c.count), 2, {4}, {0});
    ASSERT_STATUS(LLM_SUCCESS,
                  client_->PullKvCache(remote_.At(kServerId, 4), local_.cache(), 0, -1, MakeExt(c.src, c.dst)))
        << what;
    EXPECT_TRUE(SameBytes(local_.Snapshot(), expected)) << what;
    local_.Fill(99);
  }
}

TEST_F(PullKvCacheTest, TensorNumPerLayerOne) {
  Bytes expected = local_.Snapshot();
  ApplyUnits(expected, remote_.Snapshot(), 48, LayerPairs(1, 2, 2), 1, {0}, {0});
  ASSERT_STATUS(LLM_SUCCESS,
                client_->PullKvCache(remote_.At(kServerId, 0), local_.cache(), 0, -1, MakeExt({1, 2}, {2, 3}, 1)));
  EXPECT_TRUE(SameBytes(local_.Snapshot(), expected));
}

TEST_F(PullKvCacheTest, PartialPullFromACacheWithAnotherSlotSize) {
  // A size within both slots is well defined even when the slots differ.
  HostCache other(4, 5, 32, 4);
  ASSERT_STATUS(LLM_SUCCESS, other.RegisterWith(*server_));
  Bytes expected = local_.Snapshot();
  for (uint32_t t = 0; t < 4; ++t) std::memcpy(expected[t].data() + 2 * 48, other.Slot(t, 3), 20);
  ASSERT_STATUS(LLM_SUCCESS, client_->PullKvCache(other.At(kServerId, 3), local_.cache(), 2, 20));
  EXPECT_TRUE(SameBytes(local_.Snapshot(), expected));
  // Whole slots of different sizes, or more than the remote slot, are refused.
  ExpectRefused(LLM_PARAM_INVALID, local_, "size -1, slots 32 vs 48",
                [&] { return client_->PullKvCache(other.At(kServerId, 3), local_.cache(), 2, -1); });
  ExpectRefused(LLM_PARAM_INVALID, local_, "size 40 > remote slot 32",
                [&] { return client_->PullKvCache(other.At(kServerId, 3), local_.cache(), 2, 40); });
}

TEST_F(PullKvCacheTest, SizeErrorsAreParamInvalid) {
  for (int64_t size : {int64_t{0}, int64_t{-2}, int64_t{49}}) {
    ExpectRefused(LLM_PARAM_INVALID, local_, "size " + std::to_string(size),
                  [&] { return client_->PullKvCache(remote_.At(kServerId, 0), local_.cache(), 0, size); });
  }
}

TEST_F(PullKvCacheTest, SlotOutOfRangeIsParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, local_, "local slot 6 of 6",
                [&] { return client_->PullKvCache(remote_.At(kServerId, 0), local_.cache(), 6); });
  ExpectRefused(LLM_PARAM_INVALID, local_, "remote slot 5 of 5",
                [&] { return client_->PullKvCache(remote_.At(kServerId, 5), local_.cache(), 0); });
}

TEST_F(PullKvCacheTest, LayerRangeErrorsAreParamInvalid) {
  const std::vector<std::pair<std::string, KvCacheExtParam>> bad = {
      {"unequal widths", MakeExt({0, 1}, {1, 1})},
      {"first > second", MakeExt({1, 0}, {-1, -1})},
      {"below -1", MakeExt({0, 0}, {-3, -3})},
      {"N = 0", MakeExt({-1, -1}, {-1, -1}, 0)},
      {"local layer beyond", MakeExt({0, 0}, {2, 2})},
      {"remote layer beyond", MakeExt({2, 2}, {0, 0})},
  };
  for (const auto &[what, ext] : bad) {
    ExpectRefused(LLM_PARAM_INVALID, local_, what,
                  [&] { return client_->PullKvCache(remote_.At(kServerId, 0), local_.cache(), 0, -1, ext); });
  }
}

TEST_F(PullKvCacheTest, UnknownCachesAndNoLink) {
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, local_, "unknown remote id",
                [&] { return client_->PullKvCache(MakeIndex(kServerId, remote_.id() + 50, 0), local_.cache()); });
  Cache unknown;
  unknown.cache_id = local_.id() + 50;
  EXPECT_STATUS(LLM_KV_CACHE_NOT_EXIST, client_->PullKvCache(remote_.At(kServerId, 0), unknown)) << "unknown local";
  ExpectRefused(LLM_NOT_YET_LINK, local_, "unlinked cluster",
                [&] { return client_->PullKvCache(MakeIndex(kUnlinkedId, remote_.id(), 0), local_.cache()); });
}

TEST_F(PullKvCacheTest, ServerPullsFromClient) {
  Bytes expected = remote_.Snapshot();
  ApplyUnits(expected, local_.Snapshot(), 48, LayerPairs(0, 0, 2), 2, {5}, {0});
  ASSERT_STATUS(LLM_SUCCESS, server_->PullKvCache(local_.At(kClientId, 5), remote_.cache(), 0));
  EXPECT_TRUE(SameBytes(remote_.Snapshot(), expected));
}

// ----------------------------------------------------------- PullKvBlocks

using PullKvBlocksTest = TransferTest;

TEST_F(PullKvBlocksTest, RandomBlockMapsEveryLayer) {
  std::mt19937 rng(777);
  for (int round = 0; round < 10; ++round) {
    std::vector<uint64_t> src_blocks, dst_blocks;
    RandomBlockMap(rng, 1 + rng() % 6, remote_.num_slots(), local_.num_slots(), src_blocks, dst_blocks);
    Bytes expected = local_.Snapshot();
    ApplyUnits(expected, remote_.Snapshot(), 48, LayerPairs(0, 0, 2), 2, src_blocks, dst_blocks);
    const Bytes remote_before = remote_.Snapshot();
    ASSERT_STATUS(LLM_SUCCESS, client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), src_blocks, dst_blocks))
        << "round " << round;
    EXPECT_TRUE(SameBytes(local_.Snapshot(), expected)) << "round " << round;
    EXPECT_TRUE(SameBytes(remote_.Snapshot(), remote_before)) << "round " << round;
    remote_.Fill(500 + round);
  }
}

TEST_F(PullKvBlocksTest, LayerRangesAndTensorsPerLayer) {
  struct Case {
    KvCacheExtParam ext;
    uint32_t src_first, dst_first, count, per_layer;
  };
  for (const Case &c : std::vector<Case>{{MakeExt({1, 1}, {0, 0}), 1, 0, 1, 2},
                                         {MakeExt({0, 0}, {1, 1}), 0, 1, 1, 2},
                                         {MakeExt({1, 1}, {-1, -1}), 1, 1, 1, 2},
                                         {MakeExt({0, 2}, {1, 3}, 1), 0, 1, 3, 1},
                                         {MakeExt({-1, -1}, {-1, -1}, 4), 0, 0, 1, 4}}) {
    Bytes expected = local_.Snapshot();
    ApplyUnits(expected, remote_.Snapshot(), 48, LayerPairs(c.src_first, c.dst_first, c.count), c.per_layer, {0, 1, 4},
               {5, 2, 3});
    ASSERT_STATUS(LLM_SUCCESS, client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), {0, 1, 4}, {5, 2, 3}, c.ext))
        << c.src_first << "->" << c.dst_first << " x" << c.count << " N" << c.per_layer;
    EXPECT_TRUE(SameBytes(local_.Snapshot(), expected))
        << c.src_first << "->" << c.dst_first << " x" << c.count << " N" << c.per_layer;
    local_.Fill(1234);
  }
}

TEST_F(PullKvBlocksTest, SourceBatchIndexMustBeZero) {
  ExpectRefused(LLM_PARAM_INVALID, local_, "src batch_index 1",
                [&] { return client_->PullKvBlocks(remote_.At(kServerId, 1), local_.cache(), {0}, {1}); });
}

TEST_F(PullKvBlocksTest, BlockListErrorsAreParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, local_, "both empty",
                [&] { return client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), {}, {}); });
  ExpectRefused(LLM_PARAM_INVALID, local_, "src empty",
                [&] { return client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), {}, {1}); });
  ExpectRefused(LLM_PARAM_INVALID, local_, "unequal lengths",
                [&] { return client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), {0, 1}, {1}); });
  ExpectRefused(LLM_PARAM_INVALID, local_, "local block out of range",
                [&] { return client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), {0}, {6}); });
  ExpectRefused(LLM_PARAM_INVALID, local_, "local block named twice",
                [&] { return client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), {0, 1}, {2, 2}); });
}

TEST_F(PullKvBlocksTest, RemoteBlockOutOfRangeIsParamInvalidAndWritesNothing) {
  ExpectRefused(LLM_PARAM_INVALID, local_, "remote block 5 of 5",
                [&] { return client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), {0, 5, 1}, {0, 1, 2}); });
  ExpectRefused(LLM_PARAM_INVALID, local_, "run crossing the end",
                [&] { return client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), {3, 4, 5}, {0, 1, 2}); });
}

TEST_F(PullKvBlocksTest, BlockSizeMismatchIsParamInvalid) {
  HostCache other(4, 5, 96, 5);
  ASSERT_STATUS(LLM_SUCCESS, other.RegisterWith(*server_));
  ExpectRefused(LLM_PARAM_INVALID, local_, "remote blocks 96 vs local 48",
                [&] { return client_->PullKvBlocks(other.At(kServerId), local_.cache(), {0}, {1}); });
}

TEST_F(PullKvBlocksTest, LayerRangeErrorsAreParamInvalid) {
  const std::vector<std::pair<std::string, KvCacheExtParam>> bad = {
      {"unequal widths", MakeExt({0, 1}, {0, 0})},
      {"first > second", MakeExt({1, 0}, {1, 0})},
      {"below -1", MakeExt({-2, -2}, {0, 0})},
      {"N = 0", MakeExt({-1, -1}, {-1, -1}, 0)},
      {"remote layer beyond", MakeExt({2, 2}, {0, 0})},
      {"local layer beyond", MakeExt({0, 0}, {2, 2})},
  };
  for (const auto &[what, ext] : bad) {
    ExpectRefused(LLM_PARAM_INVALID, local_, what,
                  [&] { return client_->PullKvBlocks(remote_.At(kServerId), local_.cache(), {0}, {1}, ext); });
  }
}

TEST_F(PullKvBlocksTest, UnknownCachesAndNoLink) {
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, local_, "unknown remote id", [&] {
    return client_->PullKvBlocks(MakeIndex(kServerId, remote_.id() + 50, 0), local_.cache(), {0}, {1});
  });
  Cache unknown;
  unknown.cache_id = local_.id() + 50;
  EXPECT_STATUS(LLM_KV_CACHE_NOT_EXIST, client_->PullKvBlocks(remote_.At(kServerId), unknown, {0}, {1}))
      << "unknown local";
  ExpectRefused(LLM_NOT_YET_LINK, local_, "unlinked cluster", [&] {
    return client_->PullKvBlocks(MakeIndex(kUnlinkedId, remote_.id(), 0), local_.cache(), {0}, {1});
  });
}

}  // namespace
}  // namespace dd_test
