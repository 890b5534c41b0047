// xLLM's transfer over LlmDataDist (LlmDataDistTransfer in
// xllm/core/framework/kv_cache_transfer/llm_data_dist_transfer.cpp), its
// call sequence between two processes: each instance listens and registers
// one cache of every layer's K tensors and one of every layer's V tensors;
// the prefill links to the decode instance with LinkLlmClusters, pushes each
// layer with PushKvBlocks (tensor_num_per_layer = 1) after its layer
// synchronizer, the decode instance pulls a request with PullKvBlocks, and
// the prefill unlinks. Host memory stands for xLLM's device memory
// (placement kHost, the one line that differs).
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>

#include "test_support.h"

// xLLM names caches as CacheIndex{cluster_id, cache_id}; the rest is zeroed.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace dd_test {
namespace {

using namespace llm_datadist;

constexpr int64_t kLayers = 4;
const std::vector<int64_t> kCacheShape = {16, 4, 2, 8};  // blocks, block_size, heads, head_dim
constexpr uint64_t kBlockBytes = 4 * 2 * 8 * 2;          // fp16
constexpr int kStepMs = 20000;

const std::vector<uint64_t> kPushSrc = {0, 1, 2, 7};
const std::vector<uint64_t> kPushDst = {3, 4, 5, 9};
const std::vector<uint64_t> kPullSrc = {10, 11, 14};
const std::vector<uint64_t> kPullDst = {0, 1, 15};

// What the prefill's "model" writes into block `block` of layer `layer`'s K (v = 0) or V (v = 1).
uint8_t Computed(int64_t layer, int v, uint64_t block, uint64_t byte) {
  return static_cast<uint8_t>(layer * 31 + v * 101 + block * 7 + byte * 13 + 1);
}

// Cache info the instances exchange (xLLM's get_cache_info).
struct CacheInfo {
  uint64_t cluster_id;
  uint16_t port;
  int64_t k_cache_id;
  int64_t v_cache_id;
};

bool WriteAll(int fd, const void *data, size_t size) {
  const auto *p = static_cast<const uint8_t *>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd, p, size);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

bool ReadAll(int fd, void *data, size_t size, int timeout_ms) {
  auto *p = static_cast<uint8_t *>(data);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (size > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                            std::chrono::steady_clock::now());
    pollfd pfd{fd, POLLIN, 0};
    if (left.count() <= 0 || ::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return false;
    const ssize_t n = ::read(fd, p, size);
    if (n <= 0) return false;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

// One xLLM instance: its LlmDataDist, K and V caches, and the calls
// LlmDataDistTransfer makes.
class XllmTransfer {
 public:
  XllmTransfer(uint16_t listen_port, LlmRole role, uint32_t seed)
      : listen_port_(listen_port),
        cluster_id_((uint64_t{0x7F000001} << 16) | listen_port),  // convert_ip_port_to_uint64
        dd_(cluster_id_, role),
        k_(kLayers, kCacheShape, DT_FLOAT16, seed),
        v_(kLayers, kCacheShape, DT_FLOAT16, seed + 1) {}

  Status initialize(int32_t device_id) {
    std::map<AscendString, AscendString> options;
    options[OPTION_DEVICE_ID] = std::to_string(device_id).c_str();
    const std::string local_ip_info = host_ip_ + ":" + std::to_string(listen_port_);
    options[OPTION_LISTEN_IP_INFO] = local_ip_info.c_str();
    return dd_.Initialize(options);
  }

  Status allocate_kv_cache() {
    for (auto [memory, cache] : {std::make_pair(&k_, &k_cache_), std::make_pair(&v_, &v_cache_)}) {
      CacheDesc &desc = cache->cache_desc;
      desc.num_tensors = kLayers;
      desc.data_type = DT_FLOAT16;
      desc.shape = kCacheShape;
      desc.placement = CachePlacement::kHost;  // xLLM: device memory, the default kDevice
      for (uint64_t addr : memory->Addrs()) cache->tensor_addrs.push_back(static_cast<uintptr_t>(addr));
      Status st = dd_.RegisterKvCache(desc, memory->Addrs(), {}, cache->cache_id);
      if (st != LLM_SUCCESS) return st;
    }
    return LLM_SUCCESS;
  }

  CacheInfo get_cache_info() const { return {cluster_id_, listen_port_, k_cache_.cache_id, v_cache_.cache_id}; }

  ClusterInfo create_cluster_info(uint64_t cluster_id, const std::string &remote_ip, uint16_t remote_port) const {
    ClusterInfo info;
    IpInfo local_ip_info;
    IpInfo remote_ip_info;
    local_ip_info.ip = host_ip_.c_str();
    local_ip_info.port = listen_port_;
    remote_ip_info.ip = remote_ip.c_str();
    remote_ip_info.port = remote_port;
    info.remote_cluster_id = cluster_id;
    info.local_ip_infos.emplace_back(std::move(local_ip_info));
    info.remote_ip_infos.emplace_back(std::move(remote_ip_info));
    return info;
  }

  Status link_cluster(uint64_t cluster_id, const std::string &device_ip, uint16_t port) {
    std::vector<Status> rets;
    return dd_.LinkLlmClusters({create_cluster_info(cluster_id, device_ip, port)}, rets, 60000);
  }

  Status unlink_cluster(uint64_t cluster_id, const std::string &remote_ip, uint16_t remote_port, bool force_flag) {
    std::vector<Status> rets;
    return dd_.UnlinkLlmClusters({create_cluster_info(cluster_id, remote_ip, remote_port)}, rets, 1000, force_flag);
  }

  Status pull_kv_blocks(uint64_t src_cluster_id, int64_t src_k_cache_id, int64_t src_v_cache_id,
                        const std::vector<uint64_t> &src_blocks, const std::vector<uint64_t> &dst_blocks) {
    CacheIndex k_cache_index{src_cluster_id, src_k_cache_id};
    CacheIndex v_cache_index{src_cluster_id, src_v_cache_id};
    const Status k_ret = dd_.PullKvBlocks(k_cache_index, k_cache_, src_blocks, dst_blocks);
    const Status v_ret = dd_.PullKvBlocks(v_cache_index, v_cache_, src_blocks, dst_blocks);
    return k_ret != LLM_SUCCESS ? k_ret : v_ret;
  }

  // push_kv_blocks for one request: every layer after synchronize_layer.
  Status push_kv_blocks(const CacheInfo &dst, const std::vector<uint64_t> &src_blocks,
                        const std::vector<uint64_t> &dst_blocks, const std::function<void(int64_t)> &synchronize_layer) {
    Status result = LLM_SUCCESS;
    for (int64_t layer_index = 0; layer_index < kLayers; ++layer_index) {
      synchronize_layer(layer_index);
      CacheIndex k_cache_index{dst.cluster_id, dst.k_cache_id};
      CacheIndex v_cache_index{dst.cluster_id, dst.v_cache_id};
      KvCacheExtParam ext_param{};
      ext_param.src_layer_range = std::pair<int32_t, int32_t>(layer_index, layer_index);
      ext_param.dst_layer_range = std::pair<int32_t, int32_t>(layer_index, layer_index);
      ext_param.tensor_num_per_layer = 1;
      const Status k_ret = dd_.PushKvBlocks(k_cache_, k_cache_index, src_blocks, dst_blocks, ext_param);
      const Status v_ret = dd_.PushKvBlocks(v_cache_, v_cache_index, src_blocks, dst_blocks, ext_param);
      if (k_ret != LLM_SUCCESS) result = k_ret;
      if (v_ret != LLM_SUCCESS) result = v_ret;
    }
    return result;
  }

  void finalize() { dd_.Finalize(); }

  HostCache &k() { return k_; }
  HostCache &v() { return v_; }

 private:
  const std::string host_ip_ = "127.0.0.1";
  const uint16_t listen_port_;
  const uint64_t cluster_id_;
  LlmDataDist dd_;
  HostCache k_;
  HostCache v_;
  Cache k_cache_;
  Cache v_cache_;
};

// The prefill process: returns its exit code (0: every step succeeded).
int PrefillMain(int to_decode, int from_decode, uint16_t port) {
  XllmTransfer prefill(port, LlmRole::kPrompt, 10);
  if (prefill.initialize(0) != LLM_SUCCESS) return 10;
  if (prefill.allocate_kv_cache() != LLM_SUCCESS) return 11;
  CacheInfo mine = prefill.get_cache_info();
  CacheInfo decode{};
  if (!WriteAll(to_decode, &mine, sizeof(mine)) || !ReadAll(from_decode, &decode, sizeof(decode), kStepMs)) return 12;
  if (prefill.link_cluster(decode.cluster_id, "127.0.0.1", decode.port) != LLM_SUCCESS) return 13;
  // The layer synchronizer: the model has computed layer l once it returns.
  auto synchronize_layer = [&](int64_t layer) {
    for (int v = 0; v < 2; ++v) {
      HostCache &cache = v == 0 ? prefill.k() : prefill.v();
      for (uint64_t block : kPushSrc) {
        uint8_t *p = cache.Slot(static_cast<uint32_t>(layer), block);
        for (uint64_t i = 0; i < kBlockBytes; ++i) p[i] = Computed(layer, v, block, i);
      }
    }
  };
  if (prefill.push_kv_blocks(decode, kPushSrc, kPushDst, synchronize_layer) != LLM_SUCCESS) return 14;
  const char pushed = 'p';
  if (!WriteAll(to_decode, &pushed, 1)) return 15;
  char done = 0;
  if (!ReadAll(from_decode, &done, 1, kStepMs) || done != 'd') return 16;
  if (prefill.unlink_cluster(decode.cluster_id, "127.0.0.1", decode.port, false) != LLM_SUCCESS) return 17;
  prefill.finalize();
  return 0;
}

TEST(XllmClientSequence, LinkPushEveryLayerPullUnlinkBetweenProcesses) {
  const uint16_t prefill_port = PickFreePort();
  const uint16_t decode_port = PickFreePort();
  ASSERT_NE(prefill_port, 0);
  ASSERT_NE(decode_port, 0);
  ASSERT_NE(prefill_port, decode_port);
  int down[2], up[2];  // prefill -> decode, decode -> prefill
  ASSERT_EQ(::pipe(down), 0);
  ASSERT_EQ(::pipe(up), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(down[0]);
    ::close(up[1]);
    ::_exit(PrefillMain(down[1], up[0], prefill_port));
  }
  ::close(down[1]);
  ::close(up[0]);
  // Whatever happens below, the prefill process is reaped (killed if it hangs).
  struct Reaper {
    pid_t pid;
    int status = -1;
    ~Reaper() {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
    int Wait(int timeout_ms) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
      while (std::chrono::steady_clock::now() < deadline) {
        if (::waitpid(pid, &status, WNOHANG) == pid) {
          pid = 0;
          return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        }
        ::usleep(10000);
      }
      return -1;
    }
  } reaper{child};

  XllmTransfer decode(decode_port, LlmRole::kDecoder, 20);
  ASSERT_STATUS(LLM_SUCCESS, decode.initialize(1));
  ASSERT_STATUS(LLM_SUCCESS, decode.allocate_kv_cache());
  const HostCache prefill_k_at_start(kLayers, kCacheShape, DT_FLOAT16, 10);
  const HostCache prefill_v_at_start(kLayers, kCacheShape, DT_FLOAT16, 11);
  Bytes expected_k = decode.k().Snapshot();
  Bytes expected_v = decode.v().Snapshot();

  CacheInfo prefill{};
  CacheInfo mine = decode.get_cache_info();
  ASSERT_TRUE(ReadAll(down[0], &prefill, sizeof(prefill), kStepMs)) << "no cache info from the prefill";
  ASSERT_TRUE(WriteAll(up[1], &mine, sizeof(mine)));
  char pushed = 0;
  ASSERT_TRUE(ReadAll(down[0], &pushed, 1, kStepMs)) << "the prefill did not push; exit code " << reaper.Wait(5000);
  ASSERT_EQ(pushed, 'p');

  // Every layer's pushed blocks hold what the prefill computed for them.
  for (int v = 0; v < 2; ++v) {
    Bytes &expected = v == 0 ? expected_k : expected_v;
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      for (size_t k = 0; k < kPushSrc.size(); ++k) {
        for (uint64_t i = 0; i < kBlockBytes; ++i) {
          expected[layer][kPushDst[k] * kBlockBytes + i] = Computed(layer, v, kPushSrc[k], i);
        }
      }
    }
  }
  // The decode side pulls another request's blocks over the same link.
  ASSERT_STATUS(LLM_SUCCESS,
                decode.pull_kv_blocks(prefill.cluster_id, prefill.k_cache_id, prefill.v_cache_id, kPullSrc, kPullDst));
  ApplyUnits(expected_k, prefill_k_at_start.Snapshot(), kBlockBytes, LayerPairs(0, 0, kLayers), 1, kPullSrc, kPullDst);
  ApplyUnits(expected_v, prefill_v_at_start.Snapshot(), kBlockBytes, LayerPairs(0, 0, kLayers), 1, kPullSrc, kPullDst);
  EXPECT_TRUE(SameBytes(decode.k().Snapshot(), expected_k));
  EXPECT_TRUE(SameBytes(decode.v().Snapshot(), expected_v));

  const char done = 'd';
  ASSERT_TRUE(WriteAll(up[1], &done, 1));
  EXPECT_EQ(reaper.Wait(kStepMs), 0) << "the prefill process failed";
  decode.finalize();
  for (int fd : {down[0], up[1]}) ::close(fd);
}

}  // namespace
}  // namespace dd_test
