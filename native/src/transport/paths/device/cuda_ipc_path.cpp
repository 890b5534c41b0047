#include "transport/paths/device/cuda_ipc_path.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>

#include "device/cuda_driver.h"
#include "log.h"
#include "transport/io_loop.h"
#include "transport/paths/device/exports.h"
#include "transport/paths/same_host/same_host_kind.h"
#include "transport/paths/same_host/same_host_path.h"

namespace datadist {

namespace {

// The peer's allocations one link keeps open; past it, all are let go
// (each closes once no copy uses it) and opened again on need.
constexpr size_t kMaxOpened = 1024;

uint64_t ns_between(std::chrono::steady_clock::time_point from, std::chrono::steady_clock::time_point to) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count());
}

}  // namespace

// A frame whose copies are queued: what it holds until they land.
struct CudaIpcPath::Copies {
  std::shared_ptr<ServedFrame> frame;  // this end's memory (its pins), and the answer
  std::vector<std::shared_ptr<cuda::PeerAllocation>> opened;  // the peer's, opened here
  std::shared_ptr<cuda::Device> device;
  uint64_t fd_bytes = 0;
  bool on_device = false;  // this end's memory is device memory
  cuda::CUresult status = cuda::CUDA_SUCCESS;  // what the stream met; -1: refused as queued (`why`)
  std::string why;
  bool answered = false;  // by answer_landed()
  std::chrono::steady_clock::time_point queued;  // when copy_async was called
};

CudaIpcPath::CudaIpcPath(std::shared_ptr<SameHostPath> same_host, bool peer_opens_device, bool peer_takes_fds,
                         bool peer_big_frames)
    : same_host_(std::move(same_host)),
      peer_opens_device_(peer_opens_device),
      peer_takes_fds_(peer_opens_device && peer_takes_fds),
      peer_big_frames_(peer_opens_device && peer_big_frames) {}

CudaIpcPath::~CudaIpcPath() = default;

int CudaIpcPath::device_by_reference() const {
  return same_host_->active() && peer_opens_device_ && !exports_refused_.load(std::memory_order_acquire) ? 1 : 0;
}

uint64_t CudaIpcPath::device_frame_bytes() const {
  return peer_big_frames_ ? wire::kMaxTrailerFrameData : wire::kMaxFrameData;
}

Carry CudaIpcPath::carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
                         Carried &out) {
  if (device == nullptr || !same_host_->active() || body_bytes > wire::kMaxBodyBytes) return Carry::kNext;
  if (!exports_ok || !peer_opens_device_ || exports_refused_.load(std::memory_order_acquire)) return Carry::kNext;
  std::vector<device_exports::DeviceExport> exports;
  if (!export_all(*device, planned, exports) ||
      body_bytes + sizeof(wire::PathPart) + 2 * sizeof(uint32_t) + exports.size() * sizeof(device_exports::DeviceExport) >
          wire::kMaxBodyBytes) {
    return Carry::kNext;
  }
  out.trailer_path = same_host::SameHostKind::kId;
  out.trailer = device_exports::encode_table(exports);
  frames_.fetch_add(1, std::memory_order_relaxed);
  if (std::any_of(exports.begin(), exports.end(),
                  [](const device_exports::DeviceExport &e) { return e.kind == device_exports::kExportFd; })) {
    fd_frames_.fetch_add(1, std::memory_order_relaxed);
  }
  out.may_resend = true;
  return Carry::kCarries;
}

void CudaIpcPath::refused(const std::string &why) {
  exports_refused_.store(true, std::memory_order_release);
  fallbacks_.fetch_add(1, std::memory_order_relaxed);
  log_warning("link to cluster " + std::to_string(host_->peer_id()) + ": device memory goes staged: " + why);
}

