#include "transport/paths/ucx/ucx_data_path.h"

#include <unistd.h>

#include <chrono>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "device/cuda_driver.h"
#include "log.h"
#include "transport/paths/ucx/ucx_kind.h"

namespace datadist {

namespace {

// The posts of one operation (its gets or puts, a flush, the posting
// thread's hold): it ends once each has, with the first failure.
struct Countdown {
  std::mutex mu;
  size_t left = 0;
  int status = 0;
  std::string why;
  // One post ended with `st`: true for the last.
  bool done(int st, const std::string &words) {
    std::lock_guard<std::mutex> lock(mu);
    if (st != 0 && status == 0) {
      status = st;
      why = words;
    }
    return --left == 0;
  }
};

}  // namespace

void UcxDataPath::start(PathHost &host, LinkFailer fail) {
  DataPath::start(host, fail);
  fail_ = fail;
  peer_->on_error(std::move(fail));
  if (direct_) book_ = std::make_unique<ucx::GrantBook>(host.messenger(), direct_rma_ == DATADIST_UCX_RMA_DIRECT);
}

void UcxDataPath::running() {
  // The initiator says first whether it asks for grants (ucx_grants.h).
  if (initiator_) host_->messenger()(ucx::want_grants_message(direct_rma_, ::getpid()));
}

std::shared_ptr<ucx::Grantor> UcxDataPath::grantor() const {
  std::lock_guard<std::mutex> lock(grantor_mu_);
  return grantor_;
}

bool UcxDataPath::takes(const std::vector<uint8_t> &body, bool &ok) {
  const uint32_t kind = ucx::grant_message_kind(body.data(), body.size());
  if (kind == 0) return false;
  switch (kind) {
    case ucx::kWantGrants: {
      int rma = 0;
      pid_t pid = 0;
      ok = ucx::read_want_grants(body.data(), body.size(), rma, pid);
      if (!ok) return true;
      if (!initiator_) host_->messenger()(ucx::want_grants_message(direct_rma_, ::getpid()));
      // Access "owner" here, or a peer that asks for none: this end serves.
      if (!grants_ || rma == DATADIST_UCX_RMA_NONE) return true;
      std::shared_ptr<ucx::Grantor> granting;
      {
        std::lock_guard<std::mutex> lock(grantor_mu_);
        if (grantor_) {
          ok = false;  // asked once a link
          return true;
        }
        grantor_ = std::make_shared<ucx::Grantor>(peer_->worker(), host_->registry(), host_->messenger(), rma, pid);
        granting = grantor_;
      }
      std::string why;
      if (!granting->start(why)) {
        log_warning("link to cluster " + std::to_string(host_->peer_id()) + ": the peer is granted no cache over UCX (" +
                    why + "); this end serves its operations");
      }
      return true;
    }
    case ucx::kRevoked:
    case ucx::kTableTaken: {
      const std::shared_ptr<ucx::Grantor> granting = grantor();
      ok = granting != nullptr && granting->take_answer(body.data(), body.size());
      return true;
    }
    default:
      // A grant or a revocation: only for an end that asked.
      ok = book_ != nullptr && book_->take(body.data(), body.size());
      return true;
  }
}

bool UcxDataPath::move(bool write, const PlannedFrame &planned, const std::shared_ptr<cuda::Device> &device,
                       const Settle &settle) {
  // Host memory here, a cache named by id or by a model's blocks key under
  // a grant that stands.
  if (!book_ || device || (planned.target.flags & (wire::kReleaseKey | wire::kPathTrailer)) != 0) return false;
  bool revoked = false;
  std::shared_ptr<ucx::HeldGrant> grant = book_->enter(planned.target, &revoked);
  if (revoked) found_revoked_.fetch_add(1, std::memory_order_relaxed);
  if (!grant) return false;
  ResolvedTarget target;
  Status st = llm_datadist::LLM_SUCCESS;
  wire::Request req;
  const Granted granted = resolve_granted(planned, grant->cache, req, target, st);
  // This end's memory as UCX's mappings (its registered caches).
  std::vector<std::shared_ptr<ucx::Mapping>> mine;
  std::string why;
  if (granted == Granted::kNotHere ||
      (granted == Granted::kRanges && !ucx::keys_for(direct_->worker(), host_->registry(), planned.local, mine, why))) {
    book_->leave(grant);
    return false;  // the owner serves it (and says what it cannot)
  }
  if (granted == Granted::kRefused) {
    book_->leave(grant);
    settle(st, "refused here under the peer's grant of its cache, nothing moved: " + target.why);
    return true;
  }
  // One get or put per tensor of the peer's, each range with this end's mapping.
  std::map<size_t, std::vector<datadist_ucx_range>> by_tensor;
  size_t t = 0;
  for (size_t i = 0; i < target.iov.size(); ++i) {
    const auto theirs = reinterpret_cast<uintptr_t>(target.iov[i].iov_base);
    const auto local = reinterpret_cast<uintptr_t>(planned.local[i].iov_base);
    const uint64_t length = target.iov[i].iov_len;
    t = grant->cache->tensor_holding(theirs, length, t);
    datadist_ucx_mem *mem = nullptr;
    for (const auto &m : mine) {
      if (m->holds(local, length)) mem = m->mem();
    }
    if (t == grant->cache->addrs.size() || mem == nullptr) {
      book_->leave(grant);
      return false;
    }
    by_tensor[t].push_back({local, theirs, length, mem});
  }
  struct Moving : Countdown {
    std::shared_ptr<ucx::HeldGrant> grant;
    std::vector<std::shared_ptr<ucx::Mapping>> mine;  // this end's memory stays mapped until UCX is done
    Settle settle;
    bool write = false;
    uint64_t bytes = 0;
  };
  auto moving = std::make_shared<Moving>();
  moving->grant = grant;
  moving->mine = std::move(mine);
  moving->settle = settle;
  moving->write = write;
  moving->bytes = req.total_bytes;
  auto finish = [this, moving](int status, const std::string &words) {
    if (!moving->done(status, words.empty() && status != 0 ? direct_->worker()->describe(status) : words)) return;
    // Out of the grant (its puts flushed) before anyone hears of it.
    book_->leave(moving->grant);
    if (moving->status != 0) {
      // The ranges were checked against the grant: what fails is reaching
      // the peer (its process gone, or its endpoint), so the link fails.
      const std::string why = std::string("UCX could not ") + (moving->write ? "write into" : "read out of") +
                              " the peer's granted cache: " + moving->why;
      moving->settle(llm_datadist::LLM_LINK_FAILED, why);
      if (fail_) fail_(why);
      return;
    }
    one_sided_ops_.fetch_add(1, std::memory_order_relaxed);
    (moving->write ? one_sided_written_ : one_sided_read_).fetch_add(moving->bytes, std::memory_order_relaxed);
    moving->settle(llm_datadist::LLM_SUCCESS, {});
  };
  // The puts, then a flush (done once they landed at the peer), or the
  // gets; and the posting thread's hold. Posted here where the move runs
  // here (data_path.h): a shared-memory transport copies inside the post.
  moving->left = by_tensor.size() + (write ? 1 : 0) + 1;
  auto post = [this, write, grant, by_tensor = std::move(by_tensor), finish]() {
    std::string why;
    bool ok = true;
    size_t posted = 0;
    for (const auto &[tensor, ranges] : by_tensor) {
      ok = write ? direct_->put(grant->keys[tensor], ranges, finish, why)
                 : direct_->get(grant->keys[tensor], ranges, finish, why);
      if (!ok) break;
      ++posted;
    }
    if (ok && write && !direct_->flush(finish, why)) ok = false;
    if (!ok) {
      // The posts never made, and the flush, end here.
      for (size_t j = posted; j < by_tensor.size(); ++j) finish(-1, why);
      if (write) finish(-1, why);
    }
    finish(0, {});
  };
  if (moves_here(write, req.total_bytes, planned) || !host_->io_loop().run_blocking(post)) post();
  return true;
}

int UcxDataPath::device_by_reference() const {
  // Where UCX reaches device memory it moves it; else the next path says.
  return peer_->worker()->reaches_device() ? 0 : -1;
}

Carry UcxDataPath::carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
                         Carried &out) {
  if ((device != nullptr && !peer_->worker()->reaches_device()) || !exports_ok) return Carry::kNext;
  std::vector<std::shared_ptr<ucx::Mapping>> keys;
  std::string why;
  if (!ucx::keys_for(peer_->worker(), host_->registry(), planned.local, keys, why)) {
    if (!unmapped_logged_.exchange(true)) {
      log_warning("link to cluster " + std::to_string(host_->peer_id()) + ": an operation goes inline, not by UCX: " +
                  why);
    }
    return Carry::kInline;
  }
  if (body_bytes + sizeof(wire::PathPart) + ucx::key_table_bytes(keys) > wire::kMaxBodyBytes) return Carry::kInline;
  ucx::encode_keys(keys, out.trailer);
  out.trailer_path = ucx::UcxKind::kId;
  out.may_resend = true;  // for a peer whose memory is a device's
  frames_.fetch_add(1, std::memory_order_relaxed);
  return Carry::kCarries;
}

