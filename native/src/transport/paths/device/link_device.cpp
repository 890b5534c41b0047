// The device paths: CUDA IPC (the initiator exports its device memory, the
// owner opens it and copies) and staging (device memory moved through pinned
// host buffers, inline or by the same-host copy).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device/cuda_driver.h"
#include "device/staging.h"
#include "log.h"
#include "transport/link.h"
#include "transport/paths/same_host/same_host.h"
#include "transport/socket_util.h"

namespace datadist {

using llm_datadist::LLM_LINK_FAILED;
using llm_datadist::LLM_SUCCESS;
using wire::FrameHeader;
using wire::FrameType;

bool Link::export_all(const cuda::Device &device, const PlannedFrame &planned, bool fds,
                      std::vector<wire::DeviceExport> &exports) {
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
          if (found.size() == wire::kMaxExports || !device.export_at(addr, fds, made, why)) return false;
          found.push_back(made);
        }
      }
      addr = found.back().base + found.back().size;
    }
  }
  exports.clear();
  for (const cuda::Export &e : found) {
    wire::DeviceExport out{};
    if (e.fd >= 0) {
      const wire::DeviceFd fd{e.fd, 0, e.size, e.serial};
      std::memcpy(out.handle, &fd, sizeof(fd));
      out.kind = wire::kExportFd;
    } else {
      std::memcpy(out.handle, e.handle.reserved, sizeof(out.handle));
      out.kind = wire::kExportIpc;
    }
    out.base = e.base;
    out.ordinal = device.ordinal();
    exports.push_back(out);
  }
  return true;
}

bool Link::device_frames_by_reference() const {
  for (PathKind path : order_) {
    if (path == PathKind::kUcx) {
      if (ucx_ && ucx_->worker()->reaches_device()) return false;  // UCX moves them
    } else if (path == PathKind::kSameHost) {
      return peer_copies_.load(std::memory_order_acquire) && peer_opens_device_ &&
             !exports_refused_.load(std::memory_order_acquire);
    } else {
      return false;
    }
  }
  return false;
}

void Link::write_staged(Connection &conn, OutFrame frame) {
  const bool go_on = finish_staged(conn, frame);
  {
    std::lock_guard<std::mutex> lock(conn.mu);
    conn.busy = false;
    if (go_on && !conn.queue.empty()) arm_locked(conn);
  }
  end_work();
}

namespace {

// Zeros that keep a frame whole after its device copy failed mid-send.
constexpr size_t kPadBytes = 64 * 1024;

}  // namespace

bool Link::finish_staged(Connection &conn, OutFrame &frame) {
  const std::shared_ptr<cuda::Device> device = frame.device;  // outlives the copier and its pool buffers
  const uint64_t total = frame.header.data_len;
  bool header_out = false;
  // The header and body leave with the first chunk, once its copy has run.
  auto sink = [&](const uint8_t *bytes, size_t n) {
    iovec iov[3];
    size_t count = 0;
    if (!header_out) {
      iov[count++] = {&frame.header, sizeof(frame.header)};
      if (!frame.body.empty()) iov[count++] = {frame.body.data(), frame.body.size()};
    }
    iov[count++] = {const_cast<uint8_t *>(bytes), n};
    header_out = true;
    return net::writev_full(conn.fd, iov, count);
  };
  staging::Result result;
  {
    cuda::StreamCopier copier(*device);
    result = staging::stage_out(device->staging_pool(false), copier, frame.data, staging::kDepth, sink);
    if (frame.op_id == 0) device_stream_waits_.fetch_add(copier.waits(), std::memory_order_relaxed);  // a read's data
  }
  if (result.outcome == staging::Outcome::kDone) return after_send(frame, true);
  if (result.outcome == staging::Outcome::kIoFailed) return after_send(frame, false);
  const std::string why = "copying out of device memory failed: " + result.why;
  log_warning("link to cluster " + std::to_string(peer_id_) + ": " + why);
  if (frame.op_id == 0) {
    // The answer to a read: its status left with its header.
    if (header_out) {
      fail(LLM_LINK_FAILED, why + ", after part of a read's data was sent");
      return false;
    }
    OutFrame failed = answer(FrameType::kReadData, frame.header.op_id, llm_datadist::LLM_FAILED,
                             "copying out of device memory on the peer failed: " + result.why);
    std::vector<iovec> iov = frame_bytes(failed);
    return after_send(failed, net::writev_full(conn.fd, iov.data(), iov.size()));
  }
  // A write: it fails here. Once its header is out, the peer gets the frame
  // whole (zeros for the rest), and its answer cannot make it a success.
  fail_here(frame.op_id, llm_datadist::LLM_FAILED, why);
  if (!header_out) {
    mark(frame.op_id, true, true, llm_datadist::LLM_FAILED);
    return true;
  }
  const std::vector<uint8_t> zeros(static_cast<size_t>(std::min<uint64_t>(kPadBytes, total - result.moved)));
  bool ok = true;
  for (uint64_t left = total - result.moved; left > 0 && ok;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(left, zeros.size()));
    ok = net::write_full(conn.fd, zeros.data(), n);
    left -= n;
  }
  return after_send(frame, ok);
}

