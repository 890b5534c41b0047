#include "transport/paths/ucx/ucx_data_path.h"

#include <chrono>
#include <mutex>
#include <utility>
#include <vector>

#include "device/cuda_driver.h"
#include "log.h"
#include "transport/paths/ucx/ucx_kind.h"

namespace datadist {

void UcxDataPath::start(PathHost &host, LinkFailer fail) {
  DataPath::start(host, fail);
  peer_->on_error(std::move(fail));
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
  struct Posted {
    std::shared_ptr<ServedFrame> frame;  // this end's memory, alive until UCX is done with it
    std::vector<std::shared_ptr<ucx::Mapping>> mine;  // and its mappings
    std::mutex mu;
    size_t left = 0;
    int status = 0;
    std::string why;
  };
  auto posted = std::make_shared<Posted>();
  posted->frame = frame;
  posted->mine = std::move(mine);
  // Ends the frame once every get (or every put and the flush) is done.
  auto finish = [this, posted](int status, const std::string &why) {
    {
      std::lock_guard<std::mutex> lock(posted->mu);
      if (status != 0 && posted->status == 0) {
        posted->status = status;
        posted->why = why;
      }
      if (--posted->left != 0) return;
    }
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
  peer_->close();
  if (!peer_->wait_idle(std::chrono::seconds(5))) {
    log_warning("link to cluster " + std::to_string(host_->peer_id()) + ": UCX operations still pending after the close");
  }
}

void UcxDataPath::zero_counters(std::map<std::string, uint64_t> &out) {
  for (const char *name : {"ucx_frames", "ucx_fallbacks", "ucx_bytes_served", "ucx_device"}) out[name] += 0;
}

}  // namespace datadist
