// The test path (native/src/transport/paths/test/): a path that is its own
// folder and one line in paths.cpp, which the link manager, the listener and
// the handshake frames know nothing of. Two engines of this process with
// $DATADIST_AIO_TEST_PATH=1 and transport "tcp" link with it: the initiator
// moves every byte itself, with the owner's checks, and no frame goes to the
// owner. Without the variable the same link has no such path.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine.h"
#include "options.h"

namespace datadist {
namespace {

using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

constexpr uint64_t kOwner = 71, kInitiator = 72, kModel = 3;
constexpr uint64_t kBlocks = 8, kBlock = 4096;

// One blocks cache of 2 tensors, its bytes from `seed`, registered with the
// engine as the blocks cache of kModel.
struct Blocks {
  Blocks(Engine &engine, uint8_t seed) : bytes(2, std::vector<uint8_t>(kBlocks * kBlock)) {
    for (size_t t = 0; t < bytes.size(); ++t) {
      for (size_t i = 0; i < bytes[t].size(); ++i) bytes[t][i] = static_cast<uint8_t>(seed + 31 * t + i * 7);
    }
    CacheSpec spec;
    spec.num_tensors = 2;
    spec.shape = {static_cast<int64_t>(kBlocks), static_cast<int64_t>(kBlock)};
    spec.data_type = 4;  // uint8
    spec.is_blocks = true;
    const std::vector<uintptr_t> addrs{reinterpret_cast<uintptr_t>(bytes[0].data()),
                                       reinterpret_cast<uintptr_t>(bytes[1].data())};
    EXPECT_EQ(engine.register_cache(spec, addrs, {}, kModel, true, id), LLM_SUCCESS);
  }
  std::vector<std::vector<uint8_t>> bytes;
  int64_t id = -1;
};

class TestPathTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (GetParam()) {
      ::setenv("DATADIST_AIO_TEST_PATH", "1", 1);
    } else {
      ::unsetenv("DATADIST_AIO_TEST_PATH");
    }
    OptionMap owner_options{{kOptTransport, "tcp"}, {kOptListenIp, "127.0.0.1"}, {kOptListenPort, "0"},
                            {kOptRemoteCacheAccessible, "1"}, {kOptRole, "Decoder"}};
    ASSERT_EQ(owner_.initialize(owner_options), LLM_SUCCESS);
    ASSERT_EQ(initiator_.initialize({{kOptTransport, "tcp"}, {kOptRole, "Prompt"}}), LLM_SUCCESS);
    ::unsetenv("DATADIST_AIO_TEST_PATH");
    std::vector<Status> rets;
    ASSERT_EQ(initiator_.link_clusters({{kOwner, "127.0.0.1", owner_.listen_port(), "127.0.0.1"}}, 5000, rets),
              LLM_SUCCESS);
    std::string transport;
    ASSERT_EQ(initiator_.link_transport(kOwner, transport), LLM_SUCCESS);
    EXPECT_EQ(transport, "tcp");  // the test path never names the link's transport
  }
  void TearDown() override {
    initiator_.finalize();
    owner_.finalize();
  }

  // A cache of `engine`'s, kept until both engines are finalized: a
  // request's end is not the end of the owner's use of the memory (its I/O
  // thread may still be in the send of a pull's answer when the initiator
  // has the bytes), and registered memory is the caller's to keep until then.
  Blocks &blocks(Engine &engine, uint8_t seed) {
    blocks_.push_back(std::make_unique<Blocks>(engine, seed));
    return *blocks_.back();
  }

  // Pushes the initiator's blocks `src` to the owner's `dst`, or pulls the
  // owner's `src` into the initiator's `dst`; the first status that is not
  // LLM_SUCCESS, else LLM_SUCCESS.
  Status transfer(bool push, const Blocks &mine, const std::vector<uint64_t> &src, const std::vector<uint64_t> &dst) {
    RemoteName name;
    name.kind = wire::kBlocksOfModel;
    name.model_id = kModel;
    const LayerSpan span{0, 0, 1, 2};
    std::shared_ptr<Request> request;
    const Status st = push ? initiator_.push_blocks(mine.id, kOwner, name, src, dst, span, request)
                           : initiator_.pull_blocks(mine.id, kOwner, name, src, dst, span, request);
    if (st != LLM_SUCCESS) return st;
    EXPECT_TRUE(request->wait(10000));
    for (Status each : request->results()) {
      if (each != LLM_SUCCESS) return each;
    }
    return LLM_SUCCESS;
  }
  static std::vector<uint8_t> block(const Blocks &b, size_t tensor, uint64_t index) {
    const auto *at = b.bytes[tensor].data() + index * kBlock;
    return {at, at + kBlock};
  }

  Engine owner_{kOwner};
  Engine initiator_{kInitiator};
  std::vector<std::unique_ptr<Blocks>> blocks_;
};

TEST_P(TestPathTest, PushesAndPullsMoveEveryByte) {
  Blocks &theirs = blocks(owner_, 1), &mine = blocks(initiator_, 2);
  ASSERT_EQ(transfer(true, mine, {1, 3}, {5, 0}), LLM_SUCCESS);
  for (size_t t = 0; t < 2; ++t) {
    EXPECT_EQ(block(theirs, t, 5), block(mine, t, 1));
    EXPECT_EQ(block(theirs, t, 0), block(mine, t, 3));
  }
  ASSERT_EQ(transfer(false, mine, {6, 7}, {2, 4}), LLM_SUCCESS);
  for (size_t t = 0; t < 2; ++t) {
    EXPECT_EQ(block(mine, t, 2), block(theirs, t, 6));
    EXPECT_EQ(block(mine, t, 4), block(theirs, t, 7));
  }
  const std::map<std::string, uint64_t> here = initiator_.link_stats(kOwner), there = owner_.link_stats(kInitiator);
  if (GetParam()) {
    // By the test path: no frame to the owner, which served nothing.
    EXPECT_EQ(here.at("test_moves"), 2u);  // one operation each way, both tensors in it
    EXPECT_EQ(here.at("test_bytes"), 8 * kBlock);
    EXPECT_EQ(here.at("framed_ops"), 0u);
    EXPECT_EQ(there.at("owner_served_ops"), 0u);
  } else {
    // No such path on the link: inline frames the owner served.
    EXPECT_EQ(here.count("test_moves"), 0u);
    EXPECT_EQ(here.at("framed_ops"), 2u);
    EXPECT_EQ(there.at("owner_served_ops"), 2u);
  }
}

TEST_P(TestPathTest, TheOwnersChecksRefuseWhatTheOwnerWould) {
  Blocks &theirs = blocks(owner_, 3), &mine = blocks(initiator_, 4);
  const std::vector<std::vector<uint8_t>> before = theirs.bytes;
  // Block kBlocks is past the owner's cache: refused whole, nothing written.
  EXPECT_EQ(transfer(true, mine, {0, 1}, {2, kBlocks}), LLM_PARAM_INVALID);
  EXPECT_EQ(theirs.bytes, before);
  if (GetParam()) {
    const std::map<std::string, uint64_t> here = initiator_.link_stats(kOwner);
    EXPECT_GE(here.at("test_refused"), 1u);
    EXPECT_EQ(here.at("test_moves"), 0u);
    EXPECT_EQ(owner_.link_stats(kInitiator).at("owner_served_ops"), 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(WithAndWithout, TestPathTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool> &info) {
                           return info.param ? "TestPath" : "Inline";
                         });

}  // namespace
}  // namespace datadist
