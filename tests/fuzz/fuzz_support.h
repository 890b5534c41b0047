// What the fuzz targets of a peer's bytes share: the memory the engine
// under test owns, laid out so that any stray write or read shows, and a
// socket exchange that feeds an input while draining the answers.
//
// The arena lies at a fixed address between PROT_NONE guard pages, so that
// seeds may name raw addresses. In it: three registered caches (two remotely
// accessible, one not) and two buffers of the harness's own. Every byte the
// peer may not read holds a random marker; every byte the peer may not
// write keeps its initial value. Threads: the harness's thread only.
#ifndef DATADIST_TESTS_FUZZ_FUZZ_SUPPORT_H_
#define DATADIST_TESTS_FUZZ_FUZZ_SUPPORT_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "registry.h"

namespace dd_fuzz {

constexpr uintptr_t kArenaAddr = 0x6a0000000000;
constexpr size_t kPage = 4096;
constexpr size_t kArenaBytes = 8 * kPage;
constexpr size_t kTensorBytes = 256;
// Offsets in the arena.
constexpr size_t kCacheA0 = 0x1000, kCacheA1 = 0x1200;  // cache 1: 2 tensors x 4 slots x 64 B, remote, keys
constexpr size_t kCacheB = 0x2000;                       // cache 2: blocks of model 3, 8 x 32 B, remote
constexpr size_t kCacheC = 0x3000;                       // cache 3: 4 slots x 64 B, not remote accessible
constexpr size_t kReadInto = 0x4000;                     // the harness's own read lands here
constexpr size_t kWriteFrom = 0x5000;                    // the harness's own write comes from here

// Prints `what` and aborts unless `ok`.
void require(bool ok, const char *what);
// Maps `bytes` at `addr` exactly, or aborts.
uint8_t *map_fixed(uintptr_t addr, size_t bytes);

// Maps the arena; once, before any other call.
void arena_init();
uint8_t *arena();
// Puts every byte of the arena back to its initial value.
void arena_reset();
// Registers caches 1 to 3 (ids 1, 2, 3 in a fresh registry). Cache 1 binds
// keys (7, model 1) to slot 1 and (8, model 1) to slot 2; cache 3 binds
// (9, model 1) to slot 0.
void add_caches(datadist::Registry &registry);
// Aborts, naming `target`, if a byte the peer may not write changed or if
// `answers` carry bytes the peer may not read.
void check_arena(const char *target, const std::vector<uint8_t> &answers);

size_t open_fds();

// Sends `input` on `fd` while draining what comes back, then half-closes and
// drains until the other end closes or, when idle_ms >= 0, until nothing
// came for idle_ms.
std::vector<uint8_t> exchange(int fd, const uint8_t *input, size_t size, int idle_ms = -1);

// The answers' frame headers on stderr, to see what a seed does.
void trace(const std::vector<uint8_t> &answers);

}  // namespace dd_fuzz

#endif  // DATADIST_TESTS_FUZZ_FUZZ_SUPPORT_H_