void UcxDataPath::refused(const std::string &why) {
  (void)why;  // the peer's memory is a device's, which UCX does not reach there
  fallbacks_.fetch_add(1, std::memory_order_relaxed);
}

bool UcxDataPath::serves(const wire::Request &req) const {
  return (req.target.flags & wire::kPathTrailer) != 0 && req.trailer_path == ucx::UcxKind::kId;
}

std::string UcxDataPath::read_trailer(const wire::Request &req, std::shared_ptr<const void> &view) const {
  // UCX moves at most a frame's worth of bytes per frame.
  if (req.total_bytes > wire::kMaxFrameData) return "ranges exceed the frame limit";
  auto keys = std::make_shared<ucx::KeyTable>();
  std::string problem = ucx::decode_keys(req.trailer, req.segments, *keys);
  if (problem.empty()) view = std::move(keys);
  return problem;
}

void UcxDataPath::serve(std::shared_ptr<ServedFrame> frame) {
  const wire::Request &req = frame->req;
  const bool write = frame->write;
  ResolvedTarget &target = frame->target;
  // This end's memory as UCX's mappings. Where it cannot be had (device
  // memory this UCX does not reach), the initiator sends the frame again
  // inline: nothing has moved.
  std::vector<std::shared_ptr<ucx::Mapping>> mine;
  std::vector<datadist_ucx_mem *> mems(target.iov.size(), nullptr);
  std::string unmapped;
  bool mapped = true;
  if (target.entry) {
    mapped = ucx::local_maps(peer_->worker(), *target.entry, target.iov, mine, mems, unmapped);
  } else if (target.device) {
    mapped = false;
    unmapped = "device memory named by address";
  }
  // The CUDA transports copy on this thread too.
  if (mapped && target.device) mapped = target.device->make_current(unmapped);
  if (!mapped) {
    frame->done(Moved::inline_instead("this end's UCX cannot move its memory: " + unmapped));
    return;
  }
  // One get or put per key: this end's ranges (checked by the link)
  // against the initiator's, which the key bounds.
  const auto &keys = *std::static_pointer_cast<const ucx::KeyTable>(frame->view);
  std::vector<std::vector<datadist_ucx_range>> by_key(keys.keys.size());
  for (size_t i = 0; i < req.segments.size(); ++i) {
    by_key[keys.segment_key[i]].push_back({static_cast<uint64_t>(reinterpret_cast<uintptr_t>(target.iov[i].iov_base)),
                                          req.segments[i].addr, req.segments[i].length, mems[i]});
  }
  struct Posted : Countdown {
    std::shared_ptr<ServedFrame> frame;  // this end's memory, alive until UCX is done with it
    std::vector<std::shared_ptr<ucx::Mapping>> mine;  // and its mappings
  };
  auto posted = std::make_shared<Posted>();
  posted->frame = frame;
  posted->mine = std::move(mine);
  // Ends the frame once every get (or every put and the flush) is done.
  auto finish = [this, posted](int status, const std::string &why) {
    if (!posted->done(status, why)) return;
    const ServedFrame &f = *posted->frame;
    if (posted->status != 0) {
      f.done(Moved::refusal(llm_datadist::LLM_FAILED,
                            std::string("UCX could not ") +
                                (f.write ? "read the initiator's memory: " : "write the initiator's memory: ") +
                                (posted->why.empty() ? peer_->worker()->describe(posted->status) : posted->why)));
      return;
    }
    bytes_served_.fetch_add(f.req.total_bytes, std::memory_order_relaxed);
    f.done(Moved{});
  };
  size_t posts = 0;
  for (const auto &ranges : by_key) posts += ranges.empty() ? 0 : 1;
  posted->left = posts + (write ? 0 : 1) + 1;  // the gets or puts, the flush, and this thread's hold
  std::string why;
  bool ok = true;
  for (size_t k = 0; k < by_key.size() && ok; ++k) {
    if (by_key[k].empty()) continue;
    ok = write ? peer_->get(keys.packed[k], by_key[k], finish, why)
               : peer_->put(keys.packed[k], by_key[k], finish, why);
    if (!ok) {
      // This post and those never tried end here.
      size_t never = 0;
      for (size_t j = k; j < by_key.size(); ++j) never += by_key[j].empty() ? 0 : 1;
      for (size_t j = 0; j < never; ++j) finish(-1, why);
      if (!write) finish(-1, why);
    }
  }
  if (ok && !write && !peer_->flush(finish, why)) finish(-1, why);
  finish(0, {});
}

