#include "test_support.h"

#include "error_detail.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <sstream>

namespace dd_test {

using namespace llm_datadist;

std::string StatusName(Status st) { return datadist::status_name(st); }

uint16_t PickFreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  uint16_t port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr *>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr *>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

Options BaseOptions() { return {{OPTION_DEVICE_ID, "0"}}; }

uint16_t InitListening(LlmDataDist &dd, const Options &extra) {
  for (int attempt = 0; attempt < 20; ++attempt) {
    const uint16_t port = PickFreePort();
    if (port == 0) continue;
    Options options = BaseOptions();
    for (const auto &kv : extra) options[kv.first] = kv.second;
    options[OPTION_LISTEN_IP_INFO] = "127.0.0.1:" + std::to_string(port);
    if (dd.Initialize(options) == LLM_SUCCESS) return port;
  }
  return 0;
}

ClusterInfo MakeClusterInfo(uint64_t remote_cluster_id, uint16_t port, const std::string &remote_ip,
                            const std::string &local_ip) {
  ClusterInfo info;
  info.remote_cluster_id = remote_cluster_id;
  info.remote_role_type = static_cast<int32_t>(LlmRole::kPrompt);
  IpInfo local;
  local.ip = local_ip;
  info.local_ip_infos.push_back(local);
  IpInfo remote;
  remote.ip = remote_ip;
  remote.port = port;
  info.remote_ip_infos.push_back(remote);
  return info;
}

CacheIndex MakeIndex(uint64_t cluster_id, int64_t cache_id, uint32_t batch_index) {
  CacheIndex index{};
  index.cluster_id = cluster_id;
  index.cache_id = cache_id;
  index.batch_index = batch_index;
  return index;
}

KvCacheExtParam MakeExt(std::pair<int32_t, int32_t> src, std::pair<int32_t, int32_t> dst,
                        uint8_t tensor_num_per_layer) {
  KvCacheExtParam ext;
  ext.src_layer_range = src;
  ext.dst_layer_range = dst;
  ext.tensor_num_per_layer = tensor_num_per_layer;
  return ext;
}

uint64_t ElementSize(DataType dt) {
  switch (dt) {
    case DT_INT8:
    case DT_UINT8:
    case DT_BOOL:
      return 1;
    case DT_FLOAT16:
    case DT_BF16:
    case DT_INT16:
    case DT_UINT16:
      return 2;
    case DT_FLOAT:
    case DT_INT32:
    case DT_UINT32:
      return 4;
    case DT_INT64:
    case DT_UINT64:
    case DT_DOUBLE:
      return 8;
    default:
      return 0;
  }
}

HostCache::HostCache(uint32_t num_tensors, uint64_t num_slots, uint64_t slot_bytes, uint32_t seed)
    : HostCache(num_tensors, {static_cast<int64_t>(num_slots), static_cast<int64_t>(slot_bytes)}, DT_UINT8, seed) {}

HostCache::HostCache(uint32_t num_tensors, std::vector<int64_t> shape, DataType data_type, uint32_t seed)
    : shape_(std::move(shape)), data_type_(data_type) {
  uint64_t bytes = ElementSize(data_type_);
  for (int64_t dim : shape_) bytes *= static_cast<uint64_t>(dim);
  num_slots_ = static_cast<uint64_t>(shape_.at(0));
  slot_bytes_ = bytes / num_slots_;
  tensors_.assign(num_tensors, std::vector<uint8_t>(bytes));
  Fill(seed);
}

void HostCache::Fill(uint32_t seed) {
  std::mt19937 rng(seed);
  for (auto &tensor : tensors_) {
    // Words of the generator, so large caches fill quickly.
    size_t i = 0;
    for (; i + 4 <= tensor.size(); i += 4) {
      const uint32_t word = rng();
      std::memcpy(tensor.data() + i, &word, 4);
    }
    for (; i < tensor.size(); ++i) tensor[i] = static_cast<uint8_t>(rng());
  }
}

CacheDesc HostCache::Desc() const {
  CacheDesc desc;
  desc.placement = CachePlacement::kHost;
  desc.num_tensors = num_tensors();
  desc.data_type = data_type_;
  desc.shape = shape_;
  return desc;
}

std::vector<uint64_t> HostCache::Addrs() const {
  std::vector<uint64_t> addrs;
  for (const auto &tensor : tensors_) addrs.push_back(reinterpret_cast<uint64_t>(tensor.data()));
  return addrs;
}

Status HostCache::RegisterWith(LlmDataDist &dd) {
  int64_t id = -1;
  const Status st = dd.RegisterKvCache(Desc(), Addrs(), RegisterCfg{}, id);
  if (st == LLM_SUCCESS) {
    cache_.cache_id = id;
    cache_.cache_desc = Desc();
    cache_.tensor_addrs.clear();
    for (const auto &tensor : tensors_) cache_.tensor_addrs.push_back(reinterpret_cast<uintptr_t>(tensor.data()));
  }
  return st;
}

std::vector<LayerPair> LayerPairs(uint32_t src_first, uint32_t dst_first, uint32_t count) {
  std::vector<LayerPair> pairs;
  for (uint32_t l = 0; l < count; ++l) pairs.push_back({src_first + l, dst_first + l});
  return pairs;
}

void ApplyUnits(Bytes &dst, const Bytes &src, uint64_t unit_bytes, const std::vector<LayerPair> &layers,
                uint32_t per_layer, const std::vector<uint64_t> &src_units, const std::vector<uint64_t> &dst_units,
                uint64_t length) {
  const uint64_t len = std::min(unit_bytes, length);
  for (const LayerPair &layer : layers) {
    for (uint32_t i = 0; i < per_layer; ++i) {
      const auto &from = src.at(layer.src * per_layer + i);
      auto &to = dst.at(layer.dst * per_layer + i);
      for (size_t k = 0; k < src_units.size(); ++k) {
        std::memcpy(to.data() + dst_units[k] * unit_bytes, from.data() + src_units[k] * unit_bytes, len);
      }
    }
  }
}

::testing::AssertionResult SameBytes(const Bytes &actual, const Bytes &expected) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << "tensor count " << actual.size() << " != " << expected.size();
  }
  for (size_t t = 0; t < actual.size(); ++t) {
    if (actual[t] == expected[t]) continue;
    if (actual[t].size() != expected[t].size()) {
      return ::testing::AssertionFailure() << "tensor " << t << " size differs";
    }
    size_t first = 0;
    while (actual[t][first] == expected[t][first]) ++first;
    size_t count = 0;
    for (size_t i = first; i < actual[t].size(); ++i) count += actual[t][i] != expected[t][i];
    return ::testing::AssertionFailure() << "tensor " << t << ": " << count << " byte(s) differ, first at offset "
                                         << first << " (actual " << int(actual[t][first]) << ", expected "
                                         << int(expected[t][first]) << ")";
  }
  return ::testing::AssertionSuccess();
}

