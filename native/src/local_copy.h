// Local data movement: plans copies inside this process as byte segments
// and runs them on the worker pool, stopping between chunks when the request
// is cancelled.
#ifndef DATADIST_LOCAL_COPY_H_
#define DATADIST_LOCAL_COPY_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "registry.h"
#include "request.h"
#include "worker_pool.h"

namespace datadist {

struct CopySegment {
  uint8_t *dst;
  const uint8_t *src;
  uint64_t len;
};

// A run of `count` consecutive blocks starting at `src` and at `dst`.
struct BlockRun {
  uint64_t src;
  uint64_t dst;
  uint64_t count;
};

using BlockPairs = std::vector<std::pair<uint64_t, uint64_t>>;

// Merges (src, dst) pairs, in the order given, into maximal runs where both
// indices step by one.
std::vector<BlockRun> merge_block_runs(const BlockPairs &pairs);

// LLM_PARAM_INVALID when a destination block is named twice or is also a
// source: the result would depend on the order of the copies.
Status check_block_destinations(const BlockPairs &pairs, bool same_cache);

// Bytes [slot * slot_size + offset, + size) of every tensor; size -1 means
// to the end of the slot. Both caches need the same tensor count.
Status plan_copy_cache(const CacheEntry &dst, const CacheEntry &src, uint64_t dst_slot,
                       uint64_t src_slot, uint64_t offset, int64_t size, std::vector<CopySegment> &out);

// Block src -> block dst of every tensor; both caches need the same block
// size and tensor count and every index in range.
Status plan_copy_blocks(const CacheEntry &dst, const CacheEntry &src, const BlockPairs &pairs,
                        std::vector<CopySegment> &out);

// Runs the segments for `request` (result slot 0) on the pool: host memory
// with memcpy, spread over the workers; where `dst` or `src` is in device
// memory, on one worker with the driver's copies on one of the device's
// streams. The caches stay alive until the last byte has moved. Releases
// the caller's hold on the request.
void run_local_copy(WorkerPool &pool, const std::shared_ptr<Request> &request, std::vector<CopySegment> segments,
                    std::shared_ptr<CacheEntry> dst, std::shared_ptr<CacheEntry> src);

}  // namespace datadist

#endif  // DATADIST_LOCAL_COPY_H_