void UcxDataPath::counters(std::map<std::string, uint64_t> &out) const {
  out["ucx_one_sided_ops"] += one_sided_ops_.load(std::memory_order_relaxed);
  out["ucx_one_sided_bytes_written"] += one_sided_written_.load(std::memory_order_relaxed);
  out["ucx_one_sided_bytes_read"] += one_sided_read_.load(std::memory_order_relaxed);
  out["grants_held"] += book_ ? book_->held() : 0;
  out["grants_found_revoked"] += found_revoked_.load(std::memory_order_relaxed);
  out["ucx_reach"] += static_cast<uint64_t>(direct_rma_);  // NONE without a direct endpoint
  if (const std::shared_ptr<ucx::Grantor> granting = grantor()) granting->counters(out);
  out["ucx_frames"] += frames_.load(std::memory_order_relaxed);
  out["ucx_fallbacks"] += fallbacks_.load(std::memory_order_relaxed);
  out["ucx_bytes_served"] += bytes_served_.load(std::memory_order_relaxed);
  out["ucx_device"] += peer_->worker()->reaches_device() ? 1u : 0u;
}

void UcxDataPath::reap() {
  // Every UCX get or put of the link has ended (failed by the close) before
  // its operations settle, and before a new link to the peer moves bytes
  // (LinkManager reaps a peer's links that went down before it links again).
  // Closed here, not when the link fails: a forced close then, with the peer
  // frozen, left a relink's first get stalled (UCX 1.13.1, 1 run in 7).
  if (const std::shared_ptr<ucx::Grantor> granting = grantor()) granting->reap();
  if (book_) book_->clear();
  for (const auto &ep : {peer_, direct_}) {
    if (!ep) continue;
    ep->close();
    if (!ep->wait_idle(std::chrono::seconds(5))) {
      log_warning("link to cluster " + std::to_string(host_->peer_id()) +
                  ": UCX operations still pending after the close");
    }
  }
}

void UcxDataPath::zero_counters(std::map<std::string, uint64_t> &out) {
  for (const char *name : {"ucx_frames", "ucx_fallbacks", "ucx_bytes_served", "ucx_device", "ucx_one_sided_ops",
                           "ucx_one_sided_bytes_written", "ucx_one_sided_bytes_read", "ucx_reach"}) {
    out[name] += 0;
  }
}

}  // namespace datadist