bool CudaIpcPath::export_all(const cuda::Device &device, const PlannedFrame &planned,
                             std::vector<device_exports::DeviceExport> &exports) {
  std::vector<cuda::Export> found;
  for (const iovec &v : planned.local) {
    auto addr = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(v.iov_base));
    const uint64_t end = addr + v.iov_len;
    // Every export the range touches: one, or (memory of cuMemCreate)
    // several mapped side by side.
    while (addr < end) {
      const auto holds = [&](const cuda::Export &e) { return addr >= e.base && addr - e.base < e.size; };
      if (found.empty() || !holds(found.back())) {
        auto it = std::find_if(found.begin(), found.end(), holds);
        if (it != found.end()) {
          std::swap(*it, found.back());  // the next element is most likely in the same one
        } else {
          cuda::Export made;
          std::string why;
          if (found.size() == device_exports::kMaxExports || !device.export_at(addr, peer_takes_fds_, made, why)) return false;
          found.push_back(made);
        }
      }
      addr = found.back().base + found.back().size;
    }
  }
  exports.clear();
  for (const cuda::Export &e : found) exports.push_back(device_exports::to_wire(e, device.ordinal()));
  return true;
}

bool CudaIpcPath::serves(const wire::Request &req) const {
  return same_host_->peer_memory() != nullptr && (req.target.flags & wire::kPathTrailer) != 0 &&
         req.trailer_path == same_host::SameHostKind::kId;
}

// The frame's exports, and each segment's.
struct CudaIpcPath::Table {
  std::vector<device_exports::DeviceExport> exports;
  std::vector<uint32_t> segment_export;
};

std::string CudaIpcPath::read_trailer(const wire::Request &req, std::shared_ptr<const void> &view) const {
  auto table = std::make_shared<Table>();
  std::string problem = device_exports::decode_table(req.trailer, req.segments, table->exports, table->segment_export);
  if (problem.empty()) view = std::move(table);
  return problem;
}

bool CudaIpcPath::open_exports(const std::vector<device_exports::DeviceExport> &exports,
                               const std::shared_ptr<cuda::Device> &device,
                               std::vector<std::shared_ptr<cuda::PeerAllocation>> &out, std::string &why) {
  const same_host::PeerMemory &peer = *same_host_->peer_memory();
  // The driver refuses an open in the exporting process; so does this end.
  if (peer.pid() == ::getpid()) {
    why = "the initiator is this process";
    return false;
  }
  // Host memory of this end opens them in the exporting device's context.
  const std::shared_ptr<cuda::Device> in = device ? device : same_host_->device_for(exports.front().ordinal, why);
  if (!in) return false;
  std::lock_guard<std::mutex> lock(opened_mu_);
  out.clear();
  for (const device_exports::DeviceExport &e : exports) {
    std::string key = device_exports::key(e, in->ordinal());
    auto it = opened_.find(key);
    if (it == opened_.end()) {
      // A descriptor is taken out of the initiator's process, as the link's sockets were.
      std::shared_ptr<cuda::PeerAllocation> opened = device_exports::open(e, peer.pid(), in, why);
      if (!opened) return false;
      if (opened_.size() >= kMaxOpened) opened_.clear();
      it = opened_.emplace(std::move(key), std::move(opened)).first;
    }
    out.push_back(it->second);
  }
  return true;
}

