#include "transport/target_resolver.h"

namespace datadist {

using llm_datadist::LLM_KV_CACHE_NOT_EXIST;
using llm_datadist::LLM_PARAM_INVALID;
using llm_datadist::LLM_SUCCESS;

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
    case wire::kRawAddress:
      return LLM_PARAM_INVALID;  // names no cache
    default:
      return LLM_PARAM_INVALID;
  }
  return out.entry ? LLM_SUCCESS : LLM_KV_CACHE_NOT_EXIST;
}

namespace {

// Raw addresses: every range must lie inside one remotely accessible tensor.
Status resolve_addresses(const Registry &registry, const wire::Request &request, ResolvedTarget &out) {
  std::vector<iovec> iov;
  iov.reserve(request.ranges.size());
  for (const wire::Range &r : request.ranges) {
    if (r.tensor != 0 || r.slot != 0) return LLM_PARAM_INVALID;
    auto entry = registry.find_by_address(static_cast<uintptr_t>(r.offset), r.length);
    if (!entry || !entry->remote_accessible) return LLM_PARAM_INVALID;
    if (out.pins.empty() || out.pins.back() != entry) out.pins.push_back(entry);
    iov.push_back({reinterpret_cast<void *>(static_cast<uintptr_t>(r.offset)), r.length});
  }
  out.iov = std::move(iov);
  return LLM_SUCCESS;
}

}  // namespace

Status resolve_request(const Registry &registry, const wire::Request &request, ResolvedTarget &out) {
  if (request.target.kind == wire::kRawAddress) {
    if (!request.bounds.empty()) return LLM_PARAM_INVALID;
    return resolve_addresses(registry, request, out);
  }
  Status st = find_target(registry, request.target, out);
  if (st != LLM_SUCCESS) return st;
  const CacheEntry &entry = *out.entry;
  const Geometry &g = entry.geometry;
  const wire::Target &t = request.target;
  if (!entry.remote_accessible) return LLM_PARAM_INVALID;
  if (t.expected_slot_size != 0 && t.expected_slot_size != g.slot_size) return LLM_PARAM_INVALID;
  // Where a range lies in its tensor; false if anywhere outside.
  auto place = [&](const wire::Range &r, uint64_t &start) {
    uint64_t slot, end;
    if (r.tensor >= entry.addrs.size()) return false;
    if (__builtin_add_overflow(r.slot, out.bound_slot, &slot) || __builtin_mul_overflow(slot, g.slot_size, &start) ||
        __builtin_add_overflow(start, r.offset, &start) || __builtin_add_overflow(start, r.length, &end) ||
        end > g.tensor_size) {
      return false;
    }
    return (t.flags & wire::kWithinSlot) == 0 || (r.offset < g.slot_size && r.length <= g.slot_size - r.offset);
  };
  uint64_t start;
  for (const wire::Range &r : request.bounds) {
    if (!place(r, start)) return LLM_PARAM_INVALID;
  }
  std::vector<iovec> iov;
  iov.reserve(request.ranges.size());
  for (const wire::Range &r : request.ranges) {
    if (!place(r, start)) return LLM_PARAM_INVALID;
    iov.push_back({entry.addrs[r.tensor] + start, r.length});
  }
  out.iov = std::move(iov);
  out.pins.push_back(out.entry);
  return LLM_SUCCESS;
}

}  // namespace datadist
