#include "transport/paths/inline/inline_path.h"

#include <utility>

#include "device/cuda_driver.h"
#include "registry.h"

namespace datadist {

Carry InlinePath::carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
                        Carried &out) {
  (void)planned;
  (void)device;
  (void)exports_ok;
  (void)body_bytes;
  out.bytes_follow = true;
  return Carry::kCarries;
}

void InlinePath::take_data(FrameData &data, std::vector<iovec> to, std::shared_ptr<cuda::Device> device,
                           uint64_t bytes, std::function<bool(std::string failed)> done) {
  if (!device) {
    data.into(std::move(to), 0, [done = std::move(done)] { return done({}); });
    return;
  }
  staged_frames_.fetch_add(1, std::memory_order_relaxed);
  data.away([this, device = std::move(device), to = std::move(to), bytes, done = std::move(done)](net::Reader &in) {
    bool io_ok = true;
    std::string why;
    std::string failed;
    if (!receive_staged(in, *device, to, bytes, false, io_ok, why) && io_ok) {
      failed = "copying the data read into device memory failed: " + why;
    }
    return io_ok && done(std::move(failed));
  });
}

staging::Result InlinePath::send_device(const cuda::Device &device, const std::vector<iovec> &data, bool answer,
                                        const staging::Sink &sink) {
  if (!answer) staged_frames_.fetch_add(1, std::memory_order_relaxed);
  cuda::StreamCopier copier(device);
  staging::Result result = staging::stage_out(device.staging_pool(false), copier, data, staging::kDepth, sink);
  if (answer) device_stream_waits_.fetch_add(copier.waits(), std::memory_order_relaxed);  // a read's data
  return result;
}

void InlinePath::serve(std::shared_ptr<ServedFrame> frame) {
  ResolvedTarget &target = frame->target;
  const uint64_t bytes = frame->req.total_bytes;
  if (target.device) staged_bytes_served_.fetch_add(bytes, std::memory_order_relaxed);
  if (!frame->write) {
    // The data follow the answer, from this end's memory, pinned (and in
    // use) until sent.
    Moved moved;
    moved.data = std::move(target.iov);
    moved.data_bytes = bytes;
    moved.device = std::move(target.device);
    moved.pin = std::make_shared<ResolvedTarget>(std::move(target));
    frame->done(std::move(moved));
    return;
  }
  // The frame holds the memory (its target's pins) until the data are in.
  if (!target.device) {
    frame->data->into(target.iov, 0, [frame] {
      frame->done(Moved{});
      return true;
    });
    return;
  }
  frame->data->away([this, frame, bytes](net::Reader &in) {
    bool io_ok = true;
    std::string why;
    Moved moved;
    if (!receive_staged(in, *frame->target.device, frame->target.iov, bytes, true, io_ok, why) && io_ok) {
      moved = Moved::refusal(llm_datadist::LLM_FAILED, "copying into device memory on the peer failed: " + why);
    }
    if (!io_ok) return false;
    frame->done(std::move(moved));
    return true;
  });
}

bool InlinePath::receive_staged(net::Reader &in, const cuda::Device &device, const std::vector<iovec> &to,
                                uint64_t bytes, bool serving, bool &io_ok, std::string &why) {
  staging::Result result;
  {
    cuda::StreamCopier copier(device);
    result = staging::stage_in(device.staging_pool(true), copier, to, staging::kDepth,
                               [&](uint8_t *buffer, size_t n) { return in.read(buffer, n); });
    if (serving) device_stream_waits_.fetch_add(copier.waits(), std::memory_order_relaxed);
  }
  io_ok = result.outcome != staging::Outcome::kIoFailed;
  if (result.outcome != staging::Outcome::kCopyFailed) return true;
  why = result.why;
  io_ok = in.discard(bytes - result.moved);  // the frame's rest, so the next frame is read whole
  return false;
}

void InlinePath::counters(std::map<std::string, uint64_t> &out) const {
  const auto get = [](const std::atomic<uint64_t> &n) { return n.load(std::memory_order_relaxed); };
  out["staged_frames"] += get(staged_frames_);
  out["staged_bytes_served"] += get(staged_bytes_served_);
  out["device_stream_waits"] += get(device_stream_waits_);
}

void InlinePath::zero_counters(std::map<std::string, uint64_t> &out) {
  for (const char *name : {"staged_frames", "staged_bytes_served", "device_stream_waits"}) out[name] += 0;
}

}  // namespace datadist