void CudaIpcPath::serve(std::shared_ptr<ServedFrame> frame) {
  const auto began = std::chrono::steady_clock::now();
  const wire::Request &req = frame->req;
  const Table &table = *std::static_pointer_cast<const Table>(frame->view);
  const bool write = frame->write;
  ResolvedTarget &target = frame->target;
  std::vector<std::shared_ptr<cuda::PeerAllocation>> opened;
  {
    std::string why;
    if (!open_exports(table.exports, target.device, opened, why)) {
      frame->done(Moved::inline_instead("cannot open the initiator's device memory here: " + why));
      return;
    }
  }
  // Every segment inside the allocation it names, by the size of what was
  // opened (not what the initiator says), or running on into exports whose
  // bases follow that size without a gap, before any byte moves.
  std::vector<cuda::Copy> copies;
  uint64_t fd_bytes = 0;
  const auto following = [&](uint64_t base) -> int64_t {
    for (size_t e = 0; e < table.exports.size(); ++e) {
      if (table.exports[e].base == base) return static_cast<int64_t>(e);
    }
    return -1;
  };
  for (size_t i = 0; i < req.segments.size(); ++i) {
    const wire::Segment &seg = req.segments[i];
    uint32_t e = table.segment_export[i];
    uint64_t offset = seg.addr - table.exports[e].base;
    auto mine = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(target.iov[i].iov_base));
    const bool mine_device = target.device != nullptr;
    uint64_t left = seg.length;
    while (left > 0) {
      const cuda::PeerAllocation &peer = *opened[e];
      const int64_t next = offset < peer.size() && left > peer.size() - offset
                               ? following(table.exports[e].base + peer.size())
                               : -1;
      if (offset >= peer.size() || (left > peer.size() - offset && next < 0)) {
        frame->done(Moved::refusal(llm_datadist::LLM_PARAM_INVALID,
                                   "device segment " + std::to_string(i) + " [" + std::to_string(seg.addr) + ", +" +
                                       std::to_string(seg.length) + ") runs outside its exported allocation of " +
                                       std::to_string(peer.size()) + " bytes at " + std::to_string(table.exports[e].base),
                                   "refused a device operation: "));
        return;
      }
      const uint64_t n = std::min(left, peer.size() - offset);
      const uint64_t theirs = peer.base() + offset;
      copies.push_back(write ? cuda::Copy{mine, theirs, n, mine_device, true}
                             : cuda::Copy{theirs, mine, n, true, mine_device});
      if (peer.imported()) fd_bytes += n;
      mine += n;
      left -= n;
      if (left > 0) {
        e = static_cast<uint32_t>(next);
        offset = 0;
      }
    }
  }
  auto held = std::make_shared<Copies>();
  held->device = target.device ? target.device : opened.front()->device();
  held->opened = std::move(opened);
  held->fd_bytes = fd_bytes;
  held->on_device = target.device != nullptr;
  held->frame = std::move(frame);
  const uint64_t now = in_flight_.fetch_add(1, std::memory_order_relaxed) + 1;
  for (uint64_t most = in_flight_max_.load(std::memory_order_relaxed);
       now > most && !in_flight_max_.compare_exchange_weak(most, now, std::memory_order_relaxed);) {
  }
  frames_served_.fetch_add(1, std::memory_order_relaxed);
  const std::shared_ptr<cuda::Device> device = held->device;
  held->queued = std::chrono::steady_clock::now();
  serve_ns_.fetch_add(ns_between(began, held->queued), std::memory_order_relaxed);
  const auto queued = held->queued;
  std::string why;
  const bool ok = device->copy_async(
      copies, [this, held](cuda::CUresult status) mutable {
        held->status = status;
        land_ns_.fetch_add(ns_between(held->queued, std::chrono::steady_clock::now()), std::memory_order_relaxed);
        answer_landed(*held, true);  // at once where nothing in it calls the driver
        landed(std::move(held));  // the callback keeps nothing
      },
      why);
  enqueue_ns_.fetch_add(ns_between(queued, std::chrono::steady_clock::now()), std::memory_order_relaxed);
  if (ok) return;
  // Refused as queued: whatever was queued has run; answered on the pool.
  held->status = -1;
  held->why = std::move(why);
  landed(std::move(held));
}

bool CudaIpcPath::answer_landed(Copies &c, bool driver_thread) {
  if (c.status != cuda::CUDA_SUCCESS) return false;  // a failure is described by the driver
  const ServedFrame &frame = *c.frame;
  // A read that releases a key may let go of memory: not on the driver's thread.
  const bool releases = !frame.write && (frame.req.target.flags & wire::kReleaseKey) != 0;
  if (releases && driver_thread) return false;
  bytes_served_.fetch_add(frame.req.total_bytes, std::memory_order_relaxed);
  fd_bytes_served_.fetch_add(c.fd_bytes, std::memory_order_relaxed);
  answers_from_stream_.fetch_add(1, std::memory_order_relaxed);
  in_flight_.fetch_sub(1, std::memory_order_relaxed);
  c.answered = true;
  c.frame->done(Moved{});
  return true;
}

