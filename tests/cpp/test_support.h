// Helpers shared by the LlmDataDist tests: loopback ports, instances that
// listen or link, host caches backed by std::vector, and a byte model of
// what a transfer must write.
#ifndef DATADIST_TESTS_CPP_TEST_SUPPORT_H_
#define DATADIST_TESTS_CPP_TEST_SUPPORT_H_

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "llm_datadist/llm_datadist.h"

namespace dd_test {

using llm_datadist::AscendString;
using llm_datadist::Cache;
using llm_datadist::CacheDesc;
using llm_datadist::CacheIndex;
using llm_datadist::ClusterInfo;
using llm_datadist::DataType;
using llm_datadist::IpInfo;
using llm_datadist::KvCacheExtParam;
using llm_datadist::LlmDataDist;
using llm_datadist::LlmRole;
using llm_datadist::Status;

using Options = std::map<AscendString, AscendString>;
// One byte vector per tensor.
using Bytes = std::vector<std::vector<uint8_t>>;

// Readable form of a status for failure messages, e.g. "LLM_PARAM_INVALID".
std::string StatusName(Status st);

// A TCP port of 127.0.0.1 that was free a moment ago (0 if none was found).
uint16_t PickFreePort();

// Options every instance gets.
Options BaseOptions();

// Initialises `dd` listening on a free loopback port, retrying with another
// port when Initialize fails. Returns the port, 0 if it never succeeded.
uint16_t InitListening(LlmDataDist &dd, const Options &extra = {});

// A ClusterInfo with one local and one remote address.
ClusterInfo MakeClusterInfo(uint64_t remote_cluster_id, uint16_t port, const std::string &remote_ip = "127.0.0.1",
                            const std::string &local_ip = "127.0.0.1");

// A CacheIndex with every byte set (the struct has no initialisers).
CacheIndex MakeIndex(uint64_t cluster_id, int64_t cache_id, uint32_t batch_index = 0);

// Ext params: closed layer ranges and tensors per layer.
KvCacheExtParam MakeExt(std::pair<int32_t, int32_t> src, std::pair<int32_t, int32_t> dst,
                        uint8_t tensor_num_per_layer = llm_datadist::kDefaultTensorNumPerLayer);

// Bytes of one element; 0 for types the tests do not use.
uint64_t ElementSize(DataType dt);

// Host memory for a cache of `num_tensors` tensors of `shape` (dimension 0
// = slots / blocks), filled with bytes from `seed`. The memory lives as long
// as the object; it can be registered with one instance.
class HostCache {
 public:
  HostCache(uint32_t num_tensors, uint64_t num_slots, uint64_t slot_bytes, uint32_t seed);
  HostCache(uint32_t num_tensors, std::vector<int64_t> shape, DataType data_type, uint32_t seed);
  HostCache(const HostCache &) = delete;
  HostCache &operator=(const HostCache &) = delete;

  // The description RegisterKvCache gets (placement kHost).
  CacheDesc Desc() const;
  std::vector<uint64_t> Addrs() const;
  Status RegisterWith(LlmDataDist &dd);

  // After RegisterWith: id, addresses and description.
  const Cache &cache() const { return cache_; }
  int64_t id() const { return cache_.cache_id; }
  // The cache as a peer names it.
  CacheIndex At(uint64_t cluster_id, uint32_t batch_index = 0) const { return MakeIndex(cluster_id, id(), batch_index); }

  uint32_t num_tensors() const { return static_cast<uint32_t>(tensors_.size()); }
  uint64_t num_slots() const { return num_slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint8_t *Slot(uint32_t tensor, uint64_t slot) { return tensors_[tensor].data() + slot * slot_bytes_; }

  Bytes Snapshot() const { return tensors_; }
  // Refills every byte from `seed`.
  void Fill(uint32_t seed);

 private:
  std::vector<int64_t> shape_;
  DataType data_type_;
  uint64_t num_slots_ = 0;
  uint64_t slot_bytes_ = 0;
  Bytes tensors_;
  Cache cache_;
};

// Expected effect of moving blocks (or slots) between two byte images:
// for every layer pair (s, d) and i < per_layer, unit src_units[k] of tensor
// s * per_layer + i goes to unit dst_units[k] of tensor d * per_layer + i.
struct LayerPair {
  uint32_t src;
  uint32_t dst;
};
std::vector<LayerPair> LayerPairs(uint32_t src_first, uint32_t dst_first, uint32_t count);
void ApplyUnits(Bytes &dst, const Bytes &src, uint64_t unit_bytes, const std::vector<LayerPair> &layers,
                uint32_t per_layer, const std::vector<uint64_t> &src_units, const std::vector<uint64_t> &dst_units,
                uint64_t length = UINT64_MAX);

// Equality of two byte images, naming the first difference.
::testing::AssertionResult SameBytes(const Bytes &actual, const Bytes &expected);

// A block map: `count` distinct destination blocks below `dst_total` and
// source blocks below `src_total` (repeats allowed), with some runs of
// consecutive pairs.
void RandomBlockMap(std::mt19937 &rng, size_t count, uint64_t src_total, uint64_t dst_total,
                    std::vector<uint64_t> &src_blocks, std::vector<uint64_t> &dst_blocks);

// Two instances over loopback: `server_` listens, `client_` linked to it.
class LinkedPairTest : public ::testing::Test {
 protected:
  static constexpr uint64_t kServerId = 101;
  static constexpr uint64_t kClientId = 202;
  static constexpr uint64_t kUnlinkedId = 909;

  void SetUp() override;
  void TearDown() override;

  // Server options beyond BaseOptions and the listen address.
  virtual Options ServerOptions() const { return {}; }
  virtual Options ClientOptions() const { return {}; }

  ClusterInfo ServerInfo() const { return MakeClusterInfo(kServerId, port_); }
  Status Link(std::vector<Status> &rets) { return client_->LinkLlmClusters({ServerInfo()}, rets, 2000); }
  Status Unlink(std::vector<Status> &rets) { return client_->UnlinkLlmClusters({ServerInfo()}, rets, 2000); }

  std::unique_ptr<LlmDataDist> server_;
  std::unique_ptr<LlmDataDist> client_;
  uint16_t port_ = 0;
};

}  // namespace dd_test

// Status comparisons that print names.
#define EXPECT_STATUS(expected, actual)                                                              \
  EXPECT_EQ(::dd_test::StatusName(actual), ::dd_test::StatusName(expected))
#define ASSERT_STATUS(expected, actual)                                                              \
  ASSERT_EQ(::dd_test::StatusName(actual), ::dd_test::StatusName(expected))

#endif  // DATADIST_TESTS_CPP_TEST_SUPPORT_H_
