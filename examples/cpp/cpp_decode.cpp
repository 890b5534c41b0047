// C++ decode: listens, registers a KV cache, prints "READY <port> <cache id>"
// and, once a line arrives on stdin (the prefill side is done), checks the
// blocks it received: block 10 + k of every tensor must hold block k of the
// prefill side (k < 8), every other block must still be zero.
//   cpp_decode PORT
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "kv_pattern.h"
#include "llm_datadist/llm_datadist.h"

using namespace llm_datadist;

int main(int argc, char **argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s PORT\n", argv[0]);
    return 2;
  }
  LlmDataDist decode(2, LlmRole::kDecoder);
  const std::string listen = std::string("127.0.0.1:") + argv[1];
  Status st = decode.Initialize({{OPTION_LISTEN_IP_INFO, listen.c_str()}});
  if (st != LLM_SUCCESS) return std::fprintf(stderr, "Initialize: %#x\n", st), 1;
  CacheDesc desc;
  desc.placement = CachePlacement::kHost;
  desc.num_tensors = kTensors;
  desc.data_type = DT_UINT8;
  desc.shape = {static_cast<int64_t>(kBlocks), static_cast<int64_t>(kBlockBytes)};
  std::vector<std::vector<uint8_t>> kv(kTensors, std::vector<uint8_t>(kBlocks * kBlockBytes, 0));
  std::vector<uint64_t> addrs;
  for (auto &tensor : kv) addrs.push_back(reinterpret_cast<uint64_t>(tensor.data()));
  int64_t cache_id = -1;
  st = decode.RegisterKvCache(desc, addrs, {}, cache_id);
  if (st != LLM_SUCCESS) return std::fprintf(stderr, "RegisterKvCache: %#x\n", st), 1;
  std::printf("READY %s %lld\n", argv[1], static_cast<long long>(cache_id));
  std::fflush(stdout);

  std::string line;
  std::getline(std::cin, line);
  uint64_t wrong = 0;
  for (uint32_t t = 0; t < kTensors; ++t) {
    for (uint64_t b = 0; b < kBlocks; ++b) {
      const bool filled = b >= 10 && b < 18;
      for (uint64_t i = 0; i < kBlockBytes; ++i) {
        const uint8_t want = filled ? kv_byte(t, b - 10, i) : 0;
        wrong += kv[t][b * kBlockBytes + i] != want;
      }
    }
  }
  std::printf("%s\n", wrong == 0 ? "VERIFIED" : "MISMATCH");
  decode.Finalize();
  return wrong == 0 ? 0 : 1;
}
