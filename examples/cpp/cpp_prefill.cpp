// C++ prefill: pushes blocks with PushKvBlocks into a decode process (the
// Python one in interop.py) and exits 0 when the push succeeded.
//   cpp_prefill DECODE_PORT DECODE_CACHE_ID
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kv_pattern.h"
#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;

int main(int argc, char **argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s DECODE_PORT DECODE_CACHE_ID\n", argv[0]);
    return 2;
  }
  LlmDataDist prefill(1, LlmRole::kPrompt);
  Status st = prefill.Initialize({{OPTION_SYNC_CACHE_WAIT_TIME, "5000"}});
  if (st != LLM_SUCCESS) return std::fprintf(stderr, "Initialize: %#x\n", st), 1;

  CacheDesc desc;
  desc.placement = CachePlacement::kHost;
  desc.num_tensors = kTensors;
  desc.data_type = DT_UINT8;
  desc.shape = {static_cast<int64_t>(kBlocks), static_cast<int64_t>(kBlockBytes)};
  std::vector<std::vector<uint8_t>> kv(kTensors, std::vector<uint8_t>(kBlocks * kBlockBytes));
  std::vector<uint64_t> addrs;
  for (uint32_t t = 0; t < kTensors; ++t) {
    for (uint64_t b = 0; b < kBlocks; ++b) {
      for (uint64_t i = 0; i < kBlockBytes; ++i) kv[t][b * kBlockBytes + i] = kv_byte(t, b, i);
    }
    addrs.push_back(reinterpret_cast<uint64_t>(kv[t].data()));
  }
  Cache cache;
  st = prefill.RegisterKvCache(desc, addrs, {}, cache.cache_id);
  if (st != LLM_SUCCESS) return std::fprintf(stderr, "RegisterKvCache: %#x\n", st), 1;
  cache.cache_desc = desc;

  ClusterInfo decode;
  decode.remote_cluster_id = 2;
  IpInfo local, remote;
  local.ip = "127.0.0.1";
  remote.ip = "127.0.0.1";
  remote.port = static_cast<uint16_t>(std::atoi(argv[1]));
  decode.local_ip_infos.push_back(local);
  decode.remote_ip_infos.push_back(remote);
  std::vector<Status> rets;
  st = prefill.LinkLlmClusters({decode}, rets, 5000);
  if (st != LLM_SUCCESS) return std::fprintf(stderr, "LinkLlmClusters: %#x\n", st), 1;
  std::string transport;
  if (prefill.GetLinkTransport(2, transport) == LLM_SUCCESS) std::printf("link: %s\n", transport.c_str());

  // Blocks 0..7 of every layer go to the decode side's block table 20..27 (reversed).
  const std::vector<uint64_t> src_blocks = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<uint64_t> dst_blocks = {27, 26, 25, 24, 23, 22, 21, 20};
  CacheIndex dst{2, std::atoll(argv[2]), 0, {}};
  st = prefill.PushKvBlocks(cache, dst, src_blocks, dst_blocks);
  std::printf("PushKvBlocks: %#x\n", st);
  prefill.UnlinkLlmClusters({decode}, rets);
  prefill.Finalize();
  return st == LLM_SUCCESS ? 0 : 1;
}
