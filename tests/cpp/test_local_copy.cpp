// LlmDataDist::CopyKvCache and CopyKvBlocks: copies between caches of one
// instance.
#include <cstring>

#include "test_support.h"

namespace dd_test {
namespace {

using namespace llm_datadist;

class LocalCopyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dd_ = std::make_unique<LlmDataDist>(1, LlmRole::kMix);
    ASSERT_STATUS(LLM_SUCCESS, dd_->Initialize(BaseOptions()));
    ASSERT_STATUS(LLM_SUCCESS, a_.RegisterWith(*dd_));
    ASSERT_STATUS(LLM_SUCCESS, b_.RegisterWith(*dd_));
  }
  void TearDown() override { dd_->Finalize(); }

  // Bytes [offset, offset + len) of slot src_slot of every tensor of `src`
  // copied to the same range of slot dst_slot in `expected`.
  static void ApplySlotRange(Bytes &expected, const Bytes &src, uint64_t src_slot_bytes, uint64_t dst_slot_bytes,
                             uint64_t src_slot, uint64_t dst_slot, uint64_t offset, uint64_t len) {
    for (size_t t = 0; t < expected.size(); ++t) {
      std::memcpy(expected[t].data() + dst_slot * dst_slot_bytes + offset,
                  src[t].data() + src_slot * src_slot_bytes + offset, len);
    }
  }

  template <typename Op>
  void ExpectRefused(Status st, HostCache &watched, const std::string &what, Op op) {
    const Bytes before = watched.Snapshot();
    EXPECT_STATUS(st, op()) << what;
    EXPECT_TRUE(SameBytes(watched.Snapshot(), before)) << what << ": bytes changed";
  }

  std::unique_ptr<LlmDataDist> dd_;
  // 3 tensors, 64-byte slots; 5 slots in a, 4 in b.
  HostCache a_{3, 5, 64, 1};
  HostCache b_{3, 4, 64, 2};
};

// ------------------------------------------------------------ CopyKvCache

using CopyKvCacheTest = LocalCopyTest;

TEST_F(CopyKvCacheTest, WholeSlots) {
  for (uint32_t src_slot : {0u, 2u, 4u}) {
    for (uint32_t dst_slot : {0u, 3u}) {
      a_.Fill(10 + src_slot * 7 + dst_slot);
      Bytes expected = b_.Snapshot();
      ApplySlotRange(expected, a_.Snapshot(), 64, 64, src_slot, dst_slot, 0, 64);
      const Bytes src_before = a_.Snapshot();
      ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(a_.cache(), b_.cache(), src_slot, dst_slot));
      EXPECT_TRUE(SameBytes(b_.Snapshot(), expected)) << src_slot << " -> " << dst_slot;
      EXPECT_TRUE(SameBytes(a_.Snapshot(), src_before));
    }
  }
}

TEST_F(CopyKvCacheTest, DefaultArgumentsCopySlotZero) {
  Bytes expected = b_.Snapshot();
  ApplySlotRange(expected, a_.Snapshot(), 64, 64, 0, 0, 0, 64);
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(a_.cache(), b_.cache()));
  EXPECT_TRUE(SameBytes(b_.Snapshot(), expected));
}

TEST_F(CopyKvCacheTest, OffsetAndSize) {
  struct Case {
    uint64_t offset;
    int64_t size;
    uint64_t len;
  };
  for (const Case &c : std::vector<Case>{{0, 1, 1}, {10, 20, 20}, {63, 1, 1}, {32, -1, 32}, {5, -1, 59}, {0, 64, 64}}) {
    Bytes expected = b_.Snapshot();
    ApplySlotRange(expected, a_.Snapshot(), 64, 64, 1, 2, c.offset, c.len);
    ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(a_.cache(), b_.cache(), 1, 2, c.offset, c.size))
        << "offset " << c.offset << " size " << c.size;
    EXPECT_TRUE(SameBytes(b_.Snapshot(), expected)) << "offset " << c.offset << " size " << c.size;
    b_.Fill(static_cast<uint32_t>(50 + c.offset));
  }
}

TEST_F(CopyKvCacheTest, WithinOneCache) {
  Bytes expected = a_.Snapshot();
  ApplySlotRange(expected, a_.Snapshot(), 64, 64, 4, 1, 0, 64);
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(a_.cache(), a_.cache(), 4, 1));
  EXPECT_TRUE(SameBytes(a_.Snapshot(), expected));
  // A slot onto itself changes nothing.
  const Bytes before = a_.Snapshot();
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(a_.cache(), a_.cache(), 2, 2));
  EXPECT_TRUE(SameBytes(a_.Snapshot(), before));
}

TEST_F(CopyKvCacheTest, CachesNeedOnlyTheirIds) {
  Cache src, dst;
  src.cache_id = a_.id();
  dst.cache_id = b_.id();
  Bytes expected = b_.Snapshot();
  ApplySlotRange(expected, a_.Snapshot(), 64, 64, 3, 1, 0, 64);
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(src, dst, 3, 1));
  EXPECT_TRUE(SameBytes(b_.Snapshot(), expected));
}

