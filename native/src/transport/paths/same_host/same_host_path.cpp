#include "transport/paths/same_host/same_host_path.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "device/cuda_driver.h"
#include "device/staging.h"
#include "log.h"
#include "transport/io_loop.h"
#include "transport/paths/device/exports.h"

namespace datadist {

using llm_datadist::LLM_SUCCESS;

SameHostPath::SameHostPath(std::shared_ptr<same_host::CopyPool> pool, bool offered, bool peer_copies,
                           std::shared_ptr<same_host::PeerMemory> peer_memory, bool announce, bool one_sided,
                           pid_t peer_pid)
    : pool_(std::move(pool)),
      offered_(offered),
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
  std::lock_guard<std::mutex> lock(grants_mu_);
  devices_.clear();
}

bool SameHostPath::move(bool write, const PlannedFrame &planned, const std::shared_ptr<cuda::Device> &device,
                        const Settle &settle) {
  // A cache named by id or by a model's blocks key, under a grant that
  // stands (checked again in the slot below); device memory at either end
  // while this end's driver opens and copies it.
  const wire::Target &t = planned.target;
  if (!book_ || !moves_.load(std::memory_order_relaxed) ||
      (t.flags & (wire::kReleaseKey | wire::kPathTrailer)) != 0) {
    return false;
  }
  std::shared_ptr<const same_host::Grant> grant = book_->find(t);
  std::shared_ptr<same_host::GrantTable> table = grant ? book_->table() : nullptr;
  if (!table) return false;
  const bool theirs_device = !grant->exports.empty();
  if ((theirs_device || device) && !device_moves_.load(std::memory_order_relaxed)) return false;
  auto use = std::make_shared<same_host::GrantUse>(table, *grant);
  if (!use->entered()) {
    book_->drop(grant);  // revoked: the owner serves it, from what it holds now
    found_revoked_.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  ResolvedTarget target;
  Status st = LLM_SUCCESS;
  wire::Request req;
  switch (resolve_granted(planned, grant->cache, req, target, st)) {
    case Granted::kNotHere:
      return false;
    case Granted::kRefused:
      use.reset();
      settle(st, "refused here under the peer's grant of its cache, nothing moved: " + target.why);
      return true;
    case Granted::kRanges:
      break;
  }
  OneSided op{write, req.total_bytes, planned.local, std::move(use), settle};
  if (theirs_device) return move_on_stream(std::move(op), device, grant, req, target.iov);
  std::vector<wire::Segment> theirs;
  theirs.reserve(target.iov.size());
  for (const iovec &v : target.iov) theirs.push_back({reinterpret_cast<uintptr_t>(v.iov_base), v.iov_len});
  // A read whose whole operation is small, or a small write.
  const bool small = !device && moves_here(op.write, op.bytes, planned);
  auto job = [this, op = std::move(op), device, small, theirs = std::move(theirs)]() mutable {
    std::string why;
    const int error = device ? copy_staged(*device, op.mine, theirs, !op.write, why)
                             : same_host::copy_pairs(*peer_memory_, small ? nullptr : pool_.get(), op.mine, theirs,
                                                     !op.write);
    op.use.reset();  // out of the slot before anyone hears of it
    if (error == 0) {
      if (device) one_sided_staged_.fetch_add(op.bytes, std::memory_order_relaxed);
      settle_moved(op, LLM_SUCCESS, {});
      return;
    }
    if (error == ESRCH) {
      op.settle(llm_datadist::LLM_LINK_FAILED, "the peer's process is gone");
      if (fail_) fail_("the peer's process is gone");
      return;
    }
    if (error == -1) {
      settle_moved(op, llm_datadist::LLM_FAILED, "copying " + std::string(op.write ? "out of" : "into") +
                                                     " device memory here failed: " + why);
      return;
    }
    // The kernel refused (its ptrace rule changed) or the granted memory was
    // not there: this operation fails, and later ones go by frames.
    moves_.store(false, std::memory_order_relaxed);
    settle_moved(op, llm_datadist::LLM_FAILED, std::string("the one-sided copy ") + (op.write ? "into" : "out of") +
                                                   " the peer's cache failed: " + std::strerror(error));
  };
  // Copies of host memory that move here (data_path.h), whole on the
  // calling thread; the others, and those staged through a device's
  // buffers, on the loop's blocking pool (which splits kernel copies over
  // the copy threads).
  auto run = std::make_shared<decltype(job)>(std::move(job));  // one copy: its slot left once
  if (small || !host_->io_loop().run_blocking([run] { (*run)(); })) (*run)();
  return true;
}

void SameHostPath::settle_moved(OneSided &op, Status status, std::string why) {
  if (status == LLM_SUCCESS) {
    one_sided_ops_.fetch_add(1, std::memory_order_relaxed);
    (op.write ? one_sided_written_ : one_sided_read_).fetch_add(op.bytes, std::memory_order_relaxed);
  }
  op.settle(status, std::move(why));
}

std::shared_ptr<cuda::Device> SameHostPath::device_for(int ordinal, std::string &why) {
  std::lock_guard<std::mutex> lock(grants_mu_);
  auto it = devices_.find(ordinal);
  if (it != devices_.end()) return it->second;
  std::shared_ptr<cuda::Device> opened;
  if (ordinal < 0 || cuda::Device::open(ordinal, opened) != LLM_SUCCESS) {
    why = "no CUDA driver or no device " + std::to_string(ordinal) + " here";
    return nullptr;
  }
  devices_.emplace(ordinal, opened);
  return opened;
}

bool SameHostPath::open_grant(const same_host::Grant &grant, const std::shared_ptr<cuda::Device> &in,
                              std::vector<std::shared_ptr<cuda::PeerAllocation>> &out, std::string &why) {
  std::lock_guard<std::mutex> lock(grant.opened_mu);
  if (grant.opened_in != in->ordinal()) {
    // Each allocation once, however many tensors it holds.
    std::map<std::string, std::shared_ptr<cuda::PeerAllocation>> by_export;
    std::vector<std::shared_ptr<cuda::PeerAllocation>> opened;
    opened.reserve(grant.exports.size());
    for (const device_exports::DeviceExport &e : grant.exports) {
      std::shared_ptr<cuda::PeerAllocation> &one = by_export[device_exports::key(e, in->ordinal())];
      if (!one) one = device_exports::open(e, peer_memory_->pid(), in, why);
      if (!one) return false;
      opened.push_back(one);
    }
    grant.opened = std::move(opened);
    grant.opened_in = in->ordinal();
  }
  out = grant.opened;
  return true;
}

// The holder's stream copies of one operation: what they hold until the
// stream says they landed, and what then settles it (off the driver's thread).
struct SameHostPath::StreamMove {
  OneSided op;
  std::shared_ptr<cuda::Device> in;
  std::shared_ptr<const same_host::Grant> grant;
  // The allocations the copies run on: open until they have landed, whatever
  // becomes of the grant meanwhile.
  std::vector<std::shared_ptr<cuda::PeerAllocation>> opened;
  cuda::CUresult status = cuda::CUDA_SUCCESS;
};

bool SameHostPath::move_on_stream(OneSided op, const std::shared_ptr<cuda::Device> &device,
                                  const std::shared_ptr<const same_host::Grant> &grant, const wire::Request &req,
                                  const std::vector<iovec> &theirs) {
  // Opened in the context of this end's device, or (host memory here) of
  // the device the owner's memory is on; under the slot, so the owner's
  // allocations (and descriptors) stay while they are opened.
  std::string why;
  std::shared_ptr<cuda::Device> in = device ? device : device_for(grant->exports.front().ordinal, why);
  std::vector<std::shared_ptr<cuda::PeerAllocation>> opened;
  if (!in || !open_grant(*grant, in, opened, why)) {
    device_moves_.store(false, std::memory_order_relaxed);
    log_warning("the peer's (pid " + std::to_string(peer_memory_->pid()) +
                ") device memory cannot be opened here (" + why + "); it serves operations on it");
    return false;
  }
  // Each range inside the allocation its tensor's grant names, by the size
  // the driver opened.
  std::vector<cuda::Copy> copies;
  copies.reserve(theirs.size());
  for (size_t i = 0; i < theirs.size(); ++i) {
    const uint32_t tensor = req.ranges[i].tensor;
    const cuda::PeerAllocation &peer = *opened[tensor];
    const uint64_t offset = reinterpret_cast<uintptr_t>(theirs[i].iov_base) - grant->exports[tensor].base;
    const uint64_t n = theirs[i].iov_len;
    if (offset > peer.size() || n > peer.size() - offset) {
      log_warning("the peer's grant of cache " + std::to_string(grant->cache->id) +
                  " names memory past its allocation; it serves operations on it");
      book_->drop(grant);
      return false;
    }
    const auto mine = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(op.mine[i].iov_base));
    copies.push_back(op.write ? cuda::Copy{peer.base() + offset, mine, n, true, device != nullptr}
                              : cuda::Copy{mine, peer.base() + offset, n, device != nullptr, true});
  }
  auto moving = std::make_shared<StreamMove>();
  moving->op = std::move(op);
  moving->in = in;
  moving->grant = grant;
  moving->opened = std::move(opened);
  // The callback runs on the driver's thread: it leaves the slot (the
  // copies have landed) and hands the rest, whose release may call the
  // driver, to the blocking pool.
  const bool queued = in->copy_async(
      copies,
      [this, moving](cuda::CUresult status) mutable {
        moving->status = status;
        moving->op.use.reset();
        // Taken out of this callback, which keeps nothing: whichever thread
        // settles it lets go of it.
        auto landed = std::make_shared<std::shared_ptr<StreamMove>>(std::move(moving));
        if (!host_->io_loop().run_blocking([this, landed] { settle_stream(std::move(*landed)); })) {
          settle_stream(std::move(*landed));
        }
      },
      why);
  if (queued) return true;
  // Refused as queued: what was queued has run.
  moving->op.use.reset();
  device_moves_.store(false, std::memory_order_relaxed);
  settle_moved(moving->op, llm_datadist::LLM_FAILED, "the one-sided device copy was refused: " + why);
  return true;
}

