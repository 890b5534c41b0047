#include "transport/paths/same_host/same_host_path.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "device/cuda_driver.h"
#include "device/staging.h"

namespace datadist {

using llm_datadist::LLM_SUCCESS;

SameHostPath::SameHostPath(bool offered, bool peer_copies, std::shared_ptr<same_host::PeerMemory> peer_memory,
                           bool announce)
    : offered_(offered),
      announce_(announce && peer_memory != nullptr),
      peer_copies_(offered && peer_copies),
      peer_memory_(std::move(peer_memory)) {}

Carry SameHostPath::carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok,
                          size_t body_bytes, Carried &out) {
  (void)planned;
  (void)exports_ok;
  (void)out;
  // Host memory only: no kernel copy reaches a device's (cuda_ipc_path.h).
  if (device != nullptr || !active() || body_bytes > wire::kMaxBodyBytes) return Carry::kNext;
  return Carry::kCarries;
}

bool SameHostPath::serves(const wire::Request &req) const {
  return peer_memory_ != nullptr && (req.target.flags & (wire::kDeviceSegments | wire::kUcxSegments)) == 0;
}

void SameHostPath::serve(std::shared_ptr<ServedFrame> frame) {
  const wire::Request &req = frame->req;
  const bool write = frame->write;
  ResolvedTarget &target = frame->target;
  // The peer's own ranges, checked before any byte moves: a write reads
  // them, a read writes them.
  if (!peer_memory_->mapped(req.segments, !write)) {
    frame->done(Moved::refusal(llm_datadist::LLM_PARAM_INVALID,
                               std::string("the initiator's ") + (write ? "source" : "destination") +
                                   " memory is not mapped " + (write ? "readable" : "writable") + " in its process",
                               "refused a same-host operation: "));
    return;
  }
  Moved moved;
  std::string why;
  if (target.device) staged_bytes_served_.fetch_add(req.total_bytes, std::memory_order_relaxed);
  const int error = target.device ? copy_staged(*target.device, target.iov, req.segments, write, why)
                                  : same_host::copy_pairs(*peer_memory_, host_->copy_pool(), target.iov, req.segments,
                                                          write);
  if (error == ESRCH) {
    moved.peer_gone = true;
  } else if (error == -1) {
    moved = Moved::refusal(llm_datadist::LLM_FAILED, std::string("copying ") + (write ? "into" : "out of") +
                                                         " device memory on the peer failed: " + why);
  } else if (error > 0) {
    // The peer's memory changed under the copy: its own operation fails.
    moved = Moved::refusal(llm_datadist::LLM_PARAM_INVALID, std::string("the same-host copy failed: ") +
                                                                std::strerror(error));
  }
  frame->done(std::move(moved));
}

int SameHostPath::copy_staged(const cuda::Device &device, const std::vector<iovec> &mine,
                              const std::vector<wire::Segment> &theirs, bool from_peer, std::string &why) {
  // The peer's segments, read (or written) as one stream in the order of `mine`.
  size_t index = 0;
  uint64_t offset = 0;
  int error = 0;
  auto copy = [&](uint8_t *buffer, size_t n) {
    std::vector<iovec> local, remote;
    for (size_t done = 0; done < n;) {
      if (index == theirs.size()) {
        error = EINVAL;
        return false;
      }
      const wire::Segment &seg = theirs[index];
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n - done, seg.length - offset));
      if (take > 0) {
        local.push_back({buffer + done, take});
        remote.push_back({reinterpret_cast<void *>(static_cast<uintptr_t>(seg.addr + offset)), take});
      }
      done += take;
      offset += take;
      if (offset == seg.length) {
        ++index;
        offset = 0;
      }
    }
    error = peer_memory_->copy(local.data(), remote.data(), local.size(), from_peer);
    return error == 0;
  };
  staging::Result result;
  {
    cuda::StreamCopier copier(device);
    if (from_peer) {
      result = staging::stage_in(device.staging_pool(true), copier, mine, staging::kDepth, copy);
    } else {
      result = staging::stage_out(device.staging_pool(false), copier, mine, staging::kDepth,
                                  [&](const uint8_t *bytes, size_t n) { return copy(const_cast<uint8_t *>(bytes), n); });
    }
    stream_waits_.fetch_add(copier.waits(), std::memory_order_relaxed);
  }
  if (result.outcome == staging::Outcome::kIoFailed) return error;
  if (result.outcome == staging::Outcome::kCopyFailed) {
    why = result.why;
    return -1;
  }
  return 0;
}

bool SameHostPath::first_frame(wire::FrameType &type) const {
  if (!announce_) return false;
  type = wire::FrameType::kPeerCopies;
  return true;
}

bool SameHostPath::takes(wire::FrameType type, const std::vector<uint8_t> &body, bool &ok) {
  if (type != wire::FrameType::kPeerCopies) return false;
  // The peer reached this end's memory: operations started here go as
  // same-host frames from now on.
  ok = offered_ && body.empty();
  if (ok) peer_copies_.store(true, std::memory_order_release);
  return true;
}

void SameHostPath::counters(std::map<std::string, uint64_t> &out) const {
  out["staged_bytes_served"] += staged_bytes_served_.load(std::memory_order_relaxed);
  out["device_stream_waits"] += stream_waits_.load(std::memory_order_relaxed);
}

void SameHostPath::zero_counters(std::map<std::string, uint64_t> &out) {
  for (const char *name : {"staged_bytes_served", "device_stream_waits"}) out[name] += 0;
}

}  // namespace datadist
