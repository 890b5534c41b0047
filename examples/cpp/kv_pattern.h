// The bytes both sides of the interop examples agree on: byte i of block b
// of tensor t. Geometry: 8 tensors (4 layers, K and V) of 32 blocks of 4 KiB.
#ifndef EXAMPLES_CPP_KV_PATTERN_H_
#define EXAMPLES_CPP_KV_PATTERN_H_

#include <cstdint>

constexpr uint32_t kTensors = 8;
constexpr uint64_t kBlocks = 32;
constexpr uint64_t kBlockBytes = 4096;

inline uint8_t kv_byte(uint32_t tensor, uint64_t block, uint64_t i) {
  return static_cast<uint8_t>((tensor * 131 + block * 17 + i * 7 + (i >> 8)) & 0xFF);
}

#endif  // EXAMPLES_CPP_KV_PATTERN_H_
