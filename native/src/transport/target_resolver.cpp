#include "transport/target_resolver.h"

#include <cstdint>
#include <string>

namespace datadist {

using llm_datadist::LLM_KV_CACHE_NOT_EXIST;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

namespace {

std::string describe(const wire::Target &t) {
  switch (t.kind) {
    case wire::kById:
      return "cache " + std::to_string(t.cache_id);
    case wire::kByKey:
      return "the cache of key (req_id " + std::to_string(t.req_id) + ", model_id " + std::to_string(t.model_id) +
             ", prefix_id " + std::to_string(t.prefix_id) + ")";
    case wire::kBlocksOfModel:
      return "the blocks cache of model " + std::to_string(t.model_id);
    default:
      return "target kind " + std::to_string(t.kind);
  }
}

// A range of the request, or (index SIZE_MAX) one of its bounds: the outermost
// ranges of an operation split over several frames.
std::string describe(size_t index, const wire::Range &r) {
  return (index == SIZE_MAX ? std::string("the operation's outermost range") : "range " + std::to_string(index)) +
         " (tensor " + std::to_string(r.tensor) + ", slot " +
         std::to_string(r.slot) + ", offset " + std::to_string(r.offset) + ", " + std::to_string(r.length) +
         " bytes)";
}

}  // namespace

Status find_target(const Registry &registry, const wire::Target &target, ResolvedTarget &out) {
  switch (target.kind) {
    case wire::kById:
      out.entry = target.cache_id > 0 ? registry.find(target.cache_id) : nullptr;
      break;
    case wire::kByKey: {
      CacheRef ref = registry.find_by_key({target.req_id, target.model_id, target.prefix_id});
      out.entry = ref.entry;
      out.bound_slot = ref.slot;
      break;
    }
    case wire::kBlocksOfModel:
      out.entry = registry.find_blocks(target.model_id);
      break;
    default:  // a raw address names no cache
      out.why = describe(target) + " names no cache";
      return LLM_PARAM_INVALID;
  }
  if (out.entry) return LLM_SUCCESS;
  out.why = describe(target) + " does not exist on the peer";
  return LLM_KV_CACHE_NOT_EXIST;
}

namespace {

// Raw addresses: every range must lie inside one remotely accessible tensor.
Status resolve_addresses(const Registry &registry, const wire::Request &request, ResolvedTarget &out) {
  std::vector<iovec> iov;
  iov.reserve(request.ranges.size());
  for (size_t i = 0; i < request.ranges.size(); ++i) {
    const wire::Range &r = request.ranges[i];
    if (r.tensor != 0 || r.slot != 0) {
      out.why = "raw-address " + describe(i, r) + " must name tensor 0, slot 0";
      return LLM_PARAM_INVALID;
    }
    auto entry = registry.find_by_address(static_cast<uintptr_t>(r.offset), r.length);
    if (!entry || !entry->remote_accessible) {
      out.why = "address range " + std::to_string(i) + " [" + std::to_string(r.offset) + ", +" +
                std::to_string(r.length) + ") is not inside one " +
                (entry ? "remotely accessible " : "") + "tensor registered on the peer";
      return LLM_PARAM_INVALID;
    }
    // Staged or not is decided per request: all of it in host memory, or
    // all of it in memory of the one device.
    if (i > 0 && entry->device != out.device) {
      out.why = "address range " + std::to_string(i) + " is in " + (entry->device ? "device" : "host") +
                " memory and an earlier one of the same request is not: one request names one kind of memory";
      return LLM_PARAM_INVALID;
    }
    out.device = entry->device;
    if (out.pins.empty() || out.pins.back() != entry) out.pins.push_back(entry);
    iov.push_back({reinterpret_cast<void *>(static_cast<uintptr_t>(r.offset)), r.length});
  }
  out.iov = std::move(iov);
  return LLM_SUCCESS;
}

}  // namespace

Status resolve_request(const Registry &registry, const wire::Request &request, ResolvedTarget &out) {
  if (request.target.kind == wire::kRawAddress) {
    if (!request.bounds.empty()) {
      out.why = "a raw-address request has no bounds";
      return LLM_PARAM_INVALID;
    }
    return resolve_addresses(registry, request, out);
  }
  Status st = find_target(registry, request.target, out);
  if (st != LLM_SUCCESS) return st;
  return resolve_in(request, out);
}

Status resolve_in(const wire::Request &request, ResolvedTarget &out) {
  const CacheEntry &entry = *out.entry;
  const Geometry &g = entry.geometry;
  const wire::Target &t = request.target;
  if (!entry.remote_accessible) {
    out.why = describe(t) + " is not remotely accessible (registered with remote_accessible=False)";
    return LLM_PARAM_INVALID;
  }
  if (t.expected_slot_size != 0 && t.expected_slot_size != g.slot_size) {
    out.why = "the block size differs: " + std::to_string(t.expected_slot_size) + " bytes here, " +
              std::to_string(g.slot_size) + " bytes in " + describe(t) + " on the peer";
    return LLM_PARAM_INVALID;
  }
  // Where a range lies in its tensor; otherwise why not.
  auto place = [&](size_t index, const wire::Range &r, uint64_t &start) {
    uint64_t slot, end;
    if (r.tensor >= entry.addrs.size()) {
      out.why = describe(index, r) + ": " + describe(t) + " has " + std::to_string(entry.addrs.size()) + " tensors";
      return false;
    }
    if (__builtin_add_overflow(r.slot, out.bound_slot, &slot) || __builtin_mul_overflow(slot, g.slot_size, &start) ||
        __builtin_add_overflow(start, r.offset, &start) || __builtin_add_overflow(start, r.length, &end) ||
        end > g.tensor_size) {
      out.why = describe(index, r) + " ends past the " + std::to_string(g.num_slots) + " slots (blocks) of " +
                std::to_string(g.slot_size) + " bytes of " + describe(t);
      return false;
    }
    if ((t.flags & wire::kWithinSlot) != 0 && !(r.offset < g.slot_size && r.length <= g.slot_size - r.offset)) {
      out.why = describe(index, r) + " crosses a slot boundary of " + describe(t) + " (slot size " +
                std::to_string(g.slot_size) + " bytes)";
      return false;
    }
    return true;
  };
  uint64_t start;
  for (const wire::Range &r : request.bounds) {
    if (!place(SIZE_MAX, r, start)) return LLM_PARAM_INVALID;
  }
  std::vector<iovec> iov;
  iov.reserve(request.ranges.size());
  for (size_t i = 0; i < request.ranges.size(); ++i) {
    const wire::Range &r = request.ranges[i];
    if (!place(i, r, start)) return LLM_PARAM_INVALID;
    iov.push_back({entry.addrs[r.tensor] + start, r.length});
  }
  out.iov = std::move(iov);
  out.pins.push_back(out.entry);
  out.device = entry.device;
  return LLM_SUCCESS;
}

Granted resolve_granted(const PlannedFrame &planned, std::shared_ptr<CacheEntry> cache, wire::Request &req,
                        ResolvedTarget &out, Status &status) {
  std::vector<wire::Stride> strides = planned.strides;
  for (wire::Stride &stride : strides) stride.segment_stride = 0;
  if (!wire::decode_request(wire::encode_request(planned.target, planned.ranges, planned.bounds, {}, strides), req)
           .empty()) {
    return Granted::kNotHere;
  }
  out.entry = std::move(cache);
  status = resolve_in(req, out);
  if (status != llm_datadist::LLM_SUCCESS) return Granted::kRefused;
  if (out.iov.size() != planned.local.size()) return Granted::kNotHere;
  for (size_t i = 0; i < out.iov.size(); ++i) {
    if (out.iov[i].iov_len != planned.local[i].iov_len) return Granted::kNotHere;
  }
  return Granted::kRanges;
}

}  // namespace datadist
