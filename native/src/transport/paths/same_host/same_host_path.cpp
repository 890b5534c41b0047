#include "transport/paths/same_host/same_host_path.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "device/cuda_driver.h"
#include "device/staging.h"
#include "log.h"
#include "transport/io_loop.h"

namespace datadist {

using llm_datadist::LLM_SUCCESS;

SameHostPath::SameHostPath(bool offered, bool peer_copies, std::shared_ptr<same_host::PeerMemory> peer_memory,
                           bool announce, bool one_sided, pid_t peer_pid)
    : offered_(offered),
      announce_(announce && peer_memory != nullptr),
      peer_copies_(offered && peer_copies),
      peer_memory_(std::move(peer_memory)),
      one_sided_(offered && one_sided),
      peer_pid_(peer_pid) {
  if (one_sided_ && peer_memory_) book_ = std::make_unique<same_host::GrantBook>(peer_memory_->pid());
}

SameHostPath::~SameHostPath() { SameHostPath::reap(); }

void SameHostPath::start(PathHost &host, LinkFailer fail) {
  DataPath::start(host, fail);
  fail_ = std::move(fail);
}

void SameHostPath::running() {
  running_.store(true);
  if (peer_copies_.load()) start_granting();
}

void SameHostPath::start_granting() {
  if (!one_sided_ || peer_pid_ <= 0 || host_ == nullptr) return;
  std::shared_ptr<same_host::Grantor> granting;
  {
    std::lock_guard<std::mutex> lock(grants_mu_);
    if (grantor_) return;
    grantor_ = std::make_shared<same_host::Grantor>(host_->registry(), host_->messenger(), peer_pid_);
    granting = grantor_;
  }
  std::string why;
  if (!granting->start(why)) {
    log_warning("the peer (pid " + std::to_string(peer_pid_) + ") is granted no cache (" + why +
                "); this end serves its operations");
  }
}

std::shared_ptr<same_host::Grantor> SameHostPath::grantor() const {
  std::lock_guard<std::mutex> lock(grants_mu_);
  return grantor_;
}

void SameHostPath::reap() {
  if (const std::shared_ptr<same_host::Grantor> granting = grantor()) granting->reap();
  if (book_) book_->clear();
}

bool SameHostPath::move(bool write, const PlannedFrame &planned, const cuda::Device *device, const Settle &settle) {
  // Host memory on both ends, a cache named by id or by a model's blocks
  // key, under a grant that stands (checked again in the slot below).
  const wire::Target &t = planned.target;
  if (!book_ || device != nullptr || !moves_.load(std::memory_order_relaxed) ||
      (t.flags & (wire::kReleaseKey | wire::kDeviceSegments | wire::kUcxSegments)) != 0) {
    return false;
  }
  std::shared_ptr<const same_host::Grant> grant = book_->find(t);
  std::shared_ptr<same_host::GrantTable> table = grant ? book_->table() : nullptr;
  if (!table) return false;
  // The request as the owner would read it: strides unrolled, its sizes
  // bounded as on the wire.
  std::vector<wire::Stride> strides = planned.strides;
  for (wire::Stride &stride : strides) stride.segment_stride = 0;
  wire::Request req;
  if (!wire::decode_request(wire::encode_request(t, planned.ranges, planned.bounds, {}, strides), req).empty()) {
    return false;
  }
  auto use = std::make_shared<same_host::GrantUse>(table, *grant);
  if (!use->entered()) {
    book_->drop(grant);  // revoked: the owner serves it, from what it holds now
    return false;
  }
  ResolvedTarget target;
  target.entry = grant->cache;
  const Status st = resolve_in(req, target);
  if (st != LLM_SUCCESS) {
    use.reset();
    settle(st, "refused here under the peer's grant of its cache, nothing moved: " + target.why);
    return true;
  }
  if (target.iov.size() != planned.local.size()) return false;
  std::vector<wire::Segment> theirs;
  theirs.reserve(target.iov.size());
  for (size_t i = 0; i < target.iov.size(); ++i) {
    if (target.iov[i].iov_len != planned.local[i].iov_len) return false;
    theirs.push_back({reinterpret_cast<uintptr_t>(target.iov[i].iov_base), target.iov[i].iov_len});
  }
  const uint64_t bytes = req.total_bytes;
  auto job = [this, write, bytes, use, settle, mine = planned.local, theirs = std::move(theirs)]() mutable {
    const int error = same_host::copy_pairs(*peer_memory_, host_->copy_pool(), mine, theirs, !write);
    use.reset();  // out of the slot before anyone hears of it
    if (error == 0) {
      one_sided_ops_.fetch_add(1, std::memory_order_relaxed);
      (write ? one_sided_written_ : one_sided_read_).fetch_add(bytes, std::memory_order_relaxed);
      settle(LLM_SUCCESS, {});
      return;
    }
    if (error == ESRCH) {
      settle(llm_datadist::LLM_LINK_FAILED, "the peer's process is gone");
      if (fail_) fail_("the peer's process is gone");
      return;
    }
    // The kernel refused (its ptrace rule changed) or the granted memory was
    // not there: this operation fails, and later ones go by frames.
    moves_.store(false, std::memory_order_relaxed);
    settle(llm_datadist::LLM_FAILED, std::string("the one-sided copy ") + (write ? "into" : "out of") +
                                         " the peer's cache failed: " + std::strerror(error));
  };
  // Small copies on the calling thread; larger ones on the loop's blocking
  // pool, which splits them over the copy threads.
  if (bytes <= kMoveHereBytes || !host_->io_loop().run_blocking(job)) job();
  return true;
}

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
  if (type == wire::FrameType::kPathMessage) {
    const uint32_t kind = same_host::grant_message_kind(body.data(), body.size());
    if (kind == 0) return false;
    ok = offered_;
    if (!ok) return true;
    if (kind == same_host::kTableTakenMessage) {
      // The peer took this end's table (or could not): the descriptor goes.
      const std::shared_ptr<same_host::Grantor> granting = grantor();
      ok = granting != nullptr && granting->take_answer(body.data(), body.size());
      return true;
    }
    std::vector<uint8_t> answer;
    if (book_ != nullptr) {
      ok = book_->take(body.data(), body.size(), answer);
    } else if (kind == same_host::kGrantTableMessage) {
      // An end that does not move bytes itself takes no table: it says so.
      answer = same_host::table_taken_message(false);
    }
    if (ok && !answer.empty() && host_ != nullptr) host_->messenger()(std::move(answer));
    return true;
  }
  if (type != wire::FrameType::kPeerCopies) return false;
  // The peer reached this end's memory: operations started here go as
  // same-host frames from now on, and the peer may be granted its caches.
  ok = offered_ && body.empty();
  if (ok) {
    peer_copies_.store(true, std::memory_order_release);
    if (running_.load()) start_granting();
  }
  return true;
}

void SameHostPath::counters(std::map<std::string, uint64_t> &out) const {
  out["staged_bytes_served"] += staged_bytes_served_.load(std::memory_order_relaxed);
  out["device_stream_waits"] += stream_waits_.load(std::memory_order_relaxed);
  out["one_sided_ops"] += one_sided_ops_.load(std::memory_order_relaxed);
  out["one_sided_bytes_written"] += one_sided_written_.load(std::memory_order_relaxed);
  out["one_sided_bytes_read"] += one_sided_read_.load(std::memory_order_relaxed);
  out["grants_held"] += book_ ? book_->held() : 0;
  if (const std::shared_ptr<same_host::Grantor> granting = grantor()) granting->counters(out);
}

void SameHostPath::zero_counters(std::map<std::string, uint64_t> &out) {
  for (const char *name : {"staged_bytes_served", "device_stream_waits", "one_sided_ops", "one_sided_bytes_written",
                           "one_sided_bytes_read", "grants_held", "grants_given", "grants_revoked",
                           "grant_revoke_waits", "grants_quarantined", "grants_refused"}) {
    out[name] += 0;
  }
}

}  // namespace datadist