void RandomBlockMap(std::mt19937 &rng, size_t count, uint64_t src_total, uint64_t dst_total,
                    std::vector<uint64_t> &src_blocks, std::vector<uint64_t> &dst_blocks) {
  std::vector<uint64_t> free_dst(dst_total);
  std::iota(free_dst.begin(), free_dst.end(), 0);
  std::shuffle(free_dst.begin(), free_dst.end(), rng);
  std::vector<bool> used(dst_total, false);
  src_blocks.clear();
  dst_blocks.clear();
  size_t next_free = 0;
  while (dst_blocks.size() < count) {
    // Half the time continue a run of consecutive pairs when possible.
    if (!dst_blocks.empty() && rng() % 2 == 0) {
      const uint64_t s = src_blocks.back() + 1;
      const uint64_t d = dst_blocks.back() + 1;
      if (s < src_total && d < dst_total && !used[d]) {
        src_blocks.push_back(s);
        dst_blocks.push_back(d);
        used[d] = true;
        continue;
      }
    }
    while (used[free_dst[next_free]]) ++next_free;
    const uint64_t d = free_dst[next_free];
    used[d] = true;
    dst_blocks.push_back(d);
    src_blocks.push_back(rng() % src_total);
  }
}

void LinkedPairTest::SetUp() {
  server_ = std::make_unique<LlmDataDist>(kServerId, LlmRole::kPrompt);
  port_ = InitListening(*server_, ServerOptions());
  ASSERT_NE(port_, 0) << "the server never initialised";
  client_ = std::make_unique<LlmDataDist>(kClientId, LlmRole::kDecoder);
  Options options = BaseOptions();
  for (const auto &kv : ClientOptions()) options[kv.first] = kv.second;
  ASSERT_STATUS(LLM_SUCCESS, client_->Initialize(options));
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, Link(rets));
  ASSERT_EQ(rets.size(), 1u);
  ASSERT_STATUS(LLM_SUCCESS, rets[0]);
}

void LinkedPairTest::TearDown() {
  if (client_) client_->Finalize();
  if (server_) server_->Finalize();
}

}  // namespace dd_test