void CudaIpcPath::landed(std::shared_ptr<Copies> copies) {
  bool post;
  {
    std::lock_guard<std::mutex> lock(done_mu_);
    done_.push_back(std::move(copies));
    post = !answering_;
    answering_ = true;
  }
  if (!post) return;  // the job out takes this one too
  // The job holds only this pointer: the frames queued hold the link, which holds the path.
  if (host_->io_loop().run_blocking([this] { answer_landed_frames(); })) return;
  // The loop is stopping: answered here (letting go of memory may then fail in the driver).
  answer_landed_frames();
}

void CudaIpcPath::answer_landed_frames() {
  std::shared_ptr<void> keep;  // the link (and this path), until this returns
  for (;;) {
    std::vector<std::shared_ptr<Copies>> landed;
    {
      std::lock_guard<std::mutex> lock(done_mu_);
      if (done_.empty()) {
        answering_ = false;
        break;
      }
      landed.swap(done_);
    }
    for (const std::shared_ptr<Copies> &done : landed) {
      Copies &c = *done;
      if (!keep) keep = c.frame->keep;
      if (c.answered || answer_landed(c, false)) continue;
      // The copies failed, as queued (-1) or on the stream.
      const bool write = c.frame->write;
      if (c.status != -1) answers_from_stream_.fetch_add(1, std::memory_order_relaxed);
      in_flight_.fetch_sub(1, std::memory_order_relaxed);
      c.frame->done(Moved::refusal(llm_datadist::LLM_FAILED,
                                   std::string("copying ") + (write ? "into" : "out of") +
                                       (c.on_device ? " device" : " host") +
                                       " memory on the peer failed (through CUDA IPC): " +
                                       (c.status == -1 ? c.why : "the stream: " + c.device->describe(c.status))));
    }
    // `landed` lets go of the memory here, on this thread.
  }
}

void CudaIpcPath::counters(std::map<std::string, uint64_t> &out) const {
  const auto get = [](const std::atomic<uint64_t> &n) { return n.load(std::memory_order_relaxed); };
  size_t imports = 0;
  {
    std::lock_guard<std::mutex> lock(opened_mu_);
    for (const auto &entry : opened_) imports += entry.second->imported() ? 1 : 0;
  }
  out["ipc_frames"] += get(frames_);
  out["ipc_fallbacks"] += get(fallbacks_);
  out["ipc_bytes_served"] += get(bytes_served_);
  out["fd_frames"] += get(fd_frames_);
  out["fd_bytes_served"] += get(fd_bytes_served_);
  out["fd_imports"] += imports;
  out["device_frames_served"] += get(frames_served_);
  out["device_answers_from_stream"] += get(answers_from_stream_);
  out["device_frames_in_flight_max"] += get(in_flight_max_);
  out["device_serve_ns"] += get(serve_ns_);
  out["device_enqueue_ns"] += get(enqueue_ns_);
  out["device_land_ns"] += get(land_ns_);
}

void CudaIpcPath::reap() {
  // The peer's opened allocations close once no copy uses them.
  std::lock_guard<std::mutex> lock(opened_mu_);
  opened_.clear();
}

void CudaIpcPath::zero_counters(std::map<std::string, uint64_t> &out) {
  for (const char *name : {"ipc_frames", "ipc_fallbacks", "ipc_bytes_served", "fd_frames", "fd_bytes_served", "fd_imports", "device_frames_served", "device_answers_from_stream", "device_frames_in_flight_max", "device_serve_ns", "device_enqueue_ns", "device_land_ns"}) out[name] += 0;
}

}  // namespace datadist
