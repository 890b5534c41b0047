// The CUDA IPC path: a frame names the initiator's device memory as exports
// of its allocations (legacy CUDA IPC handles, or descriptors of cuMemCreate
// memory taken out of its process), and the owner opens them and copies
// device to device (or to and from its host memory) on a stream, answering
// once the copies have landed. Needs: the same-host path (one host, the
// peer's memory reached) and a CUDA driver at both ends. Checks: every
// segment inside the allocation it names, by the size of what was opened.
// Fails: an owner that cannot open the exports answers so, and the frame
// (and every later one) goes inline, staged; a copy that fails is a
// refusal of the operation.
#ifndef DATADIST_TRANSPORT_PATHS_DEVICE_CUDA_IPC_PATH_H_
#define DATADIST_TRANSPORT_PATHS_DEVICE_CUDA_IPC_PATH_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/data_path.h"
#include "transport/paths/device/exports.h"

namespace datadist {

class SameHostPath;
namespace cuda {
class PeerAllocation;
}

class CudaIpcPath : public DataPath {
 public:
  // `same_host`: the link's same-host path, whose peer memory it opens
  // from. `peer_opens_device`, `peer_takes_fds`, `peer_big_frames`: what
  // the peer said it reads (same_host::kOpensDevice, kTakesFds, kBigDeviceFrames).
  CudaIpcPath(std::shared_ptr<SameHostPath> same_host, bool peer_opens_device, bool peer_takes_fds,
              bool peer_big_frames);
  ~CudaIpcPath() override;

  // Never names the link's transport: the same-host path does.
  const char *name() const override { return "same_host"; }
  bool active() const override { return false; }
  int device_by_reference() const override;
  uint64_t device_frame_bytes() const override;
  Carry carry(const PlannedFrame &planned, const cuda::Device *device, bool exports_ok, size_t body_bytes,
              Carried &out) override;
  void refused(const std::string &why) override;
  bool serves(const wire::Request &req) const override;
  std::string read_trailer(const wire::Request &req, std::shared_ptr<const void> &view) const override;
  bool checks_initiator_first() const override { return true; }
  bool reap_waits() const override { return true; }
  void serve(std::shared_ptr<ServedFrame> frame) override;
  void counters(std::map<std::string, uint64_t> &out) const override;
  // Its counters' names, at 0 (paths.h).
  static void zero_counters(std::map<std::string, uint64_t> &out);
  void reap() override;

 private:
  struct Copies;
  struct Table;
  // The exports of the allocations holding the frame's device memory;
  // false where one cannot be exported or there are too many.
  bool export_all(const cuda::Device &device, const PlannedFrame &planned, std::vector<device_exports::DeviceExport> &exports);
  // The peer's exports opened in `device`'s context (null: this end's
  // memory is host memory; the export's device is used), cached; false
  // with `why` when one cannot be opened here.
  bool open_exports(const std::vector<device_exports::DeviceExport> &exports, const std::shared_ptr<cuda::Device> &device,
                    std::vector<std::shared_ptr<cuda::PeerAllocation>> &out, std::string &why);
  // Answers a frame whose copies landed well; false where they failed, or
  // on the driver's thread (`driver_thread`) where answering may call the
  // driver (a read that releases a key may let go of memory).
  bool answer_landed(Copies &copies, bool driver_thread);
  // From the driver's thread once a frame's copies have run: hands it to
  // a thread of the blocking pool (which answers it where the callback did
  // not, and lets go of its memory: the driver may not be called from its
  // own thread).
  void landed(std::shared_ptr<Copies> copies);
  void answer_landed_frames();

  const std::shared_ptr<SameHostPath> same_host_;
  const bool peer_opens_device_;
  const bool peer_takes_fds_;
  const bool peer_big_frames_;
  std::atomic<bool> exports_refused_{false};  // the peer could not open this end's exports once
  // Initiator side: frames naming this end's exports (those naming a
  // descriptor), and those the owner could not open.
  std::atomic<uint64_t> frames_{0}, fd_frames_{0}, fallbacks_{0};
  // Owner side: bytes copied, of which from or into imported memory;
  // frames served, answered once their copies landed, in flight (now, the
  // most at once); where a frame's time goes, summed (ns).
  std::atomic<uint64_t> bytes_served_{0}, fd_bytes_served_{0};
  std::atomic<uint64_t> frames_served_{0}, answers_from_stream_{0}, in_flight_{0}, in_flight_max_{0};
  std::atomic<uint64_t> serve_ns_{0}, enqueue_ns_{0}, land_ns_{0};
  std::mutex done_mu_;
  std::vector<std::shared_ptr<Copies>> done_;  // landed, to be answered and let go (done_mu_)
  bool answering_ = false;  // a job of the blocking pool takes them (done_mu_)
  // The peer's allocations opened here, by handle and device; closed when
  // the link is reaped (or dropped past a bound).
  mutable std::mutex opened_mu_;
  std::unordered_map<std::string, std::shared_ptr<cuda::PeerAllocation>> opened_;
};

}  // namespace datadist

#endif  // DATADIST_TRANSPORT_PATHS_DEVICE_CUDA_IPC_PATH_H_
