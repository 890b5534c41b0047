#include "local_copy.h"

#include <algorithm>
#include <cstring>
#include <unordered_set>

#include "device/cuda_driver.h"
#include "error_detail.h"

namespace datadist {

using llm_datadist::LLM_ENGINE_FINALIZED;
using llm_datadist::LLM_FAILED;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

namespace {

constexpr uint64_t kChunk = 4ULL << 20;       // bytes copied between cancellation checks
constexpr uint64_t kShardMin = 8ULL << 20;     // below this one worker does the whole copy
constexpr uint64_t kDeviceBatch = 64ULL << 20; // device copies queued between cancellation checks

}  // namespace

std::vector<BlockRun> merge_block_runs(const BlockPairs &pairs) {
  std::vector<BlockRun> runs;
  for (const auto &pair : pairs) {
    if (!runs.empty()) {
      BlockRun &last = runs.back();
      if (pair.first == last.src + last.count && pair.second == last.dst + last.count) {
        ++last.count;
        continue;
      }
    }
    runs.push_back({pair.first, pair.second, 1});
  }
  return runs;
}

Status check_block_destinations(const BlockPairs &pairs, bool same_cache) {
  std::unordered_set<uint64_t> dsts;
  for (const auto &pair : pairs) {
    if (!dsts.insert(pair.second).second) {
      return refuse(LLM_PARAM_INVALID, words("destination block ", pair.second, " is named twice"));
    }
  }
  if (same_cache) {
    for (const auto &pair : pairs) {
      if (dsts.count(pair.first) != 0) {
        return refuse(LLM_PARAM_INVALID,
                      words("block ", pair.first, " is both a source and a destination of the same cache"));
      }
    }
  }
  return LLM_SUCCESS;
}

Status plan_copy_cache(const CacheEntry &dst, const CacheEntry &src, uint64_t dst_slot,
                       uint64_t src_slot, uint64_t offset, int64_t size, std::vector<CopySegment> &out) {
  const Geometry &dg = dst.geometry;
  const Geometry &sg = src.geometry;
  if (dst.addrs.size() != src.addrs.size()) {
    return refuse(LLM_PARAM_INVALID, words("the destination has ", dst.addrs.size(), " tensors, the source ",
                                           src.addrs.size()));
  }
  if (dst_slot >= dg.num_slots) {
    return refuse(LLM_PARAM_INVALID,
                  words("destination batch index ", dst_slot, " is out of range: the cache has ", dg.num_slots));
  }
  if (src_slot >= sg.num_slots) {
    return refuse(LLM_PARAM_INVALID,
                  words("source batch index ", src_slot, " is out of range: the cache has ", sg.num_slots));
  }
  if (offset >= dg.slot_size || offset >= sg.slot_size) {
    return refuse(LLM_PARAM_INVALID, words("offset ", offset, " is not below the slot size ",
                                           std::min(dg.slot_size, sg.slot_size)));
  }
  const uint64_t room = std::min(dg.slot_size, sg.slot_size) - offset;
  uint64_t len = room;
  if (size >= 0) {
    len = static_cast<uint64_t>(size);
  } else if (dg.slot_size != sg.slot_size) {
    // "the whole slot" is ambiguous
    return refuse(LLM_PARAM_INVALID, words("size -1 needs equal slot sizes; destination ", dg.slot_size,
                                           " bytes, source ", sg.slot_size));
  }
  if (len == 0 || len > room) {
    return refuse(LLM_PARAM_INVALID,
                  words("size ", len, " does not fit: ", room, " bytes from offset ", offset, " to the slot's end"));
  }
  if (&dst == &src && dst_slot == src_slot) return LLM_SUCCESS;  // copying a range onto itself
  for (size_t t = 0; t < dst.addrs.size(); ++t) {
    out.push_back({dst.addrs[t] + dst_slot * dg.slot_size + offset,
                   src.addrs[t] + src_slot * sg.slot_size + offset, len});
  }
  return LLM_SUCCESS;
}

Status plan_copy_blocks(const CacheEntry &dst, const CacheEntry &src, const BlockPairs &pairs,
                        std::vector<CopySegment> &out) {
  const Geometry &dg = dst.geometry;
  const Geometry &sg = src.geometry;
  if (dst.addrs.size() != src.addrs.size()) {
    return refuse(LLM_PARAM_INVALID, words("the destination has ", dst.addrs.size(), " tensors, the source ",
                                           src.addrs.size()));
  }
  if (dg.slot_size != sg.slot_size) {
    return refuse(LLM_PARAM_INVALID,
                  words("block sizes differ: destination ", dg.slot_size, " bytes, source ", sg.slot_size));
  }
  for (const auto &pair : pairs) {
    if (pair.first >= sg.num_slots) {
      return refuse(LLM_PARAM_INVALID,
                    words("source block ", pair.first, " is out of range: the cache has ", sg.num_slots, " blocks"));
    }
    if (pair.second >= dg.num_slots) {
      return refuse(LLM_PARAM_INVALID, words("destination block ", pair.second,
                                             " is out of range: the cache has ", dg.num_slots, " blocks"));
    }
  }
  Status st = check_block_destinations(pairs, &dst == &src);
  if (st != LLM_SUCCESS) return st;
  const uint64_t block = sg.slot_size;
  for (const BlockRun &run : merge_block_runs(pairs)) {
    for (size_t t = 0; t < dst.addrs.size(); ++t) {
      out.push_back({dst.addrs[t] + run.dst * block, src.addrs[t] + run.src * block, run.count * block});
    }
  }
  return LLM_SUCCESS;
}

namespace {

// Copies its segments; every worker of one request settles result slot 0.
void copy_shard(const std::shared_ptr<Request> &request, const std::vector<CopySegment> &shard) {
  for (const CopySegment &seg : shard) {
    for (uint64_t done = 0; done < seg.len; done += kChunk) {
      if (request->cancel_requested()) {
        request->release(0, request->cancel_reason(), true);
        return;
      }
      std::memcpy(seg.dst + done, seg.src + done, std::min(kChunk, seg.len - done));
    }
  }
  request->release(0, LLM_SUCCESS);
}

// Queues the segments on a stream of `device` (in chunks, looking for a
// cancellation between them) and waits for them; the kind of each copy
// follows which side is device memory.
void copy_on_device(const std::shared_ptr<Request> &request, const std::vector<CopySegment> &segments,
                    const cuda::Device &device, bool dst_on_device, bool src_on_device) {
  std::string why;
  cuda::CUstream stream = device.take_stream(why);
  if (stream == nullptr) {
    request->release(0, LLM_FAILED, true, "copy to or from device memory: " + why);
    return;
  }
  const cuda::Driver &d = device.driver();
  auto ptr = [](const uint8_t *p) { return static_cast<cuda::CUdeviceptr>(reinterpret_cast<uintptr_t>(p)); };
  cuda::CUresult r = cuda::CUDA_SUCCESS;
  Status cancelled = LLM_SUCCESS;
  uint64_t queued = 0;
  for (const CopySegment &seg : segments) {
    for (uint64_t done = 0; done < seg.len && r == cuda::CUDA_SUCCESS; done += kChunk) {
      const size_t n = static_cast<size_t>(std::min(kChunk, seg.len - done));
      if (dst_on_device && src_on_device) {
        r = d.cuMemcpyDtoDAsync(ptr(seg.dst + done), ptr(seg.src + done), n, stream);
      } else if (dst_on_device) {
        r = d.cuMemcpyHtoDAsync(ptr(seg.dst + done), seg.src + done, n, stream);
      } else {
        r = d.cuMemcpyDtoHAsync(seg.dst + done, ptr(seg.src + done), n, stream);
      }
      // Every kDeviceBatch bytes: wait, then stop here if the request was cancelled.
      queued += n;
      if (r == cuda::CUDA_SUCCESS && queued >= kDeviceBatch) {
        queued = 0;
        r = d.cuStreamSynchronize(stream);
        if (r == cuda::CUDA_SUCCESS && request->cancel_requested()) cancelled = request->cancel_reason();
      }
      if (cancelled != LLM_SUCCESS) break;
    }
    if (r != cuda::CUDA_SUCCESS || cancelled != LLM_SUCCESS) break;
  }
  // The stream goes back idle: whatever was queued has finished.
  const cuda::CUresult synced = d.cuStreamSynchronize(stream);
  if (r == cuda::CUDA_SUCCESS) r = synced;
  device.give_stream(stream);
  if (cancelled != LLM_SUCCESS) {
    request->release(0, cancelled, true);
  } else if (r != cuda::CUDA_SUCCESS) {
    request->release(0, LLM_FAILED, true, "copy to or from device memory: " + device.describe(r));
  } else {
    request->release(0, LLM_SUCCESS);
  }
}

std::vector<std::vector<CopySegment>> split_into_shards(std::vector<CopySegment> segments, size_t workers) {
  uint64_t total = 0;
  for (const CopySegment &seg : segments) total += seg.len;
  const size_t count = static_cast<size_t>(std::clamp<uint64_t>(total / kShardMin, 1, workers));
  std::vector<std::vector<CopySegment>> shards(1);
  if (count == 1) {
    shards[0] = std::move(segments);
    return shards;
  }
  const uint64_t share = (total + count - 1) / count;
  uint64_t filled = 0;
  for (CopySegment seg : segments) {
    while (seg.len > 0) {
      const uint64_t take = std::min(seg.len, share - filled);
      shards.back().push_back({seg.dst, seg.src, take});
      seg.dst += take;
      seg.src += take;
      seg.len -= take;
      filled += take;
      if (filled == share) {
        shards.emplace_back();
        filled = 0;
      }
    }
  }
  if (shards.back().empty()) shards.pop_back();
  return shards;
}

}  // namespace

void run_local_copy(WorkerPool &pool, const std::shared_ptr<Request> &request, std::vector<CopySegment> segments,
                    std::shared_ptr<CacheEntry> dst, std::shared_ptr<CacheEntry> src) {
  if (dst->device || src->device) {
    request->hold();
    auto job = [request, segments = std::move(segments), dst, src] {
      copy_on_device(request, segments, dst->device ? *dst->device : *src->device, dst->device != nullptr,
                     src->device != nullptr);
    };
    if (!pool.submit(std::move(job))) request->release(0, LLM_ENGINE_FINALIZED, true);
    request->release(0, LLM_SUCCESS);
    return;
  }
  auto pins = std::make_shared<std::pair<std::shared_ptr<CacheEntry>, std::shared_ptr<CacheEntry>>>(dst, src);
  for (auto &shard : split_into_shards(std::move(segments), pool.size())) {
    request->hold();
    auto job = [request, pins, shard = std::move(shard)] { copy_shard(request, shard); };
    if (!pool.submit(std::move(job))) request->release(0, LLM_ENGINE_FINALIZED, true);
  }
  request->release(0, LLM_SUCCESS);
}

}  // namespace datadist