bool Link::receive_staged(net::Reader &in, const cuda::Device &device, const std::vector<iovec> &to, uint64_t bytes,
                          bool serving, bool &io_ok, std::string &why) {
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

int Link::peer_copy_staged(const cuda::Device &device, const std::vector<iovec> &mine,
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
    device_stream_waits_.fetch_add(copier.waits(), std::memory_order_relaxed);
  }
  if (result.outcome == staging::Outcome::kIoFailed) return error;
  if (result.outcome == staging::Outcome::kCopyFailed) {
    why = result.why;
    return -1;
  }
  return 0;
}

namespace {

// The peer's allocations one link keeps open; past it, all are let go
// (each closes once no copy uses it) and opened again on need.
constexpr size_t kMaxOpened = 1024;

}  // namespace

bool Link::open_exports(const std::vector<wire::DeviceExport> &exports, const std::shared_ptr<cuda::Device> &device,
                        std::vector<std::shared_ptr<cuda::PeerAllocation>> &out, std::string &why) {
  // The driver refuses an open in the exporting process; so does this end.
  if (peer_memory_->pid() == ::getpid()) {
    why = "the initiator is this process";
    return false;
  }
  std::lock_guard<std::mutex> lock(opened_mu_);
  std::shared_ptr<cuda::Device> in = device;
  if (!in) {
    if (!host_side_device_) {
      const int ordinal = exports.front().ordinal;
      if (ordinal < 0 || cuda::Device::open(ordinal, host_side_device_) != LLM_SUCCESS) {
        host_side_device_.reset();
        why = "no CUDA driver or no device " + std::to_string(ordinal) + " here";
        return false;
      }
    }
    in = host_side_device_;
  }
  out.clear();
  for (const wire::DeviceExport &e : exports) {
    std::string key(reinterpret_cast<const char *>(e.handle), sizeof(e.handle));
    key += ":" + std::to_string(e.kind) + ":" + std::to_string(in->ordinal());
    auto it = opened_.find(key);
    if (it == opened_.end()) {
      std::shared_ptr<cuda::PeerAllocation> opened;
      if (e.kind == wire::kExportFd) {
        // The initiator's descriptor, taken as the link's sockets were.
        wire::DeviceFd named{};
        std::memcpy(&named, e.handle, sizeof(named));
        const int fd = same_host::take_descriptor(peer_memory_->pid(), static_cast<uint32_t>(named.fd), why);
        if (fd < 0) return false;
        opened = cuda::PeerAllocation::import(in, fd, named.size, why);
      } else {
        opened = cuda::PeerAllocation::open(in, *reinterpret_cast<const cuda::CUipcMemHandle *>(e.handle), why);
      }
      if (!opened) return false;
      if (opened_.size() >= kMaxOpened) opened_.clear();
      it = opened_.emplace(std::move(key), std::move(opened)).first;
    }
    out.push_back(it->second);
  }
  return true;
}