TEST_F(CopyKvCacheTest, DifferentSlotSizesNeedAnExplicitSize) {
  HostCache wide(3, 2, 100, 3);
  ASSERT_STATUS(LLM_SUCCESS, wide.RegisterWith(*dd_));
  ExpectRefused(LLM_PARAM_INVALID, wide, "size -1, slots 64 vs 100",
                [&] { return dd_->CopyKvCache(a_.cache(), wide.cache(), 0, 1); });
  ExpectRefused(LLM_PARAM_INVALID, wide, "size 65 > smaller slot",
                [&] { return dd_->CopyKvCache(a_.cache(), wide.cache(), 0, 1, 0, 65); });
  Bytes expected = wide.Snapshot();
  for (size_t t = 0; t < 3; ++t) std::memcpy(expected[t].data() + 100 + 8, a_.Slot(t, 2) + 8, 50);
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvCache(a_.cache(), wide.cache(), 2, 1, 8, 50));
  EXPECT_TRUE(SameBytes(wide.Snapshot(), expected));
}

TEST_F(CopyKvCacheTest, IndicesOutOfRangeAreParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, b_, "src slot 5 of 5", [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), 5, 0); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "dst slot 4 of 4", [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), 0, 4); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "huge slots",
                [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), UINT32_MAX, UINT32_MAX); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "offset 64 of 64",
                [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), 0, 0, 64); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "offset 64 of 64, size 1",
                [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), 0, 0, 64, 1); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "offset 1000, size 8",
                [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), 0, 0, 1000, 8); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "offset 60 + size 5",
                [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), 0, 0, 60, 5); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "size 65", [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), 0, 0, 0, 65); });
}

TEST_F(CopyKvCacheTest, BadSizesAreParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, b_, "size 0", [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), 0, 0, 0, 0); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "size -2", [&] { return dd_->CopyKvCache(a_.cache(), b_.cache(), 0, 0, 0, -2); });
}

TEST_F(CopyKvCacheTest, DifferentTensorCountsAreParamInvalid) {
  HostCache two(2, 4, 64, 4);
  ASSERT_STATUS(LLM_SUCCESS, two.RegisterWith(*dd_));
  ExpectRefused(LLM_PARAM_INVALID, two, "3 tensors into 2", [&] { return dd_->CopyKvCache(a_.cache(), two.cache()); });
}

TEST_F(CopyKvCacheTest, UnknownCacheIsKvCacheNotExist) {
  Cache unknown;
  unknown.cache_id = 99;
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, b_, "unknown source", [&] { return dd_->CopyKvCache(unknown, b_.cache()); });
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, a_, "unknown destination",
                [&] { return dd_->CopyKvCache(a_.cache(), unknown); });
}

// ------------------------------------------------------------ CopyKvBlocks

using CopyKvBlocksTest = LocalCopyTest;

// Source block src_blocks[i] to every block of dst_lists[i], every tensor.
void ApplyBlockLists(Bytes &expected, const Bytes &src, uint64_t block, const std::vector<uint64_t> &src_blocks,
                     const std::vector<std::vector<uint64_t>> &dst_lists) {
  for (size_t t = 0; t < expected.size(); ++t) {
    for (size_t i = 0; i < src_blocks.size(); ++i) {
      for (uint64_t d : dst_lists[i]) {
        std::memcpy(expected[t].data() + d * block, src[t].data() + src_blocks[i] * block, block);
      }
    }
  }
}

TEST_F(CopyKvBlocksTest, OneSourceToSeveralDestinations) {
  const std::vector<uint64_t> src_blocks = {4, 0};
  const std::vector<std::vector<uint64_t>> dst_lists = {{0, 2, 3}, {1}};
  Bytes expected = b_.Snapshot();
  ApplyBlockLists(expected, a_.Snapshot(), 64, src_blocks, dst_lists);
  const Bytes src_before = a_.Snapshot();
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvBlocks(a_.cache(), b_.cache(), src_blocks, dst_lists));
  EXPECT_TRUE(SameBytes(b_.Snapshot(), expected));
  EXPECT_TRUE(SameBytes(a_.Snapshot(), src_before));
}

TEST_F(CopyKvBlocksTest, RandomMaps) {
  HostCache src(2, 32, 24, 5), dst(2, 40, 24, 6);
  ASSERT_STATUS(LLM_SUCCESS, src.RegisterWith(*dd_));
  ASSERT_STATUS(LLM_SUCCESS, dst.RegisterWith(*dd_));
  std::mt19937 rng(4242);
  for (int round = 0; round < 10; ++round) {
    std::vector<uint64_t> src_blocks, dst_blocks;
    RandomBlockMap(rng, 1 + rng() % 30, 32, 40, src_blocks, dst_blocks);
    std::vector<std::vector<uint64_t>> dst_lists;
    for (uint64_t d : dst_blocks) dst_lists.push_back({d});
    Bytes expected = dst.Snapshot();
    ApplyBlockLists(expected, src.Snapshot(), 24, src_blocks, dst_lists);
    ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvBlocks(src.cache(), dst.cache(), src_blocks, dst_lists)) << round;
    EXPECT_TRUE(SameBytes(dst.Snapshot(), expected)) << round;
    src.Fill(900 + round);
  }
}