void SameHostPath::settle_stream(std::shared_ptr<StreamMove> moving) {
  if (moving->status == cuda::CUDA_SUCCESS) {
    one_sided_device_.fetch_add(moving->op.bytes, std::memory_order_relaxed);
    settle_moved(moving->op, LLM_SUCCESS, {});
    return;
  }
  settle_moved(moving->op, llm_datadist::LLM_FAILED,
               std::string("the one-sided device copy ") + (moving->op.write ? "into" : "out of") +
                   " the peer's cache failed on the stream: " + moving->in->describe(moving->status));
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
  return peer_memory_ != nullptr && (req.target.flags & wire::kPathTrailer) == 0;
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
                                  : same_host::copy_pairs(*peer_memory_, pool_.get(), target.iov, req.segments,
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

bool SameHostPath::first_message(std::vector<uint8_t> &body) const {
  if (!announce_) return false;
  body = same_host::reaches_you_message();
  return true;
}

bool SameHostPath::takes(const std::vector<uint8_t> &body, bool &ok) {
  const uint32_t kind = same_host::message_kind(body.data(), body.size());
  if (kind == 0) return false;
  ok = offered_;
  if (!ok) return true;
  if (kind == same_host::kReachesYouMessage) {
    // The peer reached this end's memory: operations started here go as
    // same-host frames from now on, and the peer may be granted its caches.
    ok = body.size() == sizeof(kind);
    if (ok) {
      peer_copies_.store(true, std::memory_order_release);
      if (running_.load()) start_granting();
    }
    return true;
  }
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

void SameHostPath::counters(std::map<std::string, uint64_t> &out) const {
  out["staged_bytes_served"] += staged_bytes_served_.load(std::memory_order_relaxed);
  out["device_stream_waits"] += stream_waits_.load(std::memory_order_relaxed);
  out["one_sided_ops"] += one_sided_ops_.load(std::memory_order_relaxed);
  out["one_sided_bytes_written"] += one_sided_written_.load(std::memory_order_relaxed);
  out["one_sided_bytes_read"] += one_sided_read_.load(std::memory_order_relaxed);
  out["one_sided_device_bytes"] += one_sided_device_.load(std::memory_order_relaxed);
  out["one_sided_staged_bytes"] += one_sided_staged_.load(std::memory_order_relaxed);
  out["grants_held"] += book_ ? book_->held() : 0;
  out["grants_found_revoked"] += found_revoked_.load(std::memory_order_relaxed);
  if (const std::shared_ptr<same_host::Grantor> granting = grantor()) granting->counters(out);
}

void SameHostPath::zero_counters(std::map<std::string, uint64_t> &out) {
  for (const char *name : {"staged_bytes_served", "device_stream_waits", "one_sided_ops", "one_sided_bytes_written",
                           "one_sided_bytes_read", "one_sided_device_bytes", "one_sided_staged_bytes", "grants_held", "grants_found_revoked", "grants_given", "grants_revoked",
                           "grant_revoke_waits", "grants_quarantined", "grants_refused"}) {
    out[name] += 0;
  }
}

}  // namespace datadist