namespace {

uint64_t ns_between(std::chrono::steady_clock::time_point from, std::chrono::steady_clock::time_point to) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(to - from).count());
}

}  // namespace

struct Link::DeviceCopies {
  std::shared_ptr<Link> link;
  Connection *conn = nullptr;
  uint64_t op_id = 0;
  bool write = false;
  bool on_device = false;  // this end's memory is device memory
  wire::Request req;
  // Alive until the copies have run: this end's memory, the peer's opened
  // allocations and the device.
  ResolvedTarget target;
  std::vector<std::shared_ptr<cuda::PeerAllocation>> opened;
  std::shared_ptr<cuda::Device> device;
  uint64_t fd_bytes = 0;
  cuda::CUresult status = cuda::CUDA_SUCCESS;  // what the stream met; -1: refused as queued (`why`)
  std::string why;
  bool answered = false;  // by answer_landed()
  std::chrono::steady_clock::time_point queued;  // when copy_async was called
};

void Link::serve_device_copy(Connection &conn, const FrameHeader &header, const wire::Request &req, bool write) {
  const auto began = std::chrono::steady_clock::now();
  ResolvedTarget target;
  Status st = resolve_in_group(req, target);
  std::vector<std::shared_ptr<cuda::PeerAllocation>> opened;
  if (st == LLM_SUCCESS) {
    std::string why;
    if (!open_exports(req.exports, target.device, opened, why)) {
      // Not a refusal of the transfer (group 0): the initiator sends the frame again inline.
      st = refuse_served(0, llm_datadist::LLM_FEATURE_NOT_ENABLED, target.why,
                         "cannot open the initiator's device memory here: " + why);
    }
  }
  // Every segment inside the allocation it names, by the size of what was
  // opened (not what the initiator says), or running on into exports whose
  // bases follow that size without a gap, before any byte moves.
  std::vector<cuda::Copy> copies;
  uint64_t fd_bytes = 0;
  const auto following = [&](uint64_t base) -> int64_t {
    for (size_t e = 0; e < req.exports.size(); ++e) {
      if (req.exports[e].base == base) return static_cast<int64_t>(e);
    }
    return -1;
  };
  for (size_t i = 0; st == LLM_SUCCESS && i < req.segments.size(); ++i) {
    const wire::Segment &seg = req.segments[i];
    uint32_t e = req.segment_export[i];
    uint64_t offset = seg.addr - req.exports[e].base;
    auto mine = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(target.iov[i].iov_base));
    const bool mine_device = target.device != nullptr;
    uint64_t left = seg.length;
    while (left > 0) {
      const cuda::PeerAllocation &peer = *opened[e];
      const int64_t next = offset < peer.size() && left > peer.size() - offset
                               ? following(req.exports[e].base + peer.size())
                               : -1;
      if (offset >= peer.size() || (left > peer.size() - offset && next < 0)) {
        st = refuse_served(req.target.group, llm_datadist::LLM_PARAM_INVALID, target.why,
                           "device segment " + std::to_string(i) + " [" + std::to_string(seg.addr) + ", +" +
                               std::to_string(seg.length) + ") runs outside its exported allocation of " +
                               std::to_string(peer.size()) + " bytes at " + std::to_string(req.exports[e].base),
                           "refused a device operation: ");
        break;
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
  if (st == LLM_SUCCESS && initiator_gone(conn)) return;
  if (st == LLM_SUCCESS) {
    // The copies counted as work of the link's until answered: a reap waits
    // for them, so no byte lands after the link's operations are settled.
    if (!begin_work()) return;  // being reaped: the peer's operation ends with the link
    auto held = std::make_shared<DeviceCopies>();
    held->link = shared_from_this();
    held->conn = &conn;
    held->op_id = header.op_id;
    held->write = write;
    held->req = req;
    held->device = target.device ? target.device : opened.front()->device();
    held->opened = std::move(opened);
    held->fd_bytes = fd_bytes;
    held->on_device = target.device != nullptr;
    held->target = std::move(target);
    const uint64_t now = device_in_flight_.fetch_add(1, std::memory_order_relaxed) + 1;
    for (uint64_t most = device_in_flight_max_.load(std::memory_order_relaxed);
         now > most && !device_in_flight_max_.compare_exchange_weak(most, now, std::memory_order_relaxed);) {
    }
    device_frames_served_.fetch_add(1, std::memory_order_relaxed);
    const std::shared_ptr<cuda::Device> device = held->device;
    std::string why;
    held->queued = std::chrono::steady_clock::now();
    device_serve_ns_.fetch_add(ns_between(began, held->queued), std::memory_order_relaxed);
    const auto queued = held->queued;
    const bool ok = device->copy_async(
            copies, [held](cuda::CUresult status) mutable {
              held->status = status;
              Link &link = *held->link;
              link.device_land_ns_.fetch_add(ns_between(held->queued, std::chrono::steady_clock::now()),
                                             std::memory_order_relaxed);
              link.answer_landed(*held, true);  // at once where nothing in it calls the driver
              link.device_copies_done(std::move(held));  // the callback keeps nothing
            },
            why);
    device_enqueue_ns_.fetch_add(ns_between(queued, std::chrono::steady_clock::now()), std::memory_order_relaxed);
    if (ok) return;
    // Refused as queued: whatever was queued has run; answered here.
    held->status = -1;
    held->why = std::move(why);
    device_copies_done(std::move(held));
    return;
  }
  send_answer(conn, answer(write ? FrameType::kWriteAck : FrameType::kReadData, header.op_id, st, target.why));
}


void Link::device_copies_done(std::shared_ptr<DeviceCopies> copies) {
  bool post;
  {
    std::lock_guard<std::mutex> lock(device_done_mu_);
    device_done_.push_back(std::move(copies));
    post = !device_answering_;
    device_answering_ = true;
  }
  if (!post) return;  // the job out answers this one too
  // The job holds only this pointer: the frames queued hold the link.
  if (host_->io_loop().run_blocking([this] { answer_device_copies(); })) return;
  // The loop is stopping: answered here (letting go of memory may then fail in the driver).
  answer_device_copies();
}

bool Link::answer_landed(DeviceCopies &c, bool driver_thread) {
  if (c.status != cuda::CUDA_SUCCESS) return false;  // a failure is described by the driver
  // A read that releases a key may let go of memory: not on the driver's thread.
  const bool releases = !c.write && (c.req.target.flags & wire::kReleaseKey) != 0;
  if (releases && driver_thread) return false;
  ipc_bytes_served_.fetch_add(c.req.total_bytes, std::memory_order_relaxed);
  fd_bytes_served_.fetch_add(c.fd_bytes, std::memory_order_relaxed);
  if (releases) note_read(c.req);
  device_answers_from_stream_.fetch_add(1, std::memory_order_relaxed);
  device_in_flight_.fetch_sub(1, std::memory_order_relaxed);
  send_answer(*c.conn, answer(c.write ? FrameType::kWriteAck : FrameType::kReadData, c.op_id, LLM_SUCCESS, {}));
  c.answered = true;
  return true;
}

void Link::answer_device_copies() {
  std::shared_ptr<Link> self;  // the link, until this returns
  for (;;) {
    std::vector<std::shared_ptr<DeviceCopies>> landed;
    {
      std::lock_guard<std::mutex> lock(device_done_mu_);
      if (device_done_.empty()) {
        device_answering_ = false;
        break;
      }
      landed.swap(device_done_);
    }
    if (!self) self = landed.front()->link;
    for (const std::shared_ptr<DeviceCopies> &done : landed) {
      DeviceCopies &c = *done;
      if (!c.answered && !answer_landed(c, false)) {
        // The copies failed, as queued (-1) or on the stream.
        std::string words = c.target.why;
        const std::string why = c.status == -1 ? c.why : "the stream: " + c.device->describe(c.status);
        const Status st =
            refuse_served(c.req.target.group, llm_datadist::LLM_FAILED, words,
                          std::string("copying ") + (c.write ? "into" : "out of") + (c.on_device ? " device" : " host") +
                              " memory on the peer failed (through CUDA IPC): " + why);
        if (c.status != -1) device_answers_from_stream_.fetch_add(1, std::memory_order_relaxed);
        device_in_flight_.fetch_sub(1, std::memory_order_relaxed);
        send_answer(*c.conn, answer(c.write ? FrameType::kWriteAck : FrameType::kReadData, c.op_id, st, words));
      }
      end_work();
    }
    // `landed` lets go of the memory here, on this thread.
  }
}

std::map<std::string, uint64_t> Link::path_counters() const {
  const auto get = [](const std::atomic<uint64_t> &n) { return n.load(std::memory_order_relaxed); };
  size_t imports = 0;
  {
    std::lock_guard<std::mutex> lock(opened_mu_);
    for (const auto &entry : opened_) imports += entry.second->imported() ? 1 : 0;
  }
  return {
      // Device memory. Initiator side: frames on device memory of this end
      // sent as same-host frames with its allocations exported (CUDA IPC),
      // sent again inline because the owner could not open the exports, and
      // sent inline (staged). Owner side: bytes this end copied to or from
      // the peer's opened device memory, and device bytes it staged through
      // host buffers.
      {"ipc_frames", get(ipc_frames_)},
      {"ipc_fallbacks", get(ipc_fallbacks_)},
      {"staged_frames", get(staged_frames_)},
      {"ipc_bytes_served", get(ipc_bytes_served_)},
      {"staged_bytes_served", get(staged_bytes_served_)},
      // Of those: initiator side, the ipc_frames naming at least one export
      // as a descriptor (memory of cuMemCreate); owner side, the
      // ipc_bytes_served from or into such imported memory, and its
      // allocations imported and mapped here now (each unmapped and
      // released when the link is reaped).
      {"fd_frames", get(fd_frames_)},
      {"fd_bytes_served", get(fd_bytes_served_)},
      {"fd_imports", imports},
      // Owner side, how device frames are served: frames served by CUDA
      // IPC, those answered once their copies landed (no thread waits for
      // them), the most whose copies were in flight at once, and the waits
      // for a stream that blocked a thread of this end's while serving the
      // peer's device operations (CUDA IPC: none; staged: one per chunk).
      {"device_frames_served", get(device_frames_served_)},
      {"device_answers_from_stream", get(device_answers_from_stream_)},
      {"device_frames_in_flight_max", get(device_in_flight_max_)},
      {"device_stream_waits", get(device_stream_waits_)},
      // And where a device frame's time goes, summed over frames (ns): from
      // its request to its copies being queued (resolving, checking,
      // opening), the driver's calls that queue them, and from those calls
      // to the stream's callback (the copies, and the driver's wait before
      // it calls back).
      {"device_serve_ns", get(device_serve_ns_)},
      {"device_enqueue_ns", get(device_enqueue_ns_)},
      {"device_land_ns", get(device_land_ns_)},
      // UCX. Initiator side: frames sent naming this end's memory for the
      // peer to move with UCX, and those sent again inline because the
      // peer's memory was a device's. Owner side: bytes this end moved with
      // UCX. ucx_device: 1 where this end's UCX moves device memory (built
      // with CUDA, driver found), so device caches go by UCX too.
      {"ucx_frames", get(ucx_frames_)},
      {"ucx_fallbacks", get(ucx_fallbacks_)},
      {"ucx_bytes_served", get(ucx_bytes_served_)},
      {"ucx_device", ucx_ && ucx_->worker()->reaches_device() ? 1u : 0u},
  };
}

}  // namespace datadist