TEST_F(CopyKvBlocksTest, WithinOneCache) {
  Bytes expected = a_.Snapshot();
  ApplyBlockLists(expected, a_.Snapshot(), 64, {0, 1}, {{3}, {4, 2}});
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvBlocks(a_.cache(), a_.cache(), {0, 1}, {{3}, {4, 2}}));
  EXPECT_TRUE(SameBytes(a_.Snapshot(), expected));
}

TEST_F(CopyKvBlocksTest, LargeCopy) {
  // 2 tensors of 16 blocks of 1 MiB: enough to be split over workers.
  HostCache src(2, 16, 1 << 20, 7), dst(2, 16, 1 << 20, 8);
  ASSERT_STATUS(LLM_SUCCESS, src.RegisterWith(*dd_));
  ASSERT_STATUS(LLM_SUCCESS, dst.RegisterWith(*dd_));
  std::vector<uint64_t> src_blocks;
  std::vector<std::vector<uint64_t>> dst_lists;
  for (uint64_t b = 0; b < 16; ++b) {
    src_blocks.push_back(b);
    dst_lists.push_back({15 - b});
  }
  Bytes expected = dst.Snapshot();
  ApplyBlockLists(expected, src.Snapshot(), 1 << 20, src_blocks, dst_lists);
  ASSERT_STATUS(LLM_SUCCESS, dd_->CopyKvBlocks(src.cache(), dst.cache(), src_blocks, dst_lists));
  EXPECT_TRUE(SameBytes(dst.Snapshot(), expected));
}

TEST_F(CopyKvBlocksTest, ListErrorsAreParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, b_, "one source, two lists",
                [&] { return dd_->CopyKvBlocks(a_.cache(), b_.cache(), {0}, {{1}, {2}}); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "two sources, one list",
                [&] { return dd_->CopyKvBlocks(a_.cache(), b_.cache(), {0, 1}, {{1}}); });
}

TEST_F(CopyKvBlocksTest, IndicesOutOfRangeAreParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, b_, "src block 5 of 5",
                [&] { return dd_->CopyKvBlocks(a_.cache(), b_.cache(), {0, 5}, {{0}, {1}}); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "dst block 4 of 4",
                [&] { return dd_->CopyKvBlocks(a_.cache(), b_.cache(), {0, 1}, {{0}, {1, 4}}); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "huge",
                [&] { return dd_->CopyKvBlocks(a_.cache(), b_.cache(), {UINT64_MAX}, {{UINT64_MAX}}); });
}

TEST_F(CopyKvBlocksTest, AmbiguousDestinationsAreParamInvalid) {
  ExpectRefused(LLM_PARAM_INVALID, b_, "dst block named twice",
                [&] { return dd_->CopyKvBlocks(a_.cache(), b_.cache(), {0, 1}, {{2}, {2}}); });
  ExpectRefused(LLM_PARAM_INVALID, b_, "dst block twice in one list",
                [&] { return dd_->CopyKvBlocks(a_.cache(), b_.cache(), {0}, {{3, 3}}); });
  ExpectRefused(LLM_PARAM_INVALID, a_, "same cache: a destination is also a source",
                [&] { return dd_->CopyKvBlocks(a_.cache(), a_.cache(), {0, 1}, {{1}, {2}}); });
}

TEST_F(CopyKvBlocksTest, GeometryMismatchIsParamInvalid) {
  HostCache other_block(3, 4, 32, 9), other_count(2, 4, 64, 10);
  ASSERT_STATUS(LLM_SUCCESS, other_block.RegisterWith(*dd_));
  ASSERT_STATUS(LLM_SUCCESS, other_count.RegisterWith(*dd_));
  ExpectRefused(LLM_PARAM_INVALID, other_block, "block 64 vs 32",
                [&] { return dd_->CopyKvBlocks(a_.cache(), other_block.cache(), {0}, {{1}}); });
  ExpectRefused(LLM_PARAM_INVALID, other_count, "3 tensors vs 2",
                [&] { return dd_->CopyKvBlocks(a_.cache(), other_count.cache(), {0}, {{1}}); });
}

TEST_F(CopyKvBlocksTest, UnknownCacheIsKvCacheNotExist) {
  Cache unknown;
  unknown.cache_id = 99;
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, b_, "unknown source",
                [&] { return dd_->CopyKvBlocks(unknown, b_.cache(), {0}, {{1}}); });
  ExpectRefused(LLM_KV_CACHE_NOT_EXIST, a_, "unknown destination",
                [&] { return dd_->CopyKvBlocks(a_.cache(), unknown, {0}, {{1}}); });
}

}  // namespace
}  // namespace dd_test
