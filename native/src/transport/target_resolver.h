// The owner's side of a cache operation: turns a peer's request (a named
// cache and byte ranges) into local memory, checking every range before
// any byte moves. A request with any bad part is refused whole.
#ifndef DATADIST_TRANSPORT_TARGET_RESOLVER_H_
#define DATADIST_TRANSPORT_TARGET_RESOLVER_H_

#include <sys/uio.h>

#include <memory>
#include <string>
#include <vector>

#include "device/cuda_driver.h"
#include "registry.h"
#include "transport/planned_frame.h"
#include "transport/wire.h"

namespace datadist {

struct ResolvedTarget {
  std::shared_ptr<CacheEntry> entry;  // the named cache (none for raw addresses)
  uint64_t bound_slot = 0;
  std::vector<iovec> iov;             // one per range, in order
  std::vector<std::shared_ptr<CacheEntry>> pins;  // keep the memory alive while bytes move
  // An owner-served operation's hold on each pinned registered cache's
  // memory, which unregistering the cache waits for (taken by the link that
  // serves it).
  std::vector<std::shared_ptr<MemoryUse>> uses;
  std::string why;  // a refusal's reason, for the initiator
  // Set when `iov` are addresses of this device (the host never touches
  // them): their bytes move through staging buffers.
  std::shared_ptr<cuda::Device> device;
};

// Finds the cache a target names (LLM_KV_CACHE_NOT_EXIST if none).
Status find_target(const Registry &registry, const wire::Target &target, ResolvedTarget &out);

// find_target, then: remote access allowed, expected slot size, and every
// range inside its tensor (and inside one slot when asked); otherwise
// LLM_PARAM_INVALID, `out.iov` stays empty and `out.why` says what was wrong.
Status resolve_request(const Registry &registry, const wire::Request &request, ResolvedTarget &out);

// resolve_request's checks and ranges for the cache `out.entry` (slot
// `out.bound_slot` first) that a non-raw target of `request` named: a peer's
// cache as its grant describes it, say (its `addrs` the peer's).
Status resolve_in(const wire::Request &request, ResolvedTarget &out);

// One-sided moves: `planned` read as the owner reads its frame (strides
// unrolled, sizes bounded as on the wire) and checked by resolve_in against
// `cache`, the owner's cache as a grant describes it. kNotHere: not a frame
// to move so (it cannot be read so, or its ranges do not pair with this
// end's), and the owner serves it; kRefused: `status` and `out.why` say why.
// `req`: the frame as the owner reads it.
enum class Granted { kRanges, kRefused, kNotHere };
Granted resolve_granted(const PlannedFrame &planned, std::shared_ptr<CacheEntry> cache, wire::Request &req,
                        ResolvedTarget &out, Status &status);

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_TARGET_RESOLVER_H_
